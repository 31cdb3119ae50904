"""Tensor parallelism and Megatron sequence parallelism reproduce the single-process run and send the
bytes of the formulas.

The multi-rank cases run in two spawns (2 and 4 ranks, module fixtures); each test then checks one
property of their results against single-process references computed in this process.
"""
import pytest
import torch
import torch.nn.functional as F

from fivefold.comm import Group, volume
from fivefold.config import Config, ConfigError, ModelConfig
from fivefold.parallel import tensor
from fivefold.parallel.placement import Shard
from fivefold.parallel.tensor import VocabParallelCrossEntropy
from fivefold.shapes import padded_vocab
from fivefold.train import checkpoint
from fivefold.train.trainer import Trainer

from tests.support.spawn import ranks
from tests.support.tiny import TOL, assert_states_close, tiny_config
from tests.support.reference import reference, run_steps

MB = 2  # micro-batches in most cases: accumulation is on


def cfg(dtype="fp32", vocab=256, kv=2, tie=True, dropout=0.0, **parallel) -> Config:
    c = tiny_config(**parallel)
    c.model.vocab, c.model.kv_heads, c.model.tie_embeddings, c.model.dropout = vocab, kv, tie, dropout
    c.train.dtype = dtype
    return c


# name -> (world, config); the single-process reference is cfg(...) with the same model and dtype
CASES = {
    "tp2": (2, dict(tp=2, microbatches=MB)),
    "tp2_sp": (2, dict(tp=2, sp_mode="megatron", microbatches=MB)),
    "tp2_sp_untied_pad": (2, dict(tp=2, sp_mode="megatron", vocab=257, tie=False)),
    "tp2_sp_fp64": (2, dict(tp=2, sp_mode="megatron", microbatches=MB, dtype="fp64")),
    "tp4_kv_replicated": (4, dict(tp=4, microbatches=MB)),                    # tp % kv_heads == 0
    "tp4_kv_replicated_sp": (4, dict(tp=4, sp_mode="megatron")),
    "tp4_kv_split_sp_untied_pad": (4, dict(tp=4, kv=4, sp_mode="megatron", vocab=257, tie=False)),
    "tp2_dp2": (4, dict(tp=2, dp=2, microbatches=MB)),
    "tp2_dp2_zero1": (4, dict(tp=2, dp=2, zero=1, microbatches=MB, bucket_mb=0.05)),
    "tp2_dp2_zero2_sp": (4, dict(tp=2, dp=2, zero=2, sp_mode="megatron", microbatches=MB, bucket_mb=0.05)),
    "tp2_dp2_zero3": (4, dict(tp=2, dp=2, zero=3, microbatches=MB)),
    "tp2_dp2_zero3_sp_fp64": (4, dict(tp=2, dp=2, zero=3, sp_mode="megatron", dtype="fp64")),
}
MODEL_KEYS = ("dtype", "vocab", "kv", "tie", "dropout")


def case_config(name: str) -> Config:
    return cfg(**CASES[name][1])


def reference_config(name: str) -> Config:
    return cfg(**{k: v for k, v in CASES[name][1].items() if k in MODEL_KEYS})


# -- what each rank runs -------------------------------------------------------------------------

def dropout_probe(rank, world, cfg_dict):
    """Masks drawn by the model's dropout, the residual stream after block 0, and the local norm
    weights after 2 steps (replicated over tp: they must stay equal on every tp rank)."""
    tr = Trainer(Config.from_dict(cfg_dict), rank, world, quiet=True)
    drop = tr.model.layers[0].drop
    masks = torch.stack([drop(torch.ones(64)) for _ in range(3)]) != 0
    acts = {}
    tr.model.layers[0].register_forward_hook(lambda m, i, o: acts.setdefault("x", o.detach().clone()))
    x_bs = tr.micro_batches(0)[0].tokens
    tr.model(x_bs)
    tr.step(0)
    tr.step(1)
    norms = torch.cat([p.detach().reshape(-1) for n, p in tr.model.named_parameters() if "norm" in n])
    return {"coords": dict(tr.mesh.coords), "masks": masks, "block0": acts["x"], "norms": norms}


def checkpoint_and_resume(rank, world, cfg_dict, out):
    """run() writes a full checkpoint; a fresh trainer loading the state after 2 steps continues
    exactly as the uninterrupted run."""
    c = Config.from_dict(cfg_dict)
    c.train.checkpoint = True
    whole = Trainer(c, rank, world, quiet=True).run(out)["history"]
    first = Trainer(Config.from_dict(cfg_dict), rank, world, quiet=True)
    first.step(0)
    first.step(1)
    state = first.full_state()
    second = Trainer(Config.from_dict(cfg_dict), rank, world, quiet=True)
    second.load_full_state(state)
    resumed = second.step(2)["loss"]
    local_params = sum(p.numel() for p in second.params)
    return {"whole": [m["loss"] for m in whole], "resumed": resumed, "local_params": local_params,
            "state_bytes": second.model_state_bytes()}


def run_jobs(rank, world, jobs):
    out = []
    for kind, args in jobs:
        fn = {"steps": run_steps, "dropout": dropout_probe, "checkpoint": checkpoint_and_resume}[kind]
        out.append(fn(rank, world, *args))
    return out


def spawn(world, extra_jobs=()):
    names = [n for n, (w, _) in CASES.items() if w == world]
    jobs = [("steps", (case_config(n).to_dict(),)) for n in names] + list(extra_jobs)
    per_rank = ranks(run_jobs, world, jobs)
    results = {n: [r[i] for r in per_rank] for i, n in enumerate(names)}
    extras = [[r[i] for r in per_rank] for i in range(len(names), len(jobs))]
    return results, extras


DROPOUT = [cfg(dropout=0.1, tp=2, dp=2).to_dict(), cfg(dropout=0.1, tp=2, dp=2, sp_mode="megatron").to_dict()]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp2ck")
    ck_cfg = cfg(tp=2, sp_mode="megatron", vocab=257, tie=False).to_dict()
    results, (ck,) = spawn(2, [("checkpoint", (ck_cfg, str(out)))])
    return results, ck, out


@pytest.fixture(scope="module")
def four():
    results, dropout = spawn(4, [("dropout", (d,)) for d in DROPOUT])
    return results, dropout


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(name):
        key = tuple(sorted((k, v) for k, v in CASES[name][1].items() if k in MODEL_KEYS))
        if key not in cache:
            cache[key] = reference(reference_config(name))
        return cache[key]
    return get


# -- equivalence -----------------------------------------------------------------------------------

def check_equal(name, results, references):
    ref = references(name)
    dtype = CASES[name][1].get("dtype", "fp32")
    rtol = 1e-5 if dtype == "fp32" else 1e-12
    assert ref["grad_norms"][0] > 0.5  # clipping (max norm 0.5) is active
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=rtol, atol=0,
                                   msg=lambda m: f"{name} losses: {m}")
        torch.testing.assert_close(torch.tensor(r["grad_norms"]), torch.tensor(ref["grad_norms"]), rtol=rtol,
                                   atol=0, msg=lambda m: f"{name} grad norms: {m}")
        assert_states_close(r["state"], ref["state"], **TOL[dtype])


@pytest.mark.parametrize("name", [n for n, (w, _) in CASES.items() if w == 2])
@pytest.mark.ranks
def test_two_ranks_equal_single_process(name, two, references):
    """tp=2 with and without SP, accumulation, clipping, untied embeddings with a padded vocab (257),
    fp64 to 1e-10 everywhere: full parameters after 3 steps, losses and grad norms per step."""
    check_equal(name, two[0][name], references)


@pytest.mark.parametrize("name", [n for n, (w, _) in CASES.items() if w == 4])
@pytest.mark.ranks
def test_four_ranks_equal_single_process(name, four, references):
    """tp=4 with K/V replicated (kv_heads=2) and split (kv_heads=4), with SP and vocab padding (257 ->
    260); tp2 x dp2 with plain DP and ZeRO-1, 2 (with SP) and 3 (with SP in fp64)."""
    check_equal(name, four[0][name], references)


# -- communication ---------------------------------------------------------------------------------

def tp_rows(rows):
    return {x["op"]: x for x in rows if x["dim"] == "tp"}


def expected_tp_bytes(c: Config) -> dict[str, float]:
    """Per rank per step, from comm/volume.py. Per layer and micro-batch: TP 2 all-reduces of b·s·h
    forward (g after wo and down) and 2 backward (f before wq/wk/wv and gate/up); plus the embedding
    (g forward) and the LM head input (f backward). SP: each all-reduce becomes an all-gather and a
    reduce-scatter. Loss: all-reduce of the max (b·s) and of sum-exp and target logit (2·b·s), fp32.
    Once per step: SP sums the norm weights' partial gradients; K/V replicated over n/kv ranks sum theirs."""
    m, p, t = c.model, c.parallel, c.train
    n, w = p.tp, 8 if t.dtype == "fp64" else 4
    b = t.global_batch // p.dp // p.microbatches
    act = b * t.seq_len * m.hidden * w
    stat = b * t.seq_len * w
    per_mb = 4 * m.layers + 2
    out = {"all_reduce": p.microbatches * (volume.all_reduce(stat, n) + volume.all_reduce(2 * stat, n))}
    if p.sp_mode == "megatron":
        out["all_gather"] = p.microbatches * per_mb * volume.all_gather(act, n)
        out["reduce_scatter"] = p.microbatches * per_mb * volume.bytes_sent("reduce_scatter", act, n, "gloo")
        out["all_reduce"] += volume.all_reduce((2 * m.layers + 1) * m.hidden * w, n)
    else:
        out["all_reduce"] += p.microbatches * per_mb * volume.all_reduce(act, n)
    if n > m.kv_heads:
        kv_elems = 2 * m.layers * m.head_dim * m.hidden  # wk and wv: one head per rank
        out["all_reduce"] += volume.all_reduce(kv_elems * w, n // m.kv_heads)
    return out


@pytest.mark.parametrize("name", ["tp2", "tp2_sp", "tp2_sp_fp64", "tp4_kv_replicated", "tp4_kv_replicated_sp",
                                  "tp2_dp2_zero3"])
@pytest.mark.ranks
def test_ledger_tp_bytes_match_the_formula(name, two, four):
    results = (two[0] if CASES[name][0] == 2 else four[0])[name]
    expect = expected_tp_bytes(case_config(name))
    for r in results:
        for rows in r["ledger"]:
            got = tp_rows(rows)
            assert {op: x["bytes_sent"] for op, x in got.items()} == expect, name


@pytest.mark.ranks
def test_sp_sends_the_bytes_of_tp(two):
    """Activations: SP's all-gathers plus reduce-scatters send exactly TP's all-reduce bytes, with a ring
    reduce-scatter (NCCL's) and with fivefold's pairwise one on gloo (comm/ops.py; gloo's own, a whole
    all-reduce, would send 1.5x). SP's remaining all-reduces are the loss statistics and, once per step,
    the norm weights' gradients."""
    tp, sp = tp_rows(two[0]["tp2"][0]["ledger"][0]), tp_rows(two[0]["tp2_sp"][0]["ledger"][0])
    c = case_config("tp2")
    tokens = c.train.global_batch // c.parallel.microbatches * c.train.seq_len
    loss = c.parallel.microbatches * (volume.all_reduce(4 * tokens, 2) + volume.all_reduce(8 * tokens, 2))
    norm_sync = volume.all_reduce((2 * c.model.layers + 1) * c.model.hidden * 4, 2)
    act_tp = tp["all_reduce"]["bytes_sent"] - loss
    assert sp["all_gather"]["bytes_sent"] + sp["reduce_scatter"]["bytes_sent"] == act_tp > 0
    assert sp["all_gather"]["bytes_sent"] == sp["reduce_scatter"]["bytes_sent"]
    assert sp["all_reduce"]["bytes_sent"] == loss + norm_sync
    assert tp["all_reduce"]["calls"] == c.parallel.microbatches * (4 * c.model.layers + 2 + 2)


@pytest.mark.ranks
def test_state_bytes_are_counted_from_the_shards(two, four):
    """run.json's model-state bytes come from the tensors a rank holds: the shards."""
    for name in ("tp2", "tp4_kv_split_sp_untied_pad"):
        results = (two[0] if CASES[name][0] == 2 else four[0])[name]
        phi = results[0]["params"]
        for r in results:
            assert r["state_bytes"]["params"] < 4 * phi * 0.6
    ck = two[1]
    c = cfg(tp=2, sp_mode="megatron", vocab=257, tie=False)
    phi = c.model.num_params()
    # every rank holds half of each split matrix, a padded half of the vocab rows, and every norm
    norms = (2 * c.model.layers + 1) * c.model.hidden
    split = phi - norms - 2 * 257 * 64
    for r in ck:
        assert r["local_params"] == split // 2 + norms + 2 * (padded_vocab(257, 2) // 2) * 64
        assert r["state_bytes"]["params"] == 4 * r["local_params"]


# -- checkpoints -----------------------------------------------------------------------------------

@pytest.mark.ranks
def test_checkpoint_is_full_and_resume_is_exact(two):
    _, ck, out = two
    for r in ck:
        assert r["resumed"] == pytest.approx(r["whole"][2], rel=1e-12, abs=0)
    model = checkpoint.to_model(out)  # full single-process names and shapes, from the tp pieces
    assert model.embed.weight.shape == (257, 64) and model.head.weight.shape == (257, 64)
    assert model.layers[0].attn.wk.weight.shape == (2 * 16, 64)


# -- dropout streams ---------------------------------------------------------------------------------

@pytest.mark.ranks
def test_dropout_masks_agree_where_replicated_and_differ_where_sharded(four):
    """tp2 x dp2 with dropout 0.1. Without SP the residual stream is replicated over tp: both tp ranks
    draw the same masks, so the stream stays identical on them, and the replicated norm weights stay
    equal after training. With SP each tp rank holds other tokens and draws other masks. Data-parallel
    ranks always draw different masks."""
    for sp, probes in zip((False, True), four[1]):
        by = {(p["coords"]["dp"], p["coords"]["tp"]): p for p in probes}
        for dp in (0, 1):
            a, b = by[(dp, 0)], by[(dp, 1)]
            assert torch.equal(a["masks"], b["masks"]) != sp
            torch.testing.assert_close(a["norms"], b["norms"], rtol=0, atol=0)
            if not sp:
                torch.testing.assert_close(a["block0"], b["block0"], rtol=0, atol=0)
        assert not torch.equal(by[(0, 0)]["masks"], by[(1, 0)]["masks"])
        assert 0.8 < by[(0, 0)]["masks"].float().mean() < 1.0


def test_dropout_generator_streams():
    coords = lambda tp, dp: {"tp": tp, "dp": dp, "cp": 0, "pp": 0}  # noqa: E731
    draw = lambda g: torch.rand(8, generator=g)  # noqa: E731
    g = lambda tp, dp, sp: draw(tensor.dropout_generator(7, coords(tp, dp), sp))  # noqa: E731
    assert torch.equal(g(0, 0, False), g(1, 0, False))
    assert not torch.equal(g(0, 0, True), g(1, 0, True))
    assert not torch.equal(g(0, 0, False), g(0, 1, False))


def _sequence_orders(rank, world):
    """The SP collectives in sequence order and in rank-major order (comm/autograd.py), forward and
    backward, on (b=3, s/n=2, h=4) shards: the same values, the rank-major ones with no layout copy."""
    from fivefold.comm.autograd import gather_sequence, rank_major, reduce_scatter_sequence
    from fivefold.config import ParallelConfig
    from fivefold.mesh import ParallelMesh

    g = ParallelMesh(ParallelConfig(tp=world), rank)["tp"]
    gen = torch.Generator().manual_seed(rank)
    shard = torch.randn(3, 2, 4, generator=gen, dtype=torch.float64)
    weight_bsh = torch.randn(3, 2 * world, 4, generator=gen, dtype=torch.float64)
    out = {}
    for ordered in (True, False):
        x = shard.clone().requires_grad_()
        full = gather_sequence(x, g, ordered=ordered)
        w = weight_bsh if ordered else rank_major(weight_bsh, world)
        y = reduce_scatter_sequence(full * w, g, ordered=ordered)   # token-wise work between the two
        y.square().sum().backward()
        out[ordered] = (full.detach(), y.detach(), x.grad)
    return out


@pytest.mark.ranks
def test_rank_major_sequence_collectives_equal_the_ordered_ones():
    from fivefold.comm.autograd import rank_major

    for out in ranks(_sequence_orders, 2):
        full, y, grad = out[True]
        full_rm, y_rm, grad_rm = out[False]
        assert full.shape == (3, 4, 4) and full_rm.shape == (6, 2, 4)
        assert torch.equal(rank_major(full, 2), full_rm)
        assert torch.equal(y, y_rm) and torch.equal(grad, grad_rm)


def test_rank_major_puts_each_ranks_tokens_in_one_block():
    from fivefold.comm.autograd import rank_major

    x = torch.arange(2 * 6 * 1).view(2, 6, 1)   # b=2, s=6: rank r of 3 holds tokens 2r, 2r+1 of each row
    got = rank_major(x, 3)
    assert got.shape == (6, 2, 1)
    assert got[:, :, 0].tolist() == [[0, 1], [6, 7], [2, 3], [8, 9], [4, 5], [10, 11]]
    with pytest.raises(ValueError, match="must divide by the tensor-parallel size 4"):
        rank_major(x, 4)


# -- single-process units ------------------------------------------------------------------------------

def test_padded_logits_never_win_or_carry_loss():
    """Padding columns with huge logits change neither the loss nor get any gradient."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    targets = torch.tensor([0, 4, 2, 1, 3, 4])
    padded = torch.cat([logits, torch.full((6, 3), 1e4, dtype=torch.float64)], dim=1).requires_grad_()
    loss = VocabParallelCrossEntropy.apply(padded, targets, Group.single("tp"), 0, 5)
    torch.testing.assert_close(loss, F.cross_entropy(logits, targets, reduction="none"))
    loss.sum().backward()
    assert torch.equal(padded.grad[:, 5:], torch.zeros(6, 3, dtype=torch.float64))
    ref = logits.clone().requires_grad_()
    F.cross_entropy(ref, targets, reduction="sum").backward()
    torch.testing.assert_close(padded.grad[:, :5], ref.grad)


def test_shard_specs_split_and_reassemble():
    full = torch.arange(10 * 3.0).view(10, 3)
    n = 4
    vocab = Shard("tp", 0, 10)                    # padded to 12: pieces of 3, the last one holds 1 row + 2 zeros
    pieces = [vocab.piece(full, r, n) for r in range(n)]
    assert all(p.shape == (3, 3) for p in pieces) and torch.equal(pieces[3][1:], torch.zeros(2, 3))
    assert torch.equal(vocab.assemble(torch.stack(pieces)), full)
    kv = Shard("tp", 0, 4, replicas=2)            # 2 KV heads of 2 rows on 4 ranks: ranks 0,1 hold head 0
    kvfull = full[:4]
    pieces = [kv.piece(kvfull, r, n) for r in range(n)]
    assert torch.equal(pieces[0], pieces[1]) and torch.equal(pieces[2], kvfull[2:])
    assert torch.equal(kv.assemble(torch.stack(pieces)), kvfull)
    row = Shard("tp", 1, 3)
    assert torch.equal(row.assemble(torch.stack([row.piece(full, r, 3) for r in range(3)])), full)


def test_config_rules_for_tensor_parallel():
    c = Config(model=ModelConfig(hidden=96, heads=6, kv_heads=3, ffn=96))
    c.parallel.tp, c.parallel.dp = 2, 1
    with pytest.raises(ConfigError, match=r"valid tp: \[1, 3, 6\]"):
        c.validate(2)
    c = tiny_config(tp=4, sp_mode="megatron")
    c.train.seq_len = 30
    with pytest.raises(ConfigError, match="seq_len .* must divide by tp"):
        c.validate(4)
    c = tiny_config(tp=2)
    c.parallel.sp_mode = "ulysses"              # a context-parallel mode, not TP's sequence parallelism
    with pytest.raises(ConfigError, match="sp_mode must be one of none, megatron"):
        c.validate(2)
    c = tiny_config(tp=2, dp=2, ep=2, sp_mode="megatron")   # MoE capacity groups need whole sequences
    c.model.experts, c.model.capacity_factor = 4, 1.0
    with pytest.raises(ConfigError, match="MoE capacity mode needs whole sequences"):
        Trainer(c, 0, 4)
