"""The planner predicts exactly what a real `fivefold train` run records.

Each layout below is trained for a few steps by the real runtime (`train_rank` on fresh gloo ranks, the
same entry `fivefold train` uses); its `comm.json` (the ledger summed over ranks and steps) and
`run.json` (model-state bytes per rank, counted from the tensors that exist) are then held against the
planner, which never saw the run: bytes per (dim, op) must be equal, not close.

To extend to a new parallelism, add its layout to LAYOUTS. A layout the runtime does not run yet is
skipped with the runtime's own reason, so the list can run ahead of the runtime.
"""
import json

import pytest

from fivefold.config import Config, ConfigError
from fivefold.plan.layout import from_config
from fivefold.plan.memory import model_states
from fivefold.plan.models import from_model_config
from fivefold.plan.traffic import all_ranks
from fivefold.train.trainer import supported, train_rank

from .helpers import ranks, tiny_config

# (parallel degrees, dtype): what the runtime can run here; later issues add zero / tp / sp / pp rows.
LAYOUTS = [
    (dict(dp=2, microbatches=2, bucket_mb=0.05), "fp32"),
    (dict(dp=2, microbatches=1), "bf16"),
    (dict(dp=4, microbatches=2, bucket_mb=0.05), "fp32"),
    # ahead of the runtime (skipped until it supports them; the planner already predicts them):
    (dict(dp=2, zero=1), "fp32"),
    (dict(dp=2, zero=3, microbatches=2), "fp32"),
    (dict(tp=2, dp=1), "fp32"),
    (dict(tp=2, dp=1, sp_mode="megatron"), "fp32"),
    (dict(pp=2, dp=1, microbatches=2), "fp32"),
]


def _config(par: dict, dtype: str) -> Config:
    cfg = tiny_config(**par)
    cfg.train.dtype = dtype
    cfg.train.steps = 2
    return cfg


def _layout_id(case) -> str:
    par, dtype = case
    return "-".join(f"{k}{v}" for k, v in par.items() if k != "bucket_mb") + f"-{dtype}"


def _planned(cfg: Config) -> tuple[dict, dict]:
    """(rows per (dim, op) summed over ranks for one step, model-state bytes of one rank of stage 0)."""
    model = from_model_config(cfg.model)
    layout, work = from_config(cfg)
    return all_ranks(model, layout, work), model_states(model, layout, work, 0)


@pytest.mark.parametrize("case", LAYOUTS, ids=[_layout_id(c) for c in LAYOUTS])
def test_planner_equals_ledger_and_run_json(case, tmp_path):
    cfg = _config(*case)
    try:
        supported(cfg)
    except ConfigError as e:
        pytest.skip(f"runtime does not run this layout yet: {e}")
    world = cfg.parallel.world_size
    ranks(train_rank, world, cfg.to_dict(), str(tmp_path))
    comm = json.loads((tmp_path / "comm.json").read_text())
    run = json.loads((tmp_path / "run.json").read_text())
    steps = cfg.train.steps

    planned, states = _planned(cfg)
    measured = {(r["dim"], r["op"]): r for r in comm["rows"]}
    assert sorted(measured) == sorted(planned), "the planner predicts exactly the (dim, op) rows recorded"
    for key, row in planned.items():
        assert measured[key]["message_bytes"] == row["message_bytes"] * steps, key
        assert measured[key]["bytes_sent"] == pytest.approx(row["bytes_sent"] * steps, rel=1e-12, abs=0), key
    got = run["model_state_bytes_per_rank"]
    assert got["params"] == states["weights"]
    assert got["grads"] == states["grads"]
    assert got["optimizer"] == states["optimizer"]
    assert got["total"] == sum(states.values())


def test_single_rank_sends_nothing_and_counts_state():
    """One rank: no row at all, and fp32 model state = 4+4+8 bytes per parameter (tied once)."""
    from fivefold.train.trainer import Trainer

    cfg = _config({}, "fp32")
    tr = Trainer(cfg, quiet=True)
    tr.step(0)
    planned, states = _planned(cfg)
    assert planned == {} and tr.ledger.rows() == []
    phi = cfg.model.num_params()
    assert states == {"weights": 4 * phi, "grads": 4 * phi, "optimizer": 8 * phi}
    got = tr.model_state_bytes()
    assert (got["params"], got["grads"], got["optimizer"]) == (states["weights"], states["grads"], states["optimizer"])
