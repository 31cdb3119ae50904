"""Engines over several reduction groups: parameters whose placements name different groups are each
summed over their own group (buckets and ZeRO units never mix groups), for DDP and ZeRO-1/2/3.

Four ranks, two groups: "all" (the four ranks) and "pair" ({0, 1}, {2, 3}). Parameters reduced over
"all" stay identical everywhere; those reduced over "pair" become one copy per pair (as expert weights
are one copy per expert-data-parallel group). The reference replays that in one process: one copy of
the "all" parameters, one copy of the "pair" parameters per pair, gradients summed by the same rule,
the global norm over every distinct element, the same AdamW.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from fivefold.comm import CommLedger, Group
from fivefold.parallel.data import DataParallelOptimizer
from fivefold.parallel.placement import place
from fivefold.parallel.zero.engine import ZeroEngine
from fivefold.parallel.zero.spec import ZeroSpec
from fivefold.train.optim import AdamW, clip_, global_grad_norm

from tests.support.spawn import ranks

WORLD, STEPS, LR, CLIP = 4, 3, 1e-2, 0.05
PAIRS = [[0, 1], [2, 3]]


class Net(nn.Module):
    """Two blocks: the first all "all", the second mixing an "all" and a "pair" weight (a ZeRO-3 slot
    with two units)."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(6, 5, bias=False)),
                                     nn.Sequential(nn.Linear(5, 4, bias=False), nn.Linear(4, 3, bias=True))])
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        self.double()
        place(self.layers[0][0].weight, reduce="all")
        place(self.layers[1][0].weight, reduce="all")
        place(self.layers[1][1].weight, reduce="pair")
        place(self.layers[1][1].bias, reduce="pair")

    def forward(self, x):
        return self.layers[1](torch.tanh(self.layers[0](x)))


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(3, 6, generator=torch.Generator().manual_seed(100 * step + rank), dtype=torch.float64)


def loss_of(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    return model(batch(rank, step)).pow(2).sum() / (3 * WORLD)


def make_optimizer(params, decay):
    return AdamW(params, decay, weight_decay=0.1)


def groups_for(rank: int, ledger: CommLedger) -> dict:
    everyone = list(range(WORLD))
    pair_pgs = [dist.new_group(p) for p in PAIRS]   # every rank creates every group, in order
    mine = next(i for i, p in enumerate(PAIRS) if rank in p)
    world = Group("all", everyone, rank, dist.group.WORLD, ledger)
    return {"all": world, "pair": Group("pair", PAIRS[mine], PAIRS[mine].index(rank), pair_pgs[mine], ledger),
            "world": Group("world", everyone, rank, dist.group.WORLD, ledger)}


def run_engine(rank, world, kind):
    torch.set_num_threads(1)
    ledger = CommLedger(rank, world)
    model = Net()
    groups = groups_for(rank, ledger)
    if kind == "ddp":
        engine = DataParallelOptimizer(model, groups, make_optimizer, bucket_mb=1e-4,
                                       master_dtype=torch.float64)
    else:
        engine = ZeroEngine(model, groups, ZeroSpec(int(kind[-1])), make_optimizer, bucket_mb=1e-4,
                            master_dtype=torch.float64)
    for step in range(STEPS):
        engine.set_sync(True)
        loss_of(model, rank, step).backward()
        engine.end_backward()
        engine.finish()
        norm = global_grad_norm(engine.norm_grads(), engine.norm_group)
        clip_(engine.owned_grads(), norm, CLIP)
        engine.step(LR)
        engine.zero_grad()
    state = engine.full_state()["model"]
    dims = {row["dim"] for row in ledger.rows()}
    return {"state": state, "norm": norm, "dims": dims}


def reference():
    """One "all" copy and one "pair" copy per pair, trained by the engines' rule in one process."""
    shared = Net()
    pair_copies = [Net() for _ in PAIRS]
    names_pair = {"layers.1.1.weight", "layers.1.1.bias"}
    params = {n: p for n, p in shared.named_parameters() if n not in names_pair}
    for i, net in enumerate(pair_copies):
        params.update({f"{i}:{n}": p for n, p in net.named_parameters() if n in names_pair})
    keys = list(params)
    opt = AdamW([params[k].data for k in keys], [params[k].dim() >= 2 for k in keys], weight_decay=0.1)
    for step in range(STEPS):
        grads = {k: torch.zeros_like(params[k]) for k in keys}
        for i, pair in enumerate(PAIRS):
            net = pair_copies[i]
            with torch.no_grad():   # this pair's view: shared weights, its own pair weights
                for n, p in net.named_parameters():
                    if n not in names_pair:
                        p.copy_(params[n])
            for rank in pair:
                net.zero_grad()
                loss_of(net, rank, step).backward()
                for n, p in net.named_parameters():
                    grads[n if n not in names_pair else f"{i}:{n}"] += p.grad
        g = [grads[k] for k in keys]
        norm = float(torch.sqrt(sum(x.double().pow(2).sum() for x in g)))
        clip_(g, norm, CLIP)
        opt.step(g, LR)
    return params, norm


@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.mark.parametrize("kind", ["ddp", "zero1", "zero2", "zero3"])
@pytest.mark.ranks
def test_two_reduce_groups_equal_the_reference(kind, ref):
    params, ref_norm = ref
    for rank, r in enumerate(ranks(run_engine, WORLD, kind)):
        pair = next(i for i, p in enumerate(PAIRS) if rank in p)
        assert r["dims"] >= {"all", "pair"}   # each partition went over its own group
        assert r["norm"] == pytest.approx(ref_norm, rel=1e-12)
        for name, got in r["state"].items():
            want = params[name] if name in params else params[f"{pair}:{name}"]
            torch.testing.assert_close(got, want.detach(), rtol=1e-12, atol=1e-14)
