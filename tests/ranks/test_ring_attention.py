"""Ring attention (parallel/ring.py) equals full attention in one process, forward and backward, and
sends exactly the hops its docstring counts.

One spawn of four gloo ranks runs every multi-rank case: rings of four over the world and rings of two
over the pairs {0, 1} and {2, 3}. Every rank builds the same full q, k, v and upstream gradient from a
seed, runs its shard through the ring, and returns (got, want) pairs; the reference is full attention
in fp64 (scaled_dot_product_attention on the natural order), sliced by the rank's positions.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fivefold.comm import CommLedger, Group
from fivefold.parallel import ring
from fivefold.parallel.ring import _window, ring_attention, zigzag_indices, zigzag_positions

from tests.support.spawn import ranks

B, N, SEQ, D = 2, 4, 16, 8

# name: (dtype, kv heads, causal, layout)
CASES = {
    "fp64-causal-mha": (torch.float64, 4, True, "zigzag"),
    "fp64-causal-gqa2": (torch.float64, 2, True, "zigzag"),
    "fp64-causal-mqa": (torch.float64, 1, True, "zigzag"),
    "fp64-full-gqa2": (torch.float64, 2, False, "zigzag"),
    "fp64-causal-contiguous": (torch.float64, 2, True, "contiguous"),
    "fp64-causal-shuffled": (torch.float64, 2, True, "shuffled"),
    "fp32-causal-gqa2": (torch.float32, 2, True, "zigzag"),
    "fp32-full-mqa": (torch.float32, 1, False, "zigzag"),
}
TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=1e-5)}


def layout(name: str, seq: int, r: int) -> torch.Tensor:
    if name == "zigzag":
        return zigzag_positions(seq, r)
    if name == "contiguous":
        return torch.arange(seq).view(r, seq // r)
    return torch.randperm(seq, generator=torch.Generator().manual_seed(3)).view(r, seq // r)


def inputs(kh: int, dtype: torch.dtype, seed: int = 0):
    """Full q (b, n, S, d), k, v (b, kh, S, d) and upstream gradient, rounded to dtype."""
    gen = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(B, N, SEQ, D, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, kh, SEQ, D, generator=gen, dtype=torch.float64) for _ in range(2))
    return [t.to(dtype) for t in (q, k, v, do)]


def reference(q, k, v, do, causal: bool):
    """o, dq, dk, dv of full attention over the natural order, in fp64."""
    q, k, v = (t.detach().to(torch.float64, copy=True).requires_grad_() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    o = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                       is_causal=causal)
    o.backward(do.double())
    return o.detach(), q.grad, k.grad, v.grad


def run_case(group: Group, case: str) -> dict:
    """This rank's (got, want) for o, dq, dk, dv, and the ledger rows of a no-grad and a full call."""
    dtype, kh, causal, name = CASES[case]
    q, k, v, do = inputs(kh, dtype)
    positions_rs = layout(name, SEQ, group.size)
    mine = positions_rs[group.rank]
    want = [t[:, :, mine] for t in reference(q, k, v, do, causal)]

    q_i, k_i, v_i = (t[:, :, mine].clone().requires_grad_() for t in (q, k, v))
    if name == "shuffled":   # a non-contiguous query, as a model's (b, s, n, d) -> (b, n, s, d) gives
        q_i = q[:, :, mine].transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    snap = group.ledger.snapshot()
    with torch.no_grad():
        ring_attention(q_i, k_i, v_i, positions_rs, group, causal)
    fwd_rows = group.ledger.since(snap).rows()
    snap = group.ledger.snapshot()
    o_i = ring_attention(q_i, k_i, v_i, positions_rs, group, causal)
    o_i.backward(do[:, :, mine])
    both_rows = group.ledger.since(snap).rows()
    got = [o_i.detach(), q_i.grad, k_i.grad, v_i.grad]
    return {"pairs": list(zip(got, want)), "fwd": fwd_rows, "both": both_rows}


def ring_ranks(rank, world):
    torch.set_num_threads(1)
    ledger = CommLedger(rank, world)
    pairs = [[0, 1], [2, 3]]
    pair_pgs = [dist.new_group(p) for p in pairs]   # every rank creates every group, in order
    mine = rank // 2
    rings = {4: Group("cp", list(range(world)), rank, dist.group.WORLD, ledger),
             2: Group("cp", pairs[mine], rank % 2, pair_pgs[mine], ledger)}
    return {(r, case): run_case(group, case) for r, group in rings.items() for case in CASES}


@pytest.fixture(scope="module")
def ring_results():
    return ranks(ring_ranks, 4)


def message_bytes(r: int, kh: int, dtype: torch.dtype) -> int:
    return 2 * B * kh * (SEQ // r) * D * torch.tensor([], dtype=dtype).element_size()


@pytest.mark.parametrize("r", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.ranks
def test_ring_matches_full_attention(ring_results, r, case):
    dtype = CASES[case][0]
    for rank, result in enumerate(ring_results):
        for what, (got, want) in zip(("o", "dq", "dk", "dv"), result[(r, case)]["pairs"]):
            assert got.dtype == dtype
            torch.testing.assert_close(got.double(), want, **TOL[dtype],
                                       msg=lambda m: f"rank {rank} {what}: {m}")


@pytest.mark.parametrize("r", [2, 4])
@pytest.mark.parametrize("case", ["fp64-causal-mqa", "fp32-causal-gqa2", "fp64-full-gqa2"])
@pytest.mark.ranks
def test_ring_ledger(ring_results, r, case):
    dtype, kh = CASES[case][:2]
    msg = message_bytes(r, kh, dtype)
    for result in ring_results:
        for rows, hops in ((result[(r, case)]["fwd"], r - 1), (result[(r, case)]["both"], 3 * (r - 1))):
            assert {(row["dim"], row["op"]) for row in rows} == {("cp", "send"), ("cp", "recv")}
            by_op = {row["op"]: row for row in rows}
            for op in ("send", "recv"):
                assert by_op[op]["calls"] == hops
                assert by_op[op]["message_bytes"] == hops * msg
            assert by_op["send"]["bytes_sent"] == hops * msg
            assert by_op["recv"]["bytes_sent"] == 0


@pytest.mark.parametrize("case", ["fp64-causal-gqa2", "fp64-full-gqa2", "fp32-causal-gqa2"])
def test_ring_of_one_is_local_attention(case):
    dtype, kh, causal, _ = CASES[case]
    q, k, v, do = inputs(kh, dtype, seed=1)
    group = Group.single("cp")
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    o = ring_attention(q, k, v, torch.arange(SEQ).view(1, SEQ), group, causal)
    o.backward(do)
    for got, want in zip((o, q.grad, k.grad, v.grad), reference(q.detach(), k.detach(), v.detach(), do, causal)):
        torch.testing.assert_close(got.double(), want, **TOL[dtype])
    assert group.ledger.rows() == []


def test_rows_without_keys_are_zero_not_nan():
    """A query row that sees no key of a block (and none before it: max -inf) gets exp(...) = 0, not
    NaN, in the online softmax and in the block backward; a block nothing sees is skipped."""
    pos_q, pos_k = torch.tensor([3, 0, 5]), torch.tensor([3, 4])
    win = _window(pos_q, pos_k, causal=True)
    assert win == ring._Window(slice(0, 3), slice(0, 2), True)   # row 1 (position 0) sees nothing
    q = torch.randn(1, 1, 2, 3, D, dtype=torch.float64)
    k, v, do = torch.randn(1, 1, 2, D, dtype=torch.float64), torch.randn(1, 1, 2, D, dtype=torch.float64), q * 0.5
    m = torch.full((1, 1, 2, 3), float("-inf"), dtype=torch.float64)
    l, acc = torch.zeros_like(m), torch.zeros_like(q)
    visible = ring._visible(win, pos_q, pos_k)
    ring._attend_block(q, k, v, visible, 0.5, m, l, acc)
    assert torch.isfinite(l).all() and torch.isfinite(acc).all()
    assert (l[..., 1] == 0).all() and (acc[..., 1, :] == 0).all() and (l[..., [0, 2]] > 0).all()
    lse = m + torch.log(l)
    grads = ring._grad_block(q, k, v, do, lse, torch.zeros_like(lse), visible, 0.5)
    assert all(torch.isfinite(g).all() for g in grads)
    assert _window(torch.tensor([0, 1]), torch.tensor([2, 3]), causal=True) is None


def test_zigzag_positions():
    assert zigzag_positions(16, 4).tolist() == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert zigzag_positions(8, 1).tolist() == [list(range(8))]
    idx = zigzag_indices(16, 4)
    assert sorted(idx.tolist()) == list(range(16))
    assert idx.tolist()[:4] == [0, 1, 14, 15]
    with pytest.raises(ValueError, match="divisible by 2·r = 8"):
        zigzag_positions(12, 4)


def test_zigzag_balances_causal_work():
    """Computed (query, key) pairs per rank: equal under zig-zag (one causal diagonal block plus r-1
    half blocks), unequal under contiguous shards."""
    r, seq = 4, 32
    s = seq // r

    def work(positions_rs):
        out = []
        for i in range(r):
            wins = [_window(positions_rs[i], positions_rs[j], causal=True) for j in range(r)]
            out.append(sum((w.rows.stop - w.rows.start) * (w.cols.stop - w.cols.start) for w in wins if w))
        return out

    assert work(zigzag_positions(seq, r)) == [s * s + (r - 1) * s * s // 2] * r
    contiguous = work(torch.arange(seq).view(r, s))
    assert contiguous == [s * s * (i + 1) for i in range(r)]
    assert sum(contiguous) == sum(work(zigzag_positions(seq, r)))   # the same total, evenly spread
