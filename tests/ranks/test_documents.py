"""Document-aware packing (train.document_mask, model/documents.py): a packed batch of documents equals
the documents run one by one, and a masked run under dp2, tp2 + SP, pp2, cp2 ring (zig-zag), cp2
Ulysses and hybrid cp4 (Ulysses 2 x ring 2) equals one process, with the same ledger as the unmasked run.

One spawn of 2 ranks runs the 2-rank cases; the 4-rank case rides on test_context.py's 4-rank spawn
(conftest.py `context_four`), so it costs no process start of its own (start-up is the slow part).
"""
import numpy as np
import pytest
import torch

from fivefold.comm import CommLedger
from fivefold.config import Config, ConfigError, ModelConfig, ParallelConfig
from fivefold.mesh import ParallelMesh
from fivefold.model import Transformer, loss_sum
from fivefold.model.documents import Documents, document_positions
from fivefold.model.attention import attention_core
from fivefold.parallel.context import ContextAttention, token_indices
from fivefold.train.data import Batches, make_batches
from fivefold.train.corpus import check_data

from tests.support.spawn import spawn_jobs
from tests.support.tiny import TOL, assert_states_close, tiny_config
from tests.support.reference import reference, run_steps
from tests.support.documents import write_documents

LENGTHS = [5, 9, 4]   # three documents packed into one sequence

CASES = {   # name -> parallel degrees, on 2 ranks
    "dp2": dict(dp=2, microbatches=2),
    "tp2_sp": dict(tp=2, sp_mode="megatron"),
    "pp2_1f1b_selective": dict(pp=2, microbatches=2, schedule="1f1b"),
    "ring_cp2": dict(cp=2, cp_mode="ring"),
    "ulysses_cp2": dict(cp=2, cp_mode="ulysses", microbatches=2),
}
FOUR = {   # on 4 ranks, in conftest.py's shared spawn
    "hybrid_cp4_ulysses2": dict(cp=4, cp_mode="hybrid", ulysses=2),
}


def packed_model():
    cfg = ModelConfig(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, max_seq=64)
    return Transformer(cfg, seed=3).double()


def test_packed_batch_equals_documents_run_separately():
    """One sequence holding 3 documents, masked, gives the loss and gradients of the 3 run one by one
    (each from position 0); without the mask it does not."""
    model = packed_model()
    gen = torch.Generator().manual_seed(0)
    x_bs, y_bs = (torch.randint(0, 256, (1, sum(LENGTHS)), generator=gen) for _ in range(2))
    ids_bs = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))[None]
    docs = Documents(document_positions(ids_bs), ids_bs)
    assert docs.positions_bs.tolist() == [[*range(5), *range(9), *range(4)]]

    def loss_and_grads(run):
        model.zero_grad()
        loss = run()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    packed = loss_and_grads(lambda: loss_sum(model(x_bs, documents=docs), y_bs))
    bounds = np.cumsum([0, *LENGTHS])
    alone = loss_and_grads(lambda: sum(loss_sum(model(x_bs[:, a:b]), y_bs[:, a:b])
                                       for a, b in zip(bounds[:-1], bounds[1:])))
    torch.testing.assert_close(packed[0], alone[0], rtol=1e-12, atol=0)
    assert_states_close(packed[1], alone[1], rtol=1e-10, atol=1e-12)
    unmasked = loss_sum(model(x_bs), y_bs).detach()
    assert abs(float(unmasked - alone[0])) > 1e-3


# -- data --------------------------------------------------------------------------------------------


def test_windows_know_their_documents(docs_file):
    """A window's document ids step at exactly the token file's document starts inside it."""
    c = masked_config(docs_file, {})
    batches = make_batches(c.train, 256)
    starts = set(np.load(f"{docs_file}.idx.npy").tolist())
    offsets = batches.offsets(2)[:4].tolist()
    ids_bs = batches.local_documents(2, 0, 2)
    for o, ids in zip(offsets, ids_bs.tolist()):
        steps = [i for i in range(1, len(ids)) if ids[i] != ids[i - 1]]
        assert steps == [i for i in range(1, len(ids)) if o + i in starts]
        assert ids[0] == 0 and all(b - a in (0, 1) for a, b in zip(ids, ids[1:]))


def test_raw_tokens_have_no_documents(tmp_path):
    raw = tmp_path / "ids.u16"
    (np.arange(500) % 256).astype(np.uint16).tofile(raw)
    c = masked_config(raw, {})
    with pytest.raises(ConfigError, match="train.document_mask needs document boundaries"):
        check_data(c.train, 256)
    assert Batches(np.arange(100), 8, 2, 0).starts is None   # no mask: no starts read


@pytest.mark.parametrize("sidecar, words", [
    (lambda good: good[::-1].copy(), "from"),                                   # reversed: not from 0
    (lambda good: good[[0, 1, 2, 3, 4, 6, 5, *range(7, len(good))]], "decrease at document 6"),   # non-monotonic
    (lambda good: good[:10], "values for the header's"),                        # another (shorter) file's
    (lambda good: np.array([], dtype=np.int64), "values for the header's"),     # empty
    (lambda good: good.astype(np.float64), "not 1-D integers"),                 # floats
    (lambda good: good.reshape(1, -1), "not 1-D integers"),                     # 2-D
    (lambda good: np.concatenate([good[:-1], [good[-1] + 7]]), "not from 0 to the header's"),   # out of range
    (lambda good: good - 3, "not from 0"),                                      # negative
    (None, "is not a .npy array"),                                              # garbage bytes
])
def test_a_wrong_document_sidecar_is_one_line(tmp_path, sidecar, words):
    """FILE.idx.npy is held to the token file's header (documents + 1 non-decreasing values from 0 to the
    token count): anything else is refused before training, never a silently different mask."""
    data = tmp_path / "docs.bin"
    write_documents(data, count=40)
    side = tmp_path / "docs.bin.idx.npy"
    good = np.load(side)
    if sidecar is None:
        side.write_bytes(b"\x93NUMPY garbage")
    else:
        np.save(side, sidecar(good), allow_pickle=False)
    with pytest.raises(ConfigError, match=words) as e:
        check_data(masked_config(data, {}).train, 256)
    assert "\n" not in str(e.value)
    side.unlink()
    with pytest.raises(ConfigError, match="are missing"):
        check_data(masked_config(data, {}).train, 256)


# -- layouts -------------------------------------------------------------------------------------------

def masked_config(data, parallel: dict, mask: bool = True) -> Config:
    c = tiny_config(**parallel)
    c.train.data, c.train.document_mask = [str(data)], mask
    c.train.dtype = "fp64"   # exact to 1e-10: a difference is a wrong mask, not rounding noise Adam amplifies
    if parallel.get("schedule") == "1f1b":
        c.train.recompute = "selective"   # the checkpointed core takes the document ids too
    return c


def attention_alone(rank, world):
    """fp64 q, k, v of 16 tokens (2 rows, several documents each) through the ring and the Ulysses
    cores: (mode, output, dq, dk, dv) of this rank's tokens."""
    out = []
    for mode in ("ring", "ulysses"):
        mesh = ParallelMesh(ParallelConfig(cp=2, cp_mode=mode), rank, CommLedger(rank, world),
                            ulysses=2 if mode == "ulysses" else 1)
        u = 2 if mode == "ulysses" else 1
        idx = token_indices(16, 2, u)
        core = ContextAttention(mesh["cp_ulysses"], mesh["cp_ring"], idx.numpy().reshape(2 // u, -1))
        q, k, v, g, ids = attention_inputs()
        mine = idx[mesh.coords["cp"]]
        q, k, v = (t[:, :, mine].clone().requires_grad_() for t in (q, k, v))
        o = core(q, k, v, documents_bS=ids)
        o.backward(g[:, :, mine])
        out.append((mode, o.detach(), q.grad, k.grad, v.grad))
    return out


def attention_inputs():
    gen = torch.Generator().manual_seed(5)
    make = lambda heads: torch.randn(2, heads, 16, 8, generator=gen, dtype=torch.float64)  # noqa: E731
    # zig-zag over 2 ring ranks: rank 0's queries 12..15 share no document with rank 1's keys 4..11 in
    # either row, and its queries 0..3 see none of them, so that block is skipped
    ids = torch.tensor([[0] * 3 + [1] * 9 + [2] * 4, [0] * 12 + [1] * 4])
    return make(4), make(2), make(2), make(4), ids


def layout_jobs(docs_file, cases: dict) -> list:
    """Each case masked (3 steps) and unmasked (1 step, for the ledger)."""
    jobs = [(n, run_steps, (masked_config(docs_file, p).to_dict(),)) for n, p in cases.items()]
    return jobs + [(f"{n}_unmasked", run_steps, (masked_config(docs_file, p, mask=False).to_dict(), 1))
                   for n, p in cases.items()]


def four_rank_jobs(docs_file) -> list:
    """The jobs this file adds to the shared 4-rank spawn (conftest.py)."""
    return layout_jobs(docs_file, FOUR)


@pytest.fixture(scope="module")
def two(docs_file):
    return spawn_jobs(2, layout_jobs(docs_file, CASES) + [("attention", attention_alone, ())])


def spawned(name: str, request) -> dict:
    """The results of every job of the spawn that ran case `name` (the 4-rank spawn only when asked for)."""
    return request.getfixturevalue("context_four" if name in FOUR else "two")


@pytest.mark.ranks
@pytest.mark.parametrize("name", [*CASES, *FOUR])
def test_masked_layouts_equal_one_process(name, request, docs_file):
    c = masked_config(docs_file, {**CASES, **FOUR}[name])
    results = spawned(name, request)
    one = masked_config(docs_file, dict(microbatches=c.parallel.microbatches * c.parallel.dp))
    ref = reference(one)
    unmasked = reference(masked_config(docs_file, {}, mask=False), steps=1)
    assert abs(unmasked["losses"][0] - ref["losses"][0]) > 1e-3   # the mask changes the loss
    for r in results[name]:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=1e-10, atol=0)
        torch.testing.assert_close(torch.tensor(r["grad_norms"]), torch.tensor(ref["grad_norms"]), rtol=1e-10, atol=0)
        assert_states_close(r["state"], ref["state"], **TOL["fp64"])


@pytest.mark.ranks
@pytest.mark.parametrize("name", [*CASES, *FOUR])
def test_masked_ledger_equals_unmasked(name, request):
    """Masking sends nothing more: every step's rows (calls, bytes) equal the unmasked run's."""
    def table(rows):
        return sorted((x["dim"], x["op"], x["calls"], x["message_bytes"], x["bytes_sent"]) for x in rows)

    results = spawned(name, request)
    for masked, plain in zip(results[name], results[f"{name}_unmasked"]):
        assert any(x["dim"] != "loss" for x in plain["ledger"][0])
        for rows in masked["ledger"]:
            assert table(rows) == table(plain["ledger"][0])


@pytest.mark.ranks
def test_context_attention_masks_documents(two):
    """Ring (a block with no shared document skipped) and Ulysses equal masked attention in fp64."""
    q, k, v, g, ids = (t.requires_grad_() if t.is_floating_point() else t for t in attention_inputs())
    o = attention_core(q, k, v, documents_bS=ids)
    o.backward(g)
    want = (o.detach(), q.grad, k.grad, v.grad)
    for rank, results in enumerate(two["attention"]):
        for mode, *got in results:
            mine = token_indices(16, 2, 2 if mode == "ulysses" else 1)[rank]
            for x, y in zip(got, want):
                torch.testing.assert_close(x, y[:, :, mine], rtol=1e-10, atol=1e-10)
