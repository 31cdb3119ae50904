"""Expert parallelism: the experts of every MoE layer split over the ep ranks; tokens travel to them.

Papers: Lepikhin et al. 2020 ("GShard": experts sharded across devices, all-to-all dispatch and
combine); Fedus et al. 2021 ("Switch Transformers"); the EP group carved out of dp × cp as in
Megatron-Core (Korthikanti, Narayanan et al.), so experts need no extra devices: each of the ep ranks of
a group holds E/ep consecutive experts, and each expert shard is replicated over the dp·cp/ep ranks of
its expert-data-parallel ("edp") group, over which its gradients are summed (`placement.reduce="edp"`;
dense weights keep dp or dp × cp).

Dispatch (`AllToAllDispatch`, swapped in for the MoE block's local one, model/moe.py):
1. the router's (token, expert) assignments are sorted by expert; counts per expert are exchanged with
   one all-to-all of E integers (each rank learns how many rows every rank sends to each of its experts);
2. token rows go to the ranks holding their experts: one all-to-all with uneven splits;
3. received rows (grouped by source rank, then expert) are regrouped by local expert and the local
   experts run on them;
4. the outputs go back the way they came (the reverse all-to-all) and are weighted and summed per token.
Backward runs the same two exchanges in reverse (comm/autograd.py all_to_all_rows).

Capacity mode (`capacity_factor > 0`, GShard's drop and zero padding): every expert takes at most C
assignments per sequence (rules.moe_capacity), so each rank sends fixed buffers of E·B·C rows (B
sequences), zero-padded where an expert got fewer: the bytes do not depend on the routing (the planner
predicts them exactly), no counts are exchanged, and padding rows cost compute but no gradient.

FP8 dispatch (`parallel.fp8_dispatch`, DeepSeek-V3): the dispatch all-to-all sends each row as float8
e4m3 with one fp32 scale, h + 4 bytes instead of h·e (about 1/2 of bf16, 1/4 of fp32); combine and every
backward exchange stay in full precision (comm/autograd.py Fp8AllToAllRows).

Traffic per MoE layer and micro-batch, per rank, rows of h elements (e bytes each), all under dim "ep":
  dropless   counts exchange (E int64, forward); dispatch and combine send the routed rows bound for
             other ranks, forward and again backward (4 uneven all-to-alls);
  capacity   4 all-to-alls of E·B·C·h·e bytes each, (ep-1)/ep of them leaving the rank.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import comm
from ..comm.autograd import all_to_all_rows, fp8_all_to_all_rows
from .dimension import ShardedState
from .placement import Shard, add_shard, place, placement_of


class AllToAllDispatch:
    """The MoE dispatcher under expert parallelism: same contract as the local one (model/moe.py)."""

    def __init__(self, group, n_experts: int, fp8: bool = False):
        self.group, self.n_experts = group, n_experts
        self.local = n_experts // group.size
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
        recv_rl = self.exchange_counts(counts_e)                     # rows each rank sends per local expert
        send = counts_e.view(self.group.size, self.local).sum(1).tolist()
        recv = recv_rl.sum(1).tolist()
        x_rh = self.send_rows(x_mh, self.group, send, recv)          # grouped by source, then local expert
        by_expert = regroup(recv_rl)
        y_rh = torch.empty_like(x_rh)
        y_rh = y_rh.index_copy(0, by_expert, experts(x_rh.index_select(0, by_expert), recv_rl.sum(0).tolist()))
        y_mh = all_to_all_rows(y_rh, self.group, recv, send)
        w_m = weights_tk.reshape(-1)[assign_m].to(y_mh.dtype)
        out = torch.zeros_like(x_th, dtype=y_mh.dtype)
        return out.index_add(0, assign_m // k, y_mh * w_m[:, None])

    def padded(self, x_th, experts_tk, weights_tk, experts, seq: int, cap: int) -> torch.Tensor:
        """GShard dispatch: slot (expert, sequence, position within both) in an (E, B, C) buffer."""
        t, k = experts_tk.shape
        b, n, ep = t // seq, self.n_experts, self.group.size
        flat_a = experts_tk.reshape(-1)
        kept_a = (flat_a >= 0).nonzero().flatten()
        group_a = flat_a[kept_a] * b + (kept_a // k) // seq           # (expert, sequence) of each
        order = torch.argsort(group_a * (t * k) + kept_a)            # by group, then token order
        assign_m, group_m = kept_a[order], group_a[order]
        first = torch.searchsorted(group_m, group_m)                  # start of each row's group
        slot_m = group_m * cap + (torch.arange(len(group_m), device=group_m.device) - first)
        h = x_th.shape[1]
        buf = torch.zeros(n * b * cap, h, dtype=x_th.dtype, device=x_th.device)
        buf = buf.index_copy(0, slot_m, x_th[assign_m // k])
        rows = self.local * b * cap
        recv = self.send_rows(buf, self.group, [rows] * ep, [rows] * ep)       # (source, local expert, B, C)
        by_expert = recv.view(ep, self.local, b * cap, h).transpose(0, 1).reshape(-1, h)
        y = experts(by_expert, [ep * b * cap] * self.local)
        y = y.view(self.local, ep, b * cap, h).transpose(0, 1).reshape(-1, h)
        y_buf = all_to_all_rows(y, self.group, [rows] * ep, [rows] * ep)
        w_m = weights_tk.reshape(-1)[assign_m].to(y_buf.dtype)
        out = torch.zeros_like(x_th, dtype=y_buf.dtype)
        return out.index_add(0, assign_m // k, y_buf.index_select(0, slot_m) * w_m[:, None])

    def exchange_counts(self, counts_e: torch.Tensor) -> torch.Tensor:
        """(ep, local): how many rows rank j sends to each of this rank's experts (one all-to-all)."""
        send_rl = counts_e.view(self.group.size, self.local).contiguous()
        recv_rl = torch.empty_like(send_rl)
        comm.all_to_all(recv_rl, send_rl, self.group)
        return recv_rl


class ShapeDispatch(AllToAllDispatch):
    """A dry run's dispatch (fivefold/tools/dryrun.py). Capacity mode: the (E, B, C) buffers of `padded`, of the
    same sizes, through the same all-to-alls (forward, and in backward through autograd) and the same
    expert matmuls — but filled from no index, since fake tensors have no routed values; its bytes,
    shapes and graph are `padded`'s. Dropless: routed as perfectly balanced (`balanced`), since the
    real counts are values. With `group` None (ep = 1) only the experts run."""

    def __init__(self, group, n_experts: int, fp8: bool = False):
        self.group, self.n_experts = group, n_experts
        size = group.size if group is not None else 1
        self.local = n_experts // size
        self.send_rows = fp8_all_to_all_rows if fp8 else all_to_all_rows

    def __call__(self, x_th, experts_tk, weights_tk, experts, capacity=None) -> torch.Tensor:
        if capacity is None:
            return self.balanced(x_th, experts_tk, weights_tk, experts)
        seq, cap = capacity
        t, h = x_th.shape
        b, ep = t // seq, self.n_experts // self.local
        rows = self.local * b * cap
        buf = x_th.new_zeros(self.n_experts * b * cap, h) + x_th.mean(0, keepdim=True) * weights_tk.mean()
        if self.group is not None:
            buf = self.send_rows(buf, self.group, [rows] * ep, [rows] * ep)
        by_expert = buf.view(ep, self.local, b * cap, h).transpose(0, 1).reshape(-1, h)
        y = experts(by_expert, [ep * b * cap] * self.local)
        y = y.view(self.local, ep, b * cap, h).transpose(0, 1).reshape(-1, h)
        if self.group is not None:
            y = all_to_all_rows(y, self.group, [rows] * ep, [rows] * ep)
        return torch.zeros_like(x_th, dtype=y.dtype) + y.mean(0, keepdim=True)


    def balanced(self, x_th, experts_tk, weights_tk, experts) -> torch.Tensor:
        """Dropless routing as if perfectly balanced (what the planner plans): this rank's t·k assignments
        spread evenly over the E experts (`balanced_counts`), every rank alike, through the dropless
        path's exchanges: the counts all-to-all (its values unread), then the uneven all-to-alls of the
        routed rows, forward and back, and the experts on their rows."""
        t, h = x_th.shape
        counts = balanced_counts(t * experts_tk.shape[1], self.n_experts)
        ep = self.n_experts // self.local
        me = self.group.rank if self.group is not None else 0
        mine = counts[me * self.local:(me + 1) * self.local]          # rows each source sends my experts
        send = [sum(counts[j * self.local:(j + 1) * self.local]) for j in range(ep)]
        recv = [sum(mine)] * ep
        rows = x_th.new_zeros(sum(counts), h) + x_th.mean(0, keepdim=True) * weights_tk.mean()
        if self.group is not None:
            self.exchange_counts(torch.zeros(self.n_experts, dtype=torch.long, device=x_th.device))
            rows = self.send_rows(rows, self.group, send, recv)        # grouped by source, then local expert
        y = experts(rows, [ep * c for c in mine])                      # (row order: shapes only)
        if self.group is not None:
            y = all_to_all_rows(y, self.group, recv, send)
        return torch.zeros_like(x_th, dtype=y.dtype) + y.mean(0, keepdim=True)


def balanced_counts(assignments: int, experts: int) -> list[int]:
    """`assignments` spread over `experts` as evenly as integers allow (the first ones take the rest)."""
    q, r = divmod(assignments, experts)
    return [q + (e < r) for e in range(experts)]


def dispatcher(group, n_experts: int, fp8: bool = False, dry: bool = False):
    """A MoE layer's dispatcher: the all-to-all one over the ep `group`, or None (the layer's local one)
    when `group` is None (ep = 1); a dry run's dispatches by shapes only (`ShapeDispatch`), over `group`
    or none."""
    if dry:
        return ShapeDispatch(group, n_experts, fp8)
    return None if group is None else AllToAllDispatch(group, n_experts, fp8)


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
    """The expert-parallel dimension (the contract: dimension.py): keeps this rank's E/ep experts of every
    MoE layer (placement: an "ep" Shard, gradients over "edp"); the layers get the all-to-all dispatcher
    from parallelize.configure_moe (`dispatcher`)."""

    name = "ep"

    def __init__(self, mesh, cfg):
        self.mesh, self.group = mesh, mesh["ep"]
        self.shards = {}
        self.n_experts = cfg.model.experts
        self.fp8 = cfg.parallel.fp8_dispatch

    def apply(self, model: nn.Module) -> nn.Module:
        from ..model.moe import MoE

        local, rank = self.n_experts // self.group.size, self.group.rank
        for moe in (m for m in model.modules() if isinstance(m, MoE)):
            for name in ("w_gate", "w_up", "w_down"):
                full = getattr(moe.experts, name)
                mine = nn.Parameter(full.detach()[rank * local:(rank + 1) * local].clone(),
                                    requires_grad=full.requires_grad)
                mine.placement = placement_of(full)
                add_shard(mine, Shard("ep", 0, self.n_experts))
                setattr(moe.experts, name, place(mine, reduce="edp"))
        self.shards = {name: placement_of(p).shard("ep") for name, p in model.named_parameters(remove_duplicate=False)}
        return model


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
