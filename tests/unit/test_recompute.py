"""Activation recomputation without a pipeline (parallel/recompute.py): selective and full recompute give
the gradients of a run without recompute bit for bit, dropout included (the RNG streams are restored for
the re-run), and the activations autograd keeps (the ActivationMeter's peak) fall as the planner says.

Multi-rank checks live with their layouts: ZeRO-3 dp2 with full recompute equals the same run without
(tests/ranks/test_zero.py) and its ledger equals the planner (tests/ranks/test_plan_runtime.py); the pipeline's own
chunk-level recompute is tests/ranks/test_pipeline_runtime.py's."""
import pytest
import torch

from fivefold.tools.run_plan import planned_memory
from fivefold.model import Transformer, loss_sum
from fivefold.model.documents import Documents, document_positions
from fivefold.parallel.recompute import apply_recompute
from fivefold.train.activations import ActivationMeter
from fivefold.train.trainer import Trainer

from tests.support.tiny import tiny_config

MODES = ("none", "selective", "full")


def gradients(recompute: str, mla: bool = False, documents: bool = False) -> tuple[float, dict, int]:
    """Loss, gradients by name and the ActivationMeter's peak of one forward and backward of a 3-layer
    model with dropout 0.1 (its masks from torch's default stream)."""
    c = tiny_config(mla=mla).model
    c.layers, c.dropout = 3, 0.1
    model = Transformer(c, seed=3)
    apply_recompute(model, recompute)
    gen = torch.Generator().manual_seed(0)
    x_bs = torch.randint(0, c.vocab, (4, 32), generator=gen)
    docs = None
    if documents:   # two documents per row: the checkpointed core takes the document ids too
        ids_bs = (torch.arange(32) >= 13).long().expand(4, 32).contiguous()
        docs = Documents(document_positions(ids_bs), ids_bs)
    torch.manual_seed(11)
    with ActivationMeter() as meter:
        loss = loss_sum(model(x_bs, documents=docs), torch.roll(x_bs, -1, 1)) / x_bs.numel()
        loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}, meter.peak


@pytest.mark.parametrize("mla, documents", [(False, False), (True, False), (False, True)])
def test_recompute_gives_the_gradients_bit_for_bit(mla, documents):
    loss, grads, _ = gradients("none", mla, documents)
    for mode in ("selective", "full"):
        other_loss, other, _ = gradients(mode, mla, documents)
        assert other_loss == loss, mode
        for n in grads:
            assert torch.equal(other[n], grads[n]), (mode, n)


def test_dropout_masks_are_redrawn_identically():
    """The re-run draws the same masks and leaves the stream where the forward left it: the next draw
    after the backward is the one a run without recompute makes."""
    draws = {}
    for mode in ("none", "full"):
        gradients(mode)
        draws[mode] = torch.rand(4)
    assert torch.equal(draws["none"], draws["full"])


def trained(recompute: str, steps: int = 2) -> dict:
    c = tiny_config()
    c.model.layers = 4
    c.train.recompute, c.train.steps = recompute, steps
    tr = Trainer(c, 0, 1, quiet=True)
    metrics = [tr.step(k) for k in range(steps)]
    return {"losses": [m["loss"] for m in metrics], "norms": [m["grad_norm"] for m in metrics],
            "state": tr.full_state()["model"], "peak": tr.activations.peak,
            "planned": planned_memory(c)["stages"][0]["activations"]}


def test_trainer_recomputes_at_pp1_and_the_peak_falls_as_planned():
    """`fivefold train --recompute` on one rank (pp = 1): the same losses, norms and weights as without;
    the ActivationMeter's peak within 10% of the planner's activations (the dry run's tolerance) for
    every mode, and full recompute keeping under half of what no recompute keeps, in both."""
    runs = {mode: trained(mode) for mode in MODES}
    for mode in ("selective", "full"):
        assert runs[mode]["losses"] == runs["none"]["losses"]
        assert runs[mode]["norms"] == runs["none"]["norms"]
        for n, t in runs["none"]["state"].items():
            assert torch.equal(runs[mode]["state"][n], t), (mode, n)
    for mode, r in runs.items():
        assert abs(r["peak"] / r["planned"] - 1) <= 0.10, (mode, r["peak"], r["planned"])
    assert runs["full"]["peak"] < runs["none"]["peak"] / 2
    assert runs["full"]["planned"] < runs["none"]["planned"] / 2


def test_full_recompute_keeps_block_inputs_and_one_block():
    """Under full recompute the meter's peak is every block's input plus one block's working set or the
    head's tensors, whichever is larger: adding blocks adds one b·s·h input each, not a block's working set."""
    peaks = {}
    for layers in (2, 4):
        c = tiny_config().model
        c.layers = layers
        model = Transformer(c, seed=3)
        apply_recompute(model, "full")
        x_bs = torch.randint(0, c.vocab, (4, 32), generator=torch.Generator().manual_seed(0))
        with ActivationMeter() as meter:
            loss_sum(model(x_bs), torch.roll(x_bs, -1, 1)).backward()
        peaks[layers] = meter.peak
    assert peaks[4] - peaks[2] == 2 * 4 * 32 * c.hidden * 4   # two more fp32 (b, s, h) block inputs


def test_evaluation_and_generation_do_not_checkpoint():
    """Without autograd a checkpointed block is the plain block: the same logits, nothing saved."""
    c = tiny_config().model
    plain, full = Transformer(c, seed=3), Transformer(c, seed=3)
    apply_recompute(full, "full")
    x_bs = torch.randint(0, c.vocab, (2, 16))
    with torch.no_grad():
        assert torch.equal(plain(x_bs), full(x_bs))
    with pytest.raises(ValueError, match="recompute must be one of"):
        apply_recompute(full, "some")


def test_dropout_keeps_one_byte_masks_and_the_plan_counts_them():
    """Residual dropout (model.dropout > 0) keeps a boolean mask per branch for the backward, one byte an
    element (model/layers.py `Dropout`): two per layer, h bytes a token each, which the planner counts
    (`from_model_config` carries dropout; plan/activations.py); the ActivationMeter's peak rises by them."""
    peaks, planned = {}, {}
    for p in (0.0, 0.1):
        c = tiny_config()
        c.model.layers, c.model.dropout = 4, p
        tr = Trainer(c, 0, 1, quiet=True)
        tr.step(0)
        peaks[p], planned[p] = tr.activations.peak, planned_memory(c)["stages"][0]["activations"]
    c = tiny_config()
    tokens = c.train.global_batch // c.parallel.microbatches * c.train.seq_len
    masks = 4 * 2 * c.model.hidden * tokens
    assert planned[0.1] - planned[0.0] == masks
    assert peaks[0.1] - peaks[0.0] == masks
    assert planned[0.1] == pytest.approx(peaks[0.1], rel=0.10)
