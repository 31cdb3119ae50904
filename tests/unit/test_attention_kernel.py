"""Grouped-query attention: which kernels are given the kv heads as they are (so the backward saves only
them, as the planner counts), and the result equals repeating the heads first."""
import torch
import torch.nn.functional as F

from fivefold.model.attention import FLASH_MAX_HEAD_DIM, attention_core, kernel_reads_kv_heads


def test_only_cuda_flash_and_the_cpu_read_the_kv_heads_themselves():
    assert kernel_reads_kv_heads("cpu", torch.float32, 64, masked=True)
    assert kernel_reads_kv_heads("cuda", torch.bfloat16, 128, masked=False)
    assert kernel_reads_kv_heads("cuda", torch.bfloat16, FLASH_MAX_HEAD_DIM, masked=False)
    assert not kernel_reads_kv_heads("cuda", torch.bfloat16, FLASH_MAX_HEAD_DIM + 64, masked=False)
    assert not kernel_reads_kv_heads("cuda", torch.bfloat16, 128, masked=True)     # a mask: no flash
    assert not kernel_reads_kv_heads("cuda", torch.float32, 128, masked=False)     # memory-efficient kernel
    assert not kernel_reads_kv_heads("cuda", torch.float16, 128, masked=False)     # may lack flash (V100)


def test_grouped_heads_equal_the_repeated_heads_and_their_gradients():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 16, 32, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 16, 32, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 16, 32, generator=g, dtype=torch.float64, requires_grad=True)
    out = attention_core(q, k, v)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1), is_causal=True)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    grads_ref = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
