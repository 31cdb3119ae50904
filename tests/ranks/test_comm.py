"""Each recorded collective: its result is right and the ledger's bytes equal comm/volume.py's formula."""
import pytest
import torch

from fivefold import comm
from fivefold.comm import CommLedger, volume
from fivefold.config import ParallelConfig
from fivefold.mesh import ParallelMesh

from tests.support.spawn import ranks


def test_formulas():
    assert volume.all_reduce(1000, 4) == 1500
    assert volume.all_gather(1000, 4) == 750
    assert volume.reduce_scatter(1000, 4) == 750
    assert volume.all_to_all(1000, 4) == 750
    assert volume.all_to_all(1000, 4, kept_bytes=100) == 900
    assert volume.send(1000) == 1000 and volume.recv(1000) == 0
    assert volume.all_reduce(1000, 1) == 0


def test_ledger_merge_and_files(tmp_path):
    a, b = CommLedger(0, 2), CommLedger(1, 2)
    a.record("dp", "all_reduce", 100, 100, 0.5)
    b.record("dp", "all_reduce", 100, 100, 0.25)
    b.record("tp", "all_gather", 10, 5)
    total = CommLedger.merge([a, b])
    assert total.total("dp", "all_reduce") == 200 and total.total(field="calls") == 3
    total.write(tmp_path / "comm.json")
    back = CommLedger.read(tmp_path / "comm.json")
    assert back.rows() == total.rows()
    assert [led.total() for led in back.per_rank()] == [100, 105]
    assert "all_gather" in back.table()


def _collectives(rank, world):
    mesh = ParallelMesh(ParallelConfig(dp=world), rank)
    g = mesh["dp"]
    n = world
    x = torch.full((8,), float(rank + 1))
    comm.all_reduce(x, g)
    assert torch.all(x == sum(range(1, n + 1)))
    out = torch.empty(4 * n)
    comm.all_gather(out, torch.full((4,), float(rank)), g)
    assert torch.equal(out, torch.arange(n).float().repeat_interleave(4))
    rs = torch.empty(4)
    comm.reduce_scatter(rs, torch.arange(4 * n).float(), g)
    assert torch.equal(rs, n * torch.arange(4 * rank, 4 * rank + 4).float())
    # asynchronous: the sum lands at wait(); into a strided out (a column of a (4, 2) tensor); bf16 too
    cols = torch.zeros(4, 2)
    h = comm.reduce_scatter(cols[:, 1], torch.arange(4 * n).float(), g, async_op=True)
    h.wait()
    assert torch.equal(cols[:, 1], rs) and not cols[:, 0].any()
    half = torch.empty(4, dtype=torch.bfloat16)
    comm.reduce_scatter(half, torch.arange(4 * n).to(torch.bfloat16) + rank, g)
    assert torch.equal(half, (rs + sum(range(n))).to(torch.bfloat16))
    a2a = torch.empty(2 * n)
    comm.all_to_all(a2a, torch.full((2 * n,), float(rank)), g)
    assert torch.equal(a2a, torch.arange(n).float().repeat_interleave(2))
    # uneven: rank r sends r+1+i rows to rank i
    in_splits = [rank + 1 + i for i in range(n)]
    out_splits = [s + 1 + rank for s in range(n)]
    inp = torch.full((sum(in_splits), 3), float(rank))
    uneven = torch.empty(sum(out_splits), 3)
    comm.all_to_all(uneven, inp, g, out_splits, in_splits, dim="ep")
    right, left = (rank + 1) % n, (rank - 1) % n
    got = torch.empty(5)
    comm.send_recv([(torch.full((5,), float(rank)), right)], [(got, left)], g, dim="pp")
    assert torch.all(got == left)
    h = comm.all_reduce(torch.ones(3), g, reduce_op="avg", async_op=True)
    h.wait()
    return mesh.ledger.rows(), sum(in_splits) * 12, in_splits[rank] * 12


@pytest.mark.ranks
def test_ledger_bytes_match_formula():
    n = 4
    results = ranks(_collectives, n)
    for rank, (rows, uneven_bytes, kept) in enumerate(results):
        r = {(x["dim"], x["op"]): x for x in rows}
        assert r[("dp", "all_reduce")]["calls"] == 2
        assert r[("dp", "all_reduce")]["bytes_sent"] == volume.all_reduce(8 * 4, n) + volume.all_reduce(3 * 4, n)
        assert r[("dp", "all_gather")]["message_bytes"] == 4 * n * 4
        assert r[("dp", "all_gather")]["bytes_sent"] == volume.all_gather(4 * n * 4, n)
        # on gloo the chunks are exchanged pairwise and summed: a ring's bytes (comm/volume.py ALGORITHMS)
        assert r[("dp", "reduce_scatter")]["calls"] == 3
        assert r[("dp", "reduce_scatter")]["bytes_sent"] == (2 * volume.reduce_scatter(4 * n * 4, n)   # fp32
                                                             + volume.reduce_scatter(4 * n * 2, n))   # bf16
        assert r[("dp", "all_to_all")]["bytes_sent"] == volume.all_to_all(2 * n * 4, n)
        assert r[("ep", "all_to_all")]["bytes_sent"] == uneven_bytes - kept
        assert r[("pp", "send")]["bytes_sent"] == 20 and r[("pp", "recv")]["bytes_sent"] == 0


def _windows(rank, world):
    """parallel/engine.py all_reduce_windows with a 5-element window over tensors of 3, 7 and 4 elements
    (windows cross the tensors' edges), against one whole all-reduce of the same values."""
    from fivefold.parallel.engine import all_reduce_windows

    mesh = ParallelMesh(ParallelConfig(tp=world), rank)
    g = torch.Generator().manual_seed(rank)
    tensors = [torch.randn(3, generator=g), torch.randn(7, generator=g).view(7, 1), torch.randn(2, 2, generator=g)]
    whole = torch.cat([t.reshape(-1) for t in tensors])
    comm.all_reduce(whole, mesh["tp"], dim="check")
    all_reduce_windows(tensors, mesh["tp"], chunk=5)
    return whole, torch.cat([t.reshape(-1) for t in tensors]), mesh.ledger.rows()


@pytest.mark.ranks
def test_windowed_all_reduce_equals_one_all_reduce_and_counts_each_window():
    from fivefold.shapes import windows

    for whole, windowed, rows in ranks(_windows, 2):
        assert torch.equal(whole, windowed)
        r = {(x["dim"], x["op"]): x for x in rows}[("tp", "all_reduce")]
        assert r["calls"] == sum(k for _, k in windows(14, 5)) == 3
        assert r["message_bytes"] == 14 * 4
        assert r["bytes_sent"] == 2 * volume.all_reduce(5 * 4, 2) + volume.all_reduce(4 * 4, 2)
