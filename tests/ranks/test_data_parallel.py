"""Our data parallel equals the single-process run, and sends exactly 2Φ(n-1)/n gradient bytes per step."""
import pytest
import torch

from fivefold.comm import volume
from fivefold.train.trainer import Trainer

from tests.support.spawn import ranks
from tests.support.tiny import TOL, assert_states_close, tiny_config
from tests.support.reference import reference, run_steps


@pytest.mark.parametrize("world, micro, dtype", [(2, 1, "fp32"), (2, 2, "fp32"), (4, 2, "fp32"), (2, 2, "fp64")])
@pytest.mark.ranks
def test_dp_equals_single_process(world, micro, dtype):
    cfg = tiny_config(dp=world, microbatches=micro, bucket_mb=0.05)  # several buckets
    ref_cfg = tiny_config()
    cfg.train.dtype = ref_cfg.train.dtype = dtype
    ref = reference(ref_cfg)
    out = ranks(run_steps, world, cfg.to_dict())
    for r in out:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]),
                                   rtol=1e-5 if dtype == "fp32" else 1e-12, atol=0)
        assert_states_close(r["state"], ref["state"], **TOL[dtype])
    # exact bytes: one ring all-reduce of every fp32 gradient per step, nothing else in "dp"
    phi = ref["params"]
    for r in out:
        for rows in r["ledger"]:
            dp = [x for x in rows if x["dim"] == "dp"]
            assert [x["op"] for x in dp] == ["all_reduce"]
            width = 8 if dtype == "fp64" else 4
            assert dp[0]["message_bytes"] == width * phi
            assert dp[0]["bytes_sent"] == volume.all_reduce(width * phi, world) == 2 * width * phi * (world - 1) / world
            assert dp[0]["calls"] > 1  # bucketed


def _accumulation(rank, world):
    """Backward of non-final micro-batches sends nothing; the final one sends everything."""
    cfg = tiny_config(dp=world, microbatches=4)
    tr = Trainer(cfg, rank, world, quiet=True)
    mbs = tr.micro_batches(0)
    from fivefold.model import loss_sum
    sent = []
    for i, mb in enumerate(mbs):
        tr.engine.set_sync(i == len(mbs) - 1)
        loss_sum(tr.model(mb.tokens), mb.targets).backward()
        tr.engine.end_backward()
        sent.append(tr.ledger.total("dp"))
    tr.engine.finish()
    return sent, sum(p.numel() for p in tr.params)


@pytest.mark.ranks
def test_accumulation_sends_only_on_last_microbatch():
    for sent, phi in ranks(_accumulation, 2):
        assert sent[:3] == [0, 0, 0]
        assert sent[3] == volume.all_reduce(4 * phi, 2)


def test_bf16_keeps_fp32_main_grads_and_masters():
    cfg = tiny_config()
    cfg.train.dtype = "bf16"
    tr = Trainer(cfg, quiet=True)
    assert all(p.dtype == torch.bfloat16 for p in tr.params)
    assert all(p.main_grad.dtype == torch.float32 for p in tr.params)
    assert all(m.dtype == torch.float32 for m in tr.engine.master)
    m = tr.step(0)
    assert all(p.grad is None for p in tr.params)
    assert torch.isfinite(torch.tensor(m["loss"]))
    phi = sum(p.numel() for p in tr.params)
    assert tr.model_state_bytes() == {"params": 2 * phi, "grads": 4 * phi, "optimizer": 12 * phi,
                                      "total": 18 * phi}


@pytest.mark.ranks
def test_bf16_dp_matches_single_process_loosely():
    """bf16 compute: DP and one process agree to bf16 precision (sums differ in order)."""
    cfg = tiny_config()
    cfg.train.dtype = "bf16"
    ref = reference(cfg)
    cfg2 = tiny_config(dp=2)
    cfg2.train.dtype = "bf16"
    out = ranks(run_steps, 2, cfg2.to_dict())
    torch.testing.assert_close(torch.tensor(out[0]["losses"]), torch.tensor(ref["losses"]), rtol=2e-2, atol=0)


def test_device_option_places_model_and_state():
    """train.device = cpu puts every parameter, gradient buffer and optimizer state on the CPU; asking
    for CUDA where there is none fails at start with one line."""
    from fivefold.config import ConfigError

    cfg = tiny_config(zero=1)
    cfg.train.device = "cpu"
    tr = Trainer(cfg, quiet=True)
    tr.step(0)
    tensors = list(tr.params) + tr.engine.grad_shards + tr.engine.optimizer.exp_avg
    assert {t.device.type for t in tensors} == {"cpu"}
    if not torch.cuda.is_available():
        cfg.train.device = "cuda"
        with pytest.raises(ConfigError, match="no CUDA device"):
            Trainer(cfg, quiet=True)
