"""The pipeline runtime reproduces the single-process run for every schedule and sends the bytes of the
formula; zero bubble's split backward and activation recomputation change nothing but time and memory.

Multi-rank cases run in three spawns (2, 4 and 8 ranks, module fixtures); each test checks one property
of their results against single-process references computed in this process. One-process tests drive
the runtime directly on a single stage (pp = 1, no communication) to compare gradients exactly.
"""
import json
import weakref

import pytest
import torch

from fivefold.comm import Group, volume
from fivefold.config import Config, ConfigError
from fivefold.mesh import coords, grid_sizes
from fivefold.model import Transformer, loss_sum
from fivefold.parallel.microbatch import MicroBatch, cut
from fivefold.parallel.recompute import apply_recompute
from fivefold.parallel.pipeline import build_schedule, partition_layers
from fivefold.parallel.pipeline.runtime import PipelineRuntime, Stage, stage_names
from fivefold.train.trainer import Trainer

from tests.support.spawn import spawn_jobs
from tests.support.tiny import TOL, assert_states_close, tiny_config
from tests.support.reference import reference, run_steps


def cfg(layers=2, recompute="none", partition="even", **parallel) -> Config:
    c = tiny_config(**parallel)
    c.model.layers = layers
    c.train.recompute = recompute
    c.parallel.partition = partition
    return c


# name -> (world, config); the reference is the single-process run of the same model (same layer count)
CASES = {
    # 2 ranks
    "pp2_gpipe": (2, dict(pp=2, schedule="gpipe", microbatches=4)),
    "pp2_1f1b_full": (2, dict(pp=2, schedule="1f1b", microbatches=2, recompute="full")),
    "pp2_interleaved_selective": (2, dict(pp=2, schedule="interleaved", vpp=2, microbatches=2, layers=4,
                                          recompute="selective")),
    "pp2_zb": (2, dict(pp=2, schedule="zb", microbatches=4)),
    "pp2_zb_full": (2, dict(pp=2, schedule="zb", microbatches=2, recompute="full")),
    "pp2_zero2_1f1b": (2, dict(pp=2, zero=2, microbatches=2, bucket_mb=0.05)),
    "pp2_zero3_interleaved": (2, dict(pp=2, zero=3, schedule="interleaved", vpp=2, microbatches=2, layers=4)),
    # 4 ranks
    "pp4_gpipe": (4, dict(pp=4, schedule="gpipe", microbatches=4, layers=4)),
    "pp4_1f1b_llama3": (4, dict(pp=4, schedule="1f1b", microbatches=4, layers=8, partition="llama3")),
    "pp4_interleaved": (4, dict(pp=4, schedule="interleaved", vpp=2, microbatches=4, layers=8)),
    "pp4_zb": (4, dict(pp=4, schedule="zb", microbatches=4, layers=4)),
    "pp2_dp2_zero1": (4, dict(pp=2, dp=2, zero=1, microbatches=2, bucket_mb=0.05)),
    "pp2_dp2_zero2_interleaved": (4, dict(pp=2, dp=2, zero=2, schedule="interleaved", vpp=2, microbatches=2,
                                          layers=4, bucket_mb=0.05)),
    "pp2_dp2_zero3_1f1b_full": (4, dict(pp=2, dp=2, zero=3, microbatches=2, recompute="full")),
    "pp2_dp2_zero2_each_interleaved": (4, dict(pp=2, dp=2, zero=2, reduce_each_microbatch=True, schedule="interleaved",
                                               vpp=2, microbatches=2, layers=4)),   # shards accumulate
    "pp2_dp2_zero3_each": (4, dict(pp=2, dp=2, zero=3, reduce_each_microbatch=True, microbatches=4)),
    "pp2_tp2_sp_interleaved": (4, dict(pp=2, tp=2, sp_mode="megatron", schedule="interleaved", vpp=2,
                                       microbatches=2, layers=4)),        # boundaries carry s/tp tokens
    # 8 ranks: pipeline x tensor x data parallel with ZeRO-1
    "pp2_tp2_dp2_zero1": (8, dict(pp=2, tp=2, dp=2, zero=1, microbatches=2, bucket_mb=0.05)),
    "pp2_tp2_dp2_zero1_zb_full": (8, dict(pp=2, tp=2, dp=2, zero=1, microbatches=2, schedule="zb",
                                          recompute="full")),
}


def case_config(name: str) -> Config:
    return cfg(**CASES[name][1])


# -- what each rank runs -------------------------------------------------------------------------

def resume_half_way(rank, world, cfg_dict):
    """Two steps, full state, a fresh trainer loads it and runs the third step."""
    first = Trainer(Config.from_dict(cfg_dict), rank, world, quiet=True)
    for k in range(2):
        first.step(k)
    state = first.full_state()
    second = Trainer(Config.from_dict(cfg_dict), rank, world, quiet=True)
    second.load_full_state(state)
    second.step(2)
    return {"state": second.full_state()["model"], "half": state["model"]}


def with_aux_loss(rank, world, cfg_dict):
    """Three steps with an auxiliary loss on every block's output, through the model's channel."""
    tr = Trainer(Config.from_dict(cfg_dict), rank, world, quiet=True)
    for block in tr.model.layers.children():   # a ModuleList, or a stage's ModuleDict
        block.register_forward_hook(lambda m, args, out: m.aux.add(out, 0.05 * out.float().pow(2).mean()))
    losses = [tr.step(k)["loss"] for k in range(3)]
    return {"losses": losses, "state": tr.full_state()["model"]}


def with_micro_batch_group(rank, world, cfg_dict, group, steps=3):
    """Three steps of the interleaved schedule with `group` micro-batches per group (Llama 3's tunable N;
    the run config has no field for it, so the pipeline's action list is rebuilt with it)."""
    c = Config.from_dict(cfg_dict)
    p = c.parallel
    tr = Trainer(c, rank, world, quiet=True)
    pipe = next(d for d in tr.dims if getattr(d, "name", None) == "pp")
    default = pipe.runtime.actions
    pipe.runtime.actions = build_schedule(p.schedule, p.pp, p.microbatches, p.vpp,
                                          microbatch_group=group)[pipe.rank]
    losses, norms = [], []
    for k in range(steps):
        m = tr.step(k)
        losses.append(m["loss"])
        norms.append(m["grad_norm"])
    return {"losses": losses, "grad_norms": norms, "state": tr.full_state()["model"],
            "reordered": pipe.runtime.actions != default}


OVERLAP_CASES = {   # 4 ranks, pp2 x dp2, small buckets so a stage has several
    "ddp": dict(pp=2, dp=2, microbatches=4, bucket_mb=0.02),
    "zero1_zb": dict(pp=2, dp=2, zero=1, schedule="zb", microbatches=4, bucket_mb=0.02),
    "zero2_interleaved": dict(pp=2, dp=2, zero=2, schedule="interleaved", vpp=2, microbatches=2, layers=4,
                              bucket_mb=0.02),
    "zero3": dict(pp=2, dp=2, zero=3, microbatches=4),
}


def reductions_in_schedule(rank, world, cases, steps=2):
    """Per case: dp reductions launched by the end of the step's first final backward (a chunk's last
    weight-gradient action) and in the whole step, and whether the state equals that of
    parallel.overlap_grad_reduce off (reduce after the schedule) bit for bit."""
    out = {}
    for name, d in cases.items():
        states = []
        for overlap in (True, False):
            c = cfg(**d)
            c.parallel.overlap_grad_reduce = overlap
            tr = Trainer(c, rank, world, quiet=True)
            marks, final = [], []

            def calls():
                return sum(r["calls"] for r in tr.ledger.rows() if r["dim"] == "dp"
                           and r["op"] in ("all_reduce", "reduce_scatter"))

            def sync(enabled, set_sync=tr.engine.set_sync):
                set_sync(enabled)
                if enabled:
                    final.append(True)
                elif final:
                    marks.append(calls())
            tr.engine.set_sync = sync
            before = calls()
            tr.step(0)
            total = calls() - before
            during = marks[0] - before if marks else 0
            for k in range(1, steps):
                tr.step(k)
            states.append(tr.full_state()["model"])
            if overlap:
                got = {"during": during, "total": total}
        got["same"] = all(torch.equal(states[0][k], states[1][k]) for k in states[0])
        out[name] = got
    return out


def train_run(rank, world, cfg_dict, out):
    """A whole `fivefold train` run (writes metrics, comm, checkpoint, pipeline.json/svg on rank 0)."""
    Trainer(Config.from_dict(cfg_dict), rank, world, quiet=True).run(out)
    return None


def spawn(world, extra=()):
    jobs = [(n, run_steps, (case_config(n).to_dict(),)) for n, (w, _) in CASES.items() if w == world]
    return spawn_jobs(world, jobs + list(extra))


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp2run")
    run_cfg = cfg(pp=2, schedule="1f1b", microbatches=4)
    run_cfg.train.steps, run_cfg.train.checkpoint = 2, True
    extra = [("resume", resume_half_way, (cfg(pp=2, schedule="zb", microbatches=2).to_dict(),)),
             ("aux", with_aux_loss, (cfg(pp=2, microbatches=2, recompute="full").to_dict(),)),
             ("group", with_micro_batch_group, (cfg(pp=2, schedule="interleaved", vpp=2, microbatches=4,
                                                    layers=4).to_dict(), 4)),
             ("run", train_run, (run_cfg.to_dict(), str(out)))]
    results = spawn(2, extra)
    results["run_dir"] = out
    return results


@pytest.fixture(scope="module")
def four():
    return spawn(4, [("overlap", reductions_in_schedule, (OVERLAP_CASES,))])


@pytest.fixture(scope="module")
def eight():
    return spawn(8)


@pytest.fixture(scope="module")
def references():
    """Single-process runs of the same model over the same micro-batches (gradient accumulation), so the
    comparison isolates the pipeline: its gradients are then bitwise those of one process, except the
    tied embedding's (two copies summed in another order). Against one unsplit batch, Adam lifts the
    accumulation's rounding above rtol 1e-5 on ~0.1% of an 8-layer model's elements (as in any layout)."""
    cache = {}

    def get(layers, microbatches=1):
        if (layers, microbatches) not in cache:
            cache[layers, microbatches] = reference(cfg(layers=layers, microbatches=microbatches))
        return cache[layers, microbatches]
    return get


def check_equal(name, results, references):
    c = case_config(name)
    ref = references(c.model.layers, c.parallel.microbatches * c.parallel.dp)
    for r in results[name]:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
        # the tied embedding is counted once: the norm is the single-process norm
        torch.testing.assert_close(torch.tensor(r["grad_norms"]), torch.tensor(ref["grad_norms"]), rtol=1e-5, atol=0)
        assert_states_close(r["state"], ref["state"], **TOL["fp32"])


@pytest.mark.parametrize("name", [n for n, (w, _) in CASES.items() if w == 2])
@pytest.mark.ranks
def test_two_ranks_equal_single_process(name, two, references):
    check_equal(name, two, references)


@pytest.mark.parametrize("name", [n for n, (w, _) in CASES.items() if w == 4])
@pytest.mark.ranks
def test_four_ranks_equal_single_process(name, four, references):
    check_equal(name, four, references)


@pytest.mark.parametrize("name", [n for n, (w, _) in CASES.items() if w == 8])
@pytest.mark.ranks
def test_pp_tp_dp_zero1_on_eight_ranks_equals_single_process(name, eight, references):
    check_equal(name, eight, references)


# -- bytes -----------------------------------------------------------------------------------------

def stage_of(c: Config, rank: int) -> int:
    p = c.parallel
    return coords(rank, grid_sizes(p)[0], p.order.split("-"))["pp"]


def boundary_bytes(c: Config) -> int:
    p, t = c.parallel, c.train
    seq = t.seq_len // (p.tp if p.sp_mode == "megatron" else 1)
    return (t.global_batch // (p.dp * p.microbatches)) * seq * c.model.hidden * 4


def expected_pp(c: Config, stage: int) -> dict:
    """Per rank per step: one send of b·s·h·bytes per micro-batch per chunk boundary each way (× v when
    interleaved; s/tp with sequence parallelism); the last chunk sends no activation, the first no
    gradient; receives mirror it."""
    p = c.parallel
    act = boundary_bytes(c)
    m, v, last = p.microbatches, (p.vpp if p.schedule == "interleaved" else 1), p.pp - 1
    sends = 2 * m * v - m * (stage == last) - m * (stage == 0)
    recvs = 2 * m * v - m * (stage == 0) - m * (stage == last)
    return {"send": (sends, sends * act, sends * volume.send(act)), "recv": (recvs, recvs * act, 0.0)}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.ranks
def test_p2p_bytes_match_the_formula(name, two, four, eight):
    c = case_config(name)
    world, p = CASES[name][0], c.parallel
    results = {2: two, 4: four, 8: eight}[world][name]
    v = p.vpp if p.schedule == "interleaved" else 1
    act = boundary_bytes(c)
    for rank, r in enumerate(results):
        want = expected_pp(c, stage_of(c, rank))
        for rows in r["ledger"]:
            got = {x["op"]: (x["calls"], x["message_bytes"], x["bytes_sent"]) for x in rows if x["dim"] == "pp"}
            assert got == want, (rank, got, want)
    # summed over one pipeline's ranks: 2 (p·v - 1) boundaries-crossings of b·s·h per micro-batch
    pipeline = [rank for rank in range(world) if coords(rank, grid_sizes(p)[0], p.order.split("-"))["dp"] == 0
                and coords(rank, grid_sizes(p)[0], p.order.split("-"))["tp"] == 0]
    total = sum(x["bytes_sent"] for rank in pipeline for x in results[rank]["ledger"][0]
                if x["dim"] == "pp")
    assert total == 2 * (p.pp * v - 1) * p.microbatches * volume.send(act)


@pytest.mark.parametrize("name", ["pp2_zero2_1f1b", "pp2_zero3_interleaved", "pp2_dp2_zero2_interleaved",
                                  "pp2_dp2_zero3_1f1b_full"])
@pytest.mark.ranks
def test_zero_under_pipeline_reduces_once_per_step(name, two, four):
    """Under a pipeline ZeRO-2/3 reduce-scatter each unit once per step (gradients accumulate unsharded
    over the micro-batches, as ZeRO-1); ZeRO-3 all-gathers each block before every forward and backward
    it runs and the root unit once (under full recompute too: a block is re-run inside its backward,
    after its pre-backward gather)."""
    c = case_config(name)
    p = c.parallel
    results = {2: two, 4: four}[CASES[name][0]][name]
    per_use = 2
    for rank, r in enumerate(results):
        blocks = len(partition_layers(c.model.layers, p.pp, p.vpp).layers_of_rank(stage_of(c, rank)))
        for rows in r["ledger"]:
            got = {x["op"]: x["calls"] for x in rows if x["dim"] == "dp"}
            if p.dp == 1:
                assert got == {}, got   # a group of one sends nothing
                continue
            units = got["reduce_scatter"]
            if p.zero == 3:
                assert units == blocks + 1                          # one per block and the root
                assert got["all_gather"] == per_use * p.microbatches * blocks + 1
            else:
                assert got["all_gather"] == units                   # the parameters, after the step


@pytest.mark.ranks
def test_full_recompute_keeps_what_the_planner_plans(two):
    """Under a pipeline full recompute checkpoints each block too (parallel/recompute.py): every stage's
    ActivationMeter peak is within 10% of the planner's activations (the dry run's tolerance)."""
    from fivefold.tools.run_plan import planned_memory

    c = case_config("pp2_1f1b_full")
    planned = planned_memory(c)["stages"]
    for rank, r in enumerate(two["pp2_1f1b_full"]):
        want = planned[stage_of(c, rank)]["activations"]
        assert abs(r["activations"] / want - 1) <= 0.10, (rank, r["activations"], want)


@pytest.mark.parametrize("name", list(OVERLAP_CASES))
@pytest.mark.ranks
def test_gradient_reduction_overlaps_the_schedule(name, four):
    """With parallel.overlap_grad_reduce (the default) a chunk's buckets or units are reduced as soon as
    its last backward has run, while the schedule goes on (stage 1 drains stage 0's backwards; stage 0
    runs its own); only the tied embedding's, summed over the copies first, wait for the end. The
    result is bit for bit the result of reducing after the schedule."""
    for r in four["overlap"]:
        got = r[name]
        assert got["same"]
        assert 0 < got["during"] < got["total"], got   # the held (tied) one waits; the rest went early


@pytest.mark.parametrize("name", ["pp2_gpipe", "pp4_zb", "pp2_tp2_dp2_zero1", "pp2_zero3_interleaved"])
@pytest.mark.ranks
def test_tied_embedding_gradients_summed_once_per_step(name, two, four, eight):
    """First and last stage all-reduce the embedding gradient (v·h/tp elements) once per step; the
    middle stages send nothing under "embed"."""
    c = case_config(name)
    world, p = CASES[name][0], c.parallel
    results = {2: two, 4: four, 8: eight}[world][name]
    emb = c.model.vocab * c.model.hidden // p.tp * 4
    for rank, r in enumerate(results):
        rows = [x for x in r["ledger"][0] if x["dim"] == "embed"]
        if stage_of(c, rank) in (0, p.pp - 1):
            assert [(x["op"], x["calls"], x["message_bytes"], x["bytes_sent"]) for x in rows] == \
                [("all_reduce", 1, emb, volume.all_reduce(emb, 2))]
        else:
            assert rows == []


@pytest.mark.ranks
def test_loss_reported_by_every_rank(two, four):
    for results in (two["pp2_gpipe"], four["pp2_dp2_zero1"], four["pp4_interleaved"]):
        assert len({tuple(r["losses"]) for r in results}) == 1


@pytest.mark.ranks
def test_auxiliary_losses_train_through_the_pipeline(two, references):
    """An auxiliary loss added inside the blocks (model.aux) gives the single-process gradients under
    pp = 2 with full recompute: it is trained on the stage that holds its block, counted once."""
    single = with_aux_loss(0, 1, cfg(microbatches=2).to_dict())
    without = references(2, 2)
    assert not torch.allclose(single["state"]["layers.0.mlp.up.weight"], without["state"]["layers.0.mlp.up.weight"])
    for r in two["aux"]:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=0)
        assert_states_close(r["state"], single["state"], **TOL["fp32"])


# -- checkpoints, resume, the measured timeline -------------------------------------------------

@pytest.mark.ranks
def test_interleaved_micro_batch_group_equals_single_process(two, references):
    """N = 4 micro-batches per group on pp = 2 (breadth-first instead of the default N = p = 2) runs the same
    work in another order: the same losses, norms and weights as one process."""
    ref = references(4, 4)
    for r in two["group"]:
        assert r["reordered"]
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(r["grad_norms"]), torch.tensor(ref["grad_norms"]), rtol=1e-5, atol=0)
        assert_states_close(r["state"], ref["state"], **TOL["fp32"])


@pytest.mark.ranks
def test_resume_from_full_state_is_exact(two, references):
    """The full state holds the single-process names (the tied embedding once); loading it into a new
    pipeline (both copies of the tied weight) and stepping gives the single-process third step."""
    ref = references(2, 2)
    for r in two["resume"]:
        assert "head.weight" not in r["half"] and "embed.weight" in r["half"]
        assert_states_close(r["state"], ref["state"], **TOL["fp32"])


@pytest.mark.ranks
def test_training_run_writes_the_measured_timeline(two):
    out = two["run_dir"]
    info = json.loads((out / "pipeline.json").read_text())
    assert (info["schedule"], info["pp"], info["microbatches"]) == ("1f1b", 2, 4)
    measured = info["measured"]["timeline"]
    assert len(measured) == 2
    for rank, row in enumerate(measured):
        assert sorted((b[0], b[1]) for b in row) == sorted((k, mb) for k in "FB" for mb in range(4))
        assert all(b[2] == rank and b[4] >= b[3] >= 0 for b in row)
    assert 0 < info["measured"]["bubble"] < 1
    assert info["simulated_unit_costs"]["bubble"] == pytest.approx(1 / 5)   # (p-1)/(m+p-1)
    assert 0 <= info["simulated_measured_costs"]["bubble"] < 1
    svg = (out / "pipeline.svg").read_text()
    assert "measured" in svg and "simulated" in svg
    from fivefold.train import checkpoint

    saved = checkpoint.full_tensors(out)   # the stages' pieces, by single-process name (tied head: once)
    assert set(saved) == {n for n, _ in Transformer(cfg().model).named_parameters()}


# -- one process: the runtime on a single stage, compared exactly ---------------------------------

class LiveSaved:
    """Bytes of tensors autograd keeps for backward, and their peak (saved_tensors_hooks)."""

    def __init__(self):
        self.now = self.peak = 0

    def pack(self, t):
        n = t.numel() * t.element_size()
        self.now += n
        self.peak = max(self.peak, self.now)
        box = [t]
        holder = type("Held", (), {})()
        holder.box = box
        weakref.finalize(holder, self.release, n)
        return holder

    def release(self, n):
        self.now -= n

    @staticmethod
    def unpack(holder):
        return holder.box[0]


def one_stage(schedule: str, recompute: str = "none", m: int = 4):
    """Run a schedule on one stage (pp = 1): loss, gradients by name, peak saved-activation bytes."""
    c = cfg(layers=2)
    c.model.tie_embeddings = False   # on one stage a tied weight would have two modules
    model = Transformer(c.model, seed=3)
    stage = Stage(model, partition_layers(2, 1), 0)
    apply_recompute(stage, "none" if schedule == "zb" and recompute == "full" else recompute)   # as parallelize
    runtime = PipelineRuntime(stage, build_schedule(schedule, 1, m)[0], Group.single("pp"), recompute)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, c.model.vocab, (8, 32), generator=gen)
    y = torch.roll(x, -1, 1)
    live = LiveSaved()
    with torch.autograd.graph.saved_tensors_hooks(live.pack, live.unpack):
        loss = runtime.run(cut(x, y, m, y.numel()), loss_sum)
    grads = {n: p.grad.clone() for n, p in stage.named_parameters()}
    return float(loss), grads, live.peak, runtime


def test_split_backward_and_recompute_give_the_same_gradients():
    """I + W (zero bubble) and full or selective recomputation give the gradients of a plain backward,
    bitwise: the same kernels on the same numbers, only at other times."""
    loss, grads, _, _ = one_stage("gpipe")
    for schedule, recompute in (("zb", "none"), ("gpipe", "full"), ("gpipe", "selective"), ("zb", "full"),
                                ("1f1b", "selective")):
        other_loss, other, _, _ = one_stage(schedule, recompute)
        assert other_loss == loss
        for n in grads:
            assert torch.equal(other[n], grads[n]), (schedule, recompute, n)


def test_recompute_keeps_fewer_activations():
    """GPipe keeps every micro-batch's activations: full recompute keeps only block inputs and the head's
    tensors (and the activations of the one block being recomputed), selective drops the attention
    core's."""
    peaks = {r: one_stage("gpipe", r)[2] for r in ("none", "selective", "full")}
    assert peaks["full"] < peaks["selective"] < peaks["none"]
    assert peaks["full"] < peaks["none"] / 2


def test_weight_gradient_waits_for_w():
    """After I the weights have no gradient yet; W adds exactly the missing part."""
    c = cfg(layers=2)
    c.model.tie_embeddings = False
    stage = Stage(Transformer(c.model, seed=3), partition_layers(2, 1), 0)
    actions = build_schedule("zb", 1, 1)[0]
    assert [a.kind for a in actions] == ["F", "I", "W"]
    runtime = PipelineRuntime(stage, actions[:2], Group.single("pp"))
    x = torch.randint(0, c.model.vocab, (2, 16))
    runtime.begin([MicroBatch(x, torch.roll(x, -1, 1), loss_tokens=x.numel())], loss_sum, None)   # a step's start
    runtime.timeline = []
    for a in actions:
        runtime.compute(a)
        if a.kind == "I":
            assert all(p.grad is None for p in stage.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in stage.parameters())


# -- stages and configuration ---------------------------------------------------------------------

def test_stages_keep_single_process_names_and_a_tied_copy():
    c = cfg(layers=4)
    part = partition_layers(4, 2, 2)          # chunks 0..3 -> ranks 0, 1, 0, 1
    model = Transformer(c.model, seed=1)
    names = stage_names(model, part)
    first = Stage(Transformer(c.model, seed=1), part, 0)
    last = Stage(Transformer(c.model, seed=1), part, 1)
    assert [n for n, _ in first.named_parameters()] == [n for n, _ in names[0]]
    assert {n for n, _ in last.named_parameters()} == {n for n, _ in names[1]} | {"head.weight"}
    assert first.tied is first.embed.weight and first.tied_copy is None
    assert last.tied is last.tied_copy is last.head.weight
    assert torch.equal(last.head.weight, first.embed.weight)
    assert last.head.weight.data_ptr() != first.embed.weight.data_ptr()
    assert {n.split(".")[1] for n, _ in names[0] if n.startswith("layers")} == {"0", "2"}


def test_config_rules_for_pipeline():
    with pytest.raises(ConfigError, match="zb schedule with ZeRO-3"):
        Trainer(cfg(pp=2, dp=1, zero=3, schedule="zb", microbatches=2), 0, 2)
    with pytest.raises(ConfigError, match="reshard_after_forward = true"):
        Trainer(cfg(pp=2, dp=1, zero=3, microbatches=2, reshard_after_forward=False), 0, 2)
    with pytest.raises(ConfigError, match="train.recompute must be one of"):
        cfg(recompute="some").validate()
    odd = cfg(pp=2, schedule="interleaved", vpp=2, microbatches=3, layers=4)
    odd.train.global_batch = 6
    with pytest.raises(ConfigError, match="divisible by pp"):
        Trainer(odd, 0, 2)
    with pytest.raises(ConfigError, match="sums to"):
        Trainer(cfg(pp=2, microbatches=2, partition="1,2"), 0, 2)
