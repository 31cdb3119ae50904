"""Mechanisms published runs use are search dimensions (issue 38, point 2): the expert all-to-all overlap
(DeepSeek-V3 §3.2.1) on for ep > 1 unless fixed off, the norm and MLA up-projection recompute (§3.4) tried
for an MLA model unless fixed; what the user gives is held; the bound stays a bound."""
from dataclasses import replace

from fivefold.cli import main
from fivefold.plan.layout import Workload
from fivefold.plan.models import PRESETS
from fivefold.plan.search import mechanisms, search
from fivefold.plan.topology import TOPOLOGIES

MOE = replace(PRESETS["deepseek-v3"], name="deepseek-v3-8l", layers=8, dense_layers=1, experts=64, top_k=6, mtp_depth=0)
DGX = TOPOLOGIES["dgx-h100"]
WORK = Workload(seq=4096, global_batch=256)


def _search(fixed=None, **kw):
    return search(MOE, WORK, DGX, 64, fixed, top=4, **kw)


def test_expert_overlap_is_on_for_ep_above_one_and_held_off_when_fixed():
    res = _search()
    assert res.best and all(e.layout.ep_overlap == (e.layout.ep > 1) for e in res.best)
    assert any(e.layout.ep > 1 for e in res.best)
    assert mechanisms(next(e.layout for e in res.best if e.layout.ep > 1))["expert all-to-all"] == "overlapped"
    off = _search({"ep_overlap": False})
    assert not any(e.layout.ep_overlap for e in off.best)
    assert off.best[0].time.step_time_s >= res.best[0].time.step_time_s


def test_norm_mla_recompute_is_tried_and_held():
    on, off = _search({"recompute_norm_mla": True}), _search({"recompute_norm_mla": False})
    assert all(e.layout.recompute_norm_mla for e in on.best) and not any(e.layout.recompute_norm_mla for e in off.best)
    free = _search()
    assert free.considered > off.considered                  # both rungs were tried
    dense = search(PRESETS["llama3-8b"], WORK, DGX, 8, top=2)
    assert not any(e.layout.recompute_norm_mla for e in dense.best)   # no MLA: the option changes nothing


def test_the_bound_stays_below_every_timed_layout_with_the_overlap():
    """Soundness with ep_overlap on: the exhaustive search's times are never under a structure's bound."""
    fast, full = _search(bound=True), _search(bound=False)
    times = lambda res: sorted(round(t, 9) for t, _ in res.ranked)[:4]   # noqa: E731
    assert times(fast) == times(full)
    assert [e.layout for e in fast.best] == [e.layout for e in full.best]


def test_the_cli_holds_the_flags_in_a_search(capsys):
    assert main(["plan", "--model", "mixtral-8x7b", "--gpus", "64", "--no-ep-overlap", "--top", "3", "--json"]) == 0
    import json
    out = json.loads(capsys.readouterr().out)
    assert not out["layout"]["ep_overlap"] and out["layout"]["ep"] > 1
    assert out["search"]["mechanisms"]["expert all-to-all"] == "exposed"
    assert main(["plan", "--model", "mixtral-8x7b", "--gpus", "64", "--top", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layout"]["ep_overlap"] == (out["layout"]["ep"] > 1)


def test_the_bound_stays_below_where_stages_share_an_oversubscribed_tier():
    """Soundness with the crossing duty: on two leaves behind a 1:2 spine, with pp inside the nodes'
    order so a leaf holds several stages, the timed layouts place their in-stage groups at the duty
    their own step gives (`estimate.timed_stages`); the bound takes duty 0, so it never cuts a layout the
    exhaustive search ranks among the best."""
    from fivefold.config import ModelConfig
    from fivefold.plan.estimate import crossing_seconds
    from fivefold.plan.models import from_model_config
    from fivefold.plan.topology import load_topology

    from tests.support.paths import ROOT

    fabric = load_topology(str(ROOT / "examples" / "fabrics" / "two-leaves.toml"))
    model = from_model_config(ModelConfig(vocab=1024, hidden=256, layers=4, heads=4, kv_heads=2, ffn=512,
                                          max_seq=512, experts=4, top_k=2))
    work = Workload(seq=512, global_batch=16, dtype="fp32")
    fast = search(model, work, fabric, 8, top=8, order="tp-cp-pp-ep-dp")
    full = search(model, work, fabric, 8, top=8, order="tp-cp-pp-ep-dp", bound=False)
    times = lambda res: sorted(round(t, 9) for t, _ in res.ranked)[:8]   # noqa: E731
    assert times(fast) == times(full)
    assert [e.layout for e in fast.best] == [e.layout for e in full.best]
    assert any(crossing_seconds(e.flows_by_stage, e.layout, fabric) for e in full.best)   # the duty was in play
    assert fast.skipped + fast.skipped_layouts + fast.untimed > 0                      # and the bound cut some
