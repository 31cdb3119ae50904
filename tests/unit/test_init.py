"""Construction on the meta device and the layout-independent seeded init (model/init.py)."""
import math

import pytest
import torch

from fivefold.config import ModelConfig
from fivefold.model import Transformer
from fivefold.model.init import (TILE_COLS, TILE_ROWS, InitSource, init_box, is_placeholder, materialize,
                                 placeholder)
from fivefold.shapes import Box
from fivefold.train.checkpoint import segment_chunks

CFG = ModelConfig(vocab=300, hidden=64, layers=3, heads=4, kv_heads=2, ffn=96, experts=4, dense_layers=1,
                  qkv_bias=True, tie_embeddings=False)


def whole(name, shape, seed=3):
    return init_box(CFG, seed, name, shape, (0,) * len(shape), shape)


@pytest.mark.parametrize("shape, offsets, sizes", [
    ((300, 64), (17, 0), (150, 64)),                  # vocabulary rows (tp)
    ((64, 96), (0, 48), (64, 48)),                    # a row-parallel piece: columns (tp)
    ((4, 96, 64), (2, 0, 0), (2, 96, 64)),            # a block of experts (ep)
    ((4, 96, 64), (1, 5, 7), (2, 40, 50)),            # any box
    ((2 * TILE_ROWS + 3, 2 * TILE_COLS + 5), (TILE_ROWS - 1, TILE_COLS - 2), (TILE_ROWS + 3, TILE_COLS + 4)),
])
def test_any_box_equals_the_same_box_of_the_whole_tensor(shape, offsets, sizes):
    full = whole("layers.1.mlp.experts.w_gate" if len(shape) == 3 else "layers.0.attn.wq.weight", shape)
    box = init_box(CFG, 3, "layers.1.mlp.experts.w_gate" if len(shape) == 3 else "layers.0.attn.wq.weight",
                   shape, offsets, sizes)
    assert torch.equal(box, full[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))])


def test_zero3_flat_segments_equal_the_whole_tensor():
    """A ZeRO-3 shard is a flat range of a piece: a partial row, whole rows, a partial row."""
    shape = (300, 64)
    full = whole("embed.weight", shape)
    src = InitSource(CFG, 3)
    piece = Box(shape, (150, 0), (150, 64))   # tp rank 1 of 2
    flat = full[150:].reshape(-1)
    for start, length in ((0, 64 * 150), (37, 1000), (64 * 149 + 5, 59)):
        got = torch.zeros(length)
        for box, sizes, o in segment_chunks(piece, (150, 64), start, length):
            got[o:o + math.prod(sizes)] = src.read("model/embed.weight", box, sizes).reshape(-1)
        assert torch.equal(got, flat[start:start + length])


def test_values_depend_on_seed_and_name_and_keep_their_scale():
    a, b = whole("layers.0.attn.wq.weight", (64, 64)), whole("layers.0.attn.wk.weight", (64, 64))
    assert not torch.equal(a, b) and not torch.equal(a, whole("layers.0.attn.wq.weight", (64, 64), seed=4))
    big = ModelConfig(hidden=512, layers=8, heads=8, kv_heads=8, ffn=1024, init_std=0.1)
    w = init_box(big, 0, "layers.0.mlp.gate.weight", (1024, 512), (0, 0), (1024, 512))
    down = init_box(big, 0, "layers.0.mlp.down.weight", (512, 1024), (0, 0), (512, 1024))
    assert w.std().item() == pytest.approx(0.1, rel=0.02) and abs(w.mean().item()) < 0.002
    assert down.std().item() == pytest.approx(0.1 / 4, rel=0.02)    # 1/sqrt(2*8)
    assert torch.equal(init_box(CFG, 0, "layers.0.attn.wq.bias", (64,), (0,), (64,)), torch.zeros(64))
    assert torch.equal(init_box(CFG, 0, "norm.weight", (64,), (0,), (64,)), torch.ones(64))


def test_a_model_is_its_init_and_meta_allocates_nothing():
    model = Transformer(CFG, seed=5)
    for name, p in model.named_parameters():
        assert torch.equal(p, whole(name, tuple(p.shape), seed=5)), name
    meta = Transformer(CFG, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    assert meta.layers[1].mlp.expert_bias is None or meta.layers[1].mlp.expert_bias.is_meta


def test_materialize_keeps_ties_and_attributes_and_placeholders_hold_one_element():
    meta = Transformer(ModelConfig(vocab=64, hidden=32, layers=1, heads=2, kv_heads=2, ffn=64), device="meta")
    meta.embed.weight.placement = "marked"
    materialize(meta, "cpu", whole=False)
    assert meta.head.weight is meta.embed.weight and meta.embed.weight.placement == "marked"
    assert all(is_placeholder(p) for p in meta.parameters() if p.numel() > 1)
    assert meta.embed.weight.untyped_storage().nbytes() == 4
    assert not is_placeholder(torch.zeros(3, 4)) and is_placeholder(placeholder((3, 4), torch.float32, "cpu"))
