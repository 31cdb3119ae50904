"""Tensor parallelism's input collectives overlapped with the column GEMMs (parallel/tensor_overlap.py):
the fused path trains as the plain one does, sends the same collectives, launches the input gradient's
collective before the weight gradients and waits for it after them, and steps aside where it must (LoRA
adapters on a part, the zero-bubble schedule)."""
from __future__ import annotations

import pytest
import torch

from fivefold import rules
from fivefold.config import Config
from fivefold.train.trainer import Trainer

from tests.support.reference import run_steps
from tests.support.spawn import spawn_jobs
from tests.support.tiny import FP64, assert_states_close, tiny_config


def config(sp: bool, overlap: bool, **model) -> dict:
    c = tiny_config(model={"vocab": 257, "tie_embeddings": False, "qkv_bias": True, **model}, tp=2,
                    sp_mode="megatron" if sp else "none", microbatches=2, tp_overlap=overlap)
    c.train.dtype = "fp64"
    return c.to_dict()


def fused_parts(rank, world, cfg_dict):
    """The EnterColumns nodes in one micro-batch's graph, and the order the fused backwards ran their
    parts in: the input gradient's collective launched, the weight gradients, the wait."""
    from fivefold.parallel import tensor_overlap

    tr = Trainer(Config.from_dict(cfg_dict), rank, world, quiet=True)
    mb = tr.micro_batches(0)[0]
    loss = mb.loss(tr.loss_sum, tr.model(mb.tokens))
    seen, stack, nodes, exits = set(), [loss.grad_fn], 0, 0
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        nodes += type(fn).__name__ == "EnterColumnsBackward"
        exits += type(fn).__name__ == "ExitRowsBackward"
        stack += [f for f, _ in fn.next_functions]

    events = []
    launch, weights = tensor_overlap._launch_input_grad, tensor_overlap._weight_grads

    class Logged:
        def __init__(self, handle):
            self.handle = handle

        def wait(self):
            events.append("wait")
            self.handle.wait()

    def logged_launch(*args):
        grad, handle = launch(*args)
        events.append("launch")
        return grad, Logged(handle)

    def logged_weights(*args):
        events.append("weights")
        return weights(*args)

    tensor_overlap._launch_input_grad, tensor_overlap._weight_grads = logged_launch, logged_weights
    try:
        loss.backward()
    finally:
        tensor_overlap._launch_input_grad, tensor_overlap._weight_grads = launch, weights
    frozen_grads = [n for n, p in tr.model.named_parameters() if not p.requires_grad and p.grad is not None]
    return {"nodes": nodes, "exits": exits, "events": events, "frozen_grads": frozen_grads}


def own_later(rank, world):
    """comm.ops.reduce_scatter with this rank's chunk given after the launch (`own`, the input's own chunk
    garbage): bit for bit the plain call's sum, and the same ledger row."""
    import torch.distributed as dist

    from fivefold.comm import CommLedger, Group, ops

    group = Group("tp", list(range(world)), rank, dist.group.WORLD, CommLedger())
    g = torch.Generator().manual_seed(rank)
    inp = torch.randn(world * 3, 5, generator=g)
    plain = torch.empty(3, 5)
    ops.reduce_scatter(plain, inp, group)
    late, own = torch.empty(3, 5), torch.empty(3, 5)
    garbage = inp.clone()
    garbage[rank * 3:(rank + 1) * 3] = float("nan")
    handle = ops.reduce_scatter(late, garbage, group, async_op=True, own=own)
    own.copy_(inp[rank * 3:(rank + 1) * 3])
    handle.wait()
    rows = group.ledger.rows()
    return {"equal": bool(torch.equal(plain, late)), "calls": rows[0]["calls"], "message": rows[0]["message_bytes"],
            "bytes": rows[0]["bytes_sent"], "later": ops.takes_own_later(group)}


@pytest.mark.ranks
def test_the_reduce_scatter_takes_the_own_chunk_later():
    from fivefold.comm import volume

    for r in spawn_jobs(2, [("own", own_later, ())])["own"]:
        assert r["equal"] and r["later"] and r["calls"] == 2
        one = 2 * 3 * 5 * 4                            # the (6, 5) fp32 input of each call
        assert r["message"] == 2 * one                   # the ledger against comm/volume.py's formula
        assert r["bytes"] == 2 * volume.bytes_sent("reduce_scatter", one, 2, "gloo")


@pytest.fixture(scope="module")
def runs():
    jobs = [(f"{sp}-{on}", run_steps, (config(sp, on),)) for sp in (False, True) for on in (False, True)]
    jobs += [(f"graph-{sp}", fused_parts, (config(sp, True),)) for sp in (False, True)]
    lora = tiny_config(tp=2, sp_mode="megatron", tp_overlap=True)
    lora.train.lora_rank, lora.train.lora_targets = 4, ["wq", "wk", "wv"]
    jobs.append(("graph-lora", fused_parts, (lora.to_dict(),)))
    return spawn_jobs(2, jobs)


@pytest.mark.ranks
@pytest.mark.parametrize("sp", [False, True])
def test_fused_trains_as_the_plain_path(runs, sp):
    """fp64, q/k/v biases, an untied padded head, two micro-batches: losses, gradient norms and the whole
    state after 3 steps agree to 1e-10 with the plain path (parallel.tp_overlap off), and every step sends
    the same collectives (calls and bytes per dimension and op)."""
    for plain, fused in zip(runs[f"{sp}-False"], runs[f"{sp}-True"]):
        torch.testing.assert_close(torch.tensor(fused["losses"]), torch.tensor(plain["losses"]), rtol=1e-12, atol=0)
        torch.testing.assert_close(torch.tensor(fused["grad_norms"]), torch.tensor(plain["grad_norms"]),
                                   rtol=1e-12, atol=0)
        assert_states_close(fused["state"], plain["state"], **FP64)
        for a, b in zip(plain["ledger"], fused["ledger"]):
            sent = [[(r["dim"], r["op"], r["calls"], r["message_bytes"], r["bytes_sent"]) for r in rows]
                    for rows in (a, b)]
            assert sent[0] == sent[1]


@pytest.mark.ranks
@pytest.mark.parametrize("sp", [False, True])
def test_each_part_enters_fused_and_overlaps(runs, sp):
    """Every part's entry is one EnterColumns node (2 layers × attention and MLP, and the head), and each
    backward launches its collective, computes the weight gradients, then waits. Under SP each attention and
    each MLP leaves by ExitRows (gloo's reduce-scatter takes the own chunk after the launch)."""
    for r in runs[f"graph-{sp}"]:
        assert r["nodes"] == 2 * 2 + 1
        assert r["exits"] == (2 * 2 if sp else 0)
        assert r["events"] == ["launch", "weights", "wait"] * 5


@pytest.mark.ranks
def test_a_lora_part_takes_the_plain_path(runs):
    """LoRA adapters on q/k/v: attention enters by the plain path (its adapters need the gathered input),
    the two MLPs and the head fused. Their weights are frozen, so the fused backwards compute no weight
    gradient, but each still launches its input gradient's collective before it waits (every MLP's input
    needs a gradient: layer 0's adapters come before it); no frozen weight gets a gradient."""
    for r in runs["graph-lora"]:
        assert r["nodes"] == 2 + 1
        assert r["events"] == ["launch", "weights", "wait"] * 3
        assert r["frozen_grads"] == []


def test_the_rule():
    assert rules.overlaps_tp_input(1, "1f1b") and rules.overlaps_tp_input(2, "interleaved")
    assert rules.overlaps_tp_input(1, "zb")                      # one stage: no W pass
    assert not rules.overlaps_tp_input(2, "zb")                  # zb replays each weight's module
    assert not rules.overlaps_tp_input(1, "1f1b", on=False)
