"""The planner splits layers into pipeline stages exactly as the runtime does (architecture review,
problem 1: the two Llama-3 splits used to disagree whenever (L + 2) % pp != 0)."""
import itertools

import pytest

from fivefold.config import ConfigError, ModelConfig
from fivefold.parallel.pipeline.partition import partition_layers
from fivefold.plan.layout import Layout, Workload
from fivefold.plan.memory import memory
from fivefold.plan.units import layout_layers
from fivefold.plan.models import from_model_config
from fivefold.rules import check_partition


def test_planner_stages_hold_the_runtime_layers():
    """Every layers <= 139, pp <= 16, vpp <= 4, even and llama3: the layers the planner charges to each
    pipeline rank (`layout_layers`, which memory, traffic and time use) are the runtime's
    `Partition.layers_of_rank`; the config rule accepts exactly the splits the runtime can make."""
    models = {n: from_model_config(ModelConfig(layers=n)) for n in range(1, 140)}
    checked = 0
    for n, pp, vpp, kind in itertools.product(range(1, 140), range(1, 17), range(1, 5), ("even", "llama3")):
        try:
            check_partition(n, pp, vpp, kind)
        except ConfigError:
            with pytest.raises(ConfigError):
                partition_layers(n, pp, vpp, kind)
            continue
        runtime = partition_layers(n, pp, vpp, kind)
        planned = layout_layers(models[n], Layout(pp=pp, vpp=vpp, partition=kind))
        assert [list(p) for p in planned] == [runtime.layers_of_rank(r) for r in range(pp)], (n, pp, vpp, kind)
        checked += 1
    assert checked > 15000


@pytest.mark.parametrize("layers, pp, runtime", [(5, 2, [3, 2]), (9, 3, [3, 4, 2])])
def test_llama3_drift_cases_of_the_review(layers, pp, runtime):
    """The review's examples, through the per-stage memory rows a user sees."""
    model = from_model_config(ModelConfig(layers=layers))
    lay = Layout(pp=pp, partition="llama3", micro_batch=1)
    rows = memory(model, lay, Workload(seq=128, global_batch=8)).stages
    part = partition_layers(layers, pp, 1, "llama3")
    assert [len(part.layers_of_rank(j)) for j in range(pp)] == runtime
    assert [r["layers"] for r in rows] == runtime


def test_user_counts_and_virtual_stages():
    model = from_model_config(ModelConfig(layers=8))
    assert layout_layers(model, Layout(pp=2, partition="3,5")) == ((0, 1, 2), (3, 4, 5, 6, 7))
    assert layout_layers(model, Layout(pp=2, vpp=2, partition="1,3,3,1")) == ((0, 4, 5, 6), (1, 2, 3, 7))
