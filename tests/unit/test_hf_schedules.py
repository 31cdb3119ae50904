"""A TRL / transformers config translates one for one (issue 55, point 4): warmup_ratio and the schedules
linear, cosine and constant_with_warmup (fivefold's hf_linear, hf_cosine, constant_with_warmup) give each
optimizer step the learning rate transformers' get_scheduler gives it."""
import pytest
import torch
import transformers

from fivefold.config import ConfigError, TrainConfig
from fivefold.train.optim import lr_at

HF_NAMES = {"hf_linear": "linear", "hf_cosine": "cosine", "constant_with_warmup": "constant_with_warmup"}


def transformers_lrs(name: str, lr: float, warmup: int, total: int) -> list[float]:
    """The lr each of `total` optimizer steps runs at under transformers' scheduler (read before the step)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = transformers.get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=total)
    out = []
    for _ in range(total):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("ours", list(HF_NAMES))
@pytest.mark.parametrize("warmup, total", [(0, 7), (3, 10), (5, 40)])
def test_each_step_runs_at_transformers_learning_rate(ours, warmup, total):
    want = transformers_lrs(HF_NAMES[ours], 2e-4, warmup, total)
    got = [lr_at(k, 2e-4, 3e-5, warmup, total, ours) for k in range(total)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-18)
    assert (got[0] == 0.0) == (warmup > 0)   # step 0 at lr 0 under a warmup, as transformers'


def test_warmup_ratio_is_transformers_ceil_of_ratio_times_steps():
    assert TrainConfig(steps=300, warmup_ratio=0.03).warmup_steps == 9   # ceil(9.0)
    assert TrainConfig(steps=301, warmup_ratio=0.03).warmup_steps == 10  # ceil(9.03)
    assert TrainConfig(steps=300, warmup=20).warmup_steps == 20
    with pytest.raises(ConfigError, match="train.warmup_ratio"):
        TrainConfig(warmup_ratio=1.5).validate()


def test_min_lr_binds_only_the_schedules_that_decay_to_it():
    """transformers' schedules decay to 0: a --lr below the default min_lr is no error there."""
    TrainConfig(lr=2e-4, lr_schedule="hf_cosine").validate()
    with pytest.raises(ConfigError, match="--min-lr"):
        TrainConfig(lr=2e-4, lr_schedule="cosine").validate()
