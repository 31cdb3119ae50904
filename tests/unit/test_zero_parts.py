"""ZeRO as composed parts (parallel/zero/engine.py): the stage (what is sharded), the reduce policy (when a unit's
gradients are reduce-scattered) and the state store (where masters and moments live and how the step
reaches them) are separate objects, each chosen by one setting; the three stores step alike, bit for bit.
Single process, no ranks: the multi-rank equivalences live in test_zero.py and test_offload.py."""
import pytest
import torch
from torch import nn

from fivefold.comm import Group
from fivefold.parallel.zero.offload import DiskState, HostState
from fivefold.parallel.zero.reduce import EachMicrobatch, OncePerStep, reduce_policy
from fivefold.parallel.zero.spec import ZeroSpec
from fivefold.parallel.zero.stages import FullParams, ShardedParams
from fivefold.parallel.zero.state import DeviceState, state_store
from fivefold.parallel.zero.units import Unit
from fivefold.rules import block_units
from fivefold.train.optim import AdamW
from fivefold.train.trainer import Trainer

from tests.support.tiny import tiny_config


@pytest.mark.parametrize("stage", (1, 2, 3))
@pytest.mark.parametrize("pipeline", (False, True))
@pytest.mark.parametrize("each", (False, True))
def test_reduce_policy_by_stage_and_pipeline(stage, pipeline, each):
    """Stage 1 reduces once per step (it keeps the whole gradient anyway); stages 2 and 3 every micro-batch
    outside a pipeline, once per step under one unless reduce_each_microbatch. Reducing every micro-batch
    under a pipeline needs units a chunk's backward completes: blocks (rules.block_units)."""
    if each and stage == 1:
        with pytest.raises(Exception, match="reduce_each_microbatch"):
            reduce_policy(ZeroSpec(stage, pipeline, each))
        return
    policy = reduce_policy(ZeroSpec(stage, pipeline, each))
    once = stage == 1 or (pipeline and not each)
    assert isinstance(policy, OncePerStep if once else EachMicrobatch)
    assert policy.keeps_full_grads == once
    assert policy.reduces(sync=True)
    assert policy.reduces(sync=False) == (not once)   # a backward whose gradients are not final yet
    assert policy.restarts_at_reduce == (pipeline and not once)   # a chunk's next backward starts over
    if pipeline and not once:
        assert block_units(stage, 2, each)


def units(sizes=((5, 7), (3, 4, 2), (9,)), group_size=1) -> list[Unit]:
    """Units of small parameters (the state stores read only shard sizes and segments)."""
    group = Group("dp", list(range(group_size)), 0)
    return [Unit(f"u{j}", [nn.Parameter(torch.zeros(n)) for n in ns], [f"u{j}.{i}" for i in range(len(ns))], group)
            for j, ns in enumerate(sizes)]


def adamw(params, decay):
    return AdamW(params, decay, (0.9, 0.95), 1e-8, 0.1)


@pytest.mark.parametrize("mode", ("cpu", "nvme"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_state_stores_step_alike(mode, dtype, tmp_path):
    """DeviceState, HostState and DiskState behind one protocol: the same steps give the same parameters
    and the same (master, exp_avg, exp_avg_sq) bit for bit; `put` then `state` returns what was put."""
    us = units()
    decay = [[len(u.shapes[i]) >= 2 or i == 0 for i, _, _ in u.segments] for u in us]
    gen = torch.Generator().manual_seed(3)
    start = [torch.randn(u.shard_size, generator=gen).to(dtype) for u in us]
    grads = [[torch.randn(u.shard_size, generator=gen).to(dtype) for u in us] for _ in range(3)]
    runs = {}
    for where in ("none", mode):
        params = [p.clone() for p in start]
        store = state_store(where, us, decay, params, torch.float32, dtype, adamw, None, str(tmp_path), 0)
        assert isinstance(store, {"none": DeviceState, "cpu": HostState, "nvme": DiskState}[where])
        assert not store.holds_params
        for k, gs in enumerate(grads):
            store.step([g.clone() for g in gs], params, 1e-2 / (k + 1))
        runs[where] = params, [store.state(j) for j in range(len(us))], store
    (p_dev, s_dev, dev), (p_off, s_off, off) = runs["none"], runs[mode]
    assert dev.optimizer.t == off.optimizer.t == 3
    for a, b in zip(p_dev, p_off):
        assert torch.equal(a, b)
    for a, b in zip(s_dev, s_off):
        for x, y in zip(a, b):
            assert torch.equal(x.cpu(), y.cpu())
    for store in (dev, off):
        put = [torch.arange(3 * u.shard_size, dtype=torch.float32).view(3, -1) for u in us]
        for j, t in enumerate(put):
            store.put(j, *t)
        for j, t in enumerate(put):
            assert all(torch.equal(x, y) for x, y in zip(store.state(j), t))
        assert set(store.bytes()) >= {"optimizer"}
        store.close()


@pytest.mark.parametrize("stage", (1, 2, 3))
@pytest.mark.parametrize("offload", ("none", "cpu", "nvme"))
def test_engine_is_composed_of_its_parts(stage, offload, tmp_path):
    """The trainer's engine names its parts and was handed the config's ZeroSpec; ZeRO-3 with nvme keeps its
    parameter shards in the store."""
    cfg = tiny_config(zero=stage, offload=offload, microbatches=2)
    if offload == "nvme":
        cfg.parallel.offload_dir = str(tmp_path)
    tr = Trainer(cfg, quiet=True)
    e = tr.engine
    assert e.spec == ZeroSpec.of(cfg.parallel) and e.spec.shards_grads == (stage >= 2)
    assert isinstance(e.sharding, ShardedParams if stage == 3 else FullParams)
    assert isinstance(e.policy, OncePerStep if stage == 1 else EachMicrobatch)
    assert isinstance(e.state, {"none": DeviceState, "cpu": HostState, "nvme": DiskState}[offload])
    on_disk = stage == 3 and offload == "nvme"
    assert e.state.holds_params == on_disk
    assert (e.sharding.param_shards == []) == on_disk
    tr.step(0)
    e.remove()


@pytest.mark.parametrize("mode", ("none", "cpu", "nvme"))
def test_streamed_gradient_shards_accumulate_like_the_device_ones(mode, tmp_path):
    """The store's gradient shards: on the device, or (offload, streaming) in host memory where each reduced
    shard lands by a recorded d2h and is added; two micro-batches' shards sum to the same bits."""
    from fivefold.comm.ledger import CommLedger

    us, ledger = units(), CommLedger()
    decay = [[True] * len(u.segments) for u in us]
    params = [torch.zeros(u.shard_size) for u in us]
    store = state_store(mode, us, decay, params, torch.float32, torch.float32, adamw, ledger, str(tmp_path), 0,
                        streams_grads=mode != "none")
    assert store.streams_grads == (mode != "none")
    shards = store.grad_shards()
    gen = torch.Generator().manual_seed(5)
    parts = [[torch.randn(u.shard_size, generator=gen) for u in us] for _ in range(2)]
    for mb in parts:
        for j, t in enumerate(mb):
            store.add_grad(j, t)
    store.settle()
    for j, shard in enumerate(shards):
        assert torch.equal(shard, torch.zeros(us[j].shard_size).add_(parts[0][j]).add_(parts[1][j]))
    rows = {r["op"]: (r["calls"], r["message_bytes"]) for r in ledger.rows() if r["dim"] == "offload"}
    k = sum(u.shard_size for u in us)
    assert rows == ({} if mode == "none" else {"d2h": (2 * len(us), 2 * 4 * k)})
    store.close()
