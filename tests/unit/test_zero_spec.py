"""ZeRO's composition as one value (parallel/zero/spec.py): the facts the engine is built from and the
planner reads, against the rules written out here from the papers (ZeRO, SC 2020; ZeRO-Offload, ATC 2021;
ZeRO-Infinity, SC 2021; FSDP under torch.distributed.pipelining), and the engine of a run holding the
same value the planner derives from the run's config."""
import itertools

import pytest

from fivefold.config import ConfigError
from fivefold.parallel.zero.spec import ZeroSpec
from fivefold.plan.layout import from_config
from fivefold.train.trainer import Trainer

from tests.support.tiny import tiny_config


def _valid():
    for stage, pipeline, each, offload, reshard in itertools.product((0, 1, 2, 3), (False, True), (False, True),
                                                                     ("none", "cpu", "nvme"), (False, True)):
        if (each and stage < 2) or (offload != "none" and stage == 0):
            continue
        yield ZeroSpec(stage, pipeline, each, offload, reshard)


@pytest.mark.parametrize("z", list(_valid()), ids=str)
def test_the_facts_of_every_setting(z):
    m = 4
    assert z.shards_states == (z.stage >= 1) and z.shards_grads == (z.stage >= 2) and z.shards_params == (z.stage == 3)
    # stage 1 keeps the whole gradient; under a pipeline 2 and 3 accumulate unless told to reduce each time
    once = z.stage == 1 or (z.stage >= 2 and z.pipeline and not z.each_microbatch)
    if z.stage >= 1:
        assert z.once_per_step == once and z.reductions(m) == (1 if once else m)
    assert z.reduces_each_microbatch == (z.stage >= 2 and not once)
    assert z.reductions(m, held=True) == 1                   # a tied copy: reduced after the copies' sum
    # a unit must lie inside what one backward completes when it is reduced before the step's end
    assert z.block_units == (z.stage == 3 or (z.stage == 2 and z.pipeline and z.each_microbatch))
    if z.stage < 3:
        assert z.gathers(m) == z.gathers(m, root=True) == 0
    elif z.pipeline:                                         # before every forward and backward; root once
        assert (z.gathers(m), z.gathers(m, root=True)) == (2 * m, 1)
    else:                                                    # forward and backward, or kept from one to the other
        assert z.gathers(m) == z.gathers(m, root=True) == (2 if z.reshard_after_forward else 1) * m
    assert z.streams_grads == (z.offload != "none" and z.stage >= 2)
    assert z.params_on_disk == (z.offload == "nvme" and z.stage == 3)
    assert z.norm_group() == ("world" if z.stage else "mp") and z.norm_group(only_dp=False) == "world"


@pytest.mark.parametrize("bad", [dict(stage=4), dict(stage=1, each_microbatch=True), dict(stage=0, offload="cpu")])
def test_a_setting_the_rules_refuse_is_one_line(bad):
    with pytest.raises(ConfigError):
        ZeroSpec(**bad)


@pytest.mark.parametrize("parallel", [dict(zero=1), dict(zero=2, offload="cpu"), dict(zero=3, reshard_after_forward=False),
                                      dict(zero=2, pp=2, microbatches=2, reduce_each_microbatch=True)])
def test_the_engine_holds_the_planners_value(parallel):
    """A run's ZeRO engine is built from the value the planner derives from the same config."""
    cfg = tiny_config(**parallel)
    layout, _ = from_config(cfg)
    if layout.pp > 1:
        assert layout.zero_spec == ZeroSpec(layout.zero, True, True)
        return   # (a pipeline needs its ranks; its engine is built by the same constructor)
    assert Trainer(cfg, quiet=True).engine.spec == layout.zero_spec == ZeroSpec.of(cfg.parallel)
