"""Memory per stage: partition, ZeRO, activations (flash, CP, Ulysses), schedules, experts per EP rank."""
import pytest

from fivefold.config import ConfigError
from fivefold.plan.layout import Layout, Workload, check
from fivefold.plan.memory import (layer_acts, memory, model_states, stage_layers, stage_params,
                                  stage_activations)


def counts(layers, pp, vpp=1, partition="even"):
    return tuple(len(r) for r in stage_layers(layers, pp, vpp, partition))
from fivefold.plan.models import PRESETS

LLAMA8, L405, MIXTRAL = PRESETS["llama3-8b"], PRESETS["llama3-405b"], PRESETS["mixtral-8x7b"]
W = Workload(seq=4096, global_batch=64)


def test_llama3_uneven_split_and_even_split():
    """Dubey et al. 2024 §3.3.2: 126 layers on 16 stages, first and last one layer fewer."""
    assert counts(126, 16, partition="llama3") == (7,) + (8,) * 14 + (7,)
    assert counts(32, 4) == (8, 8, 8, 8)
    assert counts(10, 4) == (2, 2, 3, 3)
    assert counts(5, 2, partition="llama3") == (3, 2)            # the runtime's split (the review's drift case)
    assert counts(9, 3, partition="llama3") == (3, 4, 2)
    assert stage_layers(16, 2, vpp=2) == ((0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15))


def test_embedding_on_first_stage_head_on_last():
    lay = Layout(pp=4, dp=1)
    per_layer = LLAMA8.layer_params(0)
    emb = LLAMA8.vocab * LLAMA8.hidden
    assert stage_params(LLAMA8, lay, 0)[0] == 8 * per_layer + emb
    assert stage_params(LLAMA8, lay, 1)[0] == 8 * per_layer
    assert stage_params(LLAMA8, lay, 3)[0] == 8 * per_layer + emb + LLAMA8.hidden
    assert sum(stage_params(LLAMA8, lay, j)[0] for j in range(4)) == LLAMA8.num_params()


def test_experts_per_ep_rank():
    lay = Layout(ep=8, dp=8)
    dense, expert = stage_params(MIXTRAL, lay, 0)
    assert expert == MIXTRAL.layers * 1 * MIXTRAL.expert_params()        # 8 experts / 8 ranks
    assert dense + 8 * expert == MIXTRAL.num_params()
    # experts' optimizer state is sharded over the expert-data-parallel group (dp·cp/ep = 1 here)
    z = model_states(MIXTRAL, Layout(ep=8, dp=8, zero=1), W, 0)
    assert z["optimizer"] == pytest.approx(12 * (dense / 8 + expert), rel=1e-6)


def test_flash_attention_drops_the_s2_term_and_selective_recompute_too():
    no_flash = Workload(seq=8192, flash=False)
    a = layer_acts(LLAMA8, 0, no_flash, 1)
    assert a.scores == LLAMA8.heads * 8192 * 2        # softmax output, 2 bytes, no dropout
    flash = memory(LLAMA8, Layout(), Workload(seq=8192, global_batch=1)).most_loaded["activations"]
    plain = memory(LLAMA8, Layout(), Workload(seq=8192, global_batch=1, flash=False)).most_loaded["activations"]
    sel = memory(LLAMA8, Layout(recompute="selective"), Workload(seq=8192, global_batch=1, flash=False))
    assert plain - flash == pytest.approx(32 * 8192 * a.scores, rel=0.01)
    assert sel.most_loaded["activations"] == pytest.approx(flash, rel=0.01)


def test_context_parallel_shards_the_sequence():
    one = stage_activations(LLAMA8, Layout(dp=8), Workload(seq=8192, global_batch=8), 0)
    for mode in ("ring", "ulysses"):
        four = stage_activations(LLAMA8, Layout(dp=2, cp=4, cp_mode=mode), Workload(seq=8192, global_batch=2), 0)
        assert four == pytest.approx(one / 4, rel=0.02)


def test_schedules_hold_their_micro_batches():
    w = Workload(seq=4096, global_batch=32)
    acts = {s: memory(LLAMA8, Layout(pp=4, dp=1, schedule=s), w).stages[0]["activations"]
            for s in ("gpipe", "1f1b")}
    inter = memory(LLAMA8, Layout(pp=4, dp=1, vpp=2, schedule="interleaved"), w).stages[0]["activations"]
    assert acts["gpipe"] / acts["1f1b"] == pytest.approx(32 / 4, rel=0.02)
    assert inter / acts["1f1b"] == pytest.approx(1 + 3 / 8, rel=0.02)   # 1 + (p-1)/(p·v)


def test_full_recompute_keeps_layer_inputs():
    """Korthikanti §4.3: full recompute stores each layer's input (2sbh, /t with SP) plus, while one
    layer is recomputed, that layer's activations."""
    w, T, h = Workload(seq=4096, global_batch=1), 4096, LLAMA8.hidden
    none = stage_activations(LLAMA8, Layout(tp=8, pp=2, sp_mode="megatron"), w, 0)
    full = stage_activations(LLAMA8, Layout(tp=8, pp=2, sp_mode="megatron", recompute="full"), w, 0)
    emb = T * 2 * h / 8
    one_layer = (none - emb) / 16
    assert full == pytest.approx(16 * T * 2 * h / 8 + one_layer + emb)


def test_bad_layouts_name_the_rule_and_nearest_values():
    with pytest.raises(ConfigError, match=r"tp \(3\).*valid tp: \[2, 4\]|valid tp: \[1, 2, 4\]"):
        check(LLAMA8, Layout(tp=3), W)
    with pytest.raises(ConfigError, match=r"world size 64 must equal.*dp = 8"):
        check(LLAMA8, Layout(tp=8, dp=2), W, gpus=64)
    with pytest.raises(ConfigError, match=r"layers \(32\) must be >= pp\*vpp.*valid: pp"):
        check(LLAMA8, Layout(pp=64), W)
    with pytest.raises(ConfigError, match=r"experts \(8\) must divide by ep \(3\); valid ep"):
        check(MIXTRAL, Layout(ep=3, dp=6), Workload(seq=4096, global_batch=60))
    with pytest.raises(ConfigError, match=r"needs a mixture-of-experts model"):
        check(LLAMA8, Layout(ep=2, dp=2), W)
    with pytest.raises(ConfigError, match=r"global_batch \(64\) must divide by dp\*micro_batch"):
        check(LLAMA8, Layout(dp=3), W)
    with pytest.raises(ConfigError, match=r"Ulysses.*valid cp"):
        check(L405, Layout(tp=8, cp=32, cp_mode="ulysses"), Workload(seq=8192, global_batch=64))
