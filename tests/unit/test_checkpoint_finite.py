"""A checkpoint refuses NaN and inf in the state it saves (train/checkpoint.py `all_finite`, one reduction
with no temporary of the tensor's size): one bad element anywhere, in a non-contiguous region or a 0-dim
tensor is found, as the whole-tensor `isfinite` check finds it."""
import pytest
import torch

from fivefold.train.checkpoint import _region, all_finite

FINITE_CHUNK = 1 << 18   # where the former block-wise check cut: its edges kept as places to look


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("shape", [(3 * FINITE_CHUNK + 5,), (1000, 700), (7, FINITE_CHUNK + 3), (2, 3, 50_000)])
def test_one_bad_element_anywhere_is_found(shape, bad):
    t = torch.randn(shape)
    assert all_finite(t)
    n = t.numel()
    for where in (0, n // 2, n - 1, FINITE_CHUNK - 1, FINITE_CHUNK):
        if where >= n:
            continue
        u = t.clone()
        u.view(-1)[where] = bad
        assert not all_finite(u) and not bool(torch.isfinite(u).all())


def test_regions_zero_dim_and_empty_tensors():
    t = torch.randn(600, 900)
    t[599, 899] = float("nan")                      # outside the region: not its concern
    region = _region(t, (600, 800))
    assert not region.is_contiguous() and all_finite(region)
    t[300, 10] = float("inf")
    assert not all_finite(_region(t, (600, 800)))
    assert all_finite(torch.tensor(1.0)) and not all_finite(torch.tensor(float("nan")))
    assert all_finite(torch.empty(0)) and all_finite(torch.empty(0, 5))
    assert not all_finite(torch.full((3, 4), float("nan"), dtype=torch.bfloat16))
    mixed = torch.zeros(5, dtype=torch.bfloat16)
    mixed[2], mixed[4] = float("inf"), float("-inf")
    assert not all_finite(mixed) and not all_finite(mixed[3:])
    assert all_finite(torch.arange(5)) and all_finite(torch.ones(3, dtype=torch.bool))   # integers: always finite
