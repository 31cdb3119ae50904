"""Context parallelism (Ulysses, ring, hybrid) reproduces the single-process run, alone and composed with
tensor (+ SP), pipeline, data parallelism and ZeRO; its attention equals full attention; its ledger is the
formula; it divides activation memory.

Three spawns (2, 4, 8 ranks; the 4-rank one is conftest.py's, shared with test_documents.py) run every
multi-rank case; tests check their results
against single-process references computed here. The ring kernel's own tests: test_ring_attention.py.
"""
from math import lcm

import pytest
import torch

from fivefold.comm import CommLedger, volume
from fivefold.config import Config, ConfigError, ParallelConfig
from fivefold.mesh import ParallelMesh
from fivefold.model.attention import attention_core
from fivefold.parallel.context import ContextAttention, token_indices
from fivefold.train.trainer import Trainer

from tests.support.spawn import spawn_jobs
from tests.support.tiny import TOL, assert_states_close, tiny_config
from tests.support.reference import reference, run_steps

# name -> (world, parallel degrees[, model fields]); tiny model: 4 heads, 2 KV heads, seq 32, 2 layers.
# pp cases cover every schedule kind: 1f1b (8 ranks), zb's split backward, interleaving.
CASES = {
    "ulysses_cp2": (2, dict(cp=2, cp_mode="ulysses", microbatches=2)),
    "ring_cp2": (2, dict(cp=2, cp_mode="ring")),
    "ulysses_cp4_kv_repeated": (4, dict(cp=4, cp_mode="ulysses")),          # 2 KV heads repeated to 4
    "ring_cp4": (4, dict(cp=4, cp_mode="ring", microbatches=2)),
    "hybrid_2x2": (4, dict(cp=4, cp_mode="hybrid", ulysses=2)),
    "ring_cp2_dp2_zero3": (4, dict(cp=2, dp=2, zero=3, cp_mode="ring")),
    "ulysses_cp2_pp2_zb": (4, dict(cp=2, pp=2, cp_mode="ulysses", schedule="zb", microbatches=2)),
    "ring_cp2_pp2_interleaved_zero2": (4, dict(cp=2, pp=2, zero=2, cp_mode="ring", schedule="interleaved", vpp=2,
                                               microbatches=2), dict(layers=4)),
    "ulysses_cp2_tp2_sp_dp2": (8, dict(cp=2, tp=2, dp=2, sp_mode="megatron", cp_mode="ulysses")),
    "ring_cp2_pp2_dp2_zero1": (8, dict(cp=2, pp=2, dp=2, zero=1, cp_mode="ring", microbatches=2)),
}


def case_config(name: str) -> Config:
    c = tiny_config(**CASES[name][1])
    for k, v in (CASES[name][2] if len(CASES[name]) > 2 else {}).items():
        setattr(c.model, k, v)
    return c


# -- attention alone ---------------------------------------------------------------------------------

ATTENTION = [  # (mode, cp, ulysses, kv heads, causal, dtype)
    ("ulysses", 2, 2, 2, True, torch.float64), ("ulysses", 2, 2, 1, True, torch.float64),
    ("ulysses", 2, 2, 2, False, torch.float64), ("ulysses", 2, 2, 4, True, torch.float32),
    ("ulysses", 4, 4, 2, True, torch.float64), ("hybrid", 4, 2, 2, True, torch.float64),
    ("hybrid", 4, 2, 1, False, torch.float64), ("hybrid", 4, 2, 2, True, torch.float32),
]


def full_inputs(kv: int, dtype, seq: int = 16):
    gen = torch.Generator().manual_seed(kv * 7 + seq)
    make = lambda heads: torch.randn(2, heads, seq, 8, generator=gen, dtype=torch.float64).to(dtype)  # noqa: E731
    return make(4), make(kv), make(kv), make(4)   # q, k, v, upstream gradient of the output


def attention_alone(rank, world, cases):
    """Each case: this rank's slice of q, k, v through ContextAttention, backward with the slice of one
    upstream gradient; returns (output, dq, dk, dv) for this rank's tokens."""
    out = []
    for mode, cp, u, kv, causal, dtype in cases:
        if cp != world:
            continue
        mesh = ParallelMesh(ParallelConfig(cp=cp, cp_mode=mode, ulysses=u), rank, CommLedger(rank, world), ulysses=u)
        idx = token_indices(16, cp, u)
        core = ContextAttention(mesh["cp_ulysses"], mesh["cp_ring"], idx.numpy().reshape(cp // u, -1), causal)
        q, k, v, g = full_inputs(kv, dtype)
        mine = idx[mesh.coords["cp"]]
        q, k, v = (t[:, :, mine].clone().requires_grad_() for t in (q, k, v))
        o = core(q, k, v)
        o.backward(g[:, :, mine])
        out.append((o.detach(), q.grad, k.grad, v.grad))
    return out


def attention_reference(kv: int, causal: bool, dtype):
    q, k, v, g = (t.double().requires_grad_() for t in full_inputs(kv, dtype))
    o = attention_core(q, k, v, causal)
    o.backward(g.detach())
    return o.detach(), q.grad, k.grad, v.grad


def check_attention(results_by_rank, world):
    cases = [c for c in ATTENTION if c[1] == world]
    for rank, results in enumerate(results_by_rank):
        for (mode, cp, u, kv, causal, dtype), got in zip(cases, results):
            mine = token_indices(16, cp, u)[rank]
            want = attention_reference(kv, causal, dtype)
            tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
            for g_, w_ in zip(got, want):
                torch.testing.assert_close(g_.double(), w_[:, :, mine], **tol)


# -- what each spawn runs --------------------------------------------------------------------------

def activation_peak(rank, world, cp, seq):
    c = tiny_config(cp=cp, cp_mode="ring") if cp > 1 else tiny_config()
    c.train.seq_len = c.model.max_seq = seq
    c.train.global_batch = 2
    tr = Trainer(c, rank, world, quiet=True)
    tr.step(0)
    return tr.activations.peak


def spawn(world, extra=()):
    """The spawn of `world` ranks: this file's cases of that size (4 ranks: also the activation memory
    case), plus `extra` jobs."""
    jobs = [(n, run_steps, (case_config(n).to_dict(),)) for n, case in CASES.items() if case[0] == world]
    jobs.append(("attention", attention_alone, (ATTENTION,)))
    if world == 4:
        jobs.append(("memory", activation_peak, (4, 2048)))
    return spawn_jobs(world, jobs + list(extra))


@pytest.fixture(scope="module")
def two():
    return spawn(2)


@pytest.fixture(scope="module")
def four(context_four):
    return context_four   # conftest.py: this file's 4-rank spawn, shared with test_documents.py


@pytest.fixture(scope="module")
def eight():
    return spawn(8)


def results_of(name, two, four, eight):
    return {2: two, 4: four, 8: eight}[CASES[name][0]][name]


# -- training equals one process ---------------------------------------------------------------------

@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.ranks
def test_training_equals_single_process(name, two, four, eight):
    c = case_config(name)
    one = tiny_config(microbatches=c.parallel.microbatches * c.parallel.dp)
    one.model = c.model
    ref = reference(one)
    for r in results_of(name, two, four, eight):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(r["grad_norms"]), torch.tensor(ref["grad_norms"]), rtol=1e-5, atol=0)
        assert_states_close(r["state"], ref["state"], **TOL["fp32"])


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.ranks
def test_attention_alone_equals_full_attention(world, two, four):
    check_attention({2: two, 4: four}[world]["attention"], world)


# -- bytes -------------------------------------------------------------------------------------------

def expected_cp(c: Config) -> dict:
    """Per rank per step, (calls, message bytes, bytes sent) per op under dim "cp"."""
    from fivefold.rules import cp_degrees

    p, m, t = c.parallel, c.model, c.train
    u, r = cp_degrees(p.cp_mode, p.cp, m.heads, p.tp, p.ulysses)
    b, s, d, e = t.global_batch // (p.dp * p.microbatches), t.seq_len // p.cp, m.head_dim, 4
    layers, mbs = m.layers // p.pp, p.microbatches
    heads, kv = m.heads // p.tp, max(m.kv_heads // p.tp, 1)
    kv_u = lcm(kv, u) if u > 1 else kv                     # K/V heads after Ulysses' repeat
    out = {}
    if u > 1:   # q, k, v, o forward and their gradients backward
        msgs = [b * heads * s * d * e, b * kv_u * s * d * e, b * kv_u * s * d * e, b * heads * s * d * e]
        calls = 2 * len(msgs) * layers * mbs
        out["all_to_all"] = (calls, 2 * sum(msgs) * layers * mbs,
                             2 * sum(volume.all_to_all(x, u) for x in msgs) * layers * mbs)
    if r > 1:   # packed K,V of a ring rank's share (u·s tokens, kv_u/u heads): r-1 forward, 2(r-1) backward
        kv_msg = 2 * b * (kv_u // u) * (s * u) * d * e
        sends = 3 * (r - 1) * layers * mbs
        out["send"] = (sends, sends * kv_msg, sends * volume.send(kv_msg))
        out["recv"] = (sends, sends * kv_msg, 0.0)
    return out


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.ranks
def test_cp_bytes_match_the_formula(name, two, four, eight):
    c = case_config(name)
    want = expected_cp(c)
    for r in results_of(name, two, four, eight):
        for rows in r["ledger"]:
            got = {x["op"]: (x["calls"], x["message_bytes"], x["bytes_sent"]) for x in rows if x["dim"] == "cp"}
            assert got == want, (got, want)


# -- memory ------------------------------------------------------------------------------------------

@pytest.mark.ranks
def test_activation_memory_falls_with_cp(four):
    """Counted activation bytes (saved for backward) per rank at cp = 4 are at most 0.3× those of one
    process on the same 2048-token sequences."""
    one = activation_peak(0, 1, 1, 2048)
    for peak in four["memory"]:
        assert 0 < peak <= 0.3 * one, (peak, one)


# -- rules ---------------------------------------------------------------------------------------------

def test_context_parallel_rules():
    c = tiny_config(cp=3, cp_mode="ulysses")
    with pytest.raises(ConfigError, match="heads/tp = 4/1 = 4 must divide by cp"):
        c.validate(3)
    c = tiny_config(cp=4, cp_mode="ring")
    c.train.seq_len = 36
    with pytest.raises(ConfigError, match=r"seq_len \(36\) must divide by 2\*cp = 8; valid seq_len: \[24, 32, 40\]"):
        c.validate(4)
    c = tiny_config(cp=4, cp_mode="hybrid", ulysses=3)
    with pytest.raises(ConfigError, match="valid ulysses"):
        c.validate(4)
    c = tiny_config(cp=2, cp_mode="ulysses")   # sequence parallelism combines with any cp mode
    c.parallel.tp, c.parallel.sp_mode = 2, "megatron"
    c.validate(4)


def test_token_layouts():
    assert token_indices(8, 2, 2).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]             # Ulysses: contiguous
    assert token_indices(8, 2, 1).tolist() == [[0, 1, 6, 7], [2, 3, 4, 5]]             # ring: zig-zag
    assert token_indices(16, 4, 2).tolist() == [[0, 1, 2, 3], [12, 13, 14, 15],          # hybrid: zig-zag
                                                [4, 5, 6, 7], [8, 9, 10, 11]]            # shares, split
