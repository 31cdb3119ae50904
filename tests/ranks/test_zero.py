"""ZeRO-1/2/3 reproduce the single-process run, send the paper's bytes and hold the paper's memory."""
import pytest
import torch

from fivefold.comm import volume
from fivefold.train.trainer import Trainer

from tests.support.spawn import ranks
from tests.support.tiny import TOL, assert_states_close, tiny_config
from tests.support.reference import reference, run_many


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.ranks
def test_zero_equals_single_process(world):
    """Stages 1, 2, 3, with gradient accumulation (2 micro-batches) and clipping (max norm 0.5) on. On 2
    ranks also ZeRO-3 with full recompute (parallel/recompute.py, one checkpoint per block): bit for bit
    the run without, with the same all-gathers (each block is re-run inside its backward, after its
    pre-backward gather)."""
    ref = reference(tiny_config())
    assert ref["grad_norms"][0] > 0.5  # clipping is active
    cfgs = [tiny_config(dp=world, zero=stage, microbatches=2, bucket_mb=0.05).to_dict() for stage in (1, 2, 3)]
    if world == 2:
        full = tiny_config(dp=world, zero=3, microbatches=2)
        full.train.recompute = "full"
        cfgs.append(full.to_dict())
    for rank_out in ranks(run_many, world, cfgs):
        for stage, r in zip((1, 2, 3), rank_out):
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0,
                                       msg=lambda m: f"stage {stage}: {m}")
            assert_states_close(r["state"], ref["state"], **TOL["fp32"])
        if world == 2:
            plain, recomputed = rank_out[2], rank_out[3]
            assert recomputed["losses"] == plain["losses"] and recomputed["grad_norms"] == plain["grad_norms"]
            assert all(torch.equal(recomputed["state"][n], t) for n, t in plain["state"].items())
            def counts(run):
                return [[(x["dim"], x["op"], x["calls"], x["bytes_sent"]) for x in rows] for rows in run["ledger"]]
            assert counts(recomputed) == counts(plain)


@pytest.mark.ranks
def test_zero3_fp64_is_exact_and_keeping_params_gives_same_result():
    ref_cfg = tiny_config()
    ref_cfg.train.dtype = "fp64"
    ref = reference(ref_cfg)
    cfgs = []
    for keep in (True, False):
        cfg = tiny_config(dp=2, zero=3, microbatches=2, reshard_after_forward=keep)
        cfg.train.dtype = "fp64"
        cfgs.append(cfg.to_dict())
    for rank_out in ranks(run_many, 2, cfgs):
        for r in rank_out:
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=1e-12, atol=0)
            assert_states_close(r["state"], ref["state"], **TOL["fp64"])


def dp_bytes(rows):
    return sum(x["bytes_sent"] for x in rows if x["dim"] == "dp")


CASES = [(1, True, 1.0), (2, True, 1.0), (3, True, 1.5), (3, False, 1.0)]


@pytest.mark.ranks
def test_bytes_per_step_match_the_paper():
    """ZeRO-1/2 send the bytes of DP (2Φ(n-1)/n), ZeRO-3 1.5x that, with the bandwidth-optimal ring of the
    paper (NCCL's); keeping gathered params saves a gather. On gloo fivefold exchanges the reduce-scatter's
    chunks pairwise (comm/ops.py; gloo's own would all-reduce the whole input and send 1.5x DP), which sends
    the ring's bytes too, so the ledger holds the paper's figures on these gloo ranks."""
    n = 4
    cfgs = [tiny_config(dp=n, zero=stage, reshard_after_forward=keep, bucket_mb=0.05).to_dict()
            for stage, keep, _ in CASES]
    out = ranks(run_many, n, cfgs, 2)
    phi = out[0][0]["params"]
    dp_formula = volume.all_reduce(4 * phi, n)
    for (stage, keep, factor), r in ((case, rank_out[i]) for rank_out in out for i, case in enumerate(CASES)):
        gathers = 1 if stage < 3 or not keep else 2
        paper = volume.bytes_sent("reduce_scatter", 4 * phi, n) + gathers * volume.all_gather(4 * phi, n)
        assert paper == factor * dp_formula
        for rows in r["ledger"]:
            ops = {x["op"]: x for x in rows if x["dim"] == "dp"}
            assert ops["reduce_scatter"]["bytes_sent"] == volume.bytes_sent("reduce_scatter", 4 * phi, n, "gloo")
            assert ops["reduce_scatter"]["bytes_sent"] == volume.reduce_scatter(4 * phi, n)
            assert ops["all_gather"]["bytes_sent"] == gathers * volume.all_gather(4 * phi, n)
            assert dp_bytes(rows) == factor * dp_formula


@pytest.mark.ranks
def test_stage2_reduces_every_microbatch_stage1_once():
    n, m = 2, 4
    out = ranks(run_many, n, [tiny_config(dp=n, zero=s, microbatches=m).to_dict() for s in (1, 2)], 1)
    for (stage, rs_times), r in zip(((1, 1), (2, m)), out[0]):
        rows = {x["op"]: x for x in r["ledger"][0] if x["dim"] == "dp"}
        assert rows["reduce_scatter"]["bytes_sent"] == rs_times * volume.bytes_sent("reduce_scatter", 4 * r["params"],
                                                                                    n, "gloo")


def _state_bytes(rank, world, cfg_dicts):
    from fivefold.config import Config
    out = []
    for d in cfg_dicts:
        tr = Trainer(Config.from_dict(d), rank, world, quiet=True)
        tr.step(0)
        out.append((tr.model_state_bytes(), tr.n_params))
    return out


@pytest.mark.ranks
def test_model_state_bytes_match_the_formula():
    """ZeRO paper, sections 3 and 5: params w, grads g, optimizer K bytes per parameter (fp32: 4+4+8;
    mixed precision: 2+2+12, or 2+4+12 with fp32 main gradients); stages 1, 2, 3 divide K, then g,
    then w by n. Counted from the tensors each rank really holds, after a step."""
    n = 4
    cases, cfgs = [], []
    for dtype, main_fp32 in (("fp32", True), ("bf16", False), ("bf16", True)):
        for stage in (0, 1, 2, 3):
            cfg = tiny_config(dp=n, zero=stage)
            cfg.train.dtype, cfg.train.main_grads_fp32 = dtype, main_fp32
            cases.append((dtype, main_fp32, stage))
            cfgs.append(cfg.to_dict())
    for rank_results in ranks(_state_bytes, n, cfgs):
        for (dtype, main_fp32, stage), (got, phi) in zip(cases, rank_results):
            w = 4 if dtype == "fp32" else 2
            g = 4 if main_fp32 else w
            k = 8 if dtype == "fp32" else 12
            expect = {0: (w, g, k), 1: (w, g, k / n), 2: (w, g / n, k / n), 3: (w / n, g / n, k / n)}[stage]
            assert (got["params"], got["grads"], got["optimizer"]) == tuple(int(x * phi) for x in expect), \
                (dtype, main_fp32, stage)


def test_zero_with_one_rank_runs():
    cfg = tiny_config(zero=3)
    ref = reference(tiny_config())
    tr = Trainer(cfg, quiet=True)
    losses = [tr.step(k)["loss"] for k in range(3)]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["losses"]), rtol=1e-6, atol=0)
