"""The planner predicts exactly what an evaluation records (comm.json's "eval" section): forward-only
traffic per (dim, op), summed over ranks, for one evaluation of B global batches."""

import pytest

from fivefold.config import Config
from fivefold.plan.layout import from_config
from fivefold.plan.models import from_model_config
from fivefold.plan.traffic import eval_all_ranks
from fivefold.train.trainer import Trainer

from tests.support.spawn import spawn_jobs
from tests.support.tiny import scratch_folder, tiny_config

LAYOUTS = {
    "dp2": dict(dp=2, microbatches=2),
    "dp2-zero3": dict(dp=2, zero=3, microbatches=2),
    "dp2-zero3-keep": dict(dp=2, zero=3, reshard_after_forward=False, microbatches=2),
    "dp2-zero3-nvme": dict(dp=2, zero=3, offload="nvme", offload_dir="{tmp}"),
    "tp2": dict(tp=2, microbatches=2),
    "tp2-sp": dict(tp=2, sp_mode="megatron"),
    "pp2": dict(pp=2, microbatches=2),
    "pp2-interleaved": dict(pp=2, microbatches=2, schedule="interleaved", vpp=2),
    "pp2-zero3": dict(pp=2, zero=3, microbatches=2),
    "cp2-ring": dict(cp=2),
    "cp2-ulysses": dict(cp=2, cp_mode="ulysses", microbatches=2),
    "ep2": dict(dp=2, ep=2, microbatches=2),
}
# capacity mode: dropless all-to-alls send what the router chose, which the planner takes as balanced
MOE = {"ep2": dict(capacity_factor=1.0)}
EVALUATIONS = 2


def config(par: dict, moe: dict | None = None) -> Config:
    par = dict(par)
    if par.get("offload_dir") == "{tmp}":
        par["offload_dir"] = scratch_folder("fivefold-offload-")
    cfg = tiny_config(**par)
    cfg.model.layers = 4
    if moe is not None:   # an MoE model: 4 experts, top-2, the first layer dense
        cfg.model.experts, cfg.model.top_k, cfg.model.moe_ffn, cfg.model.dense_layers = 4, 2, 64, 1
        for k, v in moe.items():
            setattr(cfg.model, k, v)
    cfg.train.eval_fraction, cfg.train.eval_tokens = 0.1, 600   # 3 global batches of 8 x 32
    return cfg


def eval_rows(rank, world, cfg_dict):
    tr = Trainer(Config.from_dict(cfg_dict), rank, world, quiet=True)
    for _ in range(EVALUATIONS):
        tr.evaluate()
    return {"rows": tr.ledger.part("eval").rows(), "batches": tr.evaluator.batches.count, "train": tr.ledger.rows()}


@pytest.mark.ranks
def test_planner_equals_the_eval_ledger():
    cfgs = {name: config(par, MOE.get(name)) for name, par in LAYOUTS.items()}
    out = spawn_jobs(2, [(name, eval_rows, (cfg.to_dict(),)) for name, cfg in cfgs.items()])
    for name, cfg in cfgs.items():
        measured = {}
        for r in out[name]:
            assert r["train"] == [], name   # evaluations record nothing among the training rows
            for row in r["rows"]:
                m = measured.setdefault((row["dim"], row["op"]), {"calls": 0, "message_bytes": 0, "bytes_sent": 0})
                for k in m:
                    m[k] += row[k]
        layout, work = from_config(cfg)
        planned = eval_all_ranks(from_model_config(cfg.model), layout, work, out[name][0]["batches"])
        assert sorted(measured) == sorted(planned), name
        for key, row in planned.items():
            assert measured[key]["calls"] == row["calls"] * EVALUATIONS, (name, key)
            assert measured[key]["message_bytes"] == row["message_bytes"] * EVALUATIONS, (name, key)
            assert measured[key]["bytes_sent"] == pytest.approx(row["bytes_sent"] * EVALUATIONS, rel=1e-12), (name, key)
