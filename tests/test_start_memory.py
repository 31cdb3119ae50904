"""No rank holds the whole model: a model whose fp32 weights are 4x what each of 4 ranks holds trains
under tp2 x pp2 and under ZeRO-3 dp4, and every rank's peak resident memory stays below the planner's
bytes for it (run.json's planned_memory_bytes_by_rank) x 1.25 plus the process's own floor (the
interpreter, torch and the process group, measured before the Trainer is built).

Before meta construction every rank built the whole fp32 model first: on this model that alone is
~125 MB over the floor, which the bound below (~1.25 x the ~35 MB + activations a rank holds) cannot hold."""
import pytest

from fivefold.config import Config, ModelConfig, ParallelConfig, TrainConfig
from tests.helpers import spawn_jobs

pytestmark = pytest.mark.ranks

MODEL = ModelConfig(vocab=8192, hidden=512, layers=8, heads=8, kv_heads=4, ffn=1536, max_seq=64)


def config(**parallel) -> Config:
    return Config(model=MODEL, parallel=ParallelConfig(**parallel),
                  train=TrainConfig(steps=2, global_batch=4, seq_len=32, lr=1e-3, min_lr=1e-4, warmup=1, seed=3,
                                    data_limit_mb=0.05, checkpoint=False))


def peak_over_floor(rank, world, cfg_dict):
    from fivefold.cli import planned_memory
    from fivefold.train.trainer import Trainer, peak_rss_bytes

    floor = peak_rss_bytes()   # imports and the process group: the process before any model exists
    cfg = Config.from_dict(cfg_dict)
    t = Trainer(cfg, rank, world, quiet=True)
    for step in range(2):
        t.step(step)
    stages = planned_memory(cfg, "cpu")["stages"]
    held = sum(p.numel() for p in t.params) * 4
    return {"floor": floor, "peak": peak_rss_bytes(), "planned": stages[t.mesh.coords["pp"]]["total"],
            "weights": held}


LAYOUTS = {"tp2xpp2": dict(tp=2, pp=2, microbatches=2), "zero3-dp4": dict(dp=4, zero=3)}


@pytest.fixture(scope="module")
def results():
    return spawn_jobs(4, [(name, peak_over_floor, (config(**par).to_dict(),)) for name, par in LAYOUTS.items()],
                      timeout_s=600)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_peak_memory_is_what_the_rank_holds_not_the_model(results, layout):
    full = MODEL.num_params() * 4
    for rank, r in enumerate(results[layout]):
        if layout == "tp2xpp2":
            assert full >= 3 * r["weights"], (full, r["weights"])   # each rank holds ~1/4 of the weights
        bound = 1.25 * r["planned"] + r["floor"]
        assert r["peak"] < bound, (f"rank {rank}: peak {r['peak'] / 2**20:.0f} MiB > {bound / 2**20:.0f} MiB "
                                   f"(planned {r['planned'] / 2**20:.0f} MiB, floor {r['floor'] / 2**20:.0f} MiB, "
                                   f"whole model {full / 2**20:.0f} MiB)")
