"""Ranks that share cores (`Accelerator.ranks_per_core`, written by `fivefold calibrate` when N ranks
outnumber the cores): a pipeline rank idle in its bubble leaves its core to the few busy ones, so the fill
and drain run at whole cores and the bubble shrinks by ranks_per_core (`time.shared_cores_makespan`). With a
core or device per rank nothing changes."""
import pytest

from fivefold.config import ConfigError, ModelConfig
from fivefold.tools.plan import check_topology
from fivefold.plan.estimate import estimate
from fivefold.plan.layout import from_config
from fivefold.plan.models import from_model_config
from fivefold.plan.search import _structures, search
from fivefold.plan.time import shared_cores_makespan
from fivefold.plan.topology import topology_from_dict
from fivefold.tools.calibrate import ranks_per_core

from tests.support.tiny import tiny_config


def _structure(lay):
    return lay.tp, lay.pp, lay.cp, lay.cp_mode, lay.ep, lay.dp, lay.etp


def _topo(share: float = 1.0, size: int = 4, latency_us: float = 1000):
    return topology_from_dict({
        "name": "cpu", "accelerator": {"name": "cpu", "peak_tflops": {"fp32": 0.05}, "memory_gib": 4, "hbm_gbps": 30,
                                       "layer_overhead_us": 500, "elementwise": 1, "ranks_per_core": share},
        "tier": [{"name": "loopback", "size": size, "bandwidth_gbps": 1.0, "latency_us": latency_us}]})


def test_by_hand():
    """4 ranks on 2 cores (o = 2), each busy 300 ms at the shared rate: B + (M − B) / o."""
    assert shared_cores_makespan(0.4, [0.3] * 4, 2.0) == pytest.approx(0.35)  # a 100 ms bubble runs in 50
    assert shared_cores_makespan(0.8, [0.3] * 4, 2.0) == pytest.approx(0.55)
    assert shared_cores_makespan(0.5, [0.2, 0.4], 2.0) == pytest.approx(0.4)  # uneven stages: the mean busy
    assert shared_cores_makespan(0.4, [0.3] * 4, 4.0) == pytest.approx(0.325)
    assert 0.4 / 2 <= shared_cores_makespan(0.4, [0.1] * 4, 2.0) and 0.1 <= shared_cores_makespan(0.4, [0.1] * 4, 2.0)
    assert shared_cores_makespan(0.4, [0.3] * 4, 1.0) == 0.4                  # a core each: unchanged
    # 8 ranks on 2 cores (o = 4) in 2 stages: the bubble's busy stage has 4 ranks on the 2 cores, 2x not 4x
    assert shared_cores_makespan(0.4, [0.3] * 2, 4.0, stages=2) == pytest.approx(0.35)
    assert shared_cores_makespan(0.4, [0.3] * 4, 4.0, stages=4) == pytest.approx(0.325)
    assert shared_cores_makespan(0.4, [0.3] * 4, 2.0, stages=4) == pytest.approx(0.35)
    assert ranks_per_core(4, 2) == 2.0 and ranks_per_core(2, 2) == 1.0 and ranks_per_core(2, 8) == 1.0


def test_only_the_cores_work_shrinks_in_the_bubble():
    """Half of each stage's busy time waits on a link between hosts (its rate no core sets): in the
    bubble that half runs at its own pace and only the other half gains the freed cores; the pipeline's
    sends over such a link (`wire_fixed`) do not shrink at all. Traffic on the ranks' own loopback is
    core work (`wire_share` counts only tiers beyond the first)."""
    from fivefold.plan.time import wire_share
    from fivefold.plan.traffic import Flow

    assert shared_cores_makespan(0.4, [0.3] * 4, 2.0, wire=[0.15] * 4) == pytest.approx(0.3 + 0.1 * (0.25 + 0.5))
    assert shared_cores_makespan(0.4, [0.3] * 4, 2.0, wire=[0.0] * 4) == pytest.approx(0.35)
    assert shared_cores_makespan(0.4, [0.3] * 4, 2.0, wire=[0.3] * 4) == pytest.approx(0.4)    # all on the wire
    assert shared_cores_makespan(0.4, [0.3] * 4, 2.0, wire=[0.15] * 4, wire_fixed=0.04) == pytest.approx(
        0.3 + 0.04 + 0.06 * 0.75)
    assert shared_cores_makespan(0.4, [0.3] * 4, 1.0, wire=[0.15] * 4, wire_fixed=0.04) == 0.4   # a core each
    topo = topology_from_dict({
        "name": "fabric", "accelerator": {"name": "cpu", "peak_tflops": {"fp32": 0.05}, "memory_gib": 4, "hbm_gbps": 30},
        "tier": [{"name": "node", "size": 2, "bandwidth_gbps": 1.0, "latency_us": 30},
                 {"name": "leaf", "bandwidth_gbps": 0.01, "latency_us": 100}]})
    flows = [Flow("tp", "all_reduce", "tp", 2, seconds=0.1, tier="node"),
             Flow("ep", "all_to_all", "ep", 2, seconds=0.3, tier="leaf"),
             Flow("dp", "all_reduce", "dp_cp", 2, seconds=5.0, tier="leaf")]   # a gradient reduction: not a layer's
    assert wire_share(flows, topo) == pytest.approx(0.75)


@pytest.mark.parametrize("parallel", [dict(pp=4, microbatches=8), dict(pp=2, vpp=2, schedule="interleaved",
                                                                        microbatches=4)])
def test_a_pipeline_on_shared_cores_pays_its_work_not_its_bubble(parallel):
    """pp4 1F1B with 8 micro-batches on 2 cores: the simulated makespan M has a bubble b, each rank's busy
    time is B = M·(1 − b) on average (the simulator's bubble is idle / (ranks · M)), and the step's pipeline
    part is B + (M − B) / 2 = M·(1 − b/2); the bubble reported is the simulator's still."""
    cfg = tiny_config(**parallel)
    cfg.model.layers = 4
    layout, work = from_config(cfg)
    model = from_model_config(cfg.model)
    alone = estimate(model, layout, work, _topo(1.0)).time
    shared = estimate(model, layout, work, _topo(2.0)).time
    assert alone.bubble > 0.1 and shared.bubble == alone.bubble
    assert shared.pipeline_s == pytest.approx(alone.pipeline_s * (1 - alone.bubble / 2), rel=1e-9)
    assert shared.pipeline_s < alone.pipeline_s
    assert shared.step_time_s == pytest.approx(alone.step_time_s - (alone.pipeline_s - shared.pipeline_s), rel=1e-9)


@pytest.mark.parametrize("order", ["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"])
def test_shared_cores_shrink_the_bubble_not_the_gradients_wait(order):
    """pp2 x dp2 on 2 cores: the gradient reduction's exposure is measured on the simulator's clock (when
    each chunk's last backward ends against the pipeline's end), so sharing cores shrinks the pipeline and
    leaves the exposed reduction as it is. (Measured against the shrunk makespan, the last backward seemed
    to end after the pipeline and the difference, 0.1 s of the 0.6 s planned for benchmarks/network.py's
    pp2-dp2 case, was charged as gradient time.)"""
    cfg = tiny_config(pp=2, dp=2, microbatches=4, order=order)
    cfg.model.layers = 4
    layout, work = from_config(cfg)
    model = from_model_config(cfg.model)
    alone = estimate(model, layout, work, _topo(1.0)).time
    shared = estimate(model, layout, work, _topo(2.0)).time
    assert alone.grad_comm_s > 0 and shared.pipeline_s < alone.pipeline_s
    assert shared.grad_comm_s == pytest.approx(alone.grad_comm_s, rel=1e-9)
    assert shared.step_time_s == pytest.approx(alone.step_time_s - (alone.pipeline_s - shared.pipeline_s), rel=1e-9)


def test_without_a_pipeline_every_rank_is_busy_and_nothing_changes():
    cfg = tiny_config(dp=4, microbatches=2)
    layout, work = from_config(cfg)
    model = from_model_config(cfg.model)
    assert estimate(model, layout, work, _topo(2.0)).time.step_time_s == \
        estimate(model, layout, work, _topo(1.0)).time.step_time_s


def test_the_search_bound_still_holds_on_shared_cores():
    """The search prunes with a lower bound on every layout's step; on shared cores a pipeline's bound is
    divided by ranks_per_core, so what the search finds is what examining every layout finds. (Undivided,
    a pipeline layout's bound here exceeds its own step time.)"""
    cfg = tiny_config()
    cfg.model = ModelConfig(vocab=256, hidden=512, layers=4, heads=8, kv_heads=4, ffn=1408, max_seq=256)
    cfg.train.seq_len = 256     # compute large beside the collectives: the bubble's share decides the bound
    model = from_model_config(cfg.model)
    _, work = from_config(cfg)
    topo = _topo(2.0, latency_us=1)
    pruned = search(model, work, topo, 4, top=3)
    full = search(model, work, topo, 4, top=3, bound=False)
    assert any(lay.pp > 1 for _, lay in full.ranked)
    assert pruned.ranked[:3] == full.ranked[:3]
    keys = [s for s in _structures(model, work, topo, 4, {}) if isinstance(s[0], int)]
    bounds = dict(zip(keys, pruned.bounds))
    for t, lay in full.ranked:   # every structure's bound is at most each of its layouts' step
        assert bounds[_structure(lay)] <= t, (lay.short(), bounds[_structure(lay)], t)


@pytest.mark.parametrize("bad", [0.5, 0, -1, float("nan"), "two"])
def test_a_bad_ranks_per_core_is_one_line(bad):
    with pytest.raises(ConfigError, match="ranks_per_core"):
        check_topology(_topo(bad))


def test_a_topology_without_it_has_a_core_each():
    topo = topology_from_dict({"accelerator": {"peak_tflops": {"fp32": 1}, "memory_gib": 1},
                               "tier": [{"name": "x", "size": 2, "bandwidth_gbps": 1}]})
    assert topo.accelerator.ranks_per_core == 1.0
