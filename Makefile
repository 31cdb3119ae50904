# `make demo` trains the embedded default model on 2 local ranks; `make test` runs the test suite (CI) on 3
# pytest workers, an xdist group each at a time (pytest-xdist --dist loadgroup; tests/conftest.py puts each
# test in its file's group unless its id ends with "@name", so a file's shared spawns and fixtures stay on one worker;
# most tests wait on ranks they spawned, so 3 workers keep 2 cores busy);
# `make test-fast` runs the tests that spawn no ranks or processes (`-m "not ranks"`, about a minute);
# `make layers` checks DESIGN.md's import arrows (import-linter; tests/ranks/test_layers.py runs it too).
# Both create .venv and install what is missing. torch is pinned here to the CPU wheel on disk;
# the package itself asks only for torch>=2.8.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export OMP_NUM_THREADS := 1
export MKL_NUM_THREADS := 1

.PHONY: demo test test-fast fuzz layers bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/fivefold train --nproc 2 --overwrite --out runs/demo

test: $(STAMP)
	$(PY) -m pytest -q -n 3 --dist loadgroup tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not ranks" tests

# `make fuzz`: the input fuzzers' long random profile (tests/unit/test_fuzz_inputs.py, tests/ranks/test_fuzz_runs.py); what fails is kept in
# hypothesis's example database (.hypothesis/) and replayed first next time
fuzz: $(STAMP)
	FIVEFOLD_FUZZ_EXAMPLES=$${FUZZ_EXAMPLES:-1500} $(PY) -m pytest -q -p no:randomly tests/unit/test_fuzz_inputs.py tests/ranks/test_fuzz_runs.py

layers: $(STAMP)
	$(VENV)/bin/lint-imports --no-cache

bench: $(STAMP)
	$(PY) benchmarks/ddp.py
	$(PY) benchmarks/zero.py --no-deepspeed
	$(PY) benchmarks/tensor.py
	$(PY) benchmarks/pipeline.py
	$(PY) benchmarks/context.py --no-deepspeed
	$(PY) benchmarks/expert.py --no-deepspeed

clean:
	rm -rf runs
