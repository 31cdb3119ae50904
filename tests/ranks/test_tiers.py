"""Traffic per network tier, measured: the mesh knows which ranks share a node, the ledger records each
(dim, op) under the tier its group crosses ("intra" | "inter"), and the planner, placing the same groups
on a topology whose first tier is a node (`node_topology`), predicts those bytes exactly.

Two "nodes" of 4 ranks are emulated on 8 local gloo ranks (parallel.ranks_per_node = 4), then run for real
as two torchrun agents on localhost (LOCAL_WORLD_SIZE = 4 gives the nodes). Layout: tp2 × pp2 × dp2, in
the planner's recommended order (tp innermost: tp inside a node) and in a bad one (dp innermost, tp
outermost: every tp byte crosses between the nodes).
"""
import json
import os
import subprocess
import sys

import pytest

from fivefold import grid
from fivefold.comm import CommLedger
from fivefold.config import Config, ConfigError, ParallelConfig
from fivefold.mesh import ParallelMesh
from fivefold.plan.layout import from_config
from fivefold.plan.models import from_model_config
from fivefold.plan.topology import node_topology
from fivefold.plan.traffic import all_ranks, stage_flows
from fivefold.plan.tiers import all_ranks_by_tier, recommend_order
from fivefold.train.launch import free_port
from fivefold.train.trainer import train_rank

from tests.support.spawn import spawn_jobs
from tests.support.tiny import tiny_config
from tests.support.paths import ROOT

NODE = 4                                   # ranks per node: two nodes of 4
LAYOUT = dict(tp=2, pp=2, dp=2, microbatches=2)
BAD_ORDER = "dp-pp-cp-ep-tp"               # dp innermost, tp outermost: tp groups [r, r+4] span both nodes


def _config(order: str) -> Config:
    cfg = tiny_config(**LAYOUT, order=order, ranks_per_node=NODE)
    cfg.train.steps = 1
    return cfg


def recommended() -> str:
    """The planner's order for the layout: blocking traffic innermost (tp, then pp), dp outermost."""
    cfg = _config(grid.DEFAULT_ORDER)
    layout, work = from_config(cfg)
    return recommend_order(stage_flows(from_model_config(cfg.model), layout, work, 0))


def planned(cfg: Config) -> dict:
    """(dim, op, tier) -> calls, message_bytes, bytes_sent over all ranks for one step."""
    layout, work = from_config(cfg)
    return all_ranks_by_tier(from_model_config(cfg.model), layout, work, node_topology(cfg.parallel.ranks_per_node))


def tier_bytes(rows: dict) -> dict[str, float]:
    out: dict[str, float] = {}
    for (_, _, tier), row in rows.items():
        out[tier] = out.get(tier, 0.0) + row["bytes_sent"]
    return out


def assert_ledger_equals_plan(comm: dict, cfg: Config) -> None:
    """Every (dim, op, tier) row of comm.json equals the planner's, calls and bytes, per step."""
    steps = cfg.train.steps
    plan = planned(cfg)
    measured = {(r["dim"], r["op"], r["tier"]): r for r in comm["tiers"]}
    assert sorted(measured) == sorted(plan), "the planner predicts exactly the (dim, op, tier) rows recorded"
    for key, row in plan.items():
        assert measured[key]["calls"] == row["calls"] * steps, key
        assert measured[key]["message_bytes"] == row["message_bytes"] * steps, key
        assert measured[key]["bytes_sent"] == pytest.approx(row["bytes_sent"] * steps, rel=1e-12, abs=0), key
    assert comm["by_tier"] == pytest.approx({t: b * steps for t, b in tier_bytes(plan).items()}, rel=1e-12, abs=0)


# -- torch-free: nodes, tiers, the config rule ----------------------------------------------------------
def test_tier_of_ranks_and_nodes():
    assert grid.tier_of_ranks([0, 1, 2, 3], 4) == "intra"
    assert grid.tier_of_ranks([2, 4], 4) == "inter"
    assert grid.tier_of_ranks([0, 7], 0) == "intra"          # 0: unknown, one node
    assert [grid.node_of(r, 4) for r in (0, 3, 4, 7)] == [0, 0, 1, 1]


def test_mesh_docstring_example_on_nodes_of_8():
    tiers = ParallelMesh(ParallelConfig(tp=2, dp=4, pp=2, ep=2, ranks_per_node=8), rank=5).tiers()
    assert {g: tiers[g] for g in ("tp", "dp", "ep", "edp", "pp", "embed", "world")} == {
        "tp": "intra", "dp": "intra", "ep": "intra", "edp": "intra", "pp": "inter", "embed": "inter", "world": "inter"}


def test_node_topology_names_the_ledger_tiers():
    from fivefold.plan.topology import load_topology

    topo = load_topology("nodes:4")
    assert [(t.name, t.size) for t in topo.tiers] == [("intra", 4), ("inter", None)]
    assert [t.name for t in node_topology(0).tiers] == ["intra"]
    assert topo.tier_of(4, 8).name == "intra" and topo.tier_of(8, 8).name == "inter"


def test_ranks_per_node_must_divide_the_world():
    ParallelConfig(dp=8, ranks_per_node=4).validate(8)
    ParallelConfig(dp=8).validate(8)                              # 0: one node
    with pytest.raises(ConfigError, match=r"ranks_per_node \(3\) must divide the world size 8.*valid: 0 or"):
        ParallelConfig(dp=8, ranks_per_node=3).validate(8)
    with pytest.raises(ConfigError, match="ranks_per_node"):
        ParallelConfig(dp=8, ranks_per_node=-1).validate()


POW2 = [dict(tp=2, pp=2, dp=2), dict(tp=4, dp=2, pp=2), dict(tp=2, cp=2, dp=2, ep=2, pp=2), dict(dp=4, ep=4, tp=2),
        dict(cp=4, dp=2, ep=2, pp=2), dict(cp=4, dp=2, cp_mode="hybrid", ulysses=2), dict(tp=4, pp=4),
        dict(tp=2, cp=4, cp_mode="hybrid", ulysses=2, pp=2)]


def widths_of(p: ParallelConfig) -> grid.Widths:
    """The sub-groups' facts, as the trainer passes them: hybrid CP's Ulysses degree, and (tp = 4 here)
    K/V heads held by two tp ranks each (kv_heads = 2)."""
    return grid.Widths(ulysses=p.ulysses if p.cp_mode == "hybrid" else 1, kv_replicas=2 if p.tp == 4 else 1)
ORDERS = ["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", "dp-pp-cp-ep-tp", "pp-dp-tp-cp-ep", "cp-tp-ep-dp-pp"]


@pytest.mark.parametrize("degrees", POW2, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_every_rank_groups_cross_the_tier_the_planner_places_them_on(degrees):
    """For nodes and degrees that nest (powers of two), the tier each rank's group crosses (mesh) is the
    tier the planner places that group on (the innermost tier holding its block), for every group the
    mesh makes: embed, cp_ulysses, cp_ring and tp_kv included."""
    for order in ORDERS:
        p = ParallelConfig(**degrees, order=order)
        world, widths = p.world_size, widths_of(p)
        for k in (2, 4, 8):
            if k > world:
                continue
            p.ranks_per_node = k
            topo = node_topology(k)
            for rank in range(world):
                mesh = ParallelMesh(p, rank, ulysses=widths.ulysses, kv_replicas=widths.kv_replicas)
                assert set(mesh.groups) <= set(grid.GROUP_SPECS)
                for name, tier in mesh.tiers().items():
                    want = topo.tier_of(grid.group_block(p, name, order, widths), world).name
                    assert tier == want, (order, k, rank, name)


def test_hybrid_cp_places_the_ulysses_all_to_all_inside_a_node():
    """cp = 4, ulysses = 2, nodes of 2, cp innermost: Ulysses runs over ranks [0, 1] (one node), the ring
    over [0, 2] (two nodes). The planner used to place the all-to-all on the whole cp group ("inter")."""
    cfg = tiny_config(cp=4, dp=1, cp_mode="hybrid", ulysses=2, ranks_per_node=2)
    mesh = ParallelMesh(cfg.parallel, 0, ulysses=2)
    assert (mesh["cp_ulysses"].ranks, mesh["cp_ulysses"].tier) == ([0, 1], "intra")
    assert (mesh["cp_ring"].ranks, mesh["cp_ring"].tier) == ([0, 2], "inter")
    rows = planned(cfg)
    assert {t for (d, o, t) in rows if (d, o) == ("cp", "all_to_all")} == {"intra"}
    assert {t for (d, o, t) in rows if (d, o) in (("cp", "send"), ("cp", "recv"))} == {"inter"}


def test_kv_replica_sums_land_on_the_tp_kv_groups_tier():
    """tp = 4 over nodes of 2 with kv_heads = 2: the tp group spans both nodes, each K/V head's two tp
    ranks share one, so their partial K/V gradient sum stays inside it."""
    cfg = tiny_config(tp=4, dp=1, ranks_per_node=2, order="tp-cp-ep-dp-pp")
    mesh = ParallelMesh(cfg.parallel, 0, kv_replicas=2)
    assert (mesh["tp"].tier, mesh["tp_kv"].ranks, mesh["tp_kv"].tier) == ("inter", [0, 1], "intra")
    tiers = {t for (d, o, t), r in planned(cfg).items() if (d, o) == ("tp", "all_reduce")}
    assert tiers == {"intra", "inter"}


def test_ledger_rows_by_tier_and_comm_json(tmp_path):
    a, b = CommLedger(0, 2), CommLedger(1, 2)
    a.record("tp", "all_reduce", 100, 100, tier="intra")
    a.record("dp", "all_reduce", 100, 100, 0.5, tier="inter")
    b.record("dp", "all_reduce", 100, 100, 0.25, tier="inter")
    b.record("loss", "all_reduce", 8, 8, tier="intra")
    b.record("loss", "all_reduce", 8, 8, tier="inter")
    b.record("offload", "d2h", 64, 64)                           # a copy: on its link, as the planner names it
    total = CommLedger.merge([a, b])
    assert total.by_tier() == {"inter": 208, "intra": 108, "pcie": 64}
    assert total.total("loss", "all_reduce") == 16 and total.total("loss", tier="inter") == 8
    assert {(r["dim"], r["op"]): r["calls"] for r in total.rows()}[("loss", "all_reduce")] == 2   # rows keep (dim, op)
    total.write(tmp_path / "comm.json")
    d = json.loads((tmp_path / "comm.json").read_text())
    assert d["by_tier"] == {"inter": 208, "intra": 108, "pcie": 64}
    assert {(r["dim"], r["op"], r["tier"]) for r in d["tiers"]} >= {("loss", "all_reduce", "inter")}
    back = CommLedger.read(tmp_path / "comm.json")
    assert back.tier_rows() == total.tier_rows() and back.rows() == total.rows()
    assert [led.by_tier() for led in back.per_rank()] == [{"inter": 100, "intra": 100},
                                                          {"inter": 108, "intra": 8, "pcie": 64}]
    assert "sent per tier: inter 208 B, intra 108 B, pcie 64 B" in back.table()
    assert "per tier" not in CommLedger.merge([CommLedger.from_rows(a.tier_rows()[1:])]).table()   # one node
    for p in d["per_rank"]:                                      # a comm.json from before tiers still reads
        del p["tiers"]
    (tmp_path / "old.json").write_text(json.dumps(d))
    old = CommLedger.read(tmp_path / "old.json")
    assert old.rows() == total.rows() and old.by_tier() == {"": 380}


def test_planner_moves_tp_bytes_between_nodes_with_the_order():
    good, bad = planned(_config(recommended())), planned(_config(BAD_ORDER))
    tp = {tier: sum(r["bytes_sent"] for (d, _, t), r in rows.items() if d == "tp" and t == tier)
          for rows, tier in ((good, "intra"), (bad, "inter"))}
    assert recommended().startswith("tp-") and tp["intra"] > 0 and tp["inter"] == tp["intra"]
    assert not any(t == "inter" for (d, _, t) in good if d == "tp")
    assert not any(t == "intra" for (d, _, t) in bad if d == "tp")
    cfg = _config(recommended())
    layout, work = from_config(cfg)
    per_dim_op = {k: r["bytes_sent"] for k, r in all_ranks(from_model_config(cfg.model), layout, work).items()}
    for rows in (good, bad):   # split by tier, the same bytes as per (dim, op), whatever the order
        flat: dict = {}
        for (d, o, _), r in rows.items():
            flat[(d, o)] = flat.get((d, o), 0.0) + r["bytes_sent"]
        assert flat == pytest.approx(per_dim_op, rel=1e-12)


# -- 8 gloo ranks, two emulated nodes ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def emulated(tmp_path_factory) -> dict:
    """Both orders trained for one step in one spawn of 8 ranks (start-up is the slow part):
    order -> comm.json. The launcher kills every rank after 150 s without progress."""
    folders = {order: tmp_path_factory.mktemp(order) for order in (recommended(), BAD_ORDER)}
    jobs = [(order, train_rank, (_config(order).to_dict(), str(folder))) for order, folder in folders.items()]
    spawn_jobs(8, jobs, timeout_s=150)
    return {order: json.loads((folder / "comm.json").read_text()) for order, folder in folders.items()}


@pytest.mark.ranks
def test_recommended_order_keeps_tp_inside_a_node_and_ledger_equals_plan(emulated):
    order = recommended()
    comm = emulated[order]
    tp = [r for r in comm["tiers"] if r["dim"] == "tp"]
    assert tp and all(r["tier"] == "intra" for r in tp)                  # all tp bytes stay in a node
    assert comm["by_tier"]["inter"] > 0                                   # dp's gradients cross
    assert_ledger_equals_plan(comm, _config(order))


@pytest.mark.ranks
def test_bad_order_moves_tp_bytes_between_nodes_and_the_plan_says_so(emulated):
    good, bad = emulated[recommended()], emulated[BAD_ORDER]
    tp = {name: {r["tier"]: r["bytes_sent"] for r in c["tiers"] if r["dim"] == "tp"}
          for name, c in (("good", good), ("bad", bad))}
    assert set(tp["bad"]) == {"inter"} and tp["bad"]["inter"] == tp["good"]["intra"]
    assert bad["by_tier"]["inter"] > good["by_tier"]["inter"]            # visibly more between the nodes
    assert_ledger_equals_plan(bad, _config(BAD_ORDER))
    # the (dim, op) rows mean what they meant: the same bytes whatever the order
    assert {(r["dim"], r["op"]): r["bytes_sent"] for r in good["rows"]} == \
        pytest.approx({(r["dim"], r["op"]): r["bytes_sent"] for r in bad["rows"]})


# -- two real torchrun agents on localhost ------------------------------------------------------------------
SHAPE = ["--set", "model.vocab=256", "--set", "model.hidden=64", "--set", "model.layers=2", "--set", "model.heads=4",
         "--set", "model.kv_heads=2", "--set", "model.ffn=128", "--set", "model.max_seq=64", "--seq-len", "32",
         "--global-batch", "8", "--set", "train.data_limit_mb=0.25", "--set", "train.warmup=1",
         "--set", "train.checkpoint=false"]


@pytest.mark.ranks
def test_two_torchrun_agents_record_the_same_bytes_per_tier(tmp_path, emulated):
    """`--nnodes 2 --nproc-per-node 4 --rdzv-backend c10d` on 127.0.0.1: torchrun's LOCAL_WORLD_SIZE (4)
    becomes parallel.ranks_per_node, so comm.json's tiers equal the emulation's and the planner's."""
    order, out, port = recommended(), tmp_path / "run", free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    agents = []
    try:
        for node in range(2):
            agents.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "4",
                 "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "fivefold-tiers",
                 "--rdzv-conf", f"is_host={1 - node},join_timeout=120", "--local-addr", "127.0.0.1",
                 "--node-rank", str(node), "--max-restarts", "0",
                 "-m", "fivefold.cli", "train", *SHAPE, "--tp", "2", "--pp", "2", "--dp", "2", "--microbatches", "2",
                 "--order", order, "--steps", "1", "--out", str(out)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
        results = [a.communicate(timeout=240) for a in agents]
    finally:
        for a in agents:
            a.kill()
    for a, (_, err) in zip(agents, results):
        assert a.returncode == 0, err[-3000:]
    run = json.loads((out / "run.json").read_text())
    assert run["world_size"] == 8 and run["config"]["parallel"]["ranks_per_node"] == 4   # from LOCAL_WORLD_SIZE
    comm = json.loads((out / "comm.json").read_text())
    assert_ledger_equals_plan(comm, Config.from_dict(run["config"]))
    assert comm["by_tier"] == pytest.approx(emulated[order]["by_tier"], rel=1e-12, abs=0)
    assert all(r["tier"] == "intra" for r in comm["tiers"] if r["dim"] == "tp")


# -- what users read: the report, the Slurm example ---------------------------------------------------------
def test_report_shows_bytes_per_tier(tmp_path):
    """`fivefold report` adds a column per tier and hatches the inter-node part of each bar."""
    pytest.importorskip("matplotlib")
    from fivefold.tools.report import read_run, summary, write_report

    led = CommLedger(0, 1)
    led.record("tp", "all_reduce", 4096, 4096, tier="intra")
    led.record("dp", "all_reduce", 2048, 2048, tier="inter")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0, "loss": 5.0, "grad_norm": 1.0, "lr": 0.1, "tokens": 8, '
                                       '"seconds": 0.5}\n')
    CommLedger.merge([led]).write(run / "comm.json")
    table = summary([read_run(run)]).splitlines()
    assert table[0].split()[-4:] == ["intra", "tier", "inter", "tier"]
    assert table[1].split()[-4:] == ["4.0", "KiB", "2.0", "KiB"]
    assert {p.name for p in write_report([read_run(run)], tmp_path / "out", "svg")} == {"metrics.svg", "comm.svg"}


@pytest.mark.ranks
def test_slurm_example_runs_torchrun_per_node():
    script = ROOT / "examples" / "slurm" / "train.sbatch"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, timeout=30).returncode == 0
    text = script.read_text()
    for part in ("#SBATCH --nodes", "#SBATCH --gpus-per-node=8", "srun", "--rdzv-backend c10d",
                 '--rdzv-endpoint "$HEAD:$PORT"', '--nnodes "$SLURM_JOB_NUM_NODES"', "fivefold.cli train --config"):
        assert part in text, part
