"""The mixture-of-experts block (model/moe.py): each router against a direct computation, capacity drops,
group-limited routing, empty experts, the auxiliary losses by hand, gradients, per-sequence layout
invariance, the model structure and its parameter count, and the config rules."""
import math

import pytest
import torch
import torch.nn.functional as F

from fivefold.config import ConfigError, ModelConfig
from fivefold.model import Transformer
from fivefold.model.moe import Experts, LocalDispatch, MoE, limit_to_groups, load_balance_loss, route, within_capacity
from fivefold.model.layers import SwiGLU


def cfg_of(**kw) -> ModelConfig:
    base = dict(vocab=61, hidden=16, layers=2, heads=2, kv_heads=1, ffn=24, experts=4, top_k=2, moe_ffn=12)
    c = ModelConfig(**{**base, **kw})
    c.validate()
    return c


def moe_of(seed=0, **kw) -> MoE:
    torch.manual_seed(seed)
    m = MoE(cfg_of(**kw))
    with torch.no_grad():
        m.router.weight.normal_(0, 0.5)     # spread the router's choices
        if m.expert_bias is not None:
            m.expert_bias.normal_(0, 0.1)
    return m


def expert_ref(m: MoE, e: int, x_h: torch.Tensor) -> torch.Tensor:
    ex = m.experts
    return ex.w_down[e] @ (F.silu(ex.w_gate[e] @ x_h) * (ex.w_up[e] @ x_h))


def reference_moe(m: MoE, x_bsh: torch.Tensor, drop=None) -> torch.Tensor:
    """Token by token: router scores, top-k, weights, the experts' weighted sum, the (gated) shared expert.
    `drop`: set of (token, slot) assignments to skip."""
    b, s, h = x_bsh.shape
    out = []
    for t, x_h in enumerate(x_bsh.reshape(-1, h)):
        logits = m.router.weight @ x_h
        if m.kind == "sigmoid_bias":
            p = torch.sigmoid(logits)
            chosen = sorted(range(m.n_experts), key=lambda e: -(p[e] + m.expert_bias[e]).item())[:m.top_k]
        else:
            p = torch.softmax(logits, -1)
            chosen = sorted(range(m.n_experts), key=lambda e: -p[e].item())[:m.top_k]
        w = torch.stack([p[e] for e in chosen])
        if m.kind != "softmax_topk":
            w = w / w.sum()
        y = torch.zeros(h)
        for j, e in enumerate(chosen):
            if drop is None or (t, j) not in drop:
                y = y + w[j] * expert_ref(m, e, x_h)
        if m.shared is not None:
            sh = m.shared.down.weight @ (F.silu(m.shared.gate.weight @ x_h) * (m.shared.up.weight @ x_h))
            if m.shared_gate is not None:
                sh = torch.sigmoid(m.shared_gate.weight @ x_h) * sh
            y = y + sh
        out.append(y)
    return torch.stack(out).view(b, s, h)


@pytest.mark.parametrize("kw", [dict(router="softmax_topk_norm"), dict(router="softmax_topk"),
                                dict(router="sigmoid_bias"),
                                dict(router="softmax_topk", shared_experts=2, shared_expert_gate=True),
                                dict(router="softmax_topk_norm", shared_experts=1, top_k=1)])
def test_router_kinds_equal_direct_computation(kw):
    m = moe_of(**kw)
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(m(x), reference_moe(m, x), rtol=1e-5, atol=1e-6)
    experts_tk, weights_tk, *_ = m.route(x)
    assert experts_tk.dtype == torch.int64 and weights_tk.dtype == x.dtype
    if m.kind != "softmax_topk":
        torch.testing.assert_close(weights_tk.sum(-1), torch.ones(10))


def test_capacity_drops_exactly_the_later_tokens():
    """C = ceil(1.0 * 4 * 2 / 4) = 2 per expert per sequence; an expert keeps its first 2 tokens, whatever
    their k-slot (token 1's second choice of expert 0 beats token 2's first: token order, then slot)."""
    experts_bsk = torch.tensor([[[0, 1], [2, 0], [0, 1], [1, 0]],      # expert 0: tokens 0, 1 kept, 2, 3 dropped;
                                [[3, 2], [3, 2], [2, 3], [1, 0]]])     #   expert 1: tokens 0, 2 kept, 3 dropped
    keep = within_capacity(experts_bsk, 2, 4)                          # experts 2, 3: tokens 0, 1 kept; 2 dropped
    assert keep.tolist() == [[[True, True], [True, True], [False, True], [False, False]],
                             [[True, True], [True, True], [False, False], [True, True]]]
    # end to end: the module drops the same assignments the rule picks and the output skips them
    m = moe_of(capacity_factor=1.0)
    with torch.no_grad():
        m.router.weight[0] += 3 * m.router.weight.norm(dim=0)   # expert 0 popular: an uneven load
    x = torch.randn(2, 6, 16)
    chosen_tk, *_ = m.route(x)
    cap = math.ceil(1.0 * 6 * 2 / 4)
    drop = set()
    for b in range(2):
        used = [0] * 4
        for t in range(6):
            for j in range(2):
                e = chosen_tk[b * 6 + t, j].item()
                used[e] += 1
                if used[e] > cap:
                    drop.add((b * 6 + t, j))
    assert drop, "the uneven case must drop something"
    y = m(x)
    assert m.last_stats["dropped"].item() == len(drop)
    assert m.last_stats["tokens_per_expert"].sum().item() == 2 * 6 * 2 - len(drop)
    assert m.last_stats["tokens_per_expert"].max().item() <= 2 * cap
    torch.testing.assert_close(y, reference_moe(m, x, drop), rtol=1e-5, atol=1e-6)
    dropped_tk, dropped_w, *_ = m.route(x)
    dropped_tk, dropped_w = m.drop(dropped_tk, dropped_w, 2, 6)
    assert {(t, j) for t, j in (dropped_tk < 0).nonzero().tolist()} == drop
    assert (dropped_w[dropped_tk < 0] == 0).all()


def test_dropless_keeps_every_assignment():
    m = moe_of()
    m(torch.randn(3, 7, 16))
    assert m.last_stats["dropped"].item() == 0
    assert m.last_stats["tokens_per_expert"].sum().item() == 3 * 7 * 2


@pytest.mark.parametrize("kind", ["softmax_topk_norm", "sigmoid_bias"])
def test_group_limited_routing_stays_in_the_top_groups(kind):
    torch.manual_seed(3)
    logits = torch.randn(200, 8)
    bias = torch.randn(8) * 0.3 if kind == "sigmoid_bias" else None
    experts_tk, weights_tk, scores = route(logits, kind, 3, bias, groups=4, group_limit=2)
    choice = scores + bias if bias is not None else scores
    for t in range(200):
        group_score = [sorted(choice[t, 2 * g:2 * g + 2].tolist())[-1] + sorted(choice[t, 2 * g:2 * g + 2].tolist())[-2]
                       for g in range(4)]
        top_groups = set(sorted(range(4), key=lambda g: -group_score[g])[:2])
        assert {e // 2 for e in experts_tk[t].tolist()} <= top_groups
    # without the limit some token would have chosen outside its groups (the test is not vacuous)
    free, _, _ = route(logits, kind, 3, bias)
    masked = limit_to_groups(choice, 4, 2)
    assert (masked.gather(1, free) == float("-inf")).any()
    # the module uses it: config fields reach the router
    m = moe_of(experts=8, top_k=3, router=kind, router_groups=4, router_group_limit=2)
    e_tk, *_ = m.route(torch.randn(1, 50, 16))
    assert e_tk.shape == (50, 3)


def test_expert_without_tokens_forward_and_backward():
    m = moe_of(router="sigmoid_bias")
    with torch.no_grad():
        m.expert_bias[3] = -100.0                 # expert 3 is never selected
    x = torch.randn(2, 5, 16, requires_grad=True)
    m(x).pow(2).sum().backward()
    assert m.last_stats["tokens_per_expert"][3].item() == 0
    for w in (m.experts.w_gate, m.experts.w_up, m.experts.w_down):
        assert torch.isfinite(w.grad).all() and (w.grad[3] == 0).all() and w.grad[:3].abs().sum() > 0
    assert torch.isfinite(x.grad).all()
    # the dispatcher alone: an all-dropped batch and an empty expert
    ex = Experts(4, 16, 12)
    x_th = torch.randn(3, 16)
    y = LocalDispatch()(x_th, torch.full((3, 2), -1), torch.zeros(3, 2), ex)
    assert torch.equal(y, torch.zeros(3, 16))


def test_aux_and_z_loss_by_hand():
    m = moe_of(aux_loss_coef=0.1, z_loss_coef=0.01)
    m.configure(global_sequences=4, global_tokens=40)
    x = torch.randn(2, 3, 16)
    m(x)
    (value,) = m.aux.values
    E, k = 4, 2
    lb, z = 0.0, 0.0
    for b in range(2):
        f, P = [0.0] * E, [0.0] * E
        for t in range(3):
            logits = (m.router.weight @ x[b, t]).tolist()
            lse = math.log(sum(math.exp(v) for v in logits))
            z += lse ** 2
            p = [math.exp(v - lse) for v in logits]
            for e in sorted(range(E), key=lambda e: -p[e])[:k]:
                f[e] += 1 / (3 * k)
            for e in range(E):
                P[e] += p[e] / 3
        lb += E * sum(fe * pe for fe, pe in zip(f, P))
    want = 0.1 * lb / 4 + 0.01 * z / 40
    assert value.item() == pytest.approx(want, rel=1e-5)
    # the sigmoid router has no balance loss (only the z-loss, when on)
    s = moe_of(router="sigmoid_bias")
    s(x)
    assert s.aux.values == []
    # no graph, no loss recorded
    with torch.no_grad():
        m.aux.values.clear()
        m(x)
    assert m.aux.values == []


def test_balance_loss_is_megatrons_and_k_times_smaller_than_transformers():
    """Over one group of tokens our loss is Megatron-Core's switch_load_balancing_loss_func (f_e counted
    over the T·k top-k choices, P_e the mean of the full softmax, not the renormalised top-k weights) and
    transformers' Mixtral load_balancing_loss_func over one layer divided by k (its f_e sums to k)."""
    pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    E, k, T = 8, 2, 96
    logits_te = torch.randn(T, E, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 2
    p_te = torch.softmax(logits_te, -1)
    chosen_tk = p_te.topk(k, dim=-1).indices
    ours = load_balance_loss(p_te[None], chosen_tk[None])
    counts_e = torch.bincount(chosen_tk.flatten(), minlength=E).double()
    megatron = (p_te.sum(0) * counts_e).sum() * E / (k * T * T)
    torch.testing.assert_close(ours, megatron, rtol=1e-12, atol=0)
    theirs = load_balancing_loss_func((logits_te.float(),), E, k)
    torch.testing.assert_close(ours.float(), theirs / k, rtol=1e-5, atol=0)
    assert float(load_balance_loss(torch.full((1, T, E), 1 / E), torch.arange(T * k).remainder(E).view(1, T, k))) \
        == pytest.approx(1.0)   # perfectly balanced: 1 (transformers': k)


def test_aux_loss_is_trained_through_the_block_output():
    m = moe_of(aux_loss_coef=1.0)
    x = torch.randn(2, 5, 16)
    m(x).sum().backward()
    with_aux = m.router.weight.grad.clone()
    m.router.weight.grad = None
    m.aux_loss_coef = 0.0
    m(x).sum().backward()
    assert not torch.allclose(with_aux, m.router.weight.grad)


@pytest.mark.parametrize("kind", ["softmax_topk_norm", "softmax_topk", "sigmoid_bias"])
def test_gradients_reach_router_and_experts(kind):
    m = moe_of(router=kind, shared_experts=1, shared_expert_gate=True, z_loss_coef=1e-3)
    x = torch.randn(2, 6, 16)
    m(x).pow(2).sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    if m.expert_bias is not None:
        assert not m.expert_bias.requires_grad and "expert_bias" not in dict(m.named_parameters())


@pytest.mark.parametrize("kw", [dict(), dict(capacity_factor=1.0), dict(router="softmax_topk", z_loss_coef=0.1)])
def test_per_sequence_definitions_are_layout_invariant(kw):
    """A batch gives each sequence what it alone would get (capacity and losses are per sequence), and
    the batch's losses are the sum of the sequences' — so any split of the batch reproduces it."""
    m = moe_of(**kw)
    with torch.no_grad():
        m.router.weight[1] += 2 * m.router.weight.norm(dim=0)
    x = torch.randn(3, 8, 16)
    y = m(x)
    (whole,) = m.aux.values
    m.aux.values.clear()
    parts = [m(x[b:b + 1]) for b in range(3)]
    torch.testing.assert_close(y, torch.cat(parts), rtol=0, atol=1e-6)
    torch.testing.assert_close(whole, sum(m.aux.values), rtol=1e-6, atol=0)


def test_update_bias_and_fp32_bias():
    m = moe_of(router="sigmoid_bias", bias_update_rate=0.01)
    with torch.no_grad():
        m.expert_bias.zero_()
    m.update_bias(torch.tensor([10, 2, 4, 0]))         # mean 4: over, under, equal, under
    torch.testing.assert_close(m.expert_bias, torch.tensor([-0.01, 0.01, 0.0, 0.01]))
    assert "expert_bias" in m.state_dict()
    m = m.to(torch.bfloat16)
    assert m.router.weight.dtype == torch.bfloat16 and m.expert_bias.dtype == torch.float32
    torch.testing.assert_close(m.expert_bias, torch.tensor([-0.01, 0.01, 0.0, 0.01]))
    y = m(torch.randn(1, 4, 16, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16
    moe_of().update_bias(torch.tensor([1, 2, 3, 4]))   # a no-op for softmax routers


def test_dense_layers_shared_expert_structure_and_num_params():
    c = cfg_of(layers=3, dense_layers=1, shared_experts=2, shared_expert_gate=True, tie_embeddings=False)
    model = Transformer(c, seed=0)
    assert isinstance(model.layers[0].mlp, SwiGLU) and model.layers[0].mlp.gate.weight.shape == (24, 16)
    for layer in model.layers[1:]:
        moe = layer.mlp
        assert isinstance(moe, MoE) and moe.aux is model.aux and layer.aux is model.aux
        assert moe.router.weight.shape == (4, 16) and moe.experts.w_gate.shape == (4, 12, 16)
        assert moe.experts.w_down.shape == (4, 16, 12)
        assert isinstance(moe.shared, SwiGLU) and moe.shared.gate.weight.shape == (24, 16)   # 2 x moe_ffn
        assert moe.shared_gate.weight.shape == (1, 16) and moe.expert_bias is None
    plain = Transformer(cfg_of(layers=2), seed=0).layers[1].mlp
    assert plain.shared is None and plain.shared_gate is None
    assert not isinstance(Transformer(cfg_of(experts=0), seed=0).layers[1].mlp, MoE)
    for kw in (dict(), dict(layers=3, dense_layers=1, shared_experts=2, shared_expert_gate=True),
               dict(tie_embeddings=False, moe_ffn=0, shared_experts=1), dict(experts=0),
               dict(router="sigmoid_bias", layers=3, dense_layers=3)):
        cfg = cfg_of(**kw)
        assert cfg.num_params() == sum(p.numel() for p in Transformer(cfg).parameters()), kw


def test_init_scales_expert_output_projections():
    c = cfg_of(layers=8, init_std=0.1, experts=8, moe_ffn=64)
    model = Transformer(c, seed=1)
    moe = model.layers[0].mlp
    assert moe.experts.w_gate.std().item() == pytest.approx(0.1, rel=0.05)
    assert moe.experts.w_down.std().item() == pytest.approx(0.1 / 4, rel=0.05)       # 1/sqrt(2*8)
    again = Transformer(c, seed=1)
    assert torch.equal(again.layers[0].mlp.experts.w_down, moe.experts.w_down)


def test_whole_model_forward_backward_fp64():
    c = cfg_of(layers=2, shared_experts=1, capacity_factor=1.25, z_loss_coef=1e-3)
    model = Transformer(c, seed=2).double()
    tokens = torch.randint(0, 61, (2, 10))
    logits = model(tokens)
    assert logits.dtype == torch.float64
    logits.sum().backward()
    assert len(model.aux.values) == 2 and model.aux.take() > 0
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("kw, words", [
    (dict(top_k=5), "model.top_k (5) must be between 1 and model.experts (4); valid top_k: 1..4"),
    (dict(router="topk"), "model.router must be one of softmax_topk_norm, softmax_topk, sigmoid_bias"),
    (dict(experts=8, router_groups=3, router_group_limit=1), "router_groups (3) must divide model.experts (8)"),
    (dict(experts=8, router_groups=4, router_group_limit=5), "router_group_limit (5) must be between 1"),
    (dict(experts=8, top_k=3, router_groups=4, router_group_limit=1), "valid router_group_limit: 2..4"),
    (dict(shared_expert_gate=True), "needs model.shared_experts >= 1"),
    (dict(dense_layers=3), "valid dense_layers: 0..2"),
    (dict(capacity_factor=-1.0), "model.capacity_factor must be >= 0"),
])
def test_config_rules_name_the_rule(kw, words):
    with pytest.raises(ConfigError) as e:
        cfg_of(**kw)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_router_bias_is_checkpointed_and_resume_is_exact():
    """DeepSeek-V3's expert bias is training state: the full state carries it, and a trainer that loads
    the state of step 2 runs step 3 exactly as the uninterrupted one."""
    from fivefold.train.trainer import Trainer
    from tests.support.tiny import tiny_config

    def cfg():
        c = tiny_config()
        c.model.experts, c.model.top_k, c.model.moe_ffn, c.model.router = 4, 2, 64, "sigmoid_bias"
        return c

    first = Trainer(cfg(), quiet=True)
    for k in range(2):
        first.step(k)
    state = first.full_state()
    bias = {k: v for k, v in state["buffers"].items() if k.endswith("expert_bias")}
    assert bias and any(v.abs().sum() > 0 for v in bias.values())   # the balancing moved it
    second = Trainer(cfg(), quiet=True)
    second.load_full_state(state)
    assert first.step(2)["loss"] == second.step(2)["loss"]
    for (name, a), b in zip(first.model.named_parameters(), second.model.parameters()):
        assert torch.equal(a, b), name
