"""A schedule is one value (issue 25, step 1): `rules.check_schedule` holds every rule, so a schedule the
runtime cannot run is refused by `Config.validate`, the CLI and the planner alike, in one line, before
any rank starts; the planner, the runtime's report and pipeline.json carry the same `Schedule`,
micro-batch group included."""
import json

import pytest

from fivefold import rules
from fivefold.cli import main
from fivefold.config import Config, ConfigError, load_config
from fivefold.parallel.pipeline import Schedule
from fivefold.plan.layout import Layout, Workload, check, from_config, schedule_of
from fivefold.plan.estimate import estimate
from fivefold.plan.models import PRESETS, from_model_config
from fivefold.plan.topology import node_topology

# (overrides, the rule's words, the valid values' words): every one passed Config.validate before and
# failed inside each spawned rank (or was planned as another schedule)
INVALID = [
    ({"parallel.pp": 2, "parallel.vpp": 2, "parallel.schedule": "1f1b", "parallel.microbatches": 2},
     "vpp > 1 needs the interleaved schedule", "valid: schedule interleaved, or vpp = 1"),
    ({"parallel.pp": 2, "parallel.vpp": 2, "parallel.schedule": "zb", "parallel.microbatches": 2},
     "vpp > 1 needs the interleaved schedule", "valid: schedule interleaved, or vpp = 1"),
    ({"parallel.pp": 2, "parallel.microbatches": 4, "parallel.microbatch_group": 2},
     "microbatch_group applies to the interleaved schedule with vpp > 1", "valid: 0"),
    ({"parallel.pp": 2, "parallel.vpp": 2, "parallel.schedule": "interleaved", "parallel.microbatches": 3,
      "train.global_batch": 12},
     "the interleaved schedule needs microbatches divisible by pp", "use microbatches in [2, 4]"),
    ({"parallel.vpp": 2, "parallel.schedule": "interleaved"}, "vpp > 1 interleaves model chunks", "valid: vpp = 1"),
    ({"parallel.pp": 2}, "schedule 1f1b needs microbatches >= pp (2)", "valid: microbatches >= 2"),
]


def _world(cfg: Config) -> int:
    return cfg.parallel.world_size


@pytest.mark.parametrize("overrides, rule, valid", INVALID, ids=lambda x: str(x)[:40])
def test_config_validate_refuses_a_schedule_the_runtime_cannot_run(overrides, rule, valid):
    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError) as e:
        cfg.validate(_world(cfg))
    msg = str(e.value)
    assert rule in msg and valid in msg and "\n" not in msg, msg


@pytest.mark.parametrize("overrides, rule, valid", INVALID[:1])
def test_the_planner_refuses_it_with_the_same_line(overrides, rule, valid):
    """The planner used to plan pp=2, vpp=2, schedule=1f1b as interleaved (Layout.effective_schedule)."""
    cfg = load_config(None, overrides)
    layout = Layout(pp=2, vpp=2, schedule="1f1b", micro_batch=cfg.train.global_batch // 2)
    with pytest.raises(ConfigError) as e:
        check(from_model_config(cfg.model), layout, Workload(seq=cfg.train.seq_len, global_batch=cfg.train.global_batch))
    assert rule in str(e.value) and valid in str(e.value)
    with pytest.raises(ConfigError, match="vpp > 1 needs the interleaved schedule"):
        check(PRESETS["llama3-8b"], Layout(pp=4, vpp=2, dp=2), Workload(seq=4096, global_batch=64))


def test_train_cli_exits_2_before_any_rank_starts(capsys):
    rc = main(["train", "--nproc", "2", "--pp", "2", "--vpp", "2", "--schedule", "1f1b", "--microbatches", "2"])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.count("\n") == 0 and "vpp > 1 needs the interleaved schedule" in err and "valid:" in err, err


def test_plan_cli_exits_2_for_it(capsys):
    rc = main(["plan", "--model", "llama3-8b", "--pp", "2", "--vpp", "2", "--schedule", "1f1b", "--tp", "8",
               "--dp", "1", "--seq", "4096", "--global-batch", "16"])
    assert rc == 2 and "vpp > 1 needs the interleaved schedule" in capsys.readouterr().err


def test_every_rule_lives_in_rules():
    rules.check_schedule("interleaved", 2, 2, 6, 3)
    rules.check_schedule("interleaved", 2, 1, 2)          # interleaved with one chunk per rank is 1F1B
    rules.check_schedule("gpipe", 4, 1, 1)                # GPipe runs any number of micro-batches
    rules.check_schedule_lists("1f1b", 4, 1, 1)           # the simulator studies any (p, m)
    with pytest.raises(ConfigError, match="needs microbatches >= pp"):
        rules.check_schedule("1f1b", 4, 1, 1)
    assert rules.choices(rules.ScheduleKind) == (rules.GPIPE, rules.ONE_F_ONE_B, rules.INTERLEAVED, rules.ZB)


def _interleaved_cfg(group: int) -> Config:
    cfg = load_config(None, {"parallel.pp": 2, "parallel.vpp": 2, "parallel.schedule": "interleaved",
                             "parallel.microbatches": 6, "parallel.microbatch_group": group,
                             "train.global_batch": 12, "parallel.partition": "llama3", "model.layers": 6})
    return cfg.validate(2)


def test_schedule_value_resolves_the_group_and_round_trips():
    default, wide = Schedule.of(_interleaved_cfg(0)), Schedule.of(_interleaved_cfg(3))
    assert default.microbatch_group == 2 and wide.microbatch_group == 3 and default != wide
    assert Schedule.of(_interleaved_cfg(2)) == default            # N = 0 means N = pp: one value
    assert wide.partition.counts == (1, 2, 2, 1) and wide.pp == 2
    assert Schedule.from_dict(json.loads(json.dumps(wide.to_dict()))) == wide
    assert wide.actions() != default.actions()
    assert wide.simulate().peak_in_flight != default.simulate().peak_in_flight
    assert "N=3" in wide.title()


def test_planner_runtime_report_and_pipeline_json_carry_the_same_schedule(tmp_path):
    """One value from the config to the plan, the runtime's action lists, its report and pipeline.json."""
    from fivefold.mesh import ParallelMesh
    from fivefold.parallel.pipeline.dimension import PipelineParallelism
    from fivefold.parallel.pipeline.runtime import report, write_report

    cfg = _interleaved_cfg(3)
    schedule = Schedule.of(cfg)
    layout, work = from_config(cfg)
    model = from_model_config(cfg.model)
    assert schedule_of(model, layout, work) == schedule                                # the planner's
    planned = estimate(model, layout, work, node_topology(0), 2)
    assert planned.schedule == schedule and planned.to_dict()["schedule"] == schedule.to_dict()
    pipes = [PipelineParallelism(ParallelMesh(cfg.parallel, rank), cfg) for rank in range(2)]
    assert all(p.schedule == schedule for p in pipes)                                  # the runtime's
    assert [p.actions for p in pipes] == schedule.actions()
    measured = [[tuple(b) for b in row] for row in schedule.simulate().timeline]      # stands in for a run
    info = report(measured, schedule)
    write_report(tmp_path, info)
    written = json.loads((tmp_path / "pipeline.json").read_text())
    assert Schedule.from_dict(written) == schedule and written["microbatch_group"] == 3
    unit = schedule.simulate()
    assert written["simulated_unit_costs"]["bubble"] == unit.bubble
    assert written["simulated_unit_costs"]["timeline"] == [[list(b) for b in row] for row in unit.timeline]
