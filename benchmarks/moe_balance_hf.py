"""The peer of benchmarks/moe_balance.py: the same model, data and steps trained as a Hugging Face
`MixtralForCausalLM` with its own load-balancing loss, measured by the same imbalance metric.

The model is ours (`balance_config`: 2 layers, hidden 64, 8 experts of width 64, top-2) with our seeded
init, turned into a transformers Mixtral by `model.hf.to_hf` (the same weights: the forward is the
same function), trained in one process on the same global batches (16 x 128 tokens of the default text
per step, `make_batches`), with the same optimizer settings (AdamW betas 0.9/0.95, weight decay 0.1 on
matrices, clipping at 1.0, warm-up 20 steps then cosine, `lr_at`). The loss is the mean token
cross-entropy plus `router_aux_loss_coef` x transformers' `load_balancing_loss_func` of the step's
router logits (output_router_logits=True): one loss over the whole batch with both layers' tokens
pooled, E x sum_e f_e P_e with f_e counted over the top-k (it sums to k, so at balance it is k, where
ours is 1). The imbalance is metrics.jsonl's `expert_imbalance`: max / mean of the top-k assignments
per (layer, expert) over the step's global batch.

`--loss sequence|batch` trains the same model in the same loop with our loss instead (model/moe.py's
`load_balance_loss`, per layer): per sequence (our runtime's) or with the whole batch as one group (the
token set of transformers' and of Megatron-Core's global-batch loss), to tell the formula from the loop.

    python benchmarks/moe_balance_hf.py [--steps 200] [--warmup 50] [--coef 0.02] [--loss hf] [--bpe 2048]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from common import parse_options
from moe_balance import balance_config, summary, train_bpe

from fivefold.model.hf import to_hf
from fivefold.model.moe import load_balance_loss
from fivefold.model.transformer import Transformer
from fivefold.train.data import make_batches
from fivefold.train.optim import lr_at


def balance_loss(kind: str, out, b: int, top_k: int) -> torch.Tensor:
    """The load-balancing loss of one step: transformers' ("hf": both layers' tokens pooled, f summing to
    k), or ours (model/moe.py: per layer, f summing to 1) per sequence and averaged ("sequence", our
    runtime's) or over the whole batch as one group ("batch")."""
    if kind == "hf":
        return out.aux_loss
    total = 0.0
    for logits_te in out.router_logits:
        scores_bse = torch.softmax(logits_te.float(), dim=-1).view(b, -1, logits_te.shape[-1])
        chosen_bsk = scores_bse.topk(top_k, dim=-1).indices
        if kind == "batch":
            scores_bse, chosen_bsk = scores_bse.reshape(1, -1, scores_bse.shape[-1]), chosen_bsk.reshape(1, -1, top_k)
        total = total + load_balance_loss(scores_bse, chosen_bsk) / scores_bse.shape[0]
    return total


def imbalance(router_logits: tuple, top_k: int) -> float:
    """max / mean of the top-k assignments per (layer, expert) over the tokens of the step."""
    counts = torch.stack([torch.bincount(logits.topk(top_k, dim=-1).indices.flatten(), minlength=logits.shape[-1])
                          for logits in router_logits]).double()
    return float(counts.max() / counts.mean())


def peer_model(cfg, coef: float):
    """Our seeded model as a transformers Mixtral that returns its router logits."""
    ours = Transformer(cfg.model)
    ours.reset_parameters(cfg.train.seed)
    hf = to_hf(ours, "mixtral")
    hf.config.output_router_logits, hf.config.router_aux_loss_coef = True, coef
    return hf


def optimizer(model, t):
    """AdamW as ours: decay on matrices only."""
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": t.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)


def train(cfg, coef: float, kind: str = "hf") -> tuple[list[float], list[float]]:
    """(losses, imbalance) per step."""
    t, m = cfg.train, cfg.model
    torch.manual_seed(t.seed)
    model = peer_model(cfg, coef)
    opt = optimizer(model, t)
    batches = make_batches(t, m.vocab)
    losses, imbalances = [], []
    for step in range(t.steps):
        x_bs, y_bs = batches.local(step, 0, 1)
        out = model(input_ids=x_bs, output_router_logits=True)
        loss = F.cross_entropy(out.logits.flatten(0, 1).float(), y_bs.flatten())
        imbalances.append(imbalance(out.router_logits, m.top_k))
        opt.zero_grad(set_to_none=True)
        (loss + coef * balance_loss(kind, out, x_bs.shape[0], m.top_k)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, t.lr, t.min_lr, t.warmup, t.steps)
        opt.step()
        losses.append(loss.item())
    return losses, imbalances


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=50, help="steps left out of the summary")
    ap.add_argument("--coef", type=float, default=0.02, help="router_aux_loss_coef (Mixtral-8x7B's config: 0.02; "
                    "MixtralConfig's default: 0.001)")
    ap.add_argument("--loss", choices=("hf", "sequence", "batch"), default="hf",
                    help="the balance loss: transformers' (hf), or ours per sequence or over the batch")
    ap.add_argument("--bpe", type=int, default=0, metavar="V", help="train on a byte-level BPE of V ids (0: bytes)")
    a = parse_options(ap, argv, steps=3, warmup=1)
    cfg = balance_config(a.steps, [])
    with tempfile.TemporaryDirectory() as tmp:
        if a.bpe:
            cfg.train.tokenizer, cfg.model.vocab = str(train_bpe(a.bpe, Path(tmp), cfg.train.data_limit_mb)), a.bpe
        losses, imbalances = train(cfg, a.coef, a.loss)
    s = summary(imbalances, a.warmup)
    print(f"transformers Mixtral, 8 experts top-2, one process, {f'BPE {a.bpe}' if a.bpe else 'bytes'}, "
          f"balance loss {a.loss}, coefficient {a.coef}")
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {s['steps']} steps; imbalance (max/mean) "
          f"step 1 {s['first']:.3f}, after step {a.warmup}: mean {s['mean_after_warmup']:.3f}, "
          f"max {s['max_after_warmup']:.3f}, {s['share_under_bound']:.0%} of steps under 1.3")
    print("mean imbalance per 25 steps: " + " ".join(f"{w:.2f}" for w in s["windows"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
