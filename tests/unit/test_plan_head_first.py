"""DualPipe's placement (issue 38, point 2): the final norm, LM head and MTP modules on the first stage with
the embedding (`Layout.head_first`; DeepSeek-V3 §3.2.1 and §3.2.3), planned in memory, traffic and time, and
a search dimension for a model with MTP modules, under a one-way schedule (1F1B simulated with these
stage costs). DualPipe's bidirectional schedule, which places them so itself: tests/unit/test_plan_dualpipe.py."""
from dataclasses import replace

import pytest

from fivefold.cli import main
from fivefold.config import ConfigError
from fivefold.plan.estimate import estimate
from fivefold.plan.layout import Layout, Workload, check
from fivefold.plan.memory import stage_memory
from fivefold.plan.search import search
from fivefold.plan.traffic import pp_hops, stage_flows
from fivefold.plan.units import mtp_blocks, root_tensors, stage_params
from tests.support.deepseek import DSV3, DSV3_LAYOUT, DSV3_WORK, H800

SMALL = replace(DSV3, name="deepseek-v3-8l", layers=8, dense_layers=1, experts=16, top_k=4)   # MTP depth 1
WORK = Workload(seq=1024, global_batch=16)
LAY = Layout(pp=4, dp=2, ep=2, micro_batch=1)


def test_the_head_norm_and_mtp_move_to_the_first_stage_and_nothing_is_lost():
    last, first = LAY, replace(LAY, head_first=True)
    assert mtp_blocks(SMALL, 4, 3) and not mtp_blocks(SMALL, 4, 0)
    assert mtp_blocks(SMALL, 4, 0, True) == mtp_blocks(SMALL, 4, 3) and not mtp_blocks(SMALL, 4, 3, True)
    assert [t for _, t in root_tensors(SMALL, 1, 4, 0, True)] == ["", "norm", ""]   # embedding, norm, head
    assert root_tensors(SMALL, 1, 4, 3, True) == []
    per_stage = lambda lay: [sum(stage_params(SMALL, lay, j)) for j in range(4)]   # noqa: E731
    a, b = per_stage(last), per_stage(first)
    assert sum(a) == sum(b) and b[0] > a[0] and b[3] < a[3] and a[1:3] == b[1:3]


def test_the_last_stage_sends_its_hidden_states_on_to_the_first():
    """One more hop each way per micro-batch: the ring closes (last -> first forward, first -> last back)."""
    assert pp_hops(3, 4, 8, 1) == (0, 8) and pp_hops(0, 4, 8, 1) == (8, 0)
    assert all(pp_hops(j, 4, 8, 1, True) == (8, 8) for j in range(4))
    sent = lambda lay, j: sum(f.bytes_sent for f in stage_flows(SMALL, lay, WORK, j) if f.dim == "pp" and f.op == "send")  # noqa: E731
    for j in (0, 3):
        assert sent(replace(LAY, head_first=True), j) == 2 * sent(LAY, j)


def test_the_head_and_mtp_activations_are_alive_for_one_micro_batch_on_the_first_stage():
    """As on a last stage: the head's chunk comes last in the data flow, so its activations are not
    multiplied by the first stage's micro-batches in flight; the layers' are."""
    last, first = stage_memory(SMALL, LAY, WORK, 3), stage_memory(SMALL, replace(LAY, head_first=True), WORK, 0)
    plain0, tail = stage_memory(SMALL, LAY, WORK, 0), stage_memory(SMALL, replace(LAY, head_first=True), WORK, 3)
    head_and_mtp = last["activations"] - tail["activations"]   # what leaves the last stage
    assert head_and_mtp > 0
    assert first["activations"] == pytest.approx(plain0["activations"] + head_and_mtp, rel=1e-9)


def test_the_placement_needs_one_chunk_per_stage():
    with pytest.raises(ConfigError, match="head_first places the head"):
        check(SMALL, replace(LAY, head_first=True, pp=1, dp=8), WORK, 8)
    with pytest.raises(ConfigError, match="head_first places the head"):
        check(SMALL, replace(LAY, head_first=True, vpp=2, schedule="interleaved"), WORK, 8)


def test_deepseek_v3_search_and_the_published_layout_by_named_terms():
    """DeepSeek-V3 on 2,048 H800 with its own mechanisms (FP8 dispatch and GEMMs, node-limited routing M = 4,
    FP8 caching): the published PP16 x EP64 reads 24.1 s a step with the head and MTP on the last of 16 even
    stages; DualPipe's placement (head and MTP with the embedding) 19.8 s, and with the first stage's
    layers cut to 1 (1 + 15 x 4) 15.6 s. The search (all-to-all overlap, the norm/MLA recompute and the
    placement as dimensions) picks TP2 PP2 EP128 at 13.6 s: faster by the pipeline bubble, 0.31 of the
    published layout's step under 1F1B against under 0.05. DualPipe's bidirectional schedule, which
    DeepSeek-V3 §3.2.1 builds to remove that bubble, brings the published layout within 1% of the pick
    (tests/unit/test_plan_dualpipe.py)."""
    plain = estimate(DSV3, DSV3_LAYOUT, DSV3_WORK, H800, 2048)
    placed = estimate(DSV3, replace(DSV3_LAYOUT, head_first=True), DSV3_WORK, H800, 2048)
    cut = estimate(DSV3, replace(DSV3_LAYOUT, head_first=True, partition=",".join(["1"] + ["4"] * 15)),
                   DSV3_WORK, H800, 2048)
    assert cut.fits and cut.time.step_time_s < placed.time.step_time_s < plain.time.step_time_s
    res = search(DSV3, DSV3_WORK, H800, 2048, top=3)
    best = res.best[0]
    assert best.layout.ep_overlap and best.layout.recompute_norm_mla
    assert best.time.step_time_s < cut.time.step_time_s
    assert cut.time.bubble > 0.25 and best.time.bubble < 0.05
    # the whole difference is the bubble: the published layout's step without it would be the faster
    without_bubble = cut.time.step_time_s - cut.time.pipeline_s * cut.time.bubble
    assert without_bubble < best.time.step_time_s
    assert any(lay.head_first for _, lay in res.ranked)          # the placement was a search dimension


def test_the_cli_plans_and_holds_the_placement(capsys):
    argv = ["plan", "--model", "deepseek-v3", "--pp", "16", "--dp", "128", "--ep", "64", "--global-batch", "4096", "--json"]
    import json
    assert main(argv + ["--head-first"]) == 0
    assert json.loads(capsys.readouterr().out)["layout"]["head_first"]
    assert main(["plan", "--model", "deepseek-v3", "--gpus", "2048", "--pp", "16", "--no-head-first", "--top", "2",
                 "--json"]) == 0
    assert not json.loads(capsys.readouterr().out)["layout"]["head_first"]
