"""Latent attention (MLA, model/latent_attention.py) under every parallel layout reproduces the
single-process run: tensor parallel with and without sequence parallelism (with and without a q latent),
ring and Ulysses context parallelism (values narrower than queries and keys), a pipeline, expert
parallelism of an MoE model with MLA, ZeRO-3. All cases run on 2 ranks in one spawn; each test compares
losses, gradient norms and the full parameters after 3 steps with one process. The Hugging Face
comparison is in test_model_hf.py; the planner's rows and bytes in test_plan_runtime.py."""
import pytest
import torch

from fivefold.model import Transformer
from fivefold.model.attention import attention_core

from tests.support.spawn import spawn_jobs
from tests.support.tiny import assert_states_close, tiny_config
from tests.support.reference import reference, run_steps

MOE = dict(experts=4, top_k=2, moe_ffn=32, capacity_factor=1.0, router="sigmoid_bias", shared_experts=1,
           dense_layers=1, routed_scaling_factor=2.5)
# name -> (parallel degrees, model fields)
CASES = {
    "tp2": (dict(tp=2, microbatches=2), {}),
    "tp2_sp": (dict(tp=2, sp_mode="megatron", microbatches=2), {}),
    "tp2_no_q_lora": (dict(tp=2), dict(q_lora_rank=0)),
    "tp2_sp_no_q_lora": (dict(tp=2, sp_mode="megatron"), dict(q_lora_rank=0)),
    "cp2_ring": (dict(cp=2, cp_mode="ring"), {}),
    "cp2_ulysses": (dict(cp=2, cp_mode="ulysses", microbatches=2), {}),
    "pp2": (dict(pp=2, microbatches=2), {}),
    "dp2_zero3": (dict(dp=2, zero=3), {}),
    "ep2_moe": (dict(dp=2, ep=2), MOE),
}


# fp64 states after 3 Adam steps: one element whose gradient is ~0 moves by 3e-12 (3e-10 relative) of
# rounding, still 10^4 below fp32's outlier allowance; a wrong reduction would be off by far more
FP64_ADAM = dict(rtol=1e-8, atol=1e-10)


def case_config(name: str):
    """fp64: a layout then agrees with one process everywhere to FP64_ADAM, on any CPU. (In fp32, Adam turns
    the rounding of near-zero gradients into visible changes of a few elements, and how many depends on the
    machine's SIMD width: on an AVX-512 EPYC, tp2_sp and cp2_ring had 0.1002% of elements beyond
    rtol 1e-5 + atol 1e-6, just over FP32's 0.1% allowance, all within 1e-4.)"""
    parallel, model = CASES[name]
    c = tiny_config(mla=True, model=model, **parallel)
    c.train.dtype = "fp64"
    return c


@pytest.fixture(scope="module")
def two():
    return spawn_jobs(2, [(n, run_steps, (case_config(n).to_dict(),)) for n in CASES])


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.ranks
def test_mla_training_equals_single_process(name, two):
    c = case_config(name)
    one = tiny_config(microbatches=c.parallel.microbatches * c.parallel.dp)
    one.model, one.train.dtype = c.model, c.train.dtype
    ref = reference(one)
    assert ref["grad_norms"][0] > 0.5  # clipping (max norm 0.5) is active
    for r in two[name]:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=1e-10, atol=0)
        torch.testing.assert_close(torch.tensor(r["grad_norms"]), torch.tensor(ref["grad_norms"]), rtol=1e-10, atol=0)
        assert_states_close(r["state"], ref["state"], **FP64_ADAM)


@pytest.mark.parametrize("causal", [True, False])
def test_narrow_values_through_the_fused_kernel_equal_the_math_attention(causal):
    """v of another head dim than q, k (the CPU fused kernel takes one): values and gradients equal
    softmax(q kᵀ / sqrt(d)) v computed directly (fp64)."""
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 4, 10, 16, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 4, 10, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    o = attention_core(q, k, v, causal=causal)
    scores = q @ k.transpose(-1, -2) / 16 ** 0.5
    if causal:
        scores = scores.masked_fill(~torch.ones(10, 10, dtype=torch.bool).tril(), float("-inf"))
    want = scores.softmax(-1) @ v
    torch.testing.assert_close(o, want, rtol=1e-10, atol=1e-12)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(o, (q, k, v), do)
    for a, b in zip(got, torch.autograd.grad(want, (q, k, v), do)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_mla_parameters_counted_and_seeded_init_covers_them():
    """num_params counts the latent projections and norms; the seeded init gives the latent norms ones,
    matrices N(0, std), and wo the output projections' smaller std."""
    for q_lora in (24, 0):
        cfg = tiny_config(mla=True).model
        cfg.q_lora_rank = q_lora
        m = Transformer(cfg, seed=3)
        assert cfg.num_params() == sum(p.numel() for p in m.parameters())
        attn = dict(m.layers[0].attn.named_parameters())
        assert torch.equal(attn["kv_norm.weight"], torch.ones(16))
        assert attn["kv_b.weight"].std() > 1.5 * attn["wo.weight"].std()
        if q_lora:
            assert torch.equal(attn["q_norm.weight"], torch.ones(24)) and attn["q_a.weight"].std() > 0.01
