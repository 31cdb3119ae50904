"""Pipeline schedules as data: each rank's ordered list of actions, and a simulator that runs the lists.

Schedules (p = pipeline ranks, m = micro-batches, v = virtual stages per rank):

* GPipe — Huang et al. 2019, "GPipe: Efficient Training of Giant Neural Networks using Pipeline
  Parallelism": all m forwards, then all m backwards. Bubble (p-1)/(m+p-1); keeps m micro-batches alive.
* 1F1B — Narayanan et al. 2019, "PipeDream" (1F1B), in its flushed form (PipeDream-Flush) as used by
  Megatron-LM (Narayanan et al. 2021): stage s runs p-s-1 warm-up forwards, then alternates one forward
  and one backward, then drains. Same bubble as GPipe, but at most p-s micro-batches alive on stage s.
* Interleaved 1F1B — Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM": each rank holds v chunks (chunk c on rank c % p); forwards go round the
  ranks v times, N micro-batches at a time (a group: N micro-batches through local chunk 0, then the
  same N through chunk 1, ...). N = p by default (depth-first, Megatron-LM; needs m % p == 0); Llama 3
  (Dubey et al. 2024, §3.3.2) and Megatron-Core (`microbatch_group_size_per_vp_stage`) make N tunable
  from p (depth-first) to m (breadth-first): p <= N <= m and m % N == 0 or >= p. Rank s warms up
  2(p-s-1) + (v-1)N forwards, so it keeps min(2(p-s-1) + (v-1)N + 1, m*v) chunks alive: a larger N
  costs memory and buys slack for the point-to-point transfers. Bubble (p-1)/(v*m+p-1) without
  communication, for every valid N.
* ZB-H1 — Qi et al. 2023, "Zero Bubble Pipeline Parallelism": the backward is split into I (grad of the
  input, on the critical path) and W (grad of the weights, deferrable). Stage s runs the triples
  (F x, I x-(p-1-s), W x-(p-1)); same in-flight count as 1F1B, bubble (p-1)(F+I-W) per rank (when
  W <= min(F, I)), a third of 1F1B's when F = I = W.

Communication: every micro-batch crosses every stage boundary once each way — an activation forward
and its gradient backward, b*s*h elements each (micro-batch b, sequence s, hidden h). With p stages that
is p-1 boundaries; interleaved has p*v-1 chunk boundaries, so v times the traffic per rank.

The action contract (what a runtime executes)
---------------------------------------------
`build_schedule(...)` returns one flat list of `Action`s per pipeline rank. Each action is
`Action(kind, microbatch, chunk, peer)`; `chunk` is the *global* chunk (virtual stage) id, living on
rank `chunk % pp` (its local index there is `chunk // pp`); `microbatch` counts from 0.

Compute kinds
    F  forward of `chunk` on `microbatch` (the last chunk also computes the loss)
    B  full backward (input and weight gradients)
    I  input-gradient backward only (zero bubble)
    W  weight-gradient backward (zero bubble; after the I of the same micro-batch and chunk)
Communication kinds (`peer` = the other rank; the tensor belongs to `chunk` on this rank)
    SEND_F  send the output activation of `chunk` to rank `peer`, where it is the input of `chunk + 1`
    RECV_F  receive the input activation of `chunk` from rank `peer` (output of `chunk - 1`)
    SEND_B  send the gradient w.r.t. the input of `chunk` to `peer` (grad of `chunk - 1`'s output)
    RECV_B  receive the gradient w.r.t. the output of `chunk` from `peer` (from `chunk + 1`)

Batches: a maximal run of consecutive communication actions is ONE batch: post it whole, one
`batch_isend_irecv` with the ops in list order (`steps()` yields the lists already grouped). Sends and
receives are placed in lockstep rounds (`add_communication`): each message is sent and received in the
same round, right after its producer, and its receive is posted as soon as the data exists. Two ways to
execute, both proven by the simulator to finish for every generated schedule:

* overlap (what `simulate` times by default, as torch.distributed.pipelining does): after posting a
  batch go on; before a compute action wait for the receives of its inputs (look them up by
  `message_key`); wait for all sends at the end of the step. A batch also posts, ahead, the receives of
  the batch after the next compute action (`early_receives`): gloo moves a message only once its
  receiver has posted the buffer (its TCP pair's ready-to-receive notice), so a receive posted after the
  compute that precedes it let the message cross only then, while the next compute waited; posted one
  compute ahead, it crosses during that compute. The buffer is allocated one compute earlier.
* blocking (`simulate(..., blocking=True)`): wait for the whole batch before the next action, with
  sends that finish only when received (rendezvous, NCCL-like). Simplest, never deadlocks, but loses
  most of interleaving's gain because early receives are waited for early.

Per ordered pair of ranks, sends and receives appear in the same order (`check_actions` checks), so
FIFO matching (NCCL ignores tags) pairs the right tensors; with gloo a tag per message also works.
Matching: SEND_F(mb, c) <-> RECV_F(mb, c+1) and SEND_B(mb, c) <-> RECV_B(mb, c-1); `message_key(a)` is
the same tuple on both sides. The receiving rank keeps received tensors by message key until used.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple, Sequence, Union

from fivefold.rules import (GPIPE, INTERLEAVED, ONE_F_ONE_B, ZB, ConfigError, ScheduleKind, check_schedule_lists,
                            choices)

F, B, I, W = "F", "B", "I", "W"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE = (F, B, I, W)
COMM = (SEND_F, RECV_F, SEND_B, RECV_B)
SCHEDULES: tuple[str, ...] = choices(ScheduleKind)


class ScheduleError(ValueError):
    """An action list breaks the contract (missing, duplicate or misplaced action, unmatched message)."""


class DeadlockError(RuntimeError):
    """The simulator found ranks blocked with nothing runnable."""


@dataclass(frozen=True)
class Action:
    """One step of a rank's list: `kind` (F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B), the micro-batch,
    the global chunk id (on rank chunk % pp) and, for comm actions, the peer rank."""
    kind: str
    microbatch: int
    chunk: int
    peer: int | None = None

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM

    def __str__(self) -> str:
        text = f"{self.kind}(mb={self.microbatch}, chunk={self.chunk})"
        if self.peer is not None:
            text += f" {'to' if self.kind.startswith('SEND') else 'from'} rank {self.peer}"
        return text


# ---------------------------------------------------------------------------------------------------------
# Compute orders (no communication yet)

def check_args(pp: int, microbatches: int, vpp: int = 1) -> None:
    if pp < 1:
        raise ConfigError(f"pp must be >= 1, got {pp}")
    if microbatches < 1:
        raise ConfigError(f"microbatches must be >= 1, got {microbatches}")
    if vpp < 1:
        raise ConfigError(f"vpp must be >= 1, got {vpp}")


def gpipe_order(pp: int, microbatches: int) -> list[list[Action]]:
    """All forwards, then all backwards (in micro-batch order)."""
    check_args(pp, microbatches)
    return [[Action(F, i, r) for i in range(microbatches)] + [Action(B, i, r) for i in range(microbatches)]
            for r in range(pp)]


def one_f_one_b_order(pp: int, microbatches: int) -> list[list[Action]]:
    """Stage r runs the pairs (F x, B x-(pp-1-r)) for x = 0, 1, ...: pp-1-r warm-up forwards, then one
    forward one backward, then the cooldown backwards."""
    check_args(pp, microbatches)
    lists = []
    for r in range(pp):
        lag = pp - 1 - r
        actions = []
        for x in range(microbatches + lag):
            if x < microbatches:
                actions.append(Action(F, x, r))
            if 0 <= x - lag < microbatches:
                actions.append(Action(B, x - lag, r))
        lists.append(actions)
    return lists


def zb_h1_order(pp: int, microbatches: int) -> list[list[Action]]:
    """ZB-H1: stage r runs the triples (F x, I x-(pp-1-r), W x-(pp-1)), dropping out-of-range entries:
    the I wave moves as fast as the critical path allows and the deferred W's fill the cooldown."""
    check_args(pp, microbatches)
    lists = []
    for r in range(pp):
        lag_i, lag_w = pp - 1 - r, pp - 1
        actions = []
        for x in range(microbatches + lag_w):
            if x < microbatches:
                actions.append(Action(F, x, r))
            if 0 <= x - lag_i < microbatches:
                actions.append(Action(I, x - lag_i, r))
            if 0 <= x - lag_w < microbatches:
                actions.append(Action(W, x - lag_w, r))
        lists.append(actions)
    return lists


def interleaved_table(microbatches: int, vpp: int, group: int) -> list[tuple[int, int]]:
    """(micro-batch, local chunk) of a rank's k-th forward in the interleaved order (Megatron-Core's
    `get_schedule_table`): groups of `group` consecutive micro-batches go through local chunk 0, then
    chunk 1, ...; the last group holds what is left. The k-th backward is entry k with the local chunk
    reversed (vpp - 1 - chunk)."""
    table = []
    for first in range(0, microbatches, group):
        mbs = range(first, min(first + group, microbatches))
        table += [(mb, local) for local in range(vpp) for mb in mbs]
    return table


def interleaved_order(pp: int, microbatches: int, vpp: int, group: int = 0) -> list[list[Action]]:
    """Megatron interleaved 1F1B: (pp-r-1)*2 + (vpp-1)*N warm-up forwards on rank r, then one forward one
    backward, then cooldown backwards; N = `group` micro-batches per group (0: pp; see
    `rules.check_microbatch_group`).
    With N = pp it needs microbatches % pp == 0. vpp == 1 is plain 1F1B (and takes no group)."""
    check_args(pp, microbatches, vpp)
    check_schedule_lists(INTERLEAVED, pp, vpp, microbatches, group)
    if vpp == 1:
        return one_f_one_b_order(pp, microbatches)
    n = group or pp
    table = interleaved_table(microbatches, vpp, n)
    total = microbatches * vpp
    lists = []
    for r in range(pp):
        warmup = min((pp - r - 1) * 2 + (vpp - 1) * n, total)
        fwd = [Action(F, mb, local * pp + r) for mb, local in table]
        bwd = [Action(B, mb, (vpp - 1 - local) * pp + r) for mb, local in table]
        actions = fwd[:warmup]
        for k in range(total - warmup):
            actions += [fwd[k + warmup], bwd[k]]
        actions += bwd[total - warmup:]
        lists.append(actions)
    return lists


def interleaved_warmup(pp: int, stage: int, microbatches: int, vpp: int, group: int = 0) -> int:
    """Chunks rank `stage` holds at its peak under the interleaved schedule: its warm-up forwards
    2(p-s-1) + (v-1)N plus the first steady forward, at most every chunk of every micro-batch (m*v)."""
    n = group or pp
    return min(2 * (pp - stage - 1) + (vpp - 1) * n + 1, microbatches * vpp)


# ---------------------------------------------------------------------------------------------------------
# Communication

def message_of(action: Action, pp: int, chunks: int) -> tuple[Action, Action] | None:
    """(send on this rank, receive on the peer) for the tensor a compute action hands to another rank: F of
    a non-last chunk passes its output forward, B or I of a non-first chunk passes the input gradient back.
    None for W, for the ends of the model, and when pp == 1 (neighbouring chunks on one rank)."""
    if pp == 1:
        return None
    c, mb, here = action.chunk, action.microbatch, action.chunk % pp
    if action.kind == F and c < chunks - 1:
        return Action(SEND_F, mb, c, (c + 1) % pp), Action(RECV_F, mb, c + 1, here)
    if action.kind in (B, I) and c > 0:
        return Action(SEND_B, mb, c, (c - 1) % pp), Action(RECV_B, mb, c - 1, here)
    return None


def unit_rounds(orders: list[list[Action]], chunks: int) -> list[list[int]]:
    """The round in which each compute action runs if every action takes one round and starts as soon as
    its rank is free and its inputs were produced in an earlier round. Raises DeadlockError when the
    compute orders themselves cannot finish."""
    ranks = len(orders)
    produced: dict[tuple[str, int, int], int] = {}
    pc, rounds, t = [0] * ranks, [[] for _ in range(ranks)], 0
    while any(pc[r] < len(orders[r]) for r in range(ranks)):
        ready = [r for r in range(ranks) if pc[r] < len(orders[r])
                 and all(produced.get(k, t) < t for k in dependencies(orders[r][pc[r]], chunks))]
        if not ready:
            stuck = [f"rank {r} at {orders[r][pc[r]]}" for r in range(ranks) if pc[r] < len(orders[r])]
            raise DeadlockError("compute orders cannot finish: " + "; ".join(stuck))
        for r in ready:
            produced[result_key(orders[r][pc[r]])] = t
            rounds[r].append(t)
            pc[r] += 1
        t += 1
    return rounds


def add_communication(orders: list[list[Action]], chunks: int | None = None) -> list[list[Action]]:
    """Insert sends and receives in lockstep rounds (see `unit_rounds`): in round t a rank runs at most one
    compute action, then posts one batch holding the send of what that action produced and the receive of
    every tensor another rank produced in round t for it. Every message is thus sent and received in
    the same round, so with batches posted whole no rank can wait on a batch its peer has not reached:
    deadlock-free even when every send blocks until received. Receives are posted as soon as the data
    exists and waited for (at the latest) by the compute that uses them."""
    pp = len(orders)
    if chunks is None:
        chunks = 1 + max(a.chunk for actions in orders for a in actions)
    rounds = unit_rounds(orders, chunks)
    total = 1 + max((t for row in rounds for t in row), default=-1)
    comm: list[list[list[Action]]] = [[[] for _ in range(total)] for _ in range(pp)]
    for r, actions in enumerate(orders):
        for a, t in zip(actions, rounds[r]):
            message = message_of(a, pp, chunks)
            if message:
                send, recv = message
                comm[r][t].append(send)
                comm[send.peer][t].append(recv)
    lists = []
    for r, actions in enumerate(orders):
        at = dict(zip(rounds[r], actions))
        out: list[Action] = []
        for t in range(total):
            if t in at:
                out.append(at[t])
            out += sorted(comm[r][t], key=lambda a: (not a.kind.startswith("SEND"), a.peer, a.kind))
        lists.append(out)
    return lists


def build_schedule(name: str, pp: int, microbatches: int, vpp: int = 1,
                   communication: bool = True, microbatch_group: int = 0) -> list[list[Action]]:
    """Each rank's action list for schedule `name` (`rules.ScheduleKind`). `microbatch_group`: the
    interleaved schedule's micro-batches per group N (0: pp). The rules are `rules.check_schedule_lists`
    (any pp and micro-batch count; a run's further rules are `rules.check_schedule`); a `Schedule` value
    builds its lists with `Schedule.actions()`."""
    check_args(pp, microbatches, vpp)
    check_schedule_lists(name, pp, vpp, microbatches, microbatch_group)
    if name == GPIPE:
        orders = gpipe_order(pp, microbatches)
    elif name == ONE_F_ONE_B:
        orders = one_f_one_b_order(pp, microbatches)
    elif name == ZB:
        orders = zb_h1_order(pp, microbatches)
    else:
        orders = interleaved_order(pp, microbatches, vpp, microbatch_group)
    return add_communication(orders, pp * vpp) if communication else orders


def forward_only(pp: int, microbatches: int, vpp: int = 1) -> list[list[Action]]:
    """Each rank's action list for an evaluation: only forwards, F of every micro-batch through each of
    its chunks in (chunk, micro-batch) order, with their SEND_F / RECV_F (`add_communication`). A
    forward depends only on the same micro-batch's previous chunk, which comes earlier in that order,
    so the lists always finish."""
    check_args(pp, microbatches, vpp)
    orders = [[Action(F, mb, c) for c in range(r, pp * vpp, pp) for mb in range(microbatches)] for r in range(pp)]
    return add_communication(orders, pp * vpp)


def gpipe(pp: int, microbatches: int) -> list[list[Action]]:
    return build_schedule(GPIPE, pp, microbatches)


def one_f_one_b(pp: int, microbatches: int) -> list[list[Action]]:
    return build_schedule(ONE_F_ONE_B, pp, microbatches)


def interleaved_1f1b(pp: int, microbatches: int, vpp: int, microbatch_group: int = 0) -> list[list[Action]]:
    return build_schedule(INTERLEAVED, pp, microbatches, vpp, microbatch_group=microbatch_group)


def zero_bubble_h1(pp: int, microbatches: int) -> list[list[Action]]:
    return build_schedule(ZB, pp, microbatches)


def steps(actions: Sequence[Action]) -> Iterator[Action | list[Action]]:
    """A rank's list as the runtime executes it: a compute Action, or a list of comm Actions (one batch)."""
    batch: list[Action] = []
    for a in actions:
        if a.is_comm:
            batch.append(a)
            continue
        if batch:
            yield batch
            batch = []
        yield a
    if batch:
        yield batch


def early_receives(actions: Sequence[Action], end: int) -> list[Action]:
    """The receives a rank posts ahead with the batch that ends before index `end` of its list (overlap
    mode): those of the next batch when one compute action lies between the two. The compute in between
    never needs them (a message a round produces is used in a later round: `add_communication`), and
    each peer's receives keep their order, so FIFO matching still pairs the right tensors. Blocking
    execution posts none ahead: a batch it waits on would hold a receive whose send comes later."""
    if end >= len(actions) or actions[end].is_comm:
        return []
    out, j = [], end + 1
    while j < len(actions) and actions[j].is_comm:     # by index: no copy of the list's tail per batch
        if actions[j].kind in (RECV_F, RECV_B):
            out.append(actions[j])
        j += 1
    return out


def receives_alive_in_backward(actions: Sequence[Action], pp: int, chunks: int) -> int:
    """The most receive buffers a rank holds, posted and not yet consumed, while one of its backwards (B or
    I) runs, executing `actions` in overlap mode (receives posted ahead: `early_receives`): the pipeline's
    part of the backward's working set, which the planner counts from the same lists (plan/buffers.py)."""
    alive: set = set()
    most = 0
    for item, ahead in steps_ahead(actions):
        if isinstance(item, list):
            alive |= {message_key(a) for a in (*item, *ahead) if a.kind in (RECV_F, RECV_B)}
            continue
        if item.kind in (B, I):
            most = max(most, len(alive))
        alive -= set(input_messages(item, pp, chunks))
    return most


def steps_ahead(actions: Sequence[Action]) -> Iterator[tuple[Action | list[Action], list[Action]]]:
    """`steps`, each batch paired with the receives it posts ahead (`early_receives`; a compute: none)."""
    end = 0
    for item in steps(actions):
        end += len(item) if isinstance(item, list) else 1
        yield item, early_receives(actions, end) if isinstance(item, list) else []


def message_key(a: Action) -> tuple[str, int, int]:
    """The message a comm action moves: (direction, micro-batch, sending chunk)."""
    if a.kind == SEND_F:
        return ("F", a.microbatch, a.chunk)
    if a.kind == RECV_F:
        return ("F", a.microbatch, a.chunk - 1)
    if a.kind == SEND_B:
        return ("B", a.microbatch, a.chunk)
    return ("B", a.microbatch, a.chunk + 1)


def input_messages(action: Action, pp: int, chunks: int) -> list[tuple[str, int, int]]:
    """Message keys a compute action must have received (and waited for) before it runs: what the
    runtime waits on in overlap mode. Empty for W, for the model's ends, and when pp == 1."""
    if pp == 1 or action.kind == W:
        return []
    return [message_needed(k) for k in dependencies(action, chunks) if k[2] % pp != action.chunk % pp]


def compute_only(actions_per_rank: list[list[Action]]) -> list[list[Action]]:
    return [[a for a in actions if not a.is_comm] for actions in actions_per_rank]


def check_actions(actions_per_rank: list[list[Action]], microbatches: int, vpp: int = 1) -> None:
    """Raise ScheduleError unless the action lists keep the contract (the rules of a schedule's fields are
    `rules.check_schedule`): every (micro-batch, chunk) has exactly one F
    and either one B or one I and one W, all on rank chunk % pp, in dependency order there (F, then B or
    I, then W); with pp > 1 every tensor crossing ranks has one send, after its producer, and one receive
    on the named peer, before its consumer; per ordered pair of ranks, sends and receives appear in the
    same order (FIFO matching)."""
    pp = len(actions_per_rank)
    chunks = pp * vpp
    position: dict[tuple[str, int, int], int] = {}
    for r, actions in enumerate(actions_per_rank):
        for pos, a in enumerate(actions):
            if a.kind not in COMPUTE + COMM:
                raise ScheduleError(f"rank {r}: unknown action kind {a.kind!r}")
            if not (0 <= a.microbatch < microbatches and 0 <= a.chunk < chunks):
                raise ScheduleError(f"rank {r}: {a} is out of range (microbatches={microbatches}, chunks={chunks})")
            if a.chunk % pp != r:
                raise ScheduleError(f"rank {r}: {a} belongs on rank {a.chunk % pp}")
            if (a.kind, a.microbatch, a.chunk) in position:
                raise ScheduleError(f"rank {r}: {a} appears twice")
            position[(a.kind, a.microbatch, a.chunk)] = pos
    for mb in range(microbatches):
        for c in range(chunks):
            check_chunk(position, mb, c, pp, chunks)
    check_messages(actions_per_rank, chunks)


def check_chunk(position: dict, mb: int, c: int, pp: int, chunks: int) -> None:
    where = f"micro-batch {mb}, chunk {c} (rank {c % pp})"
    has = {k: (k, mb, c) in position for k in COMPUTE + COMM}
    if not has[F]:
        raise ScheduleError(f"no F for {where}")
    if not ((has[B] and not has[I] and not has[W]) or (not has[B] and has[I] and has[W])):
        raise ScheduleError(f"{where} needs one B, or one I and one W")
    grad = B if has[B] else I
    at = {k: position.get((k, mb, c)) for k in COMPUTE + COMM}
    order = [(F, grad)] + ([(I, W)] if has[W] else [])
    if pp > 1:
        needs = [(SEND_F, c < chunks - 1, F, True), (RECV_F, c > 0, F, False),
                 (SEND_B, c > 0, grad, True), (RECV_B, c < chunks - 1, grad, False)]
        for kind, wanted, compute, after in needs:
            if wanted != has[kind]:
                raise ScheduleError(f"{where}: {'missing' if wanted else 'unexpected'} {kind}")
            if wanted:
                order.append((compute, kind) if after else (kind, compute))
    for first, second in order:
        if at[first] > at[second]:
            raise ScheduleError(f"{where}: {second} comes before {first} on its rank")


def check_messages(actions_per_rank: list[list[Action]], chunks: int) -> None:
    pp = len(actions_per_rank)
    sent: dict[tuple[int, int], list] = defaultdict(list)
    received: dict[tuple[int, int], list] = defaultdict(list)
    for r, actions in enumerate(actions_per_rank):
        for a in actions:
            if not a.is_comm:
                continue
            other = {SEND_F: a.chunk + 1, RECV_F: a.chunk - 1, SEND_B: a.chunk - 1, RECV_B: a.chunk + 1}[a.kind]
            if not 0 <= other < chunks:
                raise ScheduleError(f"rank {r}: {a} has no neighbouring chunk {other}")
            if a.peer != other % pp:
                raise ScheduleError(f"rank {r}: {a} names peer {a.peer}, chunk {other} lives on rank {other % pp}")
            if a.kind.startswith("SEND"):
                sent[(r, a.peer)].append(message_key(a))
            else:
                received[(a.peer, r)].append(message_key(a))
    for pair in set(sent) | set(received):
        s, rcv = sent.get(pair, []), received.get(pair, [])
        if sorted(s) != sorted(rcv):
            missing = sorted(set(s) ^ set(rcv))[:3]
            raise ScheduleError(f"sends from rank {pair[0]} to rank {pair[1]} do not match the receives there "
                                f"(first differences: {missing})")
        if s != rcv:
            k = next(i for i, (x, y) in enumerate(zip(s, rcv)) if x != y)
            raise ScheduleError(f"rank {pair[0]} sends {s[k]} as message {k} to rank {pair[1]}, which receives "
                                f"{rcv[k]} there: order differs (NCCL matches in order)")


# ---------------------------------------------------------------------------------------------------------
# Simulator

class Block(NamedTuple):
    """One compute action on a timeline (simulated or measured)."""
    kind: str
    microbatch: int
    chunk: int
    start: float
    end: float


Cost = Union[float, Sequence[float], Callable[[Action], float]]


def cost_of(cost: Cost, action: Action) -> float:
    if callable(cost):
        return float(cost(action))
    if isinstance(cost, (int, float)):
        return float(cost)
    return float(cost[action.chunk])


@dataclass
class Simulation:
    """Result of `simulate`. `timeline[r]` lists rank r's compute blocks in order; `comm[r]` its comm
    actions as (action, posted, done); bubble = idle / (ranks * makespan)."""
    timeline: list[list[Block]]
    comm: list[list[tuple[Action, float, float]]]
    makespan: float
    busy: list[float]
    bubble: float
    peak_in_flight: list[int]

    def to_dict(self) -> dict:
        return {"makespan": self.makespan, "bubble": self.bubble, "busy": self.busy,
                "peak_in_flight": self.peak_in_flight,
                "timeline": [[list(b) for b in row] for row in self.timeline]}


def timeline_stats(timeline: Sequence[Sequence[Sequence]]) -> dict:
    """Makespan, busy and idle time per rank, bubble fraction and peak in-flight micro-batches of a
    timeline: a list per rank of (kind, microbatch, chunk, start, end), simulated or measured.

    In flight on a rank: (micro-batch, chunk) pairs whose F has started and whose backward has not
    finished (B, or W when the backward is split). Counted in chunks, so with vpp > 1 one micro-batch
    through all of a rank's chunks counts vpp times (each chunk holds 1/vpp of the rank's layers)."""
    blocks = [[Block(*b) for b in row] for row in timeline]
    starts = [b.start for row in blocks for b in row]
    ends = [b.end for row in blocks for b in row]
    t0 = min(starts) if starts else 0.0
    makespan = (max(ends) - t0) if ends else 0.0
    busy = [sum(b.end - b.start for b in row) for row in blocks]
    idle = [makespan - x for x in busy]
    ranks = len(blocks)
    bubble = sum(idle) / (ranks * makespan) if ranks and makespan > 0 else 0.0
    return {"makespan": makespan, "busy": busy, "idle": idle, "bubble": bubble,
            "peak_in_flight": [peak_in_flight(row) for row in blocks]}


def peak_in_flight(row: Sequence[Block]) -> int:
    split = {(b.microbatch, b.chunk) for b in row if b.kind == W}
    alive, peak = set(), 0
    for b in sorted(row, key=lambda b: (b.start, b.end)):
        key = (b.microbatch, b.chunk)
        if b.kind == F:
            alive.add(key)
            peak = max(peak, len(alive))
        elif b.kind == B or (b.kind == W and key in split):
            alive.discard(key)
    return peak


def dependencies(a: Action, chunks: int) -> list[tuple[str, int, int]]:
    """Compute results `a` needs (keys into the end-time table): 'F' forward done, 'G' input gradient
    done (by B or I), 'W' weight gradient done."""
    mb, c = a.microbatch, a.chunk
    if a.kind == F:
        return [("F", mb, c - 1)] if c > 0 else []
    if a.kind in (B, I):
        return [("F", mb, c)] + ([("G", mb, c + 1)] if c < chunks - 1 else [])
    return [("G", mb, c)]


def result_key(a: Action) -> tuple[str, int, int]:
    return ({F: "F", B: "G", I: "G", W: "W"}[a.kind], a.microbatch, a.chunk)


def describe_need(key: tuple[str, int, int]) -> str:
    what = {"F": "the forward", "G": "the input-gradient backward (B or I)", "W": "the weight gradient"}[key[0]]
    return f"{what} of micro-batch {key[1]}, chunk {key[2]}"


def message_needed(key: tuple[str, int, int]) -> tuple[str, int, int]:
    """The message that carries compute result `key` to another rank (same form as `message_key`)."""
    return ("F" if key[0] == "F" else "B", key[1], key[2])


def simulate(actions_per_rank: list[list[Action]], cost_f: Cost = 1.0, cost_b: Cost = 2.0, cost_i: Cost = 1.0,
             cost_w: Cost = 1.0, comm: Cost = 0.0, blocking: bool = False) -> Simulation:
    """Run each rank's action list in order, time it, and prove it finishes.

    Costs are per action, so per chunk (for interleaved pass a stage's cost / vpp, as `simulate_schedule`
    does): a number, a sequence indexed by global chunk id (chunk c is on rank c % pp, so this also gives
    per-rank costs), or a function of the Action. `comm` is the time of one transfer, in the same forms
    (given the SEND action). The defaults are the usual F=1, B=2 = I+W.

    A compute action starts when its rank is free and its inputs exist: F(mb, c) needs F(mb, c-1), B or
    I(mb, c) needs F(mb, c) and the input gradient of (mb, c+1), W(mb, c) needs I(mb, c). An input from
    another rank arrives `comm` after both its send and its receive are posted (lists without comm
    actions: `comm` after it was produced). A batch (consecutive comm actions) is posted at once.
    blocking=False (default): the rank goes on at once; sends finish in the background and a receive is
    waited for by the compute that uses it; a batch also posts the next batch's receives ahead
    (`early_receives`), as the runtime does. blocking=True: the rank waits for every op of the batch, and
    a send finishes only when the peer has posted the receive (rendezvous; the strictest runtime).

    Raises DeadlockError naming each blocked rank, action and what it waits for; ScheduleError when a
    compute runs before its receive is posted or a message is never matched."""
    ranks = len(actions_per_rank)
    compute = [a for actions in actions_per_rank for a in actions if not a.is_comm]
    has_comm = any(a.is_comm for actions in actions_per_rank for a in actions)
    chunks = 1 + max((a.chunk for a in compute), default=0)
    home = {result_key(a): r for r, actions in enumerate(actions_per_rank) for a in actions if not a.is_comm}
    costs = {F: cost_f, B: cost_b, I: cost_i, W: cost_w}
    ends: dict[tuple[str, int, int], float] = {}
    posted: dict[tuple[str, tuple], tuple[int, float, Action]] = {}
    pc, clock = [0] * ranks, [0.0] * ranks
    batch_end: list[int | None] = [None] * ranks
    ahead: list[set] = [set() for _ in range(ranks)]     # receives posted ahead (`early_receives`)
    timeline: list[list[Block]] = [[] for _ in range(ranks)]

    def latency(message: tuple[str, int, int]) -> float:
        return cost_of(comm, Action(SEND_F if message[0] == "F" else SEND_B, message[1], message[2]))

    def arrival(message: tuple[str, int, int]) -> float | None:
        send, recv = posted.get(("send", message)), posted.get(("recv", message))
        if send is None or recv is None:
            return None
        return max(send[1], recv[1]) + latency(message)

    def input_ready(r: int, a: Action, key: tuple[str, int, int]) -> float | None:
        if key not in ends:
            return None
        if home[key] == r:
            return ends[key]
        message = message_needed(key)
        if not has_comm:
            return ends[key] + latency(message)
        if ("recv", message) not in posted or posted[("recv", message)][0] != r:
            raise ScheduleError(f"rank {r}: {a} comes before the receive of its input {message} from rank "
                                f"{home[key]}; post RECV_{message[0]} earlier in the list")
        return arrival(message)

    def run_compute(r: int, a: Action) -> bool:
        start = clock[r]
        for key in dependencies(a, chunks):
            ready = input_ready(r, a, key)
            if ready is None:
                return False
            start = max(start, ready)
        end = start + cost_of(costs[a.kind], a)
        ends[result_key(a)] = end
        timeline[r].append(Block(a.kind, a.microbatch, a.chunk, start, end))
        clock[r] = end
        return True

    def post(r: int, a: Action) -> None:
        key = ("send" if a.kind.startswith("SEND") else "recv", message_key(a))
        if key in posted:
            raise ScheduleError(f"rank {r}: {a} is posted twice (also on rank {posted[key][0]})")
        posted[key] = (r, clock[r], a)

    def post_batch(r: int) -> None:
        j, actions = pc[r], actions_per_rank[r]
        while j < len(actions) and actions[j].is_comm:
            if actions[j] not in ahead[r]:
                post(r, actions[j])
            j += 1
        batch_end[r] = j
        if not blocking:
            for a in early_receives(actions, j):
                post(r, a)
                ahead[r].add(a)

    def finish_batch(r: int) -> bool:
        if blocking:
            done = [arrival(message_key(a)) for a in actions_per_rank[r][pc[r]:batch_end[r]]]
            if None in done:
                return False
            clock[r] = max([clock[r]] + done)
        pc[r] = batch_end[r]
        batch_end[r] = None
        return True

    while True:
        progress = False
        for r in range(ranks):
            actions = actions_per_rank[r]
            while pc[r] < len(actions):
                a = actions[pc[r]]
                if a.is_comm:
                    if batch_end[r] is None:
                        post_batch(r)
                    if not finish_batch(r):
                        break
                elif run_compute(r, a):
                    pc[r] += 1
                else:
                    break
                progress = True
        if all(pc[r] == len(actions_per_rank[r]) for r in range(ranks)):
            break
        if not progress:
            raise DeadlockError(deadlock_message(actions_per_rank, pc, batch_end, posted, ends, home, chunks))
    unmatched = [entry[2] for (side, message), entry in posted.items()
                 if (("recv" if side == "send" else "send"), message) not in posted]
    if unmatched:
        raise ScheduleError(f"{len(unmatched)} message(s) never matched, first: {unmatched[0]} on rank "
                            f"{posted[('send' if unmatched[0].kind.startswith('SEND') else 'recv', message_key(unmatched[0]))][0]}")
    comm_log: list[list[tuple[Action, float, float]]] = [[] for _ in range(ranks)]
    for (side, message), (r, t, a) in posted.items():
        comm_log[r].append((a, t, arrival(message)))
    for row in comm_log:
        row.sort(key=lambda e: e[1])
    stats = timeline_stats(timeline)
    return Simulation(timeline, comm_log, stats["makespan"], stats["busy"], stats["bubble"],
                      stats["peak_in_flight"])


def deadlock_message(actions_per_rank, pc, batch_end, posted, ends, home, chunks) -> str:
    lines = []
    for r, actions in enumerate(actions_per_rank):
        if pc[r] == len(actions):
            continue
        a = actions[pc[r]]
        if a.is_comm:
            waiting = [b for b in actions[pc[r]:batch_end[r]]
                       if ("recv" if b.kind.startswith("SEND") else "send", message_key(b)) not in posted]
            b = waiting[0]
            verb = "post the receive" if b.kind.startswith("SEND") else "post the send"
            lines.append(f"rank {r} blocked at action #{pc[r]} {b}: waiting for rank {b.peer} to {verb}")
            continue
        need = next((k for k in dependencies(a, chunks) if k not in ends), None)
        if need is None:
            need = next(k for k in dependencies(a, chunks) if home[k] != r)
            lines.append(f"rank {r} blocked at action #{pc[r]} {a}: waiting for rank {home[need]} to post the "
                         f"send of {describe_need(need)}")
        elif need not in home:
            lines.append(f"rank {r} blocked at action #{pc[r]} {a}: waiting for {describe_need(need)}, which no "
                         f"rank's list contains")
        else:
            lines.append(f"rank {r} blocked at action #{pc[r]} {a}: waiting for {describe_need(need)} "
                         f"(rank {home[need]})")
    return "pipeline schedule deadlocks: " + "; ".join(lines)


def simulate_schedule(name: str, pp: int, microbatches: int, vpp: int = 1, cost_f: float = 1.0,
                      cost_b: float = 2.0, cost_i: float = 1.0, cost_w: float = 1.0, comm: float = 0.0,
                      blocking: bool = False, microbatch_group: int = 0) -> Simulation:
    """Build schedule `name` and simulate it. Costs are per *stage* (all layers of one rank) and are
    divided by vpp for the interleaved chunks; `comm` is per transfer and is not divided. For the
    planner: one call, plain numbers, no torch."""
    actions = build_schedule(name, pp, microbatches, vpp, microbatch_group=microbatch_group)
    v = vpp if name == INTERLEAVED else 1
    return simulate(actions, cost_f / v, cost_b / v, cost_i / v, cost_w / v, comm, blocking)


def closed_form_bubble(name: str, pp: int, microbatches: int, vpp: int = 1, cost_f: float = 1.0,
                       cost_b: float = 2.0, cost_i: float = 1.0, cost_w: float = 1.0) -> float | None:
    """The papers' bubble fraction (idle / total) with zero comm: (p-1)/(m+p-1) for GPipe and 1F1B (any
    F, B), (p-1)/(v*m+p-1) for interleaved (m % p == 0, or any valid micro-batch group N), and for ZB-H1
    (p-1)(F+I-W) / (m(F+I+W) + (p-1)(F+I-W)), which holds when m >= p and W <= min(F, I) (else None:
    a heavier W lands on the critical path). The simulator reproduces each exactly."""
    p, m = pp, microbatches
    if name == ZB:
        idle = (p - 1) * (cost_f + cost_i - cost_w)
        if m < p or cost_w > min(cost_f, cost_i):
            return None
        return idle / (m * (cost_f + cost_i + cost_w) + idle)
    v = vpp if name == INTERLEAVED else 1
    return (p - 1) / (v * m + p - 1)
