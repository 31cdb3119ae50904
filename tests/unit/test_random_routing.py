"""GShard's random routing (model/random_routing.py): the draws, the rule for the second expert, the MoE
layer that applies it, and the config rules. Layouts against one process: tests/ranks/test_expert.py."""
import pytest
import torch

from fivefold.config import ConfigError, ModelConfig
from fivefold.model.moe import MoE, route
from fivefold.model.random_routing import second_sent, skip_seconds, token_keys, uniform


def test_keys_are_each_tokens_place_in_the_steps_global_batch():
    keys = token_keys(step=3, global_batch=8, first_row=2, rows=2, seq_len=5)
    assert keys.shape == (2, 5) and keys.dtype == torch.int64
    assert keys[0, 0].item() == (3 * 8 + 2) * 5 and keys[1, 4].item() == (3 * 8 + 3) * 5 + 4
    whole = token_keys(3, 8, 0, 8, 5)
    assert torch.equal(whole[2:4], keys)   # a rank's rows are the whole batch's rows
    assert torch.unique(torch.cat([token_keys(s, 8, 0, 8, 5).flatten() for s in range(4)])).numel() == 4 * 8 * 5


def test_draws_are_uniform_reproducible_and_differ_by_layer_and_seed():
    keys = torch.arange(200_000, dtype=torch.int64)
    u = uniform(keys, seed=1234, layer=0)
    assert u.dtype == torch.float64 and 0 <= u.min().item() and u.max().item() < 1
    counts = torch.histc(u, bins=20, min=0, max=1)
    assert (counts / 10_000 - 1).abs().max().item() < 0.03   # each bin within 3% of 1/20 (the sd is 1%)
    assert torch.equal(u, uniform(keys.clone(), 1234, 0))
    other_layer, other_seed = uniform(keys, 1234, 1), uniform(keys, 1235, 0)
    for v in (other_layer, other_seed):
        assert torch.corrcoef(torch.stack([u, v]))[0, 1].abs().item() < 0.01
        assert (u == v).float().mean().item() < 1e-4
    big = keys + (7 << 40)   # later steps of a large run: the high bits count too
    assert torch.corrcoef(torch.stack([u, uniform(big, 1234, 0)]))[0, 1].abs().item() < 0.01
    assert torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1].abs().item() < 0.01   # neighbours


@pytest.mark.parametrize("g2", [0.05, 0.2, 0.35, 0.5])
def test_the_second_expert_is_sent_with_probability_twice_its_share(g2):
    """GShard Algorithm 1: dispatch to the second expert when 2·g2 > u, g2 = w2 / (w1 + w2)."""
    n = 100_000
    weights_tk = torch.tensor([[1 - g2, g2]]).expand(n, 2) * 0.8   # unnormalised weights: the share counts
    sent = second_sent(weights_tk, uniform(torch.arange(n), 7, 3))
    assert sent.float().mean().item() == pytest.approx(min(1.0, 2 * g2), abs=0.005)


def test_a_skipped_second_choice_is_expert_minus_one_with_weight_zero():
    experts_tk = torch.tensor([[2, 0], [1, 3], [0, 1]])
    weights_tk = torch.tensor([[0.9, 0.1], [0.5, 0.5], [0.6, 0.4]], requires_grad=True)
    u_t = torch.tensor([0.5, 0.99, 0.7])   # 2·g2 = 0.2, 1.0, 0.8
    e, w = skip_seconds(experts_tk, weights_tk, u_t)
    assert e.tolist() == [[2, -1], [1, 3], [0, 1]]
    torch.testing.assert_close(w.detach(), torch.tensor([[0.9, 0.0], [0.5, 0.5], [0.6, 0.4]]))
    w.sum().backward()
    assert weights_tk.grad.tolist() == [[1, 0], [1, 1], [1, 1]]


def moe_layer(**fields) -> MoE:
    cfg = ModelConfig(hidden=16, experts=4, top_k=2, moe_ffn=8, random_routing=True, aux_loss_coef=0.0, **fields)
    torch.manual_seed(0)
    moe = MoE(cfg, layer=1)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.5)
    return moe


@pytest.mark.parametrize("capacity_factor", [0.0, 0.5])
def test_the_layer_equals_its_reference_and_capacity_counts_only_what_is_sent(capacity_factor):
    moe = moe_layer(capacity_factor=capacity_factor)
    moe.configure(seed=99)
    b, s, h = 2, 24, 16
    x_bsh = torch.randn(b, s, h)
    keys_bs = token_keys(5, 4, 1, b, s)
    y = moe(x_bsh, keys_bs)
    # the reference, by hand: route, draw, then capacity in (token, k-slot) order over what was sent
    logits = x_bsh.reshape(-1, h) @ moe.router.weight.T
    experts_tk, weights_tk, _ = route(logits, "softmax_topk_norm", 2)
    sent_t = second_sent(weights_tk, uniform(keys_bs.reshape(-1), 99, 1))
    assert 0 < (~sent_t).sum() < b * s   # some seconds skipped, not all
    load = {}
    want = torch.zeros(b * s, h)
    for t in range(b * s):
        if t % s == 0:
            load = {}
        for k in range(2):
            if k == 1 and not sent_t[t]:
                continue
            e = experts_tk[t, k].item()
            load[e] = load.get(e, 0) + 1
            if capacity_factor and load[e] > moe.capacity(s):
                continue
            g = moe.experts
            xe = x_bsh.reshape(-1, h)[t]
            out = g.w_down[e] @ (torch.nn.functional.silu(g.w_gate[e] @ xe) * (g.w_up[e] @ xe))
            want[t] += weights_tk[t, k] * out
    torch.testing.assert_close(y.reshape(-1, h), want, rtol=1e-5, atol=1e-6)
    sent = b * s + sent_t.sum().item()
    stats = moe.last_stats
    assert stats["tokens_per_expert"].sum().item() + stats["dropped"].item() == sent   # skips are not drops
    assert (stats["dropped"].item() > 0) == bool(capacity_factor)
    if capacity_factor:   # a skipped second choice takes no place in its expert's queue: fewer drops
        dropped = stats["dropped"].item()
        moe(x_bsh)
        assert moe.last_stats["dropped"].item() > dropped


def test_without_keys_both_experts_are_used():
    """Evaluation and generation pass no keys: the router's two choices, as without random routing."""
    moe = moe_layer()
    plain = MoE(ModelConfig(hidden=16, experts=4, top_k=2, moe_ffn=8, aux_loss_coef=0.0))
    plain.load_state_dict(moe.state_dict())
    x_bsh = torch.randn(2, 8, 16)
    torch.testing.assert_close(moe(x_bsh), plain(x_bsh))
    assert moe.last_stats["tokens_per_expert"].sum().item() == 2 * 8 * 2


def test_expected_load_is_one_plus_twice_the_mean_second_share():
    moe = moe_layer()
    x_bsh = torch.randn(16, 64, 16)
    keys_bs = token_keys(0, 16, 0, 16, 64)
    moe(x_bsh, keys_bs)
    _, weights_tk, _ = route(x_bsh.reshape(-1, 16) @ moe.router.weight.T, "softmax_topk_norm", 2)
    expected = (1 + 2 * weights_tk[:, 1]).sum().item()
    got = moe.last_stats["tokens_per_expert"].sum().item()
    assert got == pytest.approx(expected, rel=0.03)   # 1,024 tokens: the sd of the count is ~1%
    assert got < 2 * 16 * 64


@pytest.mark.parametrize("fields, words", [
    (dict(top_k=1), "top_k = 2"),
    (dict(top_k=3), "top_k = 2"),
    (dict(router="sigmoid_bias"), "softmax router"),
])
def test_random_routing_needs_top2_softmax_gating(fields, words):
    with pytest.raises(ConfigError, match=words):
        ModelConfig(experts=4, moe_ffn=8, random_routing=True, **fields).validate()
    ModelConfig(experts=4, moe_ffn=8, random_routing=True, router="softmax_topk").validate()
