"""Topologies: presets, custom TOML, the tier a group lands on, oversubscription."""
import pytest

from fivefold.config import ConfigError
from fivefold.plan.topology import TOPOLOGIES, GiB, group_bandwidth, load_topology


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
