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


def test_pipeline_stages_sharing_a_domain_do_not_cross_it_at_once():
    """A group inside one pipeline stage, in a domain that holds `stages` stages: the uplinks serve that stage's
    ranks only (benchmarks/README.md: two stages' all-to-alls measured 0.9% apart where counting every rank
    at once planned 43%); groups across stages (pp's sends) keep every rank at once."""
    from fivefold.plan.layout import Layout
    from fivefold.plan.traffic import domain_stages

    t = TOPOLOGIES["llama3"]
    assert group_bandwidth(t, 3, "all_to_all", 8, 8 * 3072, stages=2) == pytest.approx(50e9 * 2 / 7)
    assert group_bandwidth(t, 3, "all_to_all", 8, 8 * 3072, stages=8) == pytest.approx(50e9)
    assert group_bandwidth(t, 3, "all_reduce", 6, 6 * 3072, stages=2) == pytest.approx(50e9 * 12 / 42)
    fabric = load_topology(str(ROOT / "examples" / "fabrics" / "two-leaves.toml"))   # 4 nodes of 2, 2 a leaf, spine 1:2
    moe = Layout(tp=2, pp=2, dp=2, ep=2)
    assert domain_stages(moe, fabric, 2, "ep", "tp-cp-pp-ep-dp") == 2   # a leaf holds both stages
    assert domain_stages(moe, fabric, 2, "dp", "tp-cp-pp-ep-dp") == 2
    assert domain_stages(moe, fabric, 2, "ep", "tp-cp-ep-dp-pp") == 1   # a leaf holds one stage
    assert domain_stages(moe, fabric, 2, "pp", "tp-cp-pp-ep-dp") == 1   # pp's sends cross between stages
    assert domain_stages(moe, fabric, 1, "ep", "tp-cp-pp-ep-dp") == 1   # a node holds one stage
    assert domain_stages(Layout(tp=2, dp=4, ep=2), fabric, 2, "ep", "tp-cp-dp-ep-pp") == 1


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
