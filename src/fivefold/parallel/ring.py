"""Ring attention: exact attention over a sequence split across the ranks of a context-parallel group.

Paper: Liu, Zaharia, Abbeel, "Ring Attention with Blockwise Transformers for Near-Infinite Context"
(2023). Each of the r ranks of the ring holds s = S/r tokens: its queries q and its keys/values k, v.
Attention needs every query against every key, so the K/V blocks travel around the ring: at step j
(j = 0 .. r-1) rank i holds the K/V block of rank (i - j) mod r, computes its queries against it, and
meanwhile passes the block on to rank i+1 while receiving the next one from rank i-1. The partial
results are merged with the online softmax of flash attention (Milakov & Gimelshein 2018; Dao et al.
2022): a running row maximum m, a running sum of exponentials l (both fp32) and an output accumulator,
rescaled whenever m grows. After r steps o = acc / l, exactly softmax(q kᵀ / sqrt(d)) v.

Causality comes from position ids, not from block order: query at position p sees key at position p'
iff p' <= p. `positions_rs` (r, s) lists every rank's positions, so any layout works: contiguous,
zig-zag, or a hybrid with Ulysses whose tokens are two zig-zag chunks. On the CPU a block is split
into tiles of contiguous position runs, each fully visible or a causal diagonal, computed by torch's
fused flash-attention kernel (it returns the log-sum-exp the merge needs; its backward takes the merged
output and log-sum-exp); otherwise only the bounding rectangle of visible (query, key) pairs is
computed, under a mask. A block nothing sees is skipped. Packed documents (`documents_brs`, the
document id of every ring rank's tokens, model/documents.py) mask each block by document too: such a
block always takes the masked way, and one in which no query shares a document with any key (every
row of the batch) is skipped. Each rank indexes the ids from the whole rows it already holds, so no id
travels round the ring.

Load balance (the zig-zag layout of Megatron-CP and torchtitan). With contiguous shards, rank 0 sees
only its own block and rank r-1 sees all r: the ring waits for the slowest rank. Zig-zag splits the
sequence into 2r chunks and gives rank i chunks i and 2r-1-i (one early, one late). Then against its
own block a rank computes a causal diagonal block, and against any other rank's block exactly half of
a full block: for an earlier rank (i' < i) all its queries see the first chunk of that block and none
the second; for a later rank (i' > i) only its late chunk sees the block, but sees all of it. Every
rank does 1 diagonal + (r-1) half blocks: the same causal work, half of the non-causal work.

Communication per call, per rank, all under dim "cp", each message one packed K/V tensor
(b, kh, s, d + dv) of b·kh·s·(d + dv)·itemsize bytes (K and V travel together, concatenated along the
head dim, so values may be narrower than keys, as latent attention's are; GQA kv heads are expanded only
inside the local compute, never before sending):
  forward   r-1 sends + r-1 receives (no hop after the last step);
  backward  the same r-1 K/V hops again (recomputation), plus r-1 hops of a dK/dV accumulator: rank i
            keeps its own block's partial gradient; at step j >= 1 it adds its partial for block i-j to
            the accumulator rank i-1 sent (that block's partials from earlier steps) and sends the sum
            to rank i+1, so after step r-1 each accumulator arrives at the block's owner. Each step's
            K/V hop and dK/dV hop go in one batch: 2(r-1) sends + 2(r-1) receives.
Every hop is posted before the step's compute and waited after it, so it overlaps the compute.

Memory per rank is O(s) = O(S/r): two K/V blocks in flight, the running statistics, and in backward
one dK/dV accumulator. Only q, k, v, o and the fp32 log-sum-exp lse = m + log(l) (b, n, s) are saved
for backward, which recomputes each block's probabilities from them (the flash-attention backward).
A group of one rank is plain local attention with no communication.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch.autograd.function import once_differentiable

from fivefold.comm import Group, send_recv
from fivefold.model.documents import document_mask

__all__ = ["ring_attention", "zigzag_host", "zigzag_positions", "zigzag_indices"]

DIM = "cp"


# -- layout -------------------------------------------------------------------------------------------
def zigzag_host(seq: int, r: int) -> np.ndarray:
    """(r, seq // r) int64 on the host, as data (not a tensor: a dry run's fake tensors have no values,
    and the ring plans its blocks from these): rank i holds chunks i and 2r-1-i of the 2r equal chunks
    of 0 .. seq-1."""
    if r < 1 or seq % (2 * r):
        raise ValueError(f"zig-zag needs seq divisible by 2·r = {2 * r}; got seq={seq} "
                         f"(nearest valid: {seq // (2 * r) * 2 * r} or {(seq // (2 * r) + 1) * 2 * r})")
    chunks_cc = np.arange(seq, dtype=np.int64).reshape(2 * r, seq // (2 * r))
    return np.stack([np.concatenate([chunks_cc[i], chunks_cc[2 * r - 1 - i]]) for i in range(r)])


def zigzag_positions(seq: int, r: int) -> torch.Tensor:
    """`zigzag_host` as a tensor."""
    return torch.from_numpy(zigzag_host(seq, r))


def zigzag_indices(seq: int, r: int) -> torch.Tensor:
    """(seq,) the zig-zag permutation: x.index_select(dim, idx) lays the ranks' shards end to end
    (rank i's shard is the i-th of r equal slices); idx.argsort() undoes it."""
    return zigzag_positions(seq, r).flatten()


# -- one block -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Window:
    """The bounding rectangle of the visible (query, key) pairs of one block; `masked` when some pair
    inside it is not visible."""
    rows: slice
    cols: slice
    masked: bool


def _window(pos_q_s: np.ndarray, pos_k_t: np.ndarray, causal: bool) -> _Window | None:
    """Which part of a block to compute (None: nothing is visible). Positions are host arrays."""
    s, t = len(pos_q_s), len(pos_k_t)
    if not causal:
        return _Window(slice(0, s), slice(0, t), False) if s and t else None
    rows_s = pos_q_s >= pos_k_t.min()           # queries that see some key of the block
    cols_t = pos_k_t <= pos_q_s.max()           # keys some query sees
    if not rows_s.any():
        return None
    row_idx, col_idx = np.flatnonzero(rows_s), np.flatnonzero(cols_t)
    rows, cols = slice(int(row_idx[0]), int(row_idx[-1]) + 1), slice(int(col_idx[0]), int(col_idx[-1]) + 1)
    return _Window(rows, cols, bool(pos_k_t[cols].max() > pos_q_s[rows].min()))


def _visible(win: _Window, pos_q_s, pos_k_t, ids_q_bs=None, ids_k_bt=None) -> torch.Tensor | None:
    """Which (query, key) pairs of the window are visible: (s, t), or (b, 1, 1, s, t) with document ids
    (model/documents.py: the same document, and causal); None when every pair is."""
    causal_st = pos_k_t[win.cols][None, :] <= pos_q_s[win.rows][:, None] if win.masked else None
    if ids_q_bs is None:
        return causal_st
    return document_mask(ids_q_bs[:, win.rows], ids_k_bt[:, win.cols], causal_st)[:, :, None]


def _scores(q_bkgsd, k_bktd, visible, scale: float) -> torch.Tensor:
    """Scaled scores (b, kh, g, s, t) of the window's queries against its keys, -inf where not visible."""
    scores_bkgst = torch.einsum("bkgsd,bktd->bkgst", q_bkgsd, k_bktd) * scale
    if visible is not None:
        scores_bkgst = scores_bkgst.masked_fill(~visible, float("-inf"))
    return scores_bkgst


def _finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    """x where finite, else 0: a row that sees no key yet (max -inf) then gets exp(-inf - 0) = 0."""
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _attend_block(q_bkgsd, k_bktd, v_bktd, visible, scale, m_bkgs, l_bkgs, acc_bkgsd):
    """Merge one block into the running max m, sum-exp l and accumulator (views of the window's rows,
    updated in place): the online softmax."""
    scores_bkgst = _scores(q_bkgsd, k_bktd, visible, scale)
    m_new_bkgs = torch.maximum(m_bkgs, scores_bkgst.amax(-1))
    m_safe_bkgs = _finite_or_zero(m_new_bkgs)
    p_bkgst = torch.exp(scores_bkgst - m_safe_bkgs[..., None])
    rescale_bkgs = torch.exp(m_bkgs - m_safe_bkgs)          # 0 while the old max is -inf
    l_bkgs.mul_(rescale_bkgs).add_(p_bkgst.sum(-1))
    acc_bkgsd.mul_(rescale_bkgs[..., None]).add_(torch.einsum("bkgst,bktd->bkgsd", p_bkgst, v_bktd))
    m_bkgs.copy_(m_new_bkgs)


def _grad_block(q_bkgsd, k_bktd, v_bktd, do_bkgsd, lse_bkgs, delta_bkgs, visible, scale):
    """Flash-attention backward of one block: (dq, dk, dv), dk/dv summed over the g query heads."""
    scores_bkgst = _scores(q_bkgsd, k_bktd, visible, scale)
    p_bkgst = torch.exp(scores_bkgst - _finite_or_zero(lse_bkgs)[..., None])
    dv_bktd = torch.einsum("bkgst,bkgsd->bktd", p_bkgst, do_bkgsd)
    dp_bkgst = torch.einsum("bkgsd,bktd->bkgst", do_bkgsd, v_bktd)
    ds_bkgst = p_bkgst * (dp_bkgst - delta_bkgs[..., None])
    dq_bkgsd = torch.einsum("bkgst,bktd->bkgsd", ds_bkgst, k_bktd) * scale
    dk_bktd = torch.einsum("bkgst,bkgsd->bktd", ds_bkgst, q_bkgsd) * scale
    return dq_bkgsd, dk_bktd, dv_bktd


# -- fused tiles (CPU) ------------------------------------------------------------------------------------
# torch's fused CPU flash-attention kernels return the log-sum-exp the online softmax needs, and their
# backward takes the merged output and log-sum-exp: exactly a block's share of the ring's gradients.
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _runs(pos_s: np.ndarray) -> list[slice]:
    """Maximal runs of consecutive positions (a zig-zag share is two runs)."""
    breaks = np.flatnonzero(np.diff(pos_s) != 1) + 1
    edges = [0, *breaks.tolist(), len(pos_s)]
    return [slice(a, b) for a, b in zip(edges[:-1], edges[1:])]


def _tiles(pos_q_s: np.ndarray, pos_k_t: np.ndarray, causal: bool, device) -> list | None:
    """The block as tiles the fused kernel computes exactly: (query rows, key columns, causal) for each
    pair of position runs that is fully visible (causal False) or shares its positions (the causal
    diagonal); pairs nothing sees are left out. None when the fused kernel does not apply (not on the CPU,
    or a pair is only partly visible some other way): then the block goes the masked way."""
    if _FLASH is None or device.type != "cpu":
        return None
    if not causal:
        return [(slice(0, len(pos_q_s)), slice(0, len(pos_k_t)), False)]
    tiles = []
    for rows in _runs(pos_q_s):
        q0, q1 = int(pos_q_s[rows.start]), int(pos_q_s[rows.stop - 1])
        for cols in _runs(pos_k_t):
            k0, k1 = int(pos_k_t[cols.start]), int(pos_k_t[cols.stop - 1])
            if k0 > q1:
                continue                                  # all in the future
            if k1 <= q0:
                tiles.append((rows, cols, False))         # all in the past
            elif (q0, q1) == (k0, k1):
                tiles.append((rows, cols, True))          # the same positions: causal diagonal
            else:
                return None
    return tiles


def _expand(x_bksd: torch.Tensor, g: int, dtype) -> torch.Tensor:
    """K or V with each kv head repeated for its g query heads (local only; never sent)."""
    x_bksd = x_bksd.to(dtype)
    return x_bksd.repeat_interleave(g, dim=1) if g > 1 else x_bksd


def _pad_to(x: torch.Tensor, d: int) -> torch.Tensor:
    """x zero-padded along its last dim to d (the fused kernel takes one head dim for q, k and v; zero
    value columns give zero output columns, which are cut off again)."""
    return x if x.shape[-1] == d else torch.nn.functional.pad(x, (0, d - x.shape[-1]))


def _attend_tiles(q_bnsd, k_bnsd, v_bnsd, tiles, scale, m_bkgs, l_bkgs, acc_bkgsd) -> None:
    """Merge each tile's fused attention (output o_t and log-sum-exp lse_t) into the online softmax:
    the tile adds exp(lse_t - m) to l and o_t·exp(lse_t - m) to the accumulator. Values narrower than
    q/k (latent attention) are zero-padded for the kernel only."""
    b, kh, g = m_bkgs.shape[0], m_bkgs.shape[1], m_bkgs.shape[2]
    d, dv = q_bnsd.shape[-1], v_bnsd.shape[-1]
    for rows, cols, causal in tiles:
        o_bnsd, lse_bns = _FLASH(q_bnsd[:, :, rows].contiguous(), k_bnsd[:, :, cols].contiguous(),
                                 _pad_to(v_bnsd[:, :, cols].contiguous(), d), 0.0, causal, scale=scale)
        n_rows = o_bnsd.shape[2]
        o_bkgsd = o_bnsd[..., :dv].reshape(b, kh, g, n_rows, -1)
        lse_bkgs = lse_bns.reshape(b, kh, g, n_rows)
        m, l, acc = m_bkgs[..., rows], l_bkgs[..., rows], acc_bkgsd[..., rows, :]
        m_new = torch.maximum(m, lse_bkgs)
        m_safe = _finite_or_zero(m_new)
        old, new = torch.exp(m - m_safe), torch.exp(lse_bkgs - m_safe)
        l.mul_(old).add_(new)
        acc.mul_(old[..., None]).add_(o_bkgsd * new[..., None])
        m.copy_(m_new)


def _grad_tiles(do_bnsd, q_bnsd, k_bnsd, v_bnsd, o_bnsd, lse_bns, tiles, scale, kh: int):
    """Each tile's share of (dq, dk, dv) from the fused backward, given the merged output and
    log-sum-exp; dk and dv summed over each kv head's query heads."""
    b, n, s, d = q_bnsd.shape
    dv_dim = v_bnsd.shape[-1]
    dq_bnsd = torch.zeros_like(q_bnsd)
    dk_bksd = torch.zeros(b, kh, k_bnsd.shape[2], d, dtype=q_bnsd.dtype, device=q_bnsd.device)
    dv_bksd = torch.zeros(b, kh, k_bnsd.shape[2], dv_dim, dtype=q_bnsd.dtype, device=q_bnsd.device)
    for rows, cols, causal in tiles:
        dq, dk, dv = _FLASH_BACKWARD(_pad_to(do_bnsd[:, :, rows].contiguous(), d), q_bnsd[:, :, rows].contiguous(),
                                     k_bnsd[:, :, cols].contiguous(), _pad_to(v_bnsd[:, :, cols].contiguous(), d),
                                     _pad_to(o_bnsd[:, :, rows].contiguous(), d), lse_bns[:, :, rows].contiguous(),
                                     0.0, causal, scale=scale)
        t = dk.shape[2]
        dq_bnsd[:, :, rows] += dq
        dk_bksd[:, :, cols] += dk.reshape(b, kh, n // kh, t, d).sum(2)
        dv_bksd[:, :, cols] += dv[..., :dv_dim].reshape(b, kh, n // kh, t, dv_dim).sum(2)
    return dq_bnsd, dk_bksd, dv_bksd


# -- the ring ------------------------------------------------------------------------------------------
def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scores and statistics in fp32 (fp64 stays fp64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _grouped(x_bnsd: torch.Tensor, kh: int, dtype: torch.dtype) -> torch.Tensor:
    """(b, n, s, d) -> (b, kh, g, s, d): query head h = kv head h // g, index h % g within it."""
    b, n, s, d = x_bnsd.shape
    return x_bnsd.to(dtype).reshape(b, kh, n // kh, s, d)


def _pack(k_bksd: torch.Tensor, v_bksd: torch.Tensor) -> torch.Tensor:
    """K and V as one contiguous message (b, kh, s, d + dv): K's d dims, then V's."""
    return torch.cat([k_bksd, v_bksd], dim=-1)


def _k(kv_bksl: torch.Tensor, d: int) -> torch.Tensor:
    return kv_bksl[..., :d]


def _v(kv_bksl: torch.Tensor, d: int) -> torch.Tensor:
    return kv_bksl[..., d:]


def _kv_buffers(k_bksd: torch.Tensor, v_bksd: torch.Tensor, r: int) -> list[torch.Tensor]:
    """The packed local block and, on a ring, a second buffer: step j computes on buffer j % 2 (and
    sends it on) while the next block arrives in the other one."""
    own_2bksd = _pack(k_bksd, v_bksd)
    return [own_2bksd, torch.empty_like(own_2bksd)] if r > 1 else [own_2bksd]


def _hop(group: Group, send: list[torch.Tensor], recv: list[torch.Tensor]):
    """Post one batch: each tensor of `send` to rank i+1, each of `recv` from rank i-1 (in order)."""
    nxt, prv = (group.rank + 1) % group.size, (group.rank - 1) % group.size
    if not send and not recv:
        return None
    return send_recv([(t, nxt) for t in send], [(t, prv) for t in recv], group, async_op=True, dim=DIM)


def _wait(handle) -> None:
    if handle is not None:
        handle.wait()


def _block_plan(host_rs, pos_rs, ids_brs, i: int, src: int, causal: bool, device):
    """How rank i computes its queries against rank src's block: (fused tiles, None, None) on the CPU
    fast path, else (None, window, visible pairs), or (None, None, None) when no pair is visible. With
    document ids (`ids_brs`, (b, r, s)) the block is always masked, and skipped when no query shares a
    document with a key of it."""
    tiles = _tiles(host_rs[i], host_rs[src], causal, device) if ids_brs is None else None
    if tiles is not None:
        return tiles, None, None
    win = _window(host_rs[i], host_rs[src], causal)
    if win is None:
        return None, None, None
    if ids_brs is None:
        return None, win, _visible(win, pos_rs[i], pos_rs[src])
    visible = _visible(win, pos_rs[i], pos_rs[src], ids_brs[:, i], ids_brs[:, src])
    return (None, win, visible) if bool(visible.any()) else (None, None, None)


def _ring_forward(q_bnsd, k_bksd, v_bksd, pos_rs, host_rs, group: Group, causal: bool, ids_brs=None):
    b, n, s, d = q_bnsd.shape
    kh, r, i = k_bksd.shape[1], group.size, group.rank
    cdt, scale = _compute_dtype(q_bnsd.dtype), 1.0 / math.sqrt(d)
    pos_rs = pos_rs.to(q_bnsd.device)
    q_bkgsd = _grouped(q_bnsd, kh, cdt)
    m_bkgs = torch.full(q_bkgsd.shape[:-1], float("-inf"), dtype=cdt, device=q_bnsd.device)
    l_bkgs = torch.zeros_like(m_bkgs)
    acc_bkgsd = torch.zeros(q_bkgsd.shape[:-1] + (v_bksd.shape[-1],), dtype=cdt, device=q_bnsd.device)
    kv_bufs = _kv_buffers(k_bksd, v_bksd, r)
    for j in range(r):
        kv_bksl, src = kv_bufs[j % 2], (i - j) % r
        handle = _hop(group, [kv_bksl], [kv_bufs[(j + 1) % 2]]) if j < r - 1 else None
        tiles, win, visible = _block_plan(host_rs, pos_rs, ids_brs, i, src, causal, q_bnsd.device)
        if tiles:
            g = n // kh
            _attend_tiles(q_bnsd.to(cdt), _expand(_k(kv_bksl, d), g, cdt), _expand(_v(kv_bksl, d), g, cdt), tiles,
                          scale, m_bkgs, l_bkgs, acc_bkgsd)
        elif win is not None:
            rows, cols = win.rows, win.cols
            _attend_block(q_bkgsd[..., rows, :], _k(kv_bksl, d)[:, :, cols].to(cdt),
                          _v(kv_bksl, d)[:, :, cols].to(cdt), visible, scale,
                          m_bkgs[..., rows], l_bkgs[..., rows], acc_bkgsd[..., rows, :])
        _wait(handle)
    seen_bkgs = l_bkgs > 0                                  # rows with no visible key: o = 0, lse = -inf
    o_bkgsd = acc_bkgsd / torch.where(seen_bkgs, l_bkgs, torch.ones_like(l_bkgs))[..., None]
    lse_bkgs = m_bkgs + torch.log(l_bkgs)
    return o_bkgsd.reshape(b, n, s, -1).to(q_bnsd.dtype), lse_bkgs.reshape(b, n, s)


def _ring_backward(do_bnsd, q_bnsd, k_bksd, v_bksd, o_bnsd, lse_bns, pos_rs, host_rs, group: Group,
                   causal: bool, ids_brs=None):
    b, n, s, d = q_bnsd.shape
    kh, r, i = k_bksd.shape[1], group.size, group.rank
    cdt, scale = _compute_dtype(q_bnsd.dtype), 1.0 / math.sqrt(d)
    pos_rs = pos_rs.to(q_bnsd.device)
    q_bkgsd, do_bkgsd = _grouped(q_bnsd, kh, cdt), _grouped(do_bnsd, kh, cdt)
    delta_bkgs = (do_bkgsd * _grouped(o_bnsd, kh, cdt)).sum(-1)      # D = rowsum(dO * O)
    lse_bkgs = lse_bns.reshape(b, kh, n // kh, s)
    dq_bkgsd = torch.zeros_like(q_bkgsd)
    kv_bufs = _kv_buffers(k_bksd, v_bksd, r)
    dkv_in = torch.empty_like(kv_bufs[0]) if r > 2 else None   # accumulator from rank i-1 (input dtype)
    dkv_out = dkv_own = None
    for j in range(r):
        kv_bksl, src = kv_bufs[j % 2], (i - j) % r
        send, recv = ([kv_bksl], [kv_bufs[(j + 1) % 2]]) if j < r - 1 else ([], [])
        if j >= 2:                                      # pass on the accumulator of step j-1
            send, recv = send + [dkv_out], recv + [dkv_in]
        handle = _hop(group, send, recv)
        dkv_bksl = torch.zeros(kv_bksl.shape, dtype=cdt, device=kv_bksl.device)   # this step's partial
        tiles, win, visible = _block_plan(host_rs, pos_rs, ids_brs, i, src, causal, q_bnsd.device)
        if tiles:
            g = n // kh
            dq, dk, dv = _grad_tiles(do_bnsd.to(cdt), q_bnsd.to(cdt), _expand(_k(kv_bksl, d), g, cdt),
                                     _expand(_v(kv_bksl, d), g, cdt), o_bnsd.to(cdt), lse_bns, tiles, scale, kh)
            dq_bkgsd += dq.reshape(dq_bkgsd.shape)
            _k(dkv_bksl, d).add_(dk)
            _v(dkv_bksl, d).add_(dv)
        elif win is not None:
            rows, cols = win.rows, win.cols
            dq, dk, dv = _grad_block(q_bkgsd[..., rows, :], _k(kv_bksl, d)[:, :, cols].to(cdt),
                                     _v(kv_bksl, d)[:, :, cols].to(cdt), do_bkgsd[..., rows, :],
                                     lse_bkgs[..., rows], delta_bkgs[..., rows], visible, scale)
            dq_bkgsd[..., rows, :] += dq
            _k(dkv_bksl, d)[:, :, cols] += dk
            _v(dkv_bksl, d)[:, :, cols] += dv
        _wait(handle)
        if j == 0:
            dkv_own = dkv_bksl
        else:
            if j >= 2:
                dkv_bksl += dkv_in
            dkv_out = dkv_bksl.to(k_bksd.dtype)
    if r > 1:                                           # the last accumulator reaches its block's owner
        dkv_last = torch.empty_like(kv_bufs[0])
        _wait(_hop(group, [dkv_out], [dkv_last]))
        dkv_own += dkv_last
    dq_bnsd = dq_bkgsd.reshape(b, n, s, d).to(q_bnsd.dtype)
    return dq_bnsd, _k(dkv_own, d).to(k_bksd.dtype), _v(dkv_own, d).to(v_bksd.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_bnsd, k_bksd, v_bksd, positions_rs, host_rs, group, causal, documents_brs):
        o_bnsd, lse_bns = _ring_forward(q_bnsd, k_bksd, v_bksd, positions_rs, host_rs, group, causal, documents_brs)
        ctx.save_for_backward(q_bnsd, k_bksd, v_bksd, o_bnsd, lse_bns, positions_rs, documents_brs)
        ctx.host_rs, ctx.group, ctx.causal = host_rs, group, causal
        return o_bnsd

    @staticmethod
    @once_differentiable
    def backward(ctx, do_bnsd):
        q_bnsd, k_bksd, v_bksd, o_bnsd, lse_bns, positions_rs, documents_brs = ctx.saved_tensors
        dq, dk, dv = _ring_backward(do_bnsd, q_bnsd, k_bksd, v_bksd, o_bnsd, lse_bns, positions_rs,
                                    ctx.host_rs, ctx.group, ctx.causal, documents_brs)
        return dq, dk, dv, None, None, None, None, None


def ring_attention(q_bnsd: torch.Tensor, k_bksd: torch.Tensor, v_bksd: torch.Tensor, positions_rs: torch.Tensor,
                   group: Group, causal: bool = True, documents_brs: torch.Tensor | None = None,
                   host_positions_rs: np.ndarray | None = None) -> torch.Tensor:
    """Exact (causal) attention of this rank's queries against the keys/values of every rank of `group`.

    q (b, n, s, d); k (b, kh, s, d), v (b, kh, s, dv) with kh dividing n (query head h uses kv head h // (n/kh));
    positions_rs (r, s) int64: row j = the position ids of rank j's tokens (row group.rank = ours).
    documents_brs (b, r, s) int64, optional: the document id of every ring rank's tokens (computed by
    each rank from the whole rows, never sent): a query then sees only keys of its own document.
    host_positions_rs: the same positions as host data, from which the blocks are planned (default
    positions_rs's values; a dry run's fake positions have none, so context.py passes them).
    Returns o (b, n, s, dv) in q's dtype; differentiable in q, k and v. Scale 1/sqrt(d).
    """
    b, n, s, d = q_bnsd.shape
    kh = k_bksd.shape[1]
    if k_bksd.shape != (b, kh, s, d) or v_bksd.shape[:3] != k_bksd.shape[:3]:
        raise ValueError(f"k must be (b, kh, s, d) = ({b}, kh, {s}, {d}) and v (b, kh, s, dv); got "
                         f"{tuple(k_bksd.shape)} and {tuple(v_bksd.shape)}")
    if n % kh:
        raise ValueError(f"kv heads ({kh}) must divide query heads ({n})")
    if tuple(positions_rs.shape) != (group.size, s):
        raise ValueError(f"positions must be (ring size, s) = ({group.size}, {s}); got {tuple(positions_rs.shape)}")
    if documents_brs is not None and tuple(documents_brs.shape) != (b, group.size, s):
        raise ValueError(f"document ids must be (b, ring size, s) = ({b}, {group.size}, {s}); "
                         f"got {tuple(documents_brs.shape)}")
    host_rs = positions_rs.detach().cpu().numpy() if host_positions_rs is None else host_positions_rs
    return _RingAttention.apply(q_bnsd, k_bksd, v_bksd, positions_rs, host_rs, group, causal, documents_brs)
