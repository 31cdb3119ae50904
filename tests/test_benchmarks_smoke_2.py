"""Shard 2 of the benchmark smoke runs (tests/test_benchmarks.py: why they are sharded, and the runs)."""
import pytest

from .test_benchmarks import run_one_step, shard_scripts


@pytest.mark.ranks
@pytest.mark.parametrize("script", shard_scripts(2))
def test_benchmark_runs_one_step(script, tmp_path):
    run_one_step(script, tmp_path)
