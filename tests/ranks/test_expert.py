"""Expert parallelism reproduces the single-process run of the same mixture-of-experts model, alone and
with data parallel, ZeRO, pipeline and context parallel; its dispatcher equals the local one on uneven
and empty expert loads; its ledger counts the formula's all-to-alls.

Two spawns (2 and 4 ranks, module fixtures) run every multi-rank case.
"""
import pytest
import torch

from fivefold.comm import CommLedger
from fivefold.config import Config, ParallelConfig
from fivefold.mesh import ParallelMesh
from fivefold.model.moe import Experts, LocalDispatch
from fivefold.parallel.expert import AllToAllDispatch, regroup
from fivefold.train.trainer import Trainer

from tests.support.spawn import ranks, spawn_jobs
from tests.support.tiny import TOL, assert_states_close, tiny_config
from tests.support.reference import reference, run_steps

MOE = dict(experts=4, top_k=2, moe_ffn=64)

# name -> (world, parallel degrees, model fields beyond MOE)
CASES = {
    "ep2": (2, dict(dp=2, ep=2), {}),
    "ep2_capacity": (2, dict(dp=2, ep=2), dict(capacity_factor=1.0)),
    "ep2_shared_qwen": (2, dict(dp=2, ep=2), dict(router="softmax_topk", shared_experts=1, dense_layers=1)),
    "ep4": (4, dict(dp=4, ep=4, microbatches=2), {}),
    "ep2_edp2_zero3": (4, dict(dp=4, ep=2, zero=3), {}),
    "ep2_edp2_zero2_capacity": (4, dict(dp=4, ep=2, zero=2, microbatches=2), dict(capacity_factor=1.0)),
    "ep2_edp2_zero1_capacity": (4, dict(dp=4, ep=2, zero=1), dict(capacity_factor=1.25)),
    "ep2_dp2_pp2": (4, dict(dp=2, ep=2, pp=2, microbatches=2), {}),
    "ep2_cp2_ulysses": (2, dict(cp=2, ep=2, cp_mode="ulysses"), {}),
    "ep2_capacity_fp8": (2, dict(dp=2, ep=2, fp8_dispatch=True), dict(capacity_factor=1.0)),  # not exact
    "ep2_tp2_capacity": (4, dict(dp=2, ep=2, tp=2), dict(capacity_factor=1.0)),   # ep folded onto the tp pair
    "ep2_tp2_sp": (4, dict(dp=2, ep=2, tp=2, sp_mode="megatron"), {}),
    # MoE parallel folding: ep over ranks attention uses for tp (and dp, cp); etp cuts each expert's width
    "ep4_tp2_folded": (4, dict(dp=2, ep=4, tp=2), {}),                            # ep spans tp and dp
    "ep4_tp2_cp2_folded": (4, dict(cp=2, ep=4, tp=2, sp_mode="megatron"), {}),    # ep spans tp and cp
    "etp2_ep2_tp2": (4, dict(dp=2, ep=2, etp=2, tp=2), {}),                      # experts cut as tp cuts an MLP
    "etp2_ep2_tp2_capacity": (4, dict(dp=2, ep=2, etp=2, tp=2), dict(capacity_factor=1.0)),
    "etp2_tp2_sp_edp2": (4, dict(dp=2, etp=2, tp=2, sp_mode="megatron"), dict(router="softmax_topk",
                                                                              shared_experts=1)),
    "etp2_ep2_zero3": (4, dict(dp=2, ep=2, etp=2, tp=2, zero=3), {}),
    "etp2_ep2_zero1_capacity": (4, dict(dp=2, ep=2, etp=2, tp=2, zero=1), dict(capacity_factor=1.25)),
    "etp2_tp2_pp2": (4, dict(tp=2, pp=2, etp=2, microbatches=2), {}),
    "etp4_tp2_dp2": (4, dict(tp=2, dp=2, etp=4, microbatches=2), dict(capacity_factor=1.0)),   # etp beyond tp
    "etp2_ep2_zero2_recompute": (4, dict(tp=2, dp=2, ep=2, etp=2, zero=2, microbatches=2), {}, dict(recompute="full")),
    "ep2_tp2_pp2_interleaved": (4, dict(tp=2, pp=2, ep=2, vpp=2, schedule="interleaved", microbatches=2),
                                dict(layers=4)),
    "etp2_ep2_tp2_capacity_fp8": (4, dict(dp=2, ep=2, etp=2, tp=2, fp8_dispatch=True), dict(capacity_factor=1.0)),
    # Qwen3-MoE's shape: q/k norms, a head dim of its own (12 x 4 heads != hidden 64), no shared expert
    "qwen3_etp2_ep2_tp2_sp": (4, dict(dp=2, ep=2, etp=2, tp=2, sp_mode="megatron"),
                              dict(qk_norm=True, attn_head_dim=12, router="softmax_topk")),
    # (in fp64: its fp32 run leaves 0.26% of elements past the fp32 budget, every one within 1e-4; fp64 agrees
    # everywhere to 1e-10, so those are rounding)
    "qwen3_ep4_tp2_cp2": (4, dict(cp=2, ep=4, tp=2, sp_mode="megatron"), dict(qk_norm=True, attn_head_dim=12),
                          dict(dtype="fp64")),
    # GShard's random routing: every layout draws one process's second-expert choices (keys sliced by
    # tp's row split, by SP's sequence shard and cp's chunks; re-drawn alike by full recompute under pp)
    "random_ep4_tp2_folded_capacity": (4, dict(dp=2, ep=4, tp=2), dict(random_routing=True, capacity_factor=1.0)),
    "random_etp2_ep2_tp2_sp_cp2": (4, dict(cp=2, ep=2, etp=2, tp=2, sp_mode="megatron"), dict(random_routing=True),
                                   dict(dtype="fp64")),   # fp32: 0.7% of elements past its budget, each within 1e-4
    "random_ep2_dp2_pp2_recompute": (4, dict(dp=2, ep=2, pp=2, microbatches=2), dict(random_routing=True),
                                     dict(recompute="full")),
}
EXACT = [n for n in CASES if "fp8" not in n]


def moe_config(parallel: dict | None = None, model: dict | None = None) -> Config:
    c = tiny_config(**(parallel or {}))
    for k, v in {**MOE, **(model or {})}.items():
        setattr(c.model, k, v)
    return c


def case_config(name: str) -> Config:
    _, par, model, *train = CASES[name]
    c = moe_config(par, model)
    for k, v in (train[0] if train else {}).items():
        setattr(c.train, k, v)
    return c


# -- the dispatcher alone ----------------------------------------------------------------------------

def dispatcher_alone(rank, world):
    """Uneven loads, an expert with no token, a dropped assignment: the all-to-all dispatcher's output and
    gradients equal the local dispatcher's on the same experts."""
    torch.manual_seed(0)
    E, h, t = 4, 8, 6
    full = Experts(E, h, 16)
    with torch.no_grad():
        for p in full.parameters():
            p.normal_(0, 0.2)
    x = torch.randn(world, t, h)[rank].requires_grad_()
    experts_tk = torch.tensor([[0, 1], [0, 1], [0, 3], [1, 0], [3, -1], [1, 0]])   # expert 2 gets nothing
    weights_tk = torch.rand(t, 2) * (experts_tk >= 0)
    mesh = ParallelMesh(ParallelConfig(dp=world, ep=world), rank, CommLedger(rank, world))
    local = E // world
    mine = Experts(local, h, 16)
    with torch.no_grad():
        for name in ("w_gate", "w_up", "w_down"):
            getattr(mine, name).copy_(getattr(full, name)[rank * local:(rank + 1) * local])
    y = AllToAllDispatch(mesh["ep"], E)(x, experts_tk, weights_tk, mine)
    y.pow(2).sum().backward()
    ref_x = x.detach().clone().requires_grad_()
    ref = LocalDispatch()(ref_x, experts_tk, weights_tk, full)
    ref.pow(2).sum().backward()
    return {"y": (y.detach(), ref.detach()), "dx": (x.grad, ref_x.grad)}


def folded_dispatcher_alone(rank, world):
    """The same uneven loads through ep 2 x etp 2 on 4 ranks (tp 2 x dp 2, each rank its own tokens): every
    rank holds half of each of its two experts' width; outputs and input gradients equal the local
    dispatcher's on the whole experts."""
    torch.manual_seed(0)
    E, h, f, t = 4, 8, 16, 6
    full = Experts(E, h, f)
    with torch.no_grad():
        for p in full.parameters():
            p.normal_(0, 0.2)
    x = torch.randn(world, t, h)[rank].requires_grad_()
    experts_tk = torch.tensor([[0, 1], [0, 1], [0, 3], [1, 0], [3, -1], [1, 0]]).roll(rank, 0)
    weights_tk = torch.rand(t, 2) * (experts_tk >= 0)
    mesh = ParallelMesh(ParallelConfig(tp=2, dp=2, ep=2, etp=2), rank, CommLedger(rank, world))
    ep, etp = mesh["ep"], mesh["etp"]
    local, width = E // ep.size, f // etp.size
    mine = Experts(local, h, width)
    with torch.no_grad():
        experts = slice(ep.rank * local, (ep.rank + 1) * local)
        cols = slice(etp.rank * width, (etp.rank + 1) * width)
        mine.w_gate.copy_(full.w_gate[experts, cols])
        mine.w_up.copy_(full.w_up[experts, cols])
        mine.w_down.copy_(full.w_down[experts, :, cols])
    y = AllToAllDispatch(ep, E, etp=etp)(x, experts_tk, weights_tk, mine)
    y.pow(2).sum().backward()
    ref_x = x.detach().clone().requires_grad_()
    ref = LocalDispatch()(ref_x, experts_tk, weights_tk, full)
    ref.pow(2).sum().backward()
    return {"y": (y.detach(), ref.detach()), "dx": (x.grad, ref_x.grad)}


def test_regroup_orders_rows_by_expert():
    counts = torch.tensor([[2, 1], [0, 3]])          # source 0: 2 rows for expert 0, 1 for expert 1; ...
    assert regroup(counts).tolist() == [0, 1, 2, 3, 4, 5]
    counts = torch.tensor([[1, 2], [2, 1]])
    assert regroup(counts).tolist() == [0, 3, 4, 1, 2, 5]


# -- spawns ------------------------------------------------------------------------------------------

ROUTING = ["ep2", "ep2_dp2_pp2", "random_ep4_tp2_folded_capacity", "random_etp2_ep2_tp2_sp_cp2"]   # layouts whose
# routing metrics are compared with one process


def routing_steps(rank, world, cfg_dict, steps=2):
    """Each step's routing metrics (metrics.jsonl's expert_* and dropped figures) on this rank."""
    tr = Trainer(Config.from_dict(cfg_dict), rank, world, quiet=True)
    return [{k: v for k, v in tr.step(k).items() if k.startswith(("expert_", "dropped"))} for k in range(steps)]


def spawn(world):
    jobs = [(n, run_steps, (case_config(n).to_dict(),)) for n, case in CASES.items() if case[0] == world]
    jobs += [(f"{n}_routing", routing_steps, (case_config(n).to_dict(),)) for n in ROUTING if CASES[n][0] == world]
    jobs.append(("dispatch", dispatcher_alone, ()))
    if world == 4:
        jobs.append(("dispatch_folded", folded_dispatcher_alone, ()))
    return spawn_jobs(world, jobs)


@pytest.fixture(scope="module")
def two():
    return spawn(2)


@pytest.fixture(scope="module")
def four():
    return spawn(4)


def results_of(name, two, four):
    return {2: two, 4: four}[CASES[name][0]][name]


@pytest.mark.parametrize("name", EXACT)
@pytest.mark.ranks
def test_expert_parallel_equals_single_process(name, two, four):
    c = case_config(name)
    one = moe_config(dict(microbatches=c.parallel.microbatches * c.parallel.dp), CASES[name][2])
    one.train.recompute, one.train.dtype = c.train.recompute, c.train.dtype
    ref = reference(one)
    for r in results_of(name, two, four):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(r["grad_norms"]), torch.tensor(ref["grad_norms"]), rtol=1e-5, atol=0)
        assert_states_close(r["state"], ref["state"], **TOL[c.train.dtype])


@pytest.mark.parametrize("name", ROUTING)
@pytest.mark.ranks
def test_routing_imbalance_counts_the_global_batch(name, two, four):
    """expert_imbalance and the tokens per expert are the step's over its whole global batch (every
    micro-batch and rank, each MoE layer on its own), so every layout reports one process's figures: the
    mean load is global_batch x seq_len x top_k / experts assignments, not one micro-batch's share."""
    c = case_config(name)
    one = moe_config(dict(microbatches=c.parallel.microbatches * c.parallel.dp), CASES[name][2])
    want = routing_steps(0, 1, one.to_dict())
    t, m = c.train, c.model
    every = t.global_batch * t.seq_len * m.top_k / m.experts
    if m.random_routing:   # GShard: between one and two assignments a token, drawn alike in every layout
        assert all(every / 2 < w["expert_tokens_mean"] < every for w in want)
    else:
        assert all(w["expert_tokens_mean"] == every for w in want)
    assert all(w["expert_imbalance"] > 1.0 for w in want)
    for got in {2: two, 4: four}[CASES[name][0]][f"{name}_routing"]:
        assert got == want


@pytest.mark.parametrize("world, job", [(2, "dispatch"), (4, "dispatch"), (4, "dispatch_folded")])
@pytest.mark.ranks
def test_dispatcher_equals_local_on_uneven_and_empty_loads(world, job, two, four):
    for r in {2: two, 4: four}[world][job]:
        for got, want in r.values():
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.ranks
def test_ep_all_to_alls_per_step(two):
    """Per MoE layer and micro-batch: the counts exchange, dispatch and combine forward, and both again
    backward: 1 + 4 all-to-alls under dim "ep"; expert gradients summed over expert-dp (a group of one
    here: nothing sent), dense ones over dp."""
    c = case_config("ep2")
    moe_layers = c.model.layers - c.model.dense_layers
    for r in two["ep2"]:
        for rows in r["ledger"]:
            got = {(x["dim"], x["op"]): x["calls"] for x in rows}
            assert got[("ep", "all_to_all")] == 5 * moe_layers * c.parallel.microbatches
            assert ("edp", "all_reduce") not in got and got[("dp", "all_reduce")] >= 1


@pytest.mark.ranks
def test_fp8_dispatch_quarters_the_bytes_and_keeps_the_loss(two, four):
    """FP8 dispatch sends h + 4 bytes a routed row instead of 4h (fp32); combine and both backward
    exchanges are unchanged, so of the four equal-row all-to-alls per layer the step sends
    (h + 4 + 3·4h) / (4·4h) of the exact run's bytes. The loss stays within 1% of the unquantised run over
    3 steps (e4m3 keeps about two significant digits a value)."""
    h = case_config("ep2_capacity_fp8").model.hidden
    folded = zip(four["etp2_ep2_tp2_capacity_fp8"], four["etp2_ep2_tp2_capacity"])
    for fp8, exact in folded:   # with etp: the etp exchanges stay exact; the loss stays within 1%
        torch.testing.assert_close(torch.tensor(fp8["losses"]), torch.tensor(exact["losses"]), rtol=1e-2, atol=0)
        assert fp8["losses"] != exact["losses"]
    for fp8, exact in zip(two["ep2_capacity_fp8"], two["ep2_capacity"]):
        torch.testing.assert_close(torch.tensor(fp8["losses"]), torch.tensor(exact["losses"]), rtol=1e-2, atol=0)
        assert fp8["losses"] != exact["losses"]                  # it did quantise
        for rows_fp8, rows_exact in zip(fp8["ledger"], exact["ledger"]):
            got = next(x for x in rows_fp8 if x["dim"] == "ep")
            want = next(x for x in rows_exact if x["dim"] == "ep")
            assert got["calls"] == want["calls"]
            assert got["message_bytes"] == want["message_bytes"] * (13 * h + 4) / (16 * h)


@pytest.mark.ranks
def test_ep_x_tp_sends_one_tp_share(two, four):
    """Group-wise dispatch: with tp = 2 each tp rank dispatches only its half of the micro-batch's
    sequences, so a rank's expert all-to-all bytes are half those of the same dp × ep layout without tp
    (the naive scheme would send every token from both tp ranks: twice as much)."""
    def ep_bytes(rows):
        return next(x["message_bytes"] for x in rows if x["dim"] == "ep")
    for with_tp in four["ep2_tp2_capacity"]:
        without = two["ep2_capacity"][0]
        assert ep_bytes(with_tp["ledger"][0]) * 2 == ep_bytes(without["ledger"][0])


@pytest.mark.ranks
def test_etp_exchanges_per_step_follow_the_formula(four):
    """Capacity mode, etp2 x ep2 on tp2 x dp2: per MoE layer and micro-batch, the rows a rank received
    (R = E·B·C, B its sequences after tp's row split) are gathered over etp and the partial outputs
    reduce-scattered back, forward and backward: 4 all-to-alls of etp·R·h·4 bytes each, every one sending
    comm/volume.py's all_to_all share, (etp-1)/etp of it. No counts are exchanged (capacity mode)."""
    from fivefold import rules
    from fivefold.comm import volume

    c = case_config("etp2_ep2_tp2_capacity")
    p, m, t = c.parallel, c.model, c.train
    sequences = t.global_batch // (p.dp * p.microbatches) // p.tp          # per rank, after the row split
    rows = m.experts * sequences * rules.moe_capacity(m.capacity_factor, t.seq_len, m.top_k, m.experts)
    message = p.etp * rows * m.hidden * 4
    calls = 4 * (m.layers - m.dense_layers) * p.microbatches
    for r in four["etp2_ep2_tp2_capacity"]:
        for step in r["ledger"]:
            etp = [x for x in step if x["dim"] == "etp"]
            assert [x["op"] for x in etp] == ["all_to_all"]
            assert etp[0]["calls"] == calls and etp[0]["message_bytes"] == calls * message
            assert etp[0]["bytes_sent"] == pytest.approx(calls * volume.bytes_sent("all_to_all", message, p.etp, "gloo"))
            assert etp[0]["bytes_sent"] == pytest.approx(calls * message * (p.etp - 1) / p.etp)


FOLDED = [n for n in CASES if CASES[n][1].get("tp", 1) > 1]


@pytest.mark.parametrize("name", FOLDED)
@pytest.mark.ranks
def test_folded_layouts_ledger_equals_the_planner(name, four):
    """Every layout with the experts folded over tp's ranks (and etp): the planner's rows equal the ledger's,
    calls and bytes (dropless: the routed rows' all-to-all bytes follow the routing; their calls match)."""
    c = case_config(name)
    check_planned(c, [r["ledger"][0] for r in results_of(name, None, four)], dropless=not c.model.capacity_factor)


FIVE = dict(tp=2, cp=2, pp=2, dp=2, ep=4, etp=2, cp_mode="ring", microbatches=2)   # 16 ranks


def check_planned(c: Config, rows_by_rank: list, dropless: bool) -> None:
    """The planner's rows for the layout equal the ledger's summed over ranks (one step): calls, message
    and sent bytes; dropless dispatch bytes depend on the routing, so there only the calls must match."""
    from fivefold.plan.layout import from_config
    from fivefold.plan.models import from_model_config
    from fivefold.plan.traffic import all_ranks

    layout, work = from_config(c)
    planned = all_ranks(from_model_config(c.model), layout, work)
    measured: dict = {}
    for rows in rows_by_rank:
        for x in rows:
            m = measured.setdefault((x["dim"], x["op"]), [0, 0.0, 0.0])
            m[0] += x["calls"]
            m[1] += x["message_bytes"]
            m[2] += x["bytes_sent"]
    assert sorted(measured) == sorted(planned)
    for key, row in planned.items():
        assert measured[key][0] == row["calls"], key
        if not (dropless and key in (("ep", "all_to_all"), ("etp", "all_to_all"))):
            assert measured[key][1] == row["message_bytes"], key
            assert measured[key][2] == pytest.approx(row["bytes_sent"], rel=1e-12), key


@pytest.mark.ranks
def test_five_dimensions_in_one_run_equal_single_process():
    """tp2 × cp2 × pp2 × dp2 with the experts folded as etp2 × ep4 over each stage's 8 ranks: the tiny MoE
    model's losses, grad norms and
    parameters after 3 steps equal one process's (same micro-batches), and the planner's rows for the
    layout equal the ledger's (dropless: the expert all-to-all bytes follow the routing, its calls match)."""
    c = moe_config(FIVE)
    c.model.layers = 2
    out = ranks(run_steps, 16, c.to_dict(), timeout_s=600)
    check_planned(c, [r["ledger"][0] for r in out], dropless=True)
    ref = reference(moe_config(dict(microbatches=FIVE["microbatches"] * FIVE["dp"])))
    for r in out:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(r["grad_norms"]), torch.tensor(ref["grad_norms"]), rtol=1e-5, atol=0)
        assert_states_close(r["state"], ref["state"], **TOL["fp32"])
