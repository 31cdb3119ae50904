"""Our Llama equals transformers' LlamaForCausalLM: logits, loss and gradients, several configs."""
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from fivefold.model import Transformer, loss_sum  # noqa: E402
from fivefold.model.hf import from_hf, name_map, to_hf  # noqa: E402

CONFIGS = [
    dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=10000.0),
    dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True, rope_theta=10000.0),
    dict(num_attention_heads=8, num_key_value_heads=1, tie_word_embeddings=True, rope_theta=500000.0),
    dict(num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=1000.0),
]


def hf_model(**kw):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   max_position_embeddings=64, rms_norm_eps=1e-6, attn_implementation="eager",
                                   **kw)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("kw", CONFIGS)
def test_logits_loss_grads_match(kw):
    hf = hf_model(**kw)
    ours = from_hf(hf)
    assert ours.cfg.tie_embeddings == kw["tie_word_embeddings"] and ours.cfg.rope_theta == kw["rope_theta"]
    tokens = torch.randint(0, 97, (3, 24), generator=torch.Generator().manual_seed(1))
    targets = torch.roll(tokens, -1, 1)
    logits_hf = hf(tokens).logits
    logits = ours(tokens)
    torch.testing.assert_close(logits, logits_hf, rtol=1e-5, atol=1e-5)
    loss_hf = F.cross_entropy(logits_hf.flatten(0, 1), targets.flatten())
    loss = loss_sum(logits, targets) / targets.numel()
    torch.testing.assert_close(loss, loss_hf, rtol=1e-6, atol=1e-6)
    loss_hf.backward()
    loss.backward()
    theirs = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, theirs[name_map(ours.cfg)[name]].grad, rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")


def test_round_trip_and_saved_folder(tmp_path):
    hf = hf_model(**CONFIGS[0])
    hf.save_pretrained(tmp_path)
    ours = from_hf(str(tmp_path))
    back = to_hf(ours)
    theirs = hf.state_dict()
    for name, t in back.state_dict().items():
        assert torch.equal(t, theirs[name]), name
    tokens = torch.randint(0, 97, (2, 16))
    torch.testing.assert_close(back(tokens).logits, hf(tokens).logits, rtol=1e-5, atol=1e-5)


def test_seeded_init_is_deterministic():
    cfg = from_hf(hf_model(**CONFIGS[1])).cfg
    a, b, c = Transformer(cfg, seed=3), Transformer(cfg, seed=3), Transformer(cfg, seed=4)
    for (n, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q)
        if p.dim() > 1:
            assert not torch.equal(p, r)
    assert a.head.weight is a.embed.weight
