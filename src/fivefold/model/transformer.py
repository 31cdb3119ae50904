"""A Llama-style decoder: RMSNorm, rotary position embeddings, grouped-query attention, SwiGLU MLP (or,
in an MoE model's sparse layers, a mixture of SwiGLU experts: model/moe.py), optionally tied input/output
embeddings, causal scaled-dot-product attention.

It matches Hugging Face's `LlamaForCausalLM`, `MixtralForCausalLM` and `Qwen2MoeForCausalLM` numerically
(see `model/hf.py` and the tests): the same RMSNorm (computed in fp32), the same "rotate half" RoPE, the
same GQA head grouping.

Shapes: b batch, s sequence, h hidden, n query heads, k kv heads, d head dim, f ffn, v vocab.
The model knows nothing of process groups; parallel layers wrap or replace its parts.
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .attention import Attention, KVCache, LayerKV, rope_cos_sin
from .documents import Documents
from .init import init_box, materialize
from .latent_attention import LatentAttention
from .layers import AuxLosses, Dropout, RMSNorm, SwiGLU
from .moe import MoE


class Block(nn.Module):
    """Layer `index` of the model: attention (grouped-query, or latent: model/latent_attention.py), then the MLP — the mixture of experts (model/moe.py) for
    layers index >= cfg.dense_layers of an MoE model (experts > 0), else the dense SwiGLU."""

    def __init__(self, cfg: ModelConfig, aux: AuxLosses | None = None, index: int = 0, device=None):
        super().__init__()
        self.aux = aux if aux is not None else AuxLosses()   # where this block's auxiliary losses go
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps, device)
        self.attn = Attention(cfg, device) if not cfg.mla else LatentAttention(cfg, device)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps, device)
        self.mlp = MoE(cfg, self.aux, device, index) if cfg.is_moe_layer(index) else SwiGLU(cfg.hidden, cfg.ffn, device)
        self.drop = Dropout(cfg.dropout)  # on each branch before the residual add (0: off)

    def forward(self, x_bsh, cos_sd, sin_sd, kv: LayerKV | None = None, documents_bS: torch.Tensor | None = None,
                keys_bs: torch.Tensor | None = None):
        """`keys_bs`: the step-global keys of x's tokens, which a MoE layer's random routing draws by
        (model/random_routing.py); None elsewhere."""
        x_bsh = x_bsh + self.drop(self.attn(self.attn_norm(x_bsh), cos_sd, sin_sd, kv, documents_bS))
        mlp_in = self.mlp_norm(x_bsh)
        return x_bsh + self.drop(self.mlp(mlp_in, keys_bs) if isinstance(self.mlp, MoE) else self.mlp(mlp_in))


class Transformer(nn.Module):
    """tokens (b, s) int64 at position ids (s,) -> logits (b, s, v); auxiliary losses through `aux`.

    Contract the parallel layers and the pipeline rely on: `forward(tokens_bs, positions_s=None)` returns
    the logits only; positions default to 0..s-1 and may be any ids (context parallelism hands a rank
    non-contiguous ones); auxiliary losses go through the one `AuxLosses` channel shared by every block.
    Inference may pass `cache=KVCache(layers)`: positions then continue after the cached tokens."""

    def __init__(self, cfg: ModelConfig, seed: int | None = None, device=None):
        """Built on the meta device (nothing allocated); unless `device` is "meta", then materialised on
        `device` (default the CPU) and filled with the seeded init (`reset_parameters`)."""
        super().__init__()
        self.cfg = cfg
        self.aux = AuxLosses()
        # meta is passed to each part: a device context, or nn.Embedding's own init, would route a meta
        # tensor's normal_ through torch._refs (importing torch._dynamo: seconds per process)
        meta = torch.device("meta")
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden, _weight=torch.empty(cfg.vocab, cfg.hidden, device=meta))
        self.layers = nn.ModuleList(Block(cfg, self.aux, i, meta) for i in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps, meta)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False, device=meta)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        if str(device) != "meta":
            materialize(self, device or "cpu")
            self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """The seeded init of model/init.py, whole tensor by whole tensor: N(0, init_std) for matrices,
        output projections (attention's wo, an MLP's or shared expert's down, the experts' w_down) scaled
        by 1/sqrt(2·layers) (GPT-2 style), ones for norms, zeros for biases. A stacked expert weight
        (E, out, in) is E matrices, each drawn like the dense one it replaces (every entry N(0, std));
        routers and the shared-expert gate are matrices like any other. Buffers (the sigmoid router's
        expert bias, zeros when built) are left alone. Each element's value depends only on the seed,
        the parameter's name and the element's position, so a rank that holds any piece of a tensor
        initialises it to exactly these values (init.InitSource)."""
        seed = seed if seed is not None else 0
        for name, p in self.named_parameters():
            full = tuple(p.shape)
            p.copy_(init_box(self.cfg, seed, name, full, (0,) * len(full), full))

    def rope(self, positions, device=None, offset: int = 0):
        return rope_cos_sin(positions, self.cfg.rope_dim, self.cfg.rope_theta, device, offset, self.embed.weight.dtype)

    def forward(self, tokens_bs: torch.Tensor, positions_s: torch.Tensor | None = None,
                cache: KVCache | None = None, documents: Documents | None = None,
                keys_bs: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for tokens at `positions_s` (position ids shared by the batch; default 0..s-1, or
        after the cached tokens with a `cache`, which this call extends). With `documents` (packed
        documents, model/documents.py) positions are theirs (restarting per document) and attention
        stays inside each document. `keys_bs`: the tokens' step-global keys, for random routing
        (model/random_routing.py; None: none drawn)."""
        offset = cache.length if cache is not None else 0
        if documents is not None:
            positions_s = documents.positions_bs
        elif cache is not None and cache.pad_b is not None:   # left-padded rows: each counts from its first token
            steps_s = torch.arange(offset, offset + tokens_bs.shape[1], device=tokens_bs.device)
            positions_s = (steps_s[None, :] - cache.pad_b.to(tokens_bs.device)[:, None]).clamp(min=0)
        cos_sd, sin_sd = self.rope(tokens_bs.shape[1] if positions_s is None else positions_s, tokens_bs.device, offset)
        ids_bS = None if documents is None else documents.ids_bS
        kv = cache.layers if cache is not None else None
        return run_blocks(tokens_bs, self.layers, cos_sd, sin_sd, ids_bS, kv, self.embed, self.norm, self.head, keys_bs)


def run_blocks(x, blocks, cos_sd, sin_sd, documents_bS: torch.Tensor | None = None, kv: list | None = None,
               embed: nn.Module | None = None, norm: nn.Module | None = None, head: nn.Module | None = None,
               keys_bs: torch.Tensor | None = None):
    """The model's forward over a run of its blocks, the one both the whole model (`Transformer.forward`)
    and a pipeline stage's chunk (parallel/pipeline/runtime.py) run: tokens through `embed` first when it
    is given, then each block (with its layer's KV cache from `kv` when generating), then `norm` and
    `head` when given (the last chunk: logits). `keys_bs`: the tokens' keys for random routing, or None."""
    if embed is not None:
        x = embed(x)
    for i, block in enumerate(blocks):
        x = block(x, cos_sd, sin_sd, documents_bS=documents_bS, keys_bs=keys_bs) if kv is None \
            else block(x, cos_sd, sin_sd, kv[i])
    if head is not None:
        x = head(norm(x))
    return x

