"""Overlap is not free (time.interfered; docs/plan.md, "Overlap is not free"): compute beside a collective
loses the accelerator's communication share of its rate, so a collective of c seconds beside compute of t
takes max(c, t + share·c)."""
from dataclasses import replace

import pytest

from fivefold.plan.estimate import estimate
from fivefold.plan.layout import Layout, Workload
from fivefold.plan.models import PRESETS
from fivefold.plan.time import _grad_exposed, beside_backward, ep_exposed, interfered
from fivefold.plan.topology import ACCELERATORS, TOPOLOGIES
from fivefold.plan.traffic import Flow

SHARE = 20 / 132     # DeepSeek-V3 §3.2.2: 20 of the H800's 132 SMs for communication


def test_accelerator_share_is_sms_given_to_communication():
    assert ACCELERATORS["h100"].comm_share == pytest.approx(SHARE)
    assert ACCELERATORS["a100"].comm_share == pytest.approx(20 / 108)


def test_interfered_is_the_pair_by_hand():
    # compute 1.0 s beside a 0.5 s gather: compute runs at (1 - share) for 0.5 s, then alone: 1 + share·0.5
    assert interfered(0.0, 0.5, SHARE) == pytest.approx(0.5 * SHARE)
    # a collective longer than compute stays the collective's
    assert interfered(1.0, 2.0, SHARE) == 1.0
    assert interfered(0.3, 0.5, 0.0) == 0.3


def test_zero3_prefetched_collectives_cost_compute():
    """ZeRO-3 without a pipeline, per micro-batch: gathers (ag/2m) behind the forward, gathers and
    reduce-scatters behind the backward: m·(max(a - t_f, share·a) + max(a + r - t_b, share·(a + r)))."""
    flows = [Flow("dp", "all_gather", "dp_cp", 8, calls=8, seconds=0.8),
             Flow("dp", "reduce_scatter", "dp_cp", 8, calls=4, seconds=0.4)]
    lay, m, t_f, t_b = Layout(dp=8, zero=3), 2, 0.5, 1.0
    free, _ = _grad_exposed(flows, lay, m, 3.0, [(3.0, 1.0)], [(0.0, 0.5)], t_f, t_b)
    paid, _ = _grad_exposed(flows, lay, m, 3.0, [(3.0, 1.0)], [(0.0, 0.5)], t_f, t_b, share=SHARE)
    assert free == 0.0                                   # 0.2 < 0.5 and 0.2 + 0.2 < 1.0: all hidden
    assert paid == pytest.approx(m * (0.2 * SHARE + 0.4 * SHARE))


def test_expert_all_to_all_overlap_costs_compute():
    # forward's a2a/2 = 0.5 behind t_b = 0.6: hidden, costs share·0.5; backward's 0.5 behind t_f = 0.3: 0.2 shows
    assert ep_exposed(1.0, 0.3, 0.6, 1, True, 8, share=SHARE) == pytest.approx(0.5 * SHARE + 0.2)
    assert ep_exposed(1.0, 0.3, 0.6, 1, True, 8) == pytest.approx(0.2)


def test_step_time_grows_where_collectives_overlap():
    topo = TOPOLOGIES["dgx-h100"]
    free = replace(topo, accelerator=replace(topo.accelerator, comm_sms=0))
    m, w = PRESETS["llama3-8b"], Workload(seq=4096, global_batch=64)
    lay = Layout(dp=8, zero=3)     # one node: NVLink gathers hide behind compute
    paid, ideal = estimate(m, lay, w, topo).time, estimate(m, lay, w, free).time
    assert paid.grad_comm_s > ideal.grad_comm_s and paid.step_time_s > ideal.step_time_s
    # DDP's reduction once per step: the part beside the last backward slows it; the drain's part is free
    ddp = Layout(dp=8, zero=0)
    paid, ideal = estimate(m, ddp, w, topo).time, estimate(m, ddp, w, free).time
    assert paid.grad_comm_s > ideal.grad_comm_s and paid.step_time_s > ideal.step_time_s


def test_once_per_step_reduction_pays_for_what_runs_beside_the_backward():
    """8 buckets of 0.05 s become final every 0.25 s during a 2 s backward ending at t = 3: seven run
    before t (0.35 s beside compute), the last from 3.0 to 3.05. Free overlap exposes 0.05 s; with the
    share, compute beside the 0.35 s loses share x 0.35 = 0.053 s, which now shows instead."""
    assert beside_backward([(3.0, 2.0, 0.4, 8)]) == pytest.approx(0.35)
    assert beside_backward([(3.0, 0.0, 0.4, 8)]) == pytest.approx(0.0, abs=1e-12)        # all final at the end: nothing beside compute
    flows = [Flow("dp", "all_reduce", "dp_cp", 8, calls=8, seconds=0.4)]
    lay, m = Layout(dp=8, zero=0), 2
    free, _ = _grad_exposed(flows, lay, m, 3.0, [(3.0, 2.0)], [(0.0, 1.0)], 1.0, 2.0)
    paid, _ = _grad_exposed(flows, lay, m, 3.0, [(3.0, 2.0)], [(0.0, 1.0)], 1.0, 2.0, share=SHARE)
    assert free == pytest.approx(0.05)
    assert paid == pytest.approx(0.35 * SHARE) and paid == pytest.approx(0.0530303, rel=1e-5)
    # buckets all at the end of the schedule (overlap_grad_reduce off): exposed whole, nothing more charged
    off, _ = _grad_exposed(flows, replace(lay, overlap_grad_reduce=False), m, 3.0, [(3.0, 2.0)], [(0.0, 1.0)],
                           1.0, 2.0, share=SHARE)
    assert off == pytest.approx(0.4)
