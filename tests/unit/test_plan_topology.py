"""Topologies: presets, custom TOML, the tier a group lands on, oversubscription."""
import pytest

from fivefold.config import ConfigError
from fivefold.plan.topology import TOPOLOGIES, GiB, group_bandwidth, load_topology

from tests.support.paths import ROOT


def test_presets():
    dgx, llama = TOPOLOGIES["dgx-h100"], TOPOLOGIES["llama3"]
    assert [t.size for t in dgx.tiers] == [8, 256, None]
    # Dubey et al. 2024 §3.3.1: 8 per server, 16 per rack, 3,072 per pod, 1:7 above the pods (24K GPUs)
    assert [t.size for t in llama.tiers] == [8, 16, 3072, 24576]
    assert llama.tiers[-1].oversubscription == 7
    assert llama.accelerator.memory == 80 * GiB


def test_tier_of_a_group():
    t = TOPOLOGIES["llama3"]
    assert t.tier_of(8, 16384).name == "nvlink"
    assert t.tier_of(16, 16384).name == "rack"
    assert t.tier_of(128, 16384).name == "pod"
    assert t.tier_of(1024, 16384).name == "pod"       # 3072 / 1024 = 3 blocks per pod
    assert t.tier_of(2048, 16384).name == "cluster"   # 2048 does not divide 3072: some groups straddle
    assert t.tier_of(4096, 16384).name == "cluster"
    assert t.tier_of(2048, 2048).name == "pod"        # the whole job inside one pod


def test_oversubscription_bites_all_to_all_not_rings():
    t = TOPOLOGIES["llama3"]
    assert group_bandwidth(t, 3, "all_to_all", 8, 8 * 3072) == pytest.approx(50e9 / 7)
    assert group_bandwidth(t, 3, "all_reduce", 128, 16384) == pytest.approx(50e9)     # few crossings
    assert group_bandwidth(t, 3, "all_reduce", 6, 6 * 3072) == pytest.approx(50e9 * 6 / (6 * 7))


def test_pipeline_stages_sharing_a_domain_cross_it_for_their_duty():
    """A group inside one pipeline stage, in a domain that holds `stages` stages: its own stage's ranks
    cross together, the other stages' for their duty (the share of the step they spend crossing). Duty 1
    is every rank at once (as without a pipeline), duty 0 one stage's ranks alone."""
    from fivefold.plan.layout import Layout
    from fivefold.plan.tiers import domain_stages

    t = TOPOLOGIES["llama3"]                       # spine tier 3: oversubscription 7
    lockstep = group_bandwidth(t, 3, "all_to_all", 8, 8 * 3072)
    assert group_bandwidth(t, 3, "all_to_all", 8, 8 * 3072, stages=2, duty=1.0) == pytest.approx(lockstep)
    assert group_bandwidth(t, 3, "all_to_all", 8, 8 * 3072, stages=2, duty=0.0) == pytest.approx(50e9 * 2 / 7)
    assert group_bandwidth(t, 3, "all_to_all", 8, 8 * 3072, stages=2, duty=0.5) == pytest.approx(50e9 / (7 * 0.75))
    assert group_bandwidth(t, 3, "all_to_all", 8, 8 * 3072, stages=8, duty=0.0) == pytest.approx(50e9)
    assert group_bandwidth(t, 3, "all_reduce", 6, 6 * 3072, stages=2, duty=0.0) == pytest.approx(50e9 * 12 / 42)
    fabric = load_topology(str(ROOT / "examples" / "fabrics" / "two-leaves.toml"))   # 4 nodes of 2, 2 a leaf, spine 1:2
    moe = Layout(tp=2, pp=2, dp=2, ep=2)
    assert domain_stages(moe, fabric, 2, "ep", "tp-cp-pp-ep-dp") == 2   # a leaf holds both stages
    assert domain_stages(moe, fabric, 2, "dp", "tp-cp-pp-ep-dp") == 2
    assert domain_stages(moe, fabric, 2, "ep", "tp-cp-ep-dp-pp") == 1   # a leaf holds one stage
    assert domain_stages(moe, fabric, 2, "pp", "tp-cp-pp-ep-dp") == 1   # pp's sends cross between stages
    assert domain_stages(moe, fabric, 1, "ep", "tp-cp-pp-ep-dp") == 1   # a node holds one stage
    assert domain_stages(Layout(tp=2, dp=4, ep=2), fabric, 2, "ep", "tp-cp-dp-ep-pp") == 1


def test_the_estimate_finds_the_crossing_duty_between_its_bounds():
    """MoE tp2 × pp2 × dp2 × ep2 on two leaves with ep across the spine (a leaf holds both stages): the
    stages spend part of the step crossing the spine (a duty strictly between 0 and 1), and the step is
    faster than with every rank crossing at once. With ep inside a leaf no group inside a stage crosses
    the spine: no duty."""
    from dataclasses import replace

    from fivefold.config import ModelConfig
    from fivefold.plan.estimate import crossing_seconds, estimate
    from fivefold.plan.layout import Layout, Workload
    from fivefold.plan.models import from_model_config
    from fivefold.plan import estimate as est_mod

    fabric = load_topology(str(ROOT / "examples" / "fabrics" / "two-leaves.toml"))
    model = from_model_config(ModelConfig(vocab=1024, hidden=256, layers=4, heads=4, kv_heads=2, ffn=512,
                                          max_seq=512, experts=4, top_k=2))
    work = Workload(seq=512, global_batch=16, dtype="fp32")
    lay = Layout(tp=2, pp=2, dp=2, ep=2, etp=2, micro_batch=2, order="tp-cp-pp-ep-dp")   # experts cut over tp, ep over dp
    e = estimate(model, lay, work, fabric)
    crossing = crossing_seconds(e.flows_by_stage, lay, fabric)
    assert list(crossing) == [2] and 0.0 < crossing[2] < e.time.step_time_s
    rounds = est_mod.DUTY_ROUNDS
    try:
        est_mod.DUTY_ROUNDS = 0
        lockstep = estimate(model, lay, work, fabric).time.step_time_s
    finally:
        est_mod.DUTY_ROUNDS = rounds
    assert e.time.step_time_s < lockstep
    inside = replace(lay, order="tp-cp-ep-dp-pp")
    ei = estimate(model, inside, work, fabric)
    assert crossing_seconds(ei.flows_by_stage, inside, fabric) == {}


def test_custom_toml(tmp_path):
    f = tmp_path / "lab.toml"
    f.write_text('name = "lab"\n[accelerator]\nname = "X1"\nmemory_gib = 96\npeak_tflops = { bf16 = 500 }\n'
                 '[[tier]]\nname = "board"\nsize = 4\nbandwidth_gbps = 200\n'
                 '[[tier]]\nname = "ethernet"\nbandwidth_gbps = 12.5\nlatency_us = 20\noversubscription = 2\n')
    t = load_topology(str(f))
    assert t.name == "lab" and t.accelerator.memory == 96 * GiB and t.accelerator.peak("bf16") == 500e12
    assert t.tiers[1].effective_bandwidth == 12.5e9 / 2
    assert t.tier_of(8, 64).name == "ethernet"
    bad = tmp_path / "bad.toml"
    bad.write_text('[[tier]]\nname = "a"\nsize = 8\nbandwidth_gbps = 1\n[[tier]]\nname = "b"\nsize = 12\n'
                   'bandwidth_gbps = 1\n')
    with pytest.raises(ConfigError, match="nest"):
        load_topology(str(bad))


def test_unknown_topology_lists_known():
    with pytest.raises(ConfigError) as e:
        load_topology("tpu-pod")
    assert "dgx-h100" in str(e.value) and "llama3" in str(e.value)
