"""Megatron's f reduces its input gradient in place only when nothing else holds that gradient
(comm/autograd.py `_sole_owner`): a matmul's fresh input gradient is reduced where it lies, but a gradient
autograd hands to two branches (an add's backward) is reduced in a copy, so the other branch keeps its own.
The all-reduce is stood in for by doubling in place (two ranks holding the same gradient)."""
import torch

from fivefold.comm import autograd, ops
from fivefold.comm.ops import Group


def _doubled(monkeypatch) -> list[str]:
    """All-reduce stood in for by doubling in place; returns the list of what happened, in order."""
    events = []
    fresh = autograd._fresh

    def all_reduce(t, group, **kw):
        t.mul_(2)
        events.append("reduce")
        return ops.DONE

    def copy(t):
        events.append("copy")
        return fresh(t)

    monkeypatch.setattr(ops, "all_reduce", all_reduce)
    monkeypatch.setattr(autograd, "_fresh", copy)
    return events


def test_a_fresh_gradient_is_reduced_in_place(monkeypatch):
    events = _doubled(monkeypatch)
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3, 5)
    (autograd.copy_to_tensor_region(x, Group("tp", [0, 1], 0)) @ w).sum().backward()
    assert torch.equal(x.grad, 2 * torch.ones(4, 5) @ w.T)
    assert events == ["reduce"]         # no copy was made


def test_a_gradient_shared_with_another_branch_is_reduced_in_a_copy(monkeypatch):
    events = _doubled(monkeypatch)
    x = torch.randn(4, 3, requires_grad=True)
    y = autograd.copy_to_tensor_region(x, Group("tp", [0, 1], 0))
    (y + x).sum().backward()            # AddBackward hands one gradient tensor to both branches
    assert torch.equal(x.grad, torch.full((4, 3), 3.0)), x.grad   # 2 (reduced) + 1 (the residual branch)
    assert events == ["copy", "reduce"]


def test_views_and_strided_gradients_are_not_owned():
    base = torch.randn(4, 6)
    assert autograd._sole_owner(torch.randn(4, 6))
    assert not autograd._sole_owner(base[:, :3])            # a view of another tensor
    assert not autograd._sole_owner(torch.randn(6, 4).t())  # not contiguous
    viewed = torch.randn(3)
    view = viewed.view(3)
    assert not autograd._sole_owner(viewed) and view.shape == (3,)   # a view of it is alive
