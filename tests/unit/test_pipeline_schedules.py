"""Pipeline schedules as data: shape of the action lists, the simulator's timing against the papers'
closed forms, memory (in-flight micro-batches), communication matching and deadlock detection.

Costs: F=1, B=2 (I=W=1 for zero bubble) per stage unless a test says otherwise; `simulate_schedule`
divides stage costs by vpp for interleaved chunks, so every schedule does the same work."""
import random
from collections import Counter

import pytest

from fivefold.config import ConfigError
from fivefold.parallel.pipeline import (B, F, I, RECV_B, RECV_F, SEND_B, SEND_F, W, Action, DeadlockError,
                                        ScheduleError, build_schedule, check_actions, closed_form_bubble,
                                        compute_only, input_messages, message_key, simulate, simulate_schedule,
                                        steps, timeline_stats)
from fivefold.parallel.pipeline.schedules import interleaved_table, interleaved_warmup

COMBOS = [(p, m, v) for p in (1, 2, 3, 4, 6) for m in (1, 2, 3, 4, 6, 8, 12) for v in (1, 2, 3)]


def schedules_for(p, m, v):
    """(name, vpp) pairs that accept this combination."""
    out = [("gpipe", 1), ("1f1b", 1), ("zb", 1)] if v == 1 else []
    if m % p == 0:
        out.append(("interleaved", v))
    return out


def all_cases():
    return [(name, p, m, vv) for p, m, v in COMBOS for name, vv in schedules_for(p, m, v)]


@pytest.mark.parametrize("name, p, m, v", all_cases())
def test_every_schedule_is_well_formed_and_finishes(name, p, m, v):
    actions = build_schedule(name, p, m, v)
    check_actions(actions, m, v)  # one F and one B (or I+W) per (mb, chunk) on rank chunk % p; messages match
    for blocking in (False, True):  # overlap and strict rendezvous both complete
        sim = simulate_schedule(name, p, m, v, blocking=blocking)
        assert len(sim.timeline) == p
        assert sum(len(row) for row in sim.timeline) == len([a for row in actions for a in row if not a.is_comm])


def test_compute_actions_per_microbatch_and_chunk():
    for name, p, m, v in [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2), ("zb", 4, 8, 1)]:
        actions = build_schedule(name, p, m, v)
        count = Counter((a.kind, a.microbatch, a.chunk) for row in actions for a in row if not a.is_comm)
        kinds = (F, I, W) if name == "zb" else (F, B)
        assert set(count) == {(k, mb, c) for k in kinds for mb in range(m) for c in range(p * v)}
        assert set(count.values()) == {1}
        for r, row in enumerate(actions):
            assert all(a.chunk % p == r for a in row)


@pytest.mark.parametrize("costs", [dict(cost_f=1, cost_b=2), dict(cost_f=1, cost_b=1), dict(cost_f=0.7, cost_b=1.9)])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_closed_form(name, costs):
    for p in (2, 3, 4, 8):
        for m in (1, 2, 4, 8, 13):
            sim = simulate_schedule(name, p, m, **costs)
            assert sim.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12), (p, m)
            assert sim.makespan == pytest.approx((m + p - 1) * (costs["cost_f"] + costs["cost_b"]))


def test_interleaved_bubble_matches_megatron_and_shrinks_with_v():
    for p in (2, 3, 4):
        for m in (p, 2 * p, 4 * p):
            bubbles = [simulate_schedule("interleaved", p, m, v).bubble for v in (1, 2, 3, 4)]
            for v, bubble in zip((1, 2, 3, 4), bubbles):
                assert bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12), (p, m, v)
            assert all(a > b for a, b in zip(bubbles, bubbles[1:])), (p, m, bubbles)


def test_interleaved_needs_microbatches_divisible_by_pp():
    with pytest.raises(ConfigError, match=r"divisible by pp: 6 % 4 != 0; use microbatches in \[4, 8\]"):
        build_schedule("interleaved", 4, 6, 2)
    with pytest.raises(ConfigError, match="vpp > 1 needs the interleaved schedule"):
        build_schedule("1f1b", 4, 8, 2)
    with pytest.raises(ConfigError, match="schedule must be one of"):
        build_schedule("dualpipe", 4, 8)


def test_zero_bubble_is_a_third_of_1f1b():
    for p in (2, 4, 8):
        for m in (p, 2 * p, 3 * p + 1):
            zb = simulate_schedule("zb", p, m, cost_f=1, cost_i=1, cost_w=1)
            one = simulate_schedule("1f1b", p, m, cost_f=1, cost_b=2)
            idle_zb = zb.bubble * zb.makespan * p
            idle_1f1b = one.bubble * one.makespan * p
            assert idle_zb == pytest.approx(idle_1f1b / 3), (p, m)  # (p-1)(F+I-W) vs (p-1)(F+B) per rank
            assert zb.bubble == pytest.approx(closed_form_bubble("zb", p, m), abs=1e-12)
            if m % p == 0:
                assert zb.bubble < simulate_schedule("interleaved", p, m, 2).bubble < one.bubble
    for f, i, w in [(1, 1.5, 0.5), (2, 1, 1), (1.5, 2, 1)]:  # uneven split; the formula needs W <= min(F, I)
        sim = simulate_schedule("zb", 4, 8, cost_f=f, cost_i=i, cost_w=w)
        assert sim.bubble == pytest.approx(closed_form_bubble("zb", 4, 8, 1, f, 0, i, w), abs=1e-12)
    assert closed_form_bubble("zb", 4, 8, 1, 1, 0, 0.6, 1.4) is None
    assert simulate_schedule("zb", 4, 8, cost_f=1, cost_i=0.6, cost_w=1.4).bubble < simulate_schedule("1f1b", 4, 8).bubble


def test_schedule_ordering_at_p4_m8():
    bubble = {key: simulate_schedule(*key).bubble for key in
              [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2), ("interleaved", 4, 8, 4), ("zb", 4, 8, 1)]}
    assert bubble[("gpipe", 4, 8, 1)] == pytest.approx(3 / 11)
    assert bubble[("1f1b", 4, 8, 1)] == pytest.approx(3 / 11)
    assert bubble[("interleaved", 4, 8, 2)] == pytest.approx(3 / 19)
    assert bubble[("interleaved", 4, 8, 4)] == pytest.approx(3 / 35)
    assert bubble[("zb", 4, 8, 1)] == pytest.approx(3 / 27)


def test_in_flight_microbatches():
    for p in (2, 4, 6):
        for m in (1, p, 3 * p):
            one = simulate_schedule("1f1b", p, m)
            assert one.peak_in_flight == [min(m, p - s) for s in range(p)]  # stage 0 keeps at most p
            assert simulate_schedule("gpipe", p, m).peak_in_flight == [m] * p
            assert max(simulate_schedule("zb", p, m).peak_in_flight) <= p  # same memory bound as 1F1B
    for p, m, v in [(2, 4, 2), (4, 8, 2), (4, 8, 3)]:  # Megatron: rank 0 warms up 2(p-1)+(v-1)p chunks, +1
        sim = simulate_schedule("interleaved", p, m, v)
        assert sim.peak_in_flight[0] == min(2 * (p - 1) + (v - 1) * p + 1, m * v)


def test_sends_match_receives_and_traffic_per_boundary():
    for name, p, m, v in [("gpipe", 4, 8, 1), ("1f1b", 3, 5, 1), ("interleaved", 4, 8, 2), ("zb", 4, 8, 1),
                          ("interleaved", 2, 4, 3)]:
        actions = build_schedule(name, p, m, v)
        sends = {(r, a.peer, message_key(a)) for r, row in enumerate(actions) for a in row if a.kind.startswith("SEND")}
        recvs = {(a.peer, r, message_key(a)) for r, row in enumerate(actions) for a in row if a.kind.startswith("RECV")}
        assert sends == recvs
        kinds = Counter(a.kind for row in actions for a in row if a.is_comm)
        boundaries = p * v - 1  # activation forward and gradient back, once per micro-batch per boundary
        assert kinds == {SEND_F: m * boundaries, RECV_F: m * boundaries, SEND_B: m * boundaries, RECV_B: m * boundaries}
        for r, row in enumerate(actions):  # each rank sends m*v activations (m*(v) minus the model's end)
            sent_f = sum(a.kind == SEND_F for a in row)
            assert sent_f == m * v - (m if r == (p * v - 1) % p else 0)
            for a in row:
                if a.is_comm:
                    other = {SEND_F: a.chunk + 1, RECV_F: a.chunk - 1, SEND_B: a.chunk - 1, RECV_B: a.chunk + 1}[a.kind]
                    assert a.peer == other % p


def test_fifo_order_per_pair_of_ranks():
    for name, p, m, v in [("interleaved", 2, 4, 2), ("interleaved", 4, 8, 3), ("zb", 2, 5, 1)]:
        actions = build_schedule(name, p, m, v)
        for src in range(p):
            for dst in range(p):
                sent = [message_key(a) for a in actions[src] if a.kind.startswith("SEND") and a.peer == dst]
                got = [message_key(a) for a in actions[dst] if a.kind.startswith("RECV") and a.peer == src]
                assert sent == got


def test_steps_groups_batches():
    actions = build_schedule("1f1b", 4, 8)[1]
    grouped = list(steps(actions))
    flat = [x for g in grouped for x in (g if isinstance(g, list) else [g])]
    assert flat == actions
    for prev, cur in zip(grouped, grouped[1:]):
        assert not (isinstance(prev, list) and isinstance(cur, list))  # batches are maximal
    assert any(isinstance(g, list) and {a.kind for a in g} == {SEND_F, RECV_B} for g in grouped)  # Megatron's pair


def test_input_messages():
    assert input_messages(Action(F, 3, 5), 4, 8) == [("F", 3, 4)]
    assert input_messages(Action(B, 3, 5), 4, 8) == [("B", 3, 6)]
    assert input_messages(Action(I, 3, 7), 4, 8) == []
    assert input_messages(Action(W, 3, 5), 4, 8) == []
    assert input_messages(Action(F, 0, 0), 4, 8) == []
    assert input_messages(Action(F, 0, 1), 1, 2) == []


def test_compute_only_lists_simulate_the_same():
    for name, p, m, v in [("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2), ("zb", 3, 6, 1)]:
        full = simulate_schedule(name, p, m, v)
        bare = simulate(compute_only(build_schedule(name, p, m, v)), 1 / v, 2 / v, 1 / v, 1 / v)
        assert bare.makespan == pytest.approx(full.makespan)
        assert bare.timeline == full.timeline


def test_costs_per_chunk_callable_and_comm():
    actions = build_schedule("1f1b", 4, 8)
    slow_last = simulate(actions, cost_f=[1, 1, 1, 2], cost_b=lambda a: 4 if a.chunk == 3 else 2)
    assert slow_last.makespan >= 8 * (2 + 4)
    assert slow_last.busy[3] == pytest.approx(48)
    p, m, f, b, c = 4, 6, 1.0, 2.0, 0.25
    gp = simulate(build_schedule("gpipe", p, m), f, b, comm=c)  # each boundary costs c each way, at least
    assert gp.makespan >= (m + p - 1) * (f + b) + 2 * (p - 1) * c
    bare = simulate(compute_only(build_schedule("gpipe", p, m)), f, b, comm=c)  # no lists: ideal overlap
    assert bare.makespan == pytest.approx((m + p - 1) * (f + b) + 2 * (p - 1) * c)
    for blocking in (False, True):
        sim = simulate(actions, 1, 2, comm=0.3, blocking=blocking)
        assert sim.makespan > simulate(actions).makespan
        assert all(done >= posted for row in sim.comm for _, posted, done in row)


def test_random_costs_never_deadlock():
    rng = random.Random(0)
    for name, p, m, v in [("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2), ("interleaved", 3, 6, 3), ("zb", 5, 7, 1),
                          ("gpipe", 3, 4, 1)]:
        chunks = p * v
        actions = build_schedule(name, p, m, v)
        costs = [[rng.uniform(0.2, 3) for _ in range(chunks)] for _ in range(4)]
        for blocking in (False, True):
            sim = simulate(actions, *costs, comm=lambda a: rng.uniform(0, 0.5), blocking=blocking)
            assert sim.makespan > 0


def test_deadlock_is_detected_and_named():
    actions = build_schedule("1f1b", 2, 2)
    bad = [list(actions[0]), list(actions[1])]
    # rank 1 runs its first backward before its first forward
    i_f, i_b = bad[1].index(Action(F, 0, 1)), bad[1].index(Action(B, 0, 1))
    bad[1][i_f], bad[1][i_b] = bad[1][i_b], bad[1][i_f]
    with pytest.raises(DeadlockError, match=r"rank 1 blocked at action #\d+ B\(mb=0, chunk=1\): waiting for the "
                                            r"forward of micro-batch 0, chunk 1"):
        simulate(bad)
    # crossed messages: rank 0 waits for a gradient before sending the activation that produces it
    crossed = [[Action(F, 0, 0), Action(RECV_B, 0, 0, 1), Action(B, 0, 0), Action(SEND_F, 0, 0, 1)],
               [Action(RECV_F, 0, 1, 0), Action(F, 0, 1), Action(B, 0, 1), Action(SEND_B, 0, 1, 0)]]
    for blocking in (False, True):
        with pytest.raises(DeadlockError, match="rank 0 blocked at action #"):
            simulate(crossed, blocking=blocking)
    missing = [[Action(F, 0, 0), Action(B, 0, 0)], [Action(B, 0, 1)]]
    with pytest.raises(DeadlockError, match="which no rank's list contains"):
        simulate(missing)


def test_contract_violations_are_reported():
    actions = build_schedule("1f1b", 2, 2)
    no_recv = [actions[0], [a for a in actions[1] if a.kind != RECV_F]]
    with pytest.raises(ScheduleError):
        check_actions(no_recv, 2)
    with pytest.raises(ScheduleError, match="comes before the receive"):
        late = list(actions[1])
        late.remove(Action(RECV_F, 0, 1, 0))
        late.append(Action(RECV_F, 0, 1, 0))
        simulate([actions[0], late])
    wrong_rank = [actions[0] + [Action(W, 0, 1)], actions[1]]
    with pytest.raises(ScheduleError, match="belongs on rank 1"):
        check_actions(wrong_rank, 2)
    duplicate = [actions[0] + [Action(F, 0, 0)], actions[1]]
    with pytest.raises(ScheduleError, match="appears twice"):
        check_actions(duplicate, 2)


def test_timeline_stats_on_a_measured_timeline():
    measured = [[("F", 0, 0, 100.0, 101.0), ("B", 0, 0, 103.0, 105.0)],
                [("F", 0, 1, 101.0, 102.0), ("B", 0, 1, 102.0, 103.0)]]
    stats = timeline_stats(measured)
    assert stats["makespan"] == pytest.approx(5.0)
    assert stats["bubble"] == pytest.approx(1 - 5 / 10)
    assert stats["peak_in_flight"] == [1, 1]


# -- interleaved micro-batch groups (Llama 3 §3.3.2; Megatron-Core microbatch_group_size_per_vp_stage) ----
def valid_groups(p, m):
    return [n for n in range(p, m + 1) if m % n == 0 or m % n >= p]


GROUP_CASES = [(p, m, v, n) for p in (2, 3, 4) for m in range(p, 3 * p + 2) for v in (2, 3) for n in valid_groups(p, m)]


@pytest.mark.parametrize("p, m, v, n", GROUP_CASES)
def test_micro_batch_groups_are_valid_and_keep_the_bubble(p, m, v, n):
    """Every valid group size N (p <= N <= m, last group empty or >= p) gives well-formed lists that finish
    in both execution modes; without communication the bubble is Megatron's (p-1)/(v·m+p-1) for every N,
    and rank s keeps min(2(p-s-1) + (v-1)·N + 1, m·v) chunks alive."""
    actions = build_schedule("interleaved", p, m, v, microbatch_group=n)
    check_actions(actions, m, v)
    for blocking in (False, True):
        sim = simulate_schedule("interleaved", p, m, v, blocking=blocking, microbatch_group=n)
    sim = simulate_schedule("interleaved", p, m, v, microbatch_group=n)
    assert sim.bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    assert sim.peak_in_flight == [min(2 * (p - s - 1) + (v - 1) * n + 1, m * v) for s in range(p)]
    assert sim.peak_in_flight == [interleaved_warmup(p, s, m, v, n) for s in range(p)]


def test_micro_batch_group_order():
    """Megatron-Core's table for p = 2, m = 5, N = 3, v = 2: micro-batches 0 1 2 0 1 2 3 4 3 4 on local
    chunks 0 0 0 1 1 1 0 0 1 1; N = p is the default (depth-first) order, N = m breadth-first."""
    assert interleaved_table(5, 2, 3) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (3, 0), (4, 0), (3, 1), (4, 1)]
    assert build_schedule("interleaved", 4, 8, 2, microbatch_group=4) == build_schedule("interleaved", 4, 8, 2)
    rank0 = [a for a in build_schedule("interleaved", 2, 4, 2, microbatch_group=4, communication=False)[0] if a.kind == F]
    assert [(a.microbatch, a.chunk) for a in rank0] == [(0, 0), (1, 0), (2, 0), (3, 0), (0, 2), (1, 2), (2, 2), (3, 2)]
    # a group lets m be any count with a last group >= p: m = 6 on p = 4 with N = 6 (one group)
    check_actions(build_schedule("interleaved", 4, 6, 2, microbatch_group=6), 6, 2)


def test_larger_groups_trade_memory_for_slack():
    """Llama 3's reason to tune N: with transfers that take time, groups longer than p give each forward
    more slack before the micro-batch comes round to its next chunk, at the cost of (v-1)(N-p) more
    chunks alive on every rank."""
    p, m, v, comm = 4, 16, 2, 0.4
    dfs = simulate_schedule("interleaved", p, m, v, comm=comm)
    longer = simulate_schedule("interleaved", p, m, v, comm=comm, microbatch_group=6)
    assert longer.makespan < dfs.makespan
    assert [a - b for a, b in zip(longer.peak_in_flight, dfs.peak_in_flight)] == [(v - 1) * (6 - p)] * p


def test_micro_batch_group_rules():
    with pytest.raises(ConfigError, match=r"microbatch_group 3 must lie between pp \(4, depth-first\) and "
                                          r"microbatches \(8, breadth-first\); valid: \[4, 8\]"):
        build_schedule("interleaved", 4, 8, 2, microbatch_group=3)
    with pytest.raises(ConfigError, match=r"between pp .* valid: \[4, 8\]"):
        build_schedule("interleaved", 4, 8, 2, microbatch_group=9)
    with pytest.raises(ConfigError, match=r"leaves a last group of 16 % 5 = 1 micro-batches, fewer than pp \(4\); "
                                          r"valid: \[4, 6, 8, 9, 10, 11, 12, 16\]"):
        build_schedule("interleaved", 4, 16, 2, microbatch_group=5)
    with pytest.raises(ConfigError, match="integer >= 0"):
        build_schedule("interleaved", 4, 8, 2, microbatch_group=-1)
    with pytest.raises(ConfigError, match="integer >= 0"):
        build_schedule("interleaved", 4, 8, 2, microbatch_group=True)
    with pytest.raises(ConfigError, match="applies to the interleaved schedule"):
        build_schedule("1f1b", 4, 8, microbatch_group=4)
    with pytest.raises(ConfigError, match="vpp > 1"):
        build_schedule("interleaved", 4, 8, 1, microbatch_group=4)



@pytest.mark.parametrize("name,p,m,v", all_cases())
def test_receives_posted_ahead_are_never_needed_by_the_compute_they_skip(name, p, m, v):
    """Overlap mode posts, with each batch, the receives of the batch after the next compute
    (`early_receives`): that compute never consumes them, every compute's inputs are posted before it,
    and each peer's receives are posted in list order (FIFO matching pairs the right tensors)."""
    from fivefold.parallel.pipeline.schedules import steps_ahead

    for actions in build_schedule(name, p, m, v):
        posted, just_ahead = [], set()
        for item, ahead in steps_ahead(actions):
            if isinstance(item, list):
                posted += [a for a in item if a.kind in (RECV_F, RECV_B) and a not in posted] + ahead
                just_ahead = {message_key(a) for a in ahead}
                continue
            needed = set(input_messages(item, p, p * v))
            assert needed <= {message_key(a) for a in posted} and not needed & just_ahead, (item, ahead)
            just_ahead = set()
        order = [a for a in actions if a.kind in (RECV_F, RECV_B)]
        assert sorted(posted, key=order.index) == order
        for peer in {a.peer for a in order}:
            assert [a for a in posted if a.peer == peer] == [a for a in order if a.peer == peer]


def test_receives_posted_ahead_let_a_slow_message_cross_during_compute(monkeypatch):
    """With transfers that take time, posting receives one compute ahead never lengthens a step and
    shortens most: interleaved pp 4 x vpp 2 with a transfer 0.8 of a stage's forward, 68.2 against 76.2
    (the message crosses while the receiver still computes). The same lists without it (`early_receives`
    returning none) are the baseline."""
    from fivefold.parallel.pipeline import schedules

    def makespans(name, p, m, v, comm):
        actions = build_schedule(name, p, m, v)
        with_ahead = simulate(actions, 1, 2, 1, 1, comm=comm).makespan
        with monkeypatch.context() as mp:
            mp.setattr(schedules, "early_receives", lambda actions, end: [])
            without = simulate(actions, 1, 2, 1, 1, comm=comm).makespan
        return with_ahead, without

    ahead, late = makespans("interleaved", 4, 8, 2, 0.8)
    assert ahead == pytest.approx(68.2) and late == pytest.approx(76.2), (ahead, late)
    for name, p, m, v in [("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2), ("zb", 4, 8, 1), ("gpipe", 3, 6, 1)]:
        ahead, late = makespans(name, p, m, v, 0.4)
        assert ahead <= late + 1e-9, (name, ahead, late)


@pytest.mark.parametrize("name,p,v,group", [("1f1b", 2, 1, 0), ("1f1b", 4, 1, 0), ("1f1b", 7, 1, 0),
                                            ("gpipe", 4, 1, 0), ("zb", 5, 1, 0), ("interleaved", 2, 3, 0),
                                            ("interleaved", 4, 2, 0), ("interleaved", 4, 2, 6),
                                            ("interleaved", 8, 2, 0), ("interleaved", 3, 2, 5)])
def test_receives_alive_reach_their_steady_state_where_the_planner_stops_counting(name, p, v, group):
    """The planner counts the receive buffers alive in a backward (`receives_alive_in_backward`) on lists
    of `plan.buffers.steady_microbatches` micro-batches, not the step's (the search plans thousands of
    layouts): up to 8x more micro-batches give the same count on every stage."""
    from fivefold.parallel.pipeline.schedules import receives_alive_in_backward
    from fivefold.plan.buffers import steady_microbatches

    cap = steady_microbatches(p, 10 ** 6, name == "interleaved", group)

    def counts(m):
        return [receives_alive_in_backward(a, p, p * v)
                for a in build_schedule(name, p, m, v, microbatch_group=group)]

    assert all(counts(k * cap) == counts(cap) for k in (2, 3, 8))
