"""model/loss.py: the summed token cross-entropy with its gradient made in the forward, against
F.cross_entropy (values and gradients, every dtype, ignored targets, rows across blocks), and what it keeps."""
import pytest
import torch
import torch.nn.functional as F

import fivefold.model.loss as loss_module
from fivefold.model.loss import BLOCK, IGNORE_INDEX, loss_sum
from fivefold.train.activations import ActivationMeter

# the loss (fp32 for 16-bit logits, upcast exactly) and the gradient in the logits' dtype: a bf16 gradient
# is the fp32 one rounded, so within one bf16 step (at most 2^-7 of the value) of F.cross_entropy's
LOSS_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-13, atol=1e-15),
            torch.bfloat16: dict(rtol=1e-5, atol=1e-6)}
GRAD_TOL = {**LOSS_TOL, torch.bfloat16: dict(rtol=2**-7, atol=1e-12)}


def reference(logits_bsv, targets_bs):
    x = logits_bsv if logits_bsv.dtype == torch.float64 else logits_bsv.float()
    return F.cross_entropy(x.flatten(0, 1), targets_bs.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)


def vocab_parallel(logits_bsv, targets_bs):
    """parallel/tensor.py's loss on one rank (the whole vocabulary its slice; the all-reduces no-ops)."""
    from fivefold.comm import Group
    from fivefold.parallel.tensor import vocab_parallel_loss_sum
    return vocab_parallel_loss_sum(logits_bsv, targets_bs, Group.single("tp"), 0, logits_bsv.shape[-1])


def both(logits_bsv, targets_bs, scale=0.37, ours=loss_sum):
    """(loss, gradient) of ours and of the reference, each backpropagating `scale`."""
    out = []
    for fn in (ours, reference):
        x = logits_bsv.detach().clone().requires_grad_()
        loss = fn(x, targets_bs)
        (loss * scale).backward()
        out.append((loss.detach(), x.grad))
    return out


@pytest.mark.parametrize("ours", [loss_sum, vocab_parallel], ids=["loss_sum", "vocab_parallel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_loss_and_gradient_equal_f_cross_entropy(dtype, ours):
    gen = torch.Generator().manual_seed(0)
    vocab = 3000
    rows = 2 * (BLOCK // vocab) + 37                             # three blocks, the last one short
    logits = (torch.randn(1, rows, vocab, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, vocab, (1, rows), generator=gen)
    targets[0, ::5] = IGNORE_INDEX
    (loss, g_ours), (ref, g_ref) = both(logits, targets, ours=ours)
    assert loss.dtype == ref.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(loss, ref, **LOSS_TOL[dtype])
    assert g_ours.dtype == dtype
    torch.testing.assert_close(g_ours, g_ref, **GRAD_TOL[dtype])
    assert (g_ours[0, ::5] == 0).all()


def test_without_gradients_the_loss_is_the_same(monkeypatch):
    """The no-gradient path (evaluation, zero bubble's recomputed forward) reuses one block's scratch."""
    monkeypatch.setattr(loss_module, "BLOCK", 64 * 7)             # 7 rows a block: 43 blocks, the last short
    gen = torch.Generator().manual_seed(1)
    logits, targets = torch.randn(2, 150, 64, generator=gen), torch.randint(0, 64, (2, 150), generator=gen)
    targets[1, :20] = IGNORE_INDEX
    with torch.no_grad():
        quiet = loss_sum(logits, targets)
    assert quiet.equal(loss_sum(logits.clone().requires_grad_(), targets).detach())
    assert quiet.item() == pytest.approx(reference(logits, targets).item(), rel=1e-6)


def test_ignored_rows_add_nothing_and_get_no_gradient_whatever_their_logits():
    logits = torch.randn(1, 6, 10)
    logits[0, 2] = float("nan")
    logits[0, 4] = float("inf")
    targets = torch.tensor([[1, 2, IGNORE_INDEX, 3, IGNORE_INDEX, 9]])
    (ours, g_ours), (ref, g_ref) = both(logits, targets)
    torch.testing.assert_close(ours, ref)
    kept = [0, 1, 3, 5]
    torch.testing.assert_close(g_ours[0, kept], g_ref[0, kept])
    assert (g_ours[0, [2, 4]] == 0).all()     # F.cross_entropy's backward hands NaN on to the NaN row
    everything = torch.full((1, 6), IGNORE_INDEX)
    (ours, g_ours), _ = both(torch.randn(1, 6, 10), everything)
    assert ours.item() == 0 and (g_ours == 0).all()


def test_it_saves_one_fp32_gradient_and_nothing_of_the_logits():
    """What the forward keeps for the backward: one fp32 (t, v) tensor, whatever the logits' dtype;
    F.cross_entropy keeps its fp32 log-probabilities too, and its backward makes two more."""
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(4, 40, 50, dtype=dtype, requires_grad=True)
        saved = []

        def pack(t):
            saved.append((t.dtype, tuple(t.shape)))
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss_sum(logits, torch.randint(0, 50, (4, 40)))
        assert [s for s in saved if len(s[1]) == 2] == [(torch.float32, (160, 50))]


@pytest.mark.parametrize("metered", [False, True])
@pytest.mark.parametrize("which", ["loss_sum", "vocab_parallel"])
def test_a_second_backward_through_the_loss_is_refused(which, metered):
    """The backward scales the saved gradient in place: backpropagating twice (retain_graph) would hand
    on a gradient scaled twice, so the second is refused, also under the trainer's saved-tensor hooks
    (its activation meter), where autograd's own check on tensors modified in place is off."""
    from contextlib import nullcontext

    logits, targets = torch.randn(1, 8, 12, requires_grad=True), torch.randint(0, 12, (1, 8))
    with ActivationMeter() if metered else nullcontext():
        loss = (loss_sum if which == "loss_sum" else vocab_parallel)(logits, targets)
        first, = torch.autograd.grad(loss, logits, retain_graph=True)
        with pytest.raises(RuntimeError, match="ran twice"):
            torch.autograd.grad(loss, logits)
    reference = torch.func.grad(lambda x: reference_loss(x, targets))(logits.detach())
    torch.testing.assert_close(first, reference, rtol=1e-5, atol=1e-6)


def reference_loss(logits_bsv, targets_bs):
    return F.cross_entropy(logits_bsv.flatten(0, 1), targets_bs.flatten(), reduction="sum")
