"""Mixture of experts: a router sends each token to top_k of E SwiGLU experts, capacity may drop some
assignments, and load-balance losses go through the model's auxiliary-loss channel.

Papers: Shazeer et al. 2017 (sparsely-gated top-k MoE); Lepikhin et al. 2020 (GShard: expert capacity,
load-balance loss per group); Fedus et al. 2021 (Switch: loss E·Σ_e f_e·P_e); Zoph et al. 2022 (ST-MoE:
router z-loss); Jiang et al. 2024 (Mixtral); Qwen2-MoE (shared expert behind a sigmoid gate); Dai et al.
2024 (DeepSeekMoE: shared experts); DeepSeek-AI 2024 (DeepSeek-V3: sigmoid router, auxiliary-loss-free
bias balancing, node-limited routing).

Routers (`ModelConfig.router`, all computed in fp32 — fp64 for fp64 models — from logits = x·W_routerᵀ):

    softmax_topk_norm  p = softmax(logits); the top_k of p; weights = those p renormalised to sum 1 (Mixtral)
    softmax_topk       the same, weights = those p as they are (Qwen2-MoE, norm_topk_prob = false)
    sigmoid_bias       p = sigmoid(logits); the top_k of p + expert_bias; weights = the selected p (without
                       the bias) renormalised (DeepSeek-V3). No auxiliary loss: `update_bias` balances.

Every router's weights are then multiplied by `routed_scaling_factor` (1 but for DeepSeek-V3: 2.5).

Group-limited routing (router_groups G > 0, router_group_limit M): the experts form G consecutive groups of
E/G; a group's score is the sum of its top-2 selection scores (p, or p + bias; its top-1 when a group has
one expert); a token may choose only among the experts of its M best groups.

Layout-invariant definitions — every quantity below is per sequence (row b of x_bsh), so data, context,
pipeline and expert parallel layouts reproduce one process exactly:

- capacity: with capacity_factor > 0 each expert accepts C = ceil(capacity_factor·s·k/E)
  (`rules.moe_capacity`) assignments from each sequence. An expert keeps the assignments of the first C
  tokens (by position in the sequence) that chose it, whatever their k-slot; equivalently, assignments
  are taken in the order (token, then k-slot) and each kept while its expert has room. A dropped
  assignment has expert -1 and weight 0 (the other weights are not renormalised; the token's residual
  carries it). capacity_factor = 0 is dropless.
- load-balance loss (softmax routers): per sequence E·Σ_e f_e·P_e, where f_e is the fraction of the
  sequence's s·k assignments the router chose for e (before capacity drops) and P_e the mean of p_e over the
  sequence's tokens. It is summed over the micro-batch's sequences and scaled by aux_loss_coef /
  `global_sequences` (the sequences per optimizer step, given by `configure`; default 1), so a step's total is
  aux_loss_coef times the mean over its sequences.
- z-loss: z_loss_coef · Σ_tokens logsumexp(logits)² / `global_tokens` (tokens per step; default 1).

Both losses reach training through `aux.add(y, loss)` (transformer.py's AuxLosses) on this block's output.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import rules
from ..config import ModelConfig
from .layers import AuxLosses, SwiGLU, silu_mul
from .random_routing import skip_seconds, uniform


class Experts(nn.Module):
    """E SwiGLU experts as stacked weights: w_gate (E, f, h), w_up (E, f, h), w_down (E, h, f).

    Each slice [e] is laid out like nn.Linear's weight (out, in), so expert e computes
    w_down[e] · (silu(w_gate[e]·x) ⊙ w_up[e]·x). Built standalone the weights are N(0, 0.02);
    `Transformer.reset_parameters` re-draws them from its seed."""

    def __init__(self, experts: int, hidden: int, ffn: int, device=None):
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(experts, ffn, hidden, device=device))
        self.w_up = nn.Parameter(torch.empty(experts, ffn, hidden, device=device))
        self.w_down = nn.Parameter(torch.empty(experts, hidden, ffn, device=device))
        for w in (self.w_gate, self.w_up, self.w_down):
            if not w.is_meta:
                nn.init.normal_(w, std=0.02)

    def forward(self, x_mh: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x_mh: token rows grouped by expert, in the order of the experts this module holds (row block i
        of length counts[i] goes to expert i); returns their outputs, same order.
        len(counts) == self.w_gate.shape[0]. An expert with no rows runs on an empty block, so every
        weight gets a gradient (zero for that expert)."""
        assert len(counts) == self.w_gate.shape[0], (len(counts), self.w_gate.shape)
        # unbind once: its backward stacks the experts' gradients into one tensor, where indexing
        # w[e] per expert would zero-fill and add a whole stacked-size gradient for each expert
        gates, ups, downs = self.w_gate.unbind(0), self.w_up.unbind(0), self.w_down.unbind(0)
        outs = []
        for x_nh, w_gate, w_up, w_down in zip(x_mh.split(counts), gates, ups, downs):
            a_nf = silu_mul(F.linear(x_nh, w_gate), F.linear(x_nh, w_up))   # keeps gate and up, not silu's output
            outs.append(F.linear(a_nf, w_down))
        return torch.cat(outs)


class LocalDispatch:
    """No communication: sort the (token, expert) assignments by expert (stable, so a block keeps token
    order), run Experts once on the grouped rows, scatter the weighted outputs back to tokens (summed in
    that row order). Dropped assignments (expert -1) are skipped.

    `capacity` is accepted and ignored: drops were already applied by the router; a dispatcher that sends
    fixed-size buffers (expert parallelism) uses (tokens per sequence, C)."""

    def __call__(self, x_th: torch.Tensor, experts_tk: torch.Tensor, weights_tk: torch.Tensor, experts: Experts,
                 capacity: tuple[int, int] | None = None) -> torch.Tensor:
        k = experts_tk.shape[1]
        flat_a = experts_tk.reshape(-1)                      # assignment a = token * k + slot
        kept_a = (flat_a >= 0).nonzero().flatten()
        assign_m = kept_a[torch.argsort(flat_a[kept_a], stable=True)]   # row m of the expert input
        token_m = assign_m // k
        counts = torch.bincount(flat_a[assign_m], minlength=experts.w_gate.shape[0]).tolist()
        y_mh = experts(x_th[token_m], counts)
        w_m = weights_tk.reshape(-1)[assign_m].to(y_mh.dtype)
        return torch.zeros_like(x_th, dtype=y_mh.dtype).index_add(0, token_m, y_mh * w_m[:, None])


# -- routing (pure functions of the logits: the reference the tests and parallel code can reuse) -------

def limit_to_groups(choice_te: torch.Tensor, groups: int, limit: int) -> torch.Tensor:
    """Selection scores with experts outside each token's `limit` best groups set to -inf. A group's score
    is the sum of its top-2 scores (DeepSeek-V3); groups are consecutive blocks of E/groups experts."""
    t, e = choice_te.shape
    per_tgn = choice_te.view(t, groups, e // groups)
    group_score_tg = per_tgn.topk(min(2, e // groups), dim=-1).values.sum(-1)
    best_tl = group_score_tg.topk(limit, dim=-1).indices
    allowed_tg = torch.zeros_like(group_score_tg, dtype=torch.bool).scatter_(1, best_tl, True)
    return per_tgn.masked_fill(~allowed_tg[..., None], float("-inf")).view(t, e)


def route(logits_te: torch.Tensor, kind: str, top_k: int, bias_e: torch.Tensor | None = None,
          groups: int = 0, group_limit: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(experts_tk int64, weights_tk, scores_te) for router `kind` (module docstring), in logits' dtype.
    scores_te is p: softmax or sigmoid of the logits."""
    if kind == "sigmoid_bias":
        scores_te = torch.sigmoid(logits_te)
        choice_te = scores_te + bias_e.to(scores_te.dtype)
    else:
        scores_te = torch.softmax(logits_te, dim=-1)
        choice_te = scores_te
    if groups:
        choice_te = limit_to_groups(choice_te, groups, group_limit)
    experts_tk = choice_te.topk(top_k, dim=-1).indices
    weights_tk = scores_te.gather(1, experts_tk)
    if kind in ("softmax_topk_norm", "sigmoid_bias"):
        weights_tk = weights_tk / weights_tk.sum(-1, keepdim=True)
    return experts_tk, weights_tk, scores_te


def within_capacity(experts_bsk: torch.Tensor, capacity: int, n_experts: int) -> torch.Tensor:
    """keep_bsk: within each sequence, expert e keeps its first `capacity` assignments in (token, k-slot)
    order — the first `capacity` tokens that chose it. Entries already -1 are neither kept nor counted."""
    b, s, k = experts_bsk.shape
    flat_ba = experts_bsk.reshape(b, s * k)
    onehot_bae = F.one_hot(flat_ba.clamp(min=0), n_experts) * (flat_ba >= 0)[..., None]
    rank_ba = (onehot_bae.cumsum(1) * onehot_bae).sum(-1)       # 1-based place in its expert's queue; 0: none
    return ((rank_ba >= 1) & (rank_ba <= capacity)).view(b, s, k)


def load_balance_loss(scores_bse: torch.Tensor, experts_bsk: torch.Tensor, sum_parts=None, parts: int = 1) -> torch.Tensor:
    """Σ over sequences of E·Σ_e f_e·P_e (Switch Transformer eq. 4 per sequence): f_e the fraction of the
    sequence's s·k router choices that went to e (not differentiable), P_e the mean score of e.

    When each sequence is split over `parts` ranks (context parallelism), `sum_parts` sums a per-sequence
    statistic over them (differentiably); every rank then computes the whole sequence's loss and adds
    1/parts of it, so the ranks together add it once."""
    b, s, e = scores_bse.shape
    k = experts_bsk.shape[2]
    counts_be = torch.zeros(b, e, dtype=scores_bse.dtype, device=scores_bse.device)
    counts_be.scatter_add_(1, experts_bsk.reshape(b, s * k), torch.ones_like(counts_be[:, :1]).expand(b, s * k))
    score_sums_be = scores_bse.sum(1)
    if sum_parts is not None:
        counts_be, score_sums_be = sum_parts(counts_be), sum_parts(score_sums_be)
    f_be = counts_be / (parts * s * k)
    p_be = score_sums_be / (parts * s)
    return e * (f_be * p_be).sum() / parts


def z_loss(logits_te: torch.Tensor) -> torch.Tensor:
    """Σ_tokens logsumexp(logits)² (ST-MoE): keeps router logits small."""
    return torch.logsumexp(logits_te, dim=-1).pow(2).sum()


class MoE(nn.Module):
    """x_bsh -> y_bsh: the routed experts' weighted sum, plus the shared experts (optionally gated).

    Parts (names the parallel code and Hugging Face import rely on): router (nn.Linear(h, E)), experts
    (Experts), shared (SwiGLU of width shared_experts·moe_ffn, or None), shared_gate (nn.Linear(h, 1), or
    None), buffer expert_bias (E,) for the sigmoid_bias router (else None). expert_bias is persistent (it
    is in `state_dict`: it is training state, like a norm's running statistics), is never a parameter, and
    stays fp32 (fp64 in fp64 models) when the module is cast: its small updates would vanish in bf16.

    What the parallel dimensions and the run decide is told in one call, `configure(...)` (made by
    parallel/parallelize.py configure_moe once every dimension is applied): the dispatcher (LocalDispatch
    by default; expert parallelism's all-to-all one), the row split under tensor parallelism (`enter`,
    `leave`), the sum of a per-sequence statistic over the ranks holding parts of each sequence and their
    number (`sum_sequence_parts`, `sequence_parts`: sequence and context parallelism), and the step's
    `global_sequences` and `global_tokens`, which scale the auxiliary losses (module docstring). After each
    forward `last_stats` holds "tokens_per_expert" ((E,) int64: assignments each expert ran, after drops)
    and "dropped" (a 0-dim int64 tensor: assignments dropped by capacity), detached, for metrics; the
    step's sum of them is taken once with `take_step_stats()`."""

    def __init__(self, cfg: ModelConfig, aux: AuxLosses | None = None, device=None, layer: int = 0):
        super().__init__()
        e, h, m = cfg.experts, cfg.hidden, cfg.expert_ffn
        self.layer, self.random_routing = layer, cfg.random_routing   # model/random_routing.py
        self.n_experts, self.top_k, self.kind = e, cfg.top_k, cfg.router
        self.groups, self.group_limit = cfg.router_groups, cfg.router_group_limit
        self.capacity_factor = cfg.capacity_factor
        self.aux_loss_coef, self.z_loss_coef = cfg.aux_loss_coef, cfg.z_loss_coef
        self.bias_update_rate = cfg.bias_update_rate
        self.routed_scale = cfg.routed_scaling_factor
        self.aux = aux if aux is not None else AuxLosses()
        self.router = nn.Linear(h, e, bias=False, device=device)
        self.experts = Experts(e, h, m, device)
        self.shared = SwiGLU(h, cfg.shared_experts * m, device) if cfg.shared_experts else None
        self.shared_gate = nn.Linear(h, 1, bias=False, device=device) if cfg.shared_expert_gate else None
        self.register_buffer("expert_bias", torch.zeros(e, device=device) if cfg.router == "sigmoid_bias" else None)
        self.configure()
        self.last_stats: dict[str, torch.Tensor] = {}
        self.step_stats: torch.Tensor | None = None   # (E + 1,): tokens per expert and dropped, this step

    def configure(self, *, dispatcher=None, rows: tuple[nn.Module, nn.Module] | None = None,
                  sum_sequence_parts=None, sequence_parts: int = 1, global_sequences: int = 1,
                  global_tokens: int = 1, keys_view=None, seed: int = 0) -> None:
        """Everything the parallel dimensions and the run tell this layer, in one call (the defaults:
        one process). `dispatcher`: how routed rows reach the experts (None: LocalDispatch). `rows`:
        (enter, leave) modules around the layer (tensor parallelism without SP: take this rank's
        sequences, all-gather the outputs again; None: identity). `sum_sequence_parts`: sums a
        per-sequence statistic over the `sequence_parts` ranks holding parts of each sequence (None when
        every rank holds whole sequences). `global_sequences`, `global_tokens`: the step's totals.
        `keys_view`: this layer's tokens' keys from the keys of the block's input (model/random_routing.py;
        None: the same tokens), `seed`: the run's, both read only under random routing."""
        self.dispatcher = dispatcher if dispatcher is not None else LocalDispatch()
        self.enter, self.leave = rows if rows is not None else (nn.Identity(), nn.Identity())
        self.sum_sequence_parts, self.sequence_parts = sum_sequence_parts, sequence_parts
        self.global_sequences, self.global_tokens = global_sequences, global_tokens
        self.keys_view, self.seed = keys_view, seed

    def take_step_stats(self) -> torch.Tensor | None:
        """The step's (E + 1,) counts so far (tokens per expert, dropped), or None; starts afresh."""
        stats, self.step_stats = self.step_stats, None
        return stats

    def route(self, x_bsh: torch.Tensor):
        """(experts_tk, weights_tk, scores_te, logits_te): the router's choices for the b·s tokens (row
        t = b_index·s + s_index), before capacity; weights in x's dtype, scores p and logits in the router
        dtype (fp32, or fp64 for fp64 models)."""
        b, s, h = x_bsh.shape
        rdtype = torch.float64 if x_bsh.dtype == torch.float64 else torch.float32
        logits_te = F.linear(x_bsh.reshape(b * s, h).to(rdtype), self.router.weight.to(rdtype))
        experts_tk, weights_tk, scores_te = route(logits_te, self.kind, self.top_k, self.expert_bias,
                                                  self.groups, self.group_limit)
        if self.routed_scale != 1.0:   # DeepSeek-V3's routed_scaling_factor
            weights_tk = weights_tk * self.routed_scale
        return experts_tk, weights_tk.to(x_bsh.dtype), scores_te, logits_te

    def capacity(self, s: int) -> int:
        """Assignments each expert accepts from one sequence of length s (0: dropless)."""
        return rules.moe_capacity(self.capacity_factor, s, self.top_k, self.n_experts)

    def drop(self, experts_tk: torch.Tensor, weights_tk: torch.Tensor, b: int, s: int):
        """Capacity: assignments past their expert's capacity in their sequence become expert -1, weight 0."""
        keep_tk = within_capacity(experts_tk.view(b, s, -1), self.capacity(s), self.n_experts).view(b * s, -1)
        return experts_tk.masked_fill(~keep_tk, -1), weights_tk.masked_fill(~keep_tk, 0.0)

    def forward(self, x_bsh: torch.Tensor, keys_bs: torch.Tensor | None = None) -> torch.Tensor:
        """`keys_bs`: the step-global keys of the block input's tokens, under random routing (else
        ignored; None: both experts, as chosen)."""
        x_bsh = self.enter(x_bsh)
        b, s, h = x_bsh.shape
        x_th = x_bsh.reshape(b * s, h)
        experts_tk, weights_tk, scores_te, logits_te = self.route(x_bsh)
        loss = self.router_loss(scores_te, logits_te, experts_tk.view(b, s, -1)) if torch.is_grad_enabled() else None
        unsent = 0   # second choices random routing did not send (not drops)
        if self.random_routing and keys_bs is not None:
            keys_bs = keys_bs if self.keys_view is None else self.keys_view(keys_bs)
            experts_tk, weights_tk = skip_seconds(experts_tk, weights_tk, uniform(keys_bs.reshape(-1), self.seed, self.layer))
            unsent = (experts_tk < 0).sum()
        if self.capacity_factor > 0:
            experts_tk, weights_tk = self.drop(experts_tk, weights_tk, b, s)
            y_th = self.dispatcher(x_th, experts_tk, weights_tk, self.experts, capacity=(s, self.capacity(s)))
        else:
            y_th = self.dispatcher(x_th, experts_tk, weights_tk, self.experts)
        if self.shared is not None:
            shared_th = self.shared(x_th)
            if self.shared_gate is not None:
                shared_th = torch.sigmoid(self.shared_gate(x_th)) * shared_th
            y_th = y_th + shared_th
        kept_a = (experts_tk >= 0).reshape(-1)   # counted by scatter, not by boolean indexing: shapes never
        per_expert = torch.zeros(self.n_experts, dtype=torch.long, device=experts_tk.device).scatter_add_(
            0, experts_tk.clamp(min=0).reshape(-1), kept_a.long())   # depend on values (a dry run has none)
        dropped = (experts_tk < 0).sum() - unsent   # by capacity; random routing's skipped seconds are not drops
        self.last_stats = {"tokens_per_expert": per_expert.detach(), "dropped": dropped.detach()}
        if torch.is_grad_enabled():   # the step's totals (a forward re-run for recomputation counts once)
            step = torch.cat([self.last_stats["tokens_per_expert"], self.last_stats["dropped"].view(1)])
            self.step_stats = step if self.step_stats is None else self.step_stats + step
        y_bsh = y_th.view(b, s, h)
        return self.leave(y_bsh if loss is None else self.aux.add(y_bsh, loss))

    def router_loss(self, scores_te: torch.Tensor, logits_te: torch.Tensor, chosen_bsk: torch.Tensor):
        """The load-balance loss (softmax routers) plus the z-loss, scaled as the module docstring says
        (a 0-dim tensor), or None when both are off. chosen_bsk: the router's choices before capacity."""
        b, s, _ = chosen_bsk.shape
        loss = None
        if self.kind != "sigmoid_bias" and self.aux_loss_coef > 0:
            lb = load_balance_loss(scores_te.view(b, s, -1), chosen_bsk, self.sum_sequence_parts, self.sequence_parts)
            loss = lb * (self.aux_loss_coef / self.global_sequences)
        if self.z_loss_coef > 0:
            z = z_loss(logits_te) * (self.z_loss_coef / self.global_tokens)
            loss = z if loss is None else loss + z
        return loss

    @torch.no_grad()
    def update_bias(self, counts_e: torch.Tensor) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing (sigmoid_bias only; a no-op otherwise):
        expert_bias += bias_update_rate · sign(mean(counts) - counts), with counts_e the assignments per
        expert over the step (e.g. last_stats["tokens_per_expert"] summed over micro-batches and ranks)."""
        if self.expert_bias is None:
            return
        c = counts_e.to(device=self.expert_bias.device, dtype=self.expert_bias.dtype)
        self.expert_bias += self.bias_update_rate * torch.sign(c.mean() - c)

    def _apply(self, fn, recurse=True):
        """Module.to / .cuda / .bfloat16 cast floating buffers; keep expert_bias's fp32 values (only its
        device follows; fp64 when the module becomes fp64)."""
        bias = self.expert_bias
        super()._apply(fn, recurse)
        if bias is not None:
            moved = self.expert_bias
            dtype = torch.float64 if moved.dtype == torch.float64 else torch.float32
            # values that exist are kept (a cast would round them); a meta bias has only its shape
            self.expert_bias = moved.to(dtype) if bias.is_meta or moved.is_meta else \
                bias.to(device=moved.device, dtype=dtype)
        return self
