"""Expert parallelism, folded: the experts of every MoE layer split over ep ranks and each expert's width
over etp ranks; tokens travel to them.

Papers: Lepikhin et al. 2020 ("GShard": experts sharded across devices, all-to-all dispatch and
combine); Fedus et al. 2021 ("Switch Transformers"); Liu et al. 2025 ("MoE Parallel Folding:
Heterogeneous Parallelism Mappings for Efficient Large-Scale MoE Model Training with Megatron Core"): the
expert layers get their own mapping of the same ranks, etp × ep × edp over attention's tp × cp × dp
(grid.py), so ep may span ranks attention uses for tp, cp or dp, and no rank holds an expert (or an expert
slice) it does not own. Each of the ep ranks of a group holds E/ep consecutive experts; with etp > 1 each of
those is cut over the etp ranks as tensor parallelism cuts a dense MLP (gate and up by columns, down by
rows: `Shard("etp", ...)`); each piece is replicated over the edp ranks of its expert-data-parallel group,
over which its gradients are summed (`placement.reduce="edp"`; the router and shared experts stay with
the dense mapping: whole on every tp rank, gradients partial over tp and reduced over dp or dp × cp).

Where tokens come from: every rank of a stage holds its own tokens when they reach a MoE layer (its
dp batch, its cp chunk, and under tp its SP sequence shard or, without SP, its 1/tp of the sequences:
tensor.py moe_rows), so each rank routes and dispatches only its own, and no token is gathered over tp
on its way in. Dispatch (`AllToAllDispatch`, swapped in for the MoE block's local one, model/moe.py):
1. the router's (token, expert) assignments are sorted by expert; counts per expert are exchanged with
   one all-to-all of E integers over ep (each rank learns how many rows every rank sends each of its experts);
2. token rows go to the ranks holding their experts: one all-to-all with uneven splits over ep;
3. etp > 1: the etp ranks (the same experts, other slices) gather each other's received rows
   (`gather_rows_uneven`, after an all-gather of their counts), so each runs its slice on all of them;
4. received rows are regrouped by local expert and the local experts (or slices) run on them;
5. etp > 1: the partial outputs (one slice of the width each) are summed back into their owners' rows
   (`reduce_scatter_rows_uneven`);
6. the outputs go back the way they came (the reverse all-to-all over ep) and are weighted and summed per
   token. Backward runs the same exchanges in reverse (comm/autograd.py).

Capacity mode (`capacity_factor > 0`, GShard's drop and zero padding): every expert takes at most C
assignments per sequence (rules.moe_capacity), so each rank sends fixed buffers of E·B·C rows (B
sequences), zero-padded where an expert got fewer: the bytes do not depend on the routing (the planner
predicts them exactly), no counts are exchanged, and padding rows cost compute but no gradient.

FP8 dispatch (`parallel.fp8_dispatch`, DeepSeek-V3): the dispatch all-to-all sends each row as float8
e4m3 with one fp32 scale, h + 4 bytes instead of h·e (about 1/2 of bf16, 1/4 of fp32); combine, the etp
exchanges and every backward exchange stay in full precision (comm/autograd.py Fp8AllToAllRows).

Traffic per MoE layer and micro-batch, per rank, rows of h elements (e bytes each):
  ep   dropless: counts (E int64, forward); dispatch and combine send the routed rows bound for other
       ranks, forward and again backward (4 uneven all-to-alls). Capacity: 4 all-to-alls of E·B·C·h·e
       bytes each, (ep-1)/ep of them leaving the rank.
  etp  the rows R this rank received: gathered (forward) and reduce-scattered (its backward), the partial
       outputs reduce-scattered (forward) and gathered (backward): 4 all-to-alls of etp·R·h·e bytes, each
       (etp-1)/etp leaving; dropless adds an all-gather of the (ep, E/ep) counts (int64).
"""
from __future__ import annotations

import torch
from torch import nn

from .. import comm
from ..comm.autograd import all_to_all_rows, fp8_all_to_all_rows, gather_rows_uneven, reduce_scatter_rows_uneven
from .dimension import ShardedState
from .placement import Placement, Shard, placement_of


class AllToAllDispatch:
    """The MoE dispatcher under expert parallelism (ep and / or etp): same contract as the local one
    (model/moe.py). `group`: the ep group (None: ep = 1, no all-to-all); `etp`: the expert-tensor-parallel
    group (None: etp = 1, whole experts)."""

    def __init__(self, group, n_experts: int, fp8: bool = False, etp=None):
        self.group, self.n_experts, self.etp = group, n_experts, etp
        self.ep = group.size if group is not None else 1
        self.local = n_experts // self.ep
        self.send_rows = fp8_all_to_all_rows if fp8 else all_to_all_rows   # dispatch; combine stays exact

    def __call__(self, x_th: torch.Tensor, experts_tk: torch.Tensor, weights_tk: torch.Tensor, experts,
                 capacity: tuple[int, int] | None = None) -> torch.Tensor:
        """`capacity` = (tokens per sequence, C) in capacity mode: fixed, zero-padded buffers."""
        if capacity is not None:
            return self.padded(x_th, experts_tk, weights_tk, experts, *capacity)
        k = experts_tk.shape[1]
        flat_a = experts_tk.reshape(-1)
        kept_a = (flat_a >= 0).nonzero().flatten()                  # assignments not dropped
        order = torch.argsort(flat_a[kept_a], stable=True)
        assign_m = kept_a[order]                                    # assignment of each routed row, by expert
        expert_m = flat_a[assign_m]
        x_mh = x_th[assign_m // k]
        counts_e = torch.bincount(expert_m, minlength=self.n_experts)
        if self.group is None:
            recv_rl, send, recv, x_rh = counts_e.view(1, self.local), None, None, x_mh
        else:
            recv_rl = self.exchange_counts(counts_e)                 # rows each rank sends per local expert
            send = counts_e.view(self.ep, self.local).sum(1).tolist()
            recv = recv_rl.sum(1).tolist()
            x_rh = self.send_rows(x_mh, self.group, send, recv)      # grouped by source, then local expert
        y_rh = self.run_local(x_rh, recv_rl, experts)
        y_mh = y_rh if self.group is None else all_to_all_rows(y_rh, self.group, recv, send)
        w_m = weights_tk.reshape(-1)[assign_m].to(y_mh.dtype)
        out = torch.zeros_like(x_th, dtype=y_mh.dtype)
        return out.index_add(0, assign_m // k, y_mh * w_m[:, None])

    def run_local(self, x_rh: torch.Tensor, recv_rl: torch.Tensor, experts) -> torch.Tensor:
        """The local experts on rows grouped by source, then local expert (`recv_rl[r, l]` rows of source
        r for expert l), outputs in the same order. etp > 1: first every etp rank's rows, then their
        partial outputs summed back into this rank's."""
        rows = None
        if self.etp is not None:
            n, ep = self.etp.size, recv_rl.shape[0]
            counts = torch.empty((n * ep, self.local), dtype=recv_rl.dtype, device=recv_rl.device)
            comm.all_gather(counts, recv_rl.contiguous(), self.etp)  # (etp rank, source, local expert)
            rows = counts.view(n, ep, self.local).sum((1, 2)).tolist()   # rows each etp rank received
            x_rh = gather_rows_uneven(x_rh, self.etp, rows)          # etp-rank-major, then source, expert
            recv_rl = counts.view(-1, self.local)
        by_expert = regroup(recv_rl)
        y_rh = torch.empty_like(x_rh)
        y_rh = y_rh.index_copy(0, by_expert, experts(x_rh.index_select(0, by_expert), recv_rl.sum(0).tolist()))
        return y_rh if rows is None else reduce_scatter_rows_uneven(y_rh, self.etp, rows)

    def padded(self, x_th, experts_tk, weights_tk, experts, seq: int, cap: int) -> torch.Tensor:
        """GShard dispatch: slot (expert, sequence, position within both) in an (E, B, C) buffer."""
        t, k = experts_tk.shape
        b, n, ep = t // seq, self.n_experts, self.ep
        flat_a = experts_tk.reshape(-1)
        kept_a = (flat_a >= 0).nonzero().flatten()
        group_a = flat_a[kept_a] * b + (kept_a // k) // seq           # (expert, sequence) of each
        order = torch.argsort(group_a * (t * k) + kept_a)            # by group, then token order
        assign_m, group_m = kept_a[order], group_a[order]
        first = torch.searchsorted(group_m, group_m)                  # start of each row's group
        slot_m = group_m * cap + (torch.arange(len(group_m), device=group_m.device) - first)
        h = x_th.shape[1]
        filled = lambda: torch.zeros(n * b * cap, h, dtype=x_th.dtype, device=x_th.device).index_copy(   # noqa: E731
            0, slot_m, x_th[assign_m // k])
        y_buf = self.padded_exchange(filled, experts, b * cap)
        w_m = weights_tk.reshape(-1)[assign_m].to(y_buf.dtype)
        out = torch.zeros_like(x_th, dtype=y_buf.dtype)
        return out.index_add(0, assign_m // k, y_buf.index_select(0, slot_m) * w_m[:, None])

    def padded_exchange(self, make_buffer, experts, slots: int) -> torch.Tensor:
        """The (E·slots, h) buffer `make_buffer()` makes, in (expert, slot) order, through the experts and back:
        over ep to the experts' ranks (source, local expert, slot), over etp to every slice's rank, and back.
        Made here, so it is freed once sent (a caller's name would keep E·B·C·h alive through the experts)."""
        buf = make_buffer()
        h, ep, rows = buf.shape[1], self.ep, self.local * slots
        if self.group is not None:
            buf = self.send_rows(buf, self.group, [rows] * ep, [rows] * ep)     # (source, local expert, slot)
        sources = ep
        if self.etp is not None:
            buf = gather_rows_uneven(buf, self.etp, [ep * rows] * self.etp.size)   # (etp rank, source, ...)
            sources = ep * self.etp.size
        by_expert = buf.view(sources, self.local, slots, h).transpose(0, 1).reshape(-1, h)
        y = experts(by_expert, [sources * slots] * self.local)
        y = y.view(self.local, sources, slots, h).transpose(0, 1).reshape(-1, h)
        if self.etp is not None:
            y = reduce_scatter_rows_uneven(y, self.etp, [ep * rows] * self.etp.size)
        return y if self.group is None else all_to_all_rows(y, self.group, [rows] * ep, [rows] * ep)

    def exchange_counts(self, counts_e: torch.Tensor) -> torch.Tensor:
        """(ep, local): how many rows rank j sends to each of this rank's experts (one all-to-all)."""
        send_rl = counts_e.view(self.ep, self.local).contiguous()
        recv_rl = torch.empty_like(send_rl)
        comm.all_to_all(recv_rl, send_rl, self.group)
        return recv_rl


class ShapeDispatch(AllToAllDispatch):
    """A dry run's dispatch (fivefold/tools/dryrun.py). Capacity mode: the (E, B, C) buffers of `padded`, of the
    same sizes, through the same exchanges (forward, and in backward through autograd) and the same
    expert matmuls — but filled from no index, since fake tensors have no routed values; its bytes,
    shapes and graph are `padded`'s. Dropless: routed as perfectly balanced (`balanced`), since the
    real counts are values. With `group` and `etp` None (ep = etp = 1) only the experts run."""

    def __call__(self, x_th, experts_tk, weights_tk, experts, capacity=None) -> torch.Tensor:
        if capacity is None:
            return self.balanced(x_th, experts_tk, weights_tk, experts)
        seq, cap = capacity
        t, h = x_th.shape
        b = t // seq
        y = self.padded_exchange(lambda: x_th.new_zeros(self.n_experts * b * cap, h) + x_th.mean(0, keepdim=True)
                                 * weights_tk.mean(), experts, b * cap)
        return torch.zeros_like(x_th, dtype=y.dtype) + y.mean(0, keepdim=True)

    def balanced(self, x_th, experts_tk, weights_tk, experts) -> torch.Tensor:
        """Dropless routing as if perfectly balanced (what the planner plans): this rank's t·k assignments
        spread evenly over the E experts (`balanced_counts`), every rank alike, through the dropless
        path's exchanges: the counts all-to-all (its values unread), then the uneven all-to-alls of the
        routed rows, forward and back, the etp exchanges, and the experts on their rows."""
        t, h = x_th.shape
        counts = balanced_counts(t * experts_tk.shape[1], self.n_experts)
        ep = self.ep
        me = self.group.rank if self.group is not None else 0
        mine = counts[me * self.local:(me + 1) * self.local]          # rows each source sends my experts
        send = [sum(counts[j * self.local:(j + 1) * self.local]) for j in range(ep)]
        recv = [sum(mine)] * ep
        rows = x_th.new_zeros(sum(counts), h) + x_th.mean(0, keepdim=True) * weights_tk.mean()
        if self.group is not None:
            self.exchange_counts(torch.zeros(self.n_experts, dtype=torch.long, device=x_th.device))
            rows = self.send_rows(rows, self.group, send, recv)        # grouped by source, then local expert
        per_expert = [ep * c for c in mine]
        if self.etp is not None:
            n = self.etp.size
            counts_t = torch.zeros((n * ep, self.local), dtype=torch.long, device=x_th.device)
            comm.all_gather(counts_t, torch.zeros((ep, self.local), dtype=torch.long, device=x_th.device), self.etp)
            rows = gather_rows_uneven(rows, self.etp, [sum(recv)] * n)
            per_expert = [n * c for c in per_expert]
        y = experts(rows, per_expert)                                  # (row order: shapes only)
        if self.etp is not None:
            y = reduce_scatter_rows_uneven(y, self.etp, [sum(recv)] * self.etp.size)
        if self.group is not None:
            y = all_to_all_rows(y, self.group, recv, send)
        return torch.zeros_like(x_th, dtype=y.dtype) + y.mean(0, keepdim=True)


def balanced_counts(assignments: int, experts: int) -> list[int]:
    """`assignments` spread over `experts` as evenly as integers allow (the first ones take the rest)."""
    q, r = divmod(assignments, experts)
    return [q + (e < r) for e in range(experts)]


def dispatcher(group, n_experts: int, fp8: bool = False, dry: bool = False, etp=None):
    """A MoE layer's dispatcher: the all-to-all one over the ep `group` and the `etp` group (either None
    when its degree is 1), or None (the layer's local one) when both are None; a dry run's dispatches by
    shapes only (`ShapeDispatch`), over them or none."""
    if dry:
        return ShapeDispatch(group, n_experts, fp8, etp)
    return None if group is None and etp is None else AllToAllDispatch(group, n_experts, fp8, etp)


def regroup(counts_rl: torch.Tensor) -> torch.Tensor:
    """Row order that turns blocks laid out source-major (source r, then local expert l) into
    expert-major (expert l, then source r)."""
    counts = counts_rl.tolist()
    starts, o = [], 0
    for row in counts:
        starts.append([])
        for c in row:
            starts[-1].append(o)
            o += c
    device = counts_rl.device   # made where the rows are: no host-to-device copy per layer and step
    idx = [torch.arange(starts[r][l], starts[r][l] + counts[r][l], device=device) for l in range(len(counts[0]))
           for r in range(len(counts))]
    return torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long, device=device)


class ExpertParallelism(ShardedState):
    """The expert dimension (the contract: dimension.py): keeps this rank's piece of every MoE layer's
    routed experts, its E/ep experts and of each its 1/etp of the width (placement: an "ep" Shard on dim
    0, an "etp" Shard on the width: dim 1 of gate and up, dim 2 of down; gradients summed over "edp");
    the layers get the dispatcher from parallelize.configure_moe (`dispatcher`). Applied whenever the
    experts are on the expert grid (rules.experts_on_expert_grid: ep or etp > 1). The router and the
    shared experts are not its: they follow the dense mapping (tensor.py replicated_moe)."""

    name = "ep"
    _WIDTH_DIM = {"w_gate": 1, "w_up": 1, "w_down": 2}   # the expert width's dim in each stacked weight

    def __init__(self, mesh, cfg):
        self.mesh, self.group, self.etp = mesh, mesh["ep"], mesh["etp"]
        self.shards, self.etp_shards = {}, {}
        self.n_experts, self.width = cfg.model.experts, cfg.model.expert_ffn
        self.fp8 = cfg.parallel.fp8_dispatch

    def apply(self, model: nn.Module) -> nn.Module:
        from ..model.moe import MoE

        by_ep = Shard("ep", 0, self.n_experts)
        for moe in (m for m in model.modules() if isinstance(m, MoE)):
            for name, dim in self._WIDTH_DIM.items():
                full = getattr(moe.experts, name)
                by_width = Shard("etp", dim, self.width)
                piece = full.detach()
                for shard, group in ((by_ep, self.group), (by_width, self.etp)):
                    start, length = shard.extent(group.rank, group.size)
                    piece = piece.narrow(shard.dim, start, length)
                mine = nn.Parameter(piece.clone(), requires_grad=full.requires_grad)   # meta: no storage
                mine.placement = Placement(shards=(by_ep, by_width), reduce="edp")
                setattr(moe.experts, name, mine)
        named = list(model.named_parameters(remove_duplicate=False))
        self.shards = {name: placement_of(p).shard("ep") for name, p in named}
        self.etp_shards = {name: placement_of(p).shard("etp") for name, p in named}
        return model

    def _sharded(self) -> list:
        """Each expert's slices over etp, then the experts over ep (gathered in that order)."""
        return [(self.etp, self.etp_shards), (self.group, self.shards)]


def moe_step_stats(model: nn.Module, group, layers: int, read=torch.Tensor.tolist, n_experts: int | None = None) -> dict:
    """The step's routing statistics over every MoE layer and rank, then each layer's balancing update.

    Each MoE layer of this rank contributes its (E + 1,) step counts (tokens per expert, dropped) at its
    layer's row of a (layers, E + 1) table; one all-reduce over `group` (the world: ranks hold distinct
    tokens or layers; recorded under dim "moe_stats") makes it global. Returns metrics (tokens per expert
    min / max / mean over layers and experts, dropped, imbalance = max / mean) and hands each layer its
    global counts (`update_bias`: DeepSeek-V3's auxiliary-loss-free balancing; a no-op for other routers).
    dropped_fraction: dropped assignments over all the step's assignments (kept + dropped).
    Empty when the model has no MoE layer. `n_experts` (the model config's) lets a pipeline stage that
    holds no MoE layer (DeepSeek-V3's dense first layers) still join the world's all-reduce, which every
    other rank waits in; without it the experts are read from this rank's MoE layers. `read` turns the
    global table into numbers (a dry run's reads zeros: fake tensors hold none)."""
    from ..model.moe import MoE

    mine = [(int(name.split(".")[1]), m) for name, m in model.named_modules()
            if isinstance(m, MoE) and name.startswith("layers.")]
    if n_experts is None:
        if not any(isinstance(m, MoE) for m in model.modules()):
            return {}
        n_experts = next(m for m in model.modules() if isinstance(m, MoE)).n_experts
    table = torch.zeros(layers, n_experts + 1, dtype=torch.float64,
                        device=next(model.parameters()).device)
    for i, moe in mine:
        stats = moe.take_step_stats()
        if stats is not None:
            table[i] = stats.to(table.dtype)
    comm.all_reduce(table, group, dim="moe_stats")
    for i, moe in mine:
        moe.update_bias(table[i, :n_experts])
    rows = read(table)
    counts = [c for row in rows for c in row[:n_experts] if sum(row[:n_experts]) > 0]   # the MoE layers' experts
    if not counts:
        return {}
    mean, dropped = sum(counts) / len(counts), sum(row[n_experts] for row in rows)
    assigned = sum(map(sum, rows))   # every assignment routed this step: run by an expert or dropped
    return {"expert_tokens_min": min(counts), "expert_tokens_max": max(counts),
            "expert_tokens_mean": mean, "dropped_tokens": dropped,
            "dropped_fraction": dropped / assigned if assigned else 0.0,
            "expert_imbalance": max(counts) / mean if mean else 0.0}
