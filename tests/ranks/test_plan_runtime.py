"""The planner predicts exactly what a real `fivefold train` run records.

Each layout below is trained for a few steps by the real runtime (`train_rank` on fresh gloo ranks, the
same entry `fivefold train` uses); its `comm.json` (the ledger summed over ranks and steps) and
`run.json` (model-state bytes per rank, counted from the tensors that exist) are then held against the
planner, which never saw the run: calls and bytes per (dim, op) must be equal, not close.

To extend to a new parallelism, add its layout to LAYOUTS. A layout the runtime does not run yet is
skipped with the runtime's own reason, so the list can run ahead of the runtime.
"""
import json
from pathlib import Path

import pytest

from fivefold.config import Config, ConfigError
from fivefold.plan.layout import from_config
from fivefold.plan.buffers import offload_bytes
from fivefold.plan.memory import stage_memory
from fivefold.plan.models import from_model_config
from fivefold.plan.traffic import all_ranks
from fivefold.train.trainer import supported, train_rank

from tests.support.spawn import ranks
from tests.support.tiny import TINY_MLA, scratch_folder, tiny_config

# (parallel degrees, dtype[, model fields]). Layouts are grouped by world size and run in one spawn per
# group (at most one 4-rank spawn: it is the slow one); one the runtime does not run yet is skipped with the
# runtime's reason. The tiny model has 4 heads and 2 KV heads, vocab 256. Within a group, put layouts whose
# runtime is still moving (pp) last: a failure stops the group's later runs.
LAYOUTS = [
    (dict(dp=2, microbatches=2, bucket_mb=0.05), "bf16"),                  # DDP, several buckets
    (dict(dp=2, zero=2, microbatches=2, bucket_mb=0.05), "bf16"),          # per-micro-batch reduce-scatter
    (dict(dp=3, zero=1, microbatches=2, bucket_mb=0.05), "fp32"),          # odd n: padded buckets
    (dict(dp=3, zero=3, microbatches=2), "fp32"),                          # per-block units, padded
    (dict(tp=2, dp=1, microbatches=2), "fp32"),                            # f/g all-reduces, vocab-parallel CE
    (dict(tp=2, dp=1, sp_mode="megatron", microbatches=2), "fp32"),        # all-gather / reduce-scatter
    (dict(tp=2, dp=1, sp_mode="megatron", microbatches=2), "bf16", dict(vocab=259)),  # bf16 acts, padded vocab
    (dict(dp=2, zero=3, microbatches=2, recompute="full"), "fp32"),        # re-run inside the gathered backward
    (dict(tp=2, dp=1, sp_mode="megatron", microbatches=2, recompute="full"), "fp32"),  # SP collectives twice
    (dict(cp=2, dp=1, cp_mode="ulysses", microbatches=2, recompute="selective"), "fp32"),  # all-to-alls kept
    (dict(pp=2, dp=1, microbatches=2), "fp32"),                            # sends, tied embedding, loss
    (dict(pp=2, dp=1, microbatches=2, partition="llama3"), "fp32", dict(layers=5)),  # split (3, 2), not (2, 3)
    # 4 ranks
    (dict(tp=4, dp=1, sp_mode="megatron", microbatches=2), "fp32", dict(vocab=262)),  # K/V over 2 ranks each
    (dict(tp=2, dp=2, zero=1, microbatches=2, bucket_mb=0.05), "bf16"),   # tp x ZeRO-1 buckets
    (dict(tp=2, dp=2, zero=3, sp_mode="megatron", microbatches=2), "fp32"),  # SP norm sync of ZeRO-3 shards
    (dict(tp=2, dp=2, zero=3, reshard_after_forward=False, microbatches=2), "bf16",
     dict(kv_heads=1)),                                                    # K/V sync over tp; one dp rank owns it
    (dict(pp=2, tp=2, dp=1, sp_mode="megatron", microbatches=2), "fp32"),  # pp x tp x SP
    (dict(pp=2, dp=2, zero=1, vpp=2, schedule="interleaved", partition="llama3", microbatches=2, bucket_mb=0.05),
     "fp32", dict(layers=5)),                                              # chunks (1,2,1,1): rank layers 2, 3
    (dict(pp=2, dp=2, zero=2, schedule="interleaved", vpp=2, microbatches=2, bucket_mb=0.05), "fp32",
     dict(layers=4)),                                                      # ZeRO-2 under pp: reduced once per step
    (dict(pp=2, dp=2, zero=3, microbatches=2), "bf16"),                    # ZeRO-3 under pp: 2m gathers per block
    (dict(pp=2, dp=2, zero=3, microbatches=2, recompute="full"), "fp32"),  # ... with full recompute too
    (dict(pp=2, dp=2, zero=2, reduce_each_microbatch=True, schedule="interleaved", vpp=2, microbatches=2), "fp32",
     dict(layers=4)),                                                      # a reduce-scatter per micro-batch and block
    (dict(pp=2, dp=2, zero=3, reduce_each_microbatch=True, microbatches=2), "bf16",
     dict(tie_embeddings=False)),                                          # untied: the root too, every micro-batch
    (dict(dp=2, zero=3, offload="cpu", microbatches=2), "fp32"),           # ZeRO-Offload: d2h grads, h2d params
    (dict(dp=2, zero=1, offload="nvme", offload_dir="{tmp}", microbatches=2, bucket_mb=0.05), "bf16"),  # + disk
    (dict(dp=2, zero=3, offload="nvme", offload_dir="{tmp}", microbatches=2), "bf16"),  # params on disk
    (dict(pp=2, dp=1, zero=3, offload="nvme", offload_dir="{tmp}", microbatches=2), "fp32"),  # root read once a step
    (dict(pp=2, dp=2, zero=3, microbatches=2, partition="llama3"), "fp32", dict(layers=5)),  # root once per step
    (dict(dp=2, zero=1, microbatches=2, bucket_mb=0.01), "fp32",
     dict(experts=4, top_k=2, moe_ffn=64, capacity_factor=1.0)),          # experts at ep = 1: in dp's buckets
    (dict(dp=2, ep=2), "fp32", dict(experts=4, top_k=2, moe_ffn=64, capacity_factor=1.0)),  # EP padded buffers
    (dict(dp=2, ep=2, recompute="full"), "fp32", dict(experts=4, top_k=2, moe_ffn=64, capacity_factor=1.0)),  # a2a x2
    (dict(dp=2, ep=2, fp8_dispatch=True), "bf16", dict(experts=4, top_k=2, moe_ffn=64, capacity_factor=1.0)),  # fp8
    (dict(cp=2, dp=1), "fp32"),                                            # ring: K,V sends, dK,dV back
    (dict(cp=2, dp=1, cp_mode="ulysses", microbatches=2), "bf16"),         # 4 all-to-alls each way per layer
    (dict(cp=4, dp=1, cp_mode="hybrid", ulysses=2), "fp32"),               # Ulysses inside, ring outside
    (dict(cp=2, dp=2, zero=3, cp_mode="ulysses"), "fp32", dict(kv_heads=1)),  # K/V repeated; ZeRO-3 over dp×cp
    (dict(cp=2, tp=2, dp=1, sp_mode="megatron", cp_mode="ulysses"), "fp32"),  # cp × tp + SP
    (dict(cp=2, pp=2, dp=1, cp_mode="ring", microbatches=2), "fp32"),      # cp × pp
    (dict(tp=2, dp=2, ep=2), "fp32", dict(experts=4, top_k=2, moe_ffn=64, capacity_factor=1.0)),  # EP x TP
    (dict(dp=4, ep=2, zero=1, microbatches=2), "fp32",
     dict(experts=4, top_k=2, moe_ffn=64, capacity_factor=1.25, shared_experts=1)),  # experts over edp, ZeRO-1                                            # not in the runtime yet
]


# latent attention (DeepSeek's MLA; tests/support/tiny.py TINY_MLA): the latents enter the tensor-parallel region,
# their projections' gradients are partial under SP, K and V of their own head dims cross the cp ring and
# the Ulysses all-to-alls. A fixture of their own (one 2-rank spawn), so `-k mla` runs only them.
MLA_MOE = dict(experts=4, top_k=2, moe_ffn=32, capacity_factor=1.0, router="sigmoid_bias", shared_experts=1,
               dense_layers=1, routed_scaling_factor=2.5)
MLA_LAYOUTS = [
    (dict(tp=2, dp=1, microbatches=2), "fp32", TINY_MLA),                        # f on the latents
    (dict(tp=2, dp=1, sp_mode="megatron", microbatches=2), "bf16", TINY_MLA),    # latents all-gathered
    (dict(tp=2, dp=1, sp_mode="megatron"), "fp32", {**TINY_MLA, "q_lora_rank": 0}),  # x for q_proj, latents
    (dict(tp=2, dp=1), "fp32", {**TINY_MLA, "q_lora_rank": 0}),
    (dict(cp=2, dp=1), "fp32", TINY_MLA),                                        # ring: K, V of two widths
    (dict(cp=2, dp=1, cp_mode="ulysses", microbatches=2), "bf16", TINY_MLA),
    (dict(dp=2, zero=1, microbatches=2, bucket_mb=0.01), "fp32", TINY_MLA),      # exact buckets
    (dict(dp=2, ep=2), "fp32", {**TINY_MLA, **MLA_MOE}),                         # MoE + MLA
]


# LoRA (model/lora.py): the adapters are what the engines hold, reduce and gather; the frozen base weights are
# held whole beside them. Rank 4 on every linear layer of each block. Then train.freeze patterns.
LORA_LAYOUTS = [
    (dict(dp=2, lora_rank=4, microbatches=2, bucket_mb=0.001), "fp32"),         # DDP: adapters' buckets only
    (dict(dp=2, zero=3, lora_rank=4, microbatches=2), "bf16"),                  # ZeRO-3 gathers adapters; base whole
    (dict(dp=2, zero=2, lora_rank=4, microbatches=2, bucket_mb=0.001), "fp32"), # ZeRO-2: adapters' gradient shards
    (dict(tp=2, dp=1, sp_mode="megatron", lora_rank=4, microbatches=2), "fp32"),  # A or B whole, summed over tp
    (dict(pp=2, dp=1, lora_rank=4, microbatches=2), "fp32"),                    # no root unit: embedding frozen
    (dict(dp=2, ep=2, lora_rank=4), "fp32", dict(experts=4, top_k=2, moe_ffn=64, capacity_factor=1.0,
                                                 shared_experts=1)),            # experts frozen, shared adapted
    (dict(tp=4, dp=1, lora_rank=4, microbatches=2), "fp32"),                    # K/V's B over 2 ranks each
    (dict(tp=2, dp=2, zero=1, lora_rank=4, microbatches=2, bucket_mb=0.001), "bf16"),
    # train.freeze: the planner filters the runtime's tensors by the same name patterns
    (dict(dp=2, freeze=("embed.*", "layers.0.*"), microbatches=2, bucket_mb=0.001), "fp32"),  # DDP of the rest
    (dict(dp=2, zero=3, freeze=("layers.1.mlp.*", "norm.weight"), microbatches=2), "bf16"),     # ZeRO-3 units
    (dict(tp=2, dp=1, sp_mode="megatron", freeze=("embed.*", "layers.0.attn.*"), microbatches=2), "fp32"),
    (dict(pp=2, dp=1, freeze=("embed.*", "layers.0.attn.*"), microbatches=2), "fp32"),          # tied copy frozen
    (dict(tp=2, dp=1, freeze=("*_norm.weight", "norm.weight"), microbatches=2), "fp32"),        # no SP norm sync
]


def _config(par: dict, dtype: str, model: dict | None = None) -> Config:
    par = dict(par)
    recompute = par.pop("recompute", "none")   # train fields, listed with the layout
    lora_rank = par.pop("lora_rank", 0)
    freeze = list(par.pop("freeze", ()))
    cfg = tiny_config(**par)
    cfg.train.recompute = recompute
    cfg.train.lora_rank, cfg.train.freeze = lora_rank, freeze
    for k, v in (model or {}).items():
        setattr(cfg.model, k, v)
    cfg.train.dtype = dtype
    cfg.train.steps = 1
    cfg.train.global_batch = 12 if cfg.parallel.dp % 3 == 0 else 8
    if cfg.parallel.offload_dir == "{tmp}":          # disk offload: a scratch folder of its own
        cfg.parallel.offload_dir = scratch_folder("fivefold-offload-")
    return cfg


def _layout_id(case) -> str:
    par, dtype, *model = case
    short = {"reshard_after_forward": "reshard", "sp_mode": "sp"}
    parts = [f"{short.get(k, k)}{'+'.join(v) if isinstance(v, tuple) else v}" for k, v in par.items()
             if k != "bucket_mb"]
    return "-".join(parts + [f"{k}{v}" for k, v in (model[0] if model else {}).items()] + [dtype])


def _train_many(rank: int, world: int, jobs: list) -> list:
    """Several `fivefold train` runs, one after the other, on the same ranks (saves process start-up).
    After each run the ranks agree (an unrecorded all-reduce) whether any failed; if one did, its
    traceback is returned for that layout and the remaining runs are not started."""
    import traceback

    import torch
    import torch.distributed as dist

    errors = []
    for cfg_dict, out in jobs:
        err = None
        try:
            train_rank(rank, world, cfg_dict, out)
        except Exception:  # noqa: BLE001 - reported to the test of that layout
            err = traceback.format_exc()
        failed = torch.tensor([0 if err is None else 1])
        if dist.is_initialized() and world > 1:
            dist.all_reduce(failed)
        errors.append(err or ("another rank failed" if int(failed) else None))
        if int(failed):
            errors += ["not run: an earlier layout on these ranks failed"] * (len(jobs) - len(errors))
            break
    return errors


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Train every layout the runtime supports, grouped by world size; id -> output folder."""
    return _run_layouts(LAYOUTS, tmp_path_factory)


@pytest.fixture(scope="module")
def mla_runs(tmp_path_factory) -> dict:
    return _run_layouts(MLA_LAYOUTS, tmp_path_factory)


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory) -> dict:
    return _run_layouts(LORA_LAYOUTS, tmp_path_factory)


def _run_layouts(layouts: list, tmp_path_factory) -> dict:
    by_world: dict[int, list] = {}
    out = {}
    for case in layouts:
        cfg = _config(*case)
        try:
            supported(cfg)
        except ConfigError:
            continue
        folder = tmp_path_factory.mktemp(_layout_id(case))
        by_world.setdefault(cfg.parallel.world_size, []).append((cfg.to_dict(), str(folder)))
        out[_layout_id(case)] = folder
    for world, jobs in by_world.items():
        per_rank = ranks(_train_many, world, jobs)
        for k, (_, folder) in enumerate(jobs):
            errs = [e[k] for e in per_rank if e[k]]
            if errs:
                (Path(folder) / "error.txt").write_text(max(errs, key=len))
    return out


def _planned(cfg: Config) -> tuple[dict, dict, dict]:
    """(rows per (dim, op) summed over ranks for one step, device model-state bytes of one rank of stage
    0, what that rank keeps on the host and on disk under offload)."""
    model = from_model_config(cfg.model, train=cfg.train)
    layout, work = from_config(cfg)
    row = stage_memory(model, layout, work, 0)
    states = {c: row[c] for c in ("weights", "grads", "optimizer")}
    return all_ranks(model, layout, work), states, offload_bytes(model, layout, work, 0)


@pytest.mark.parametrize("case", LAYOUTS, ids=[_layout_id(c) for c in LAYOUTS])
@pytest.mark.ranks
def test_planner_equals_ledger_and_run_json(case, runs):
    check_planner_equals_run(case, runs)


@pytest.mark.parametrize("case", MLA_LAYOUTS, ids=["mla-" + _layout_id(c) for c in MLA_LAYOUTS])
@pytest.mark.ranks
def test_planner_equals_ledger_and_run_json_mla(case, mla_runs):
    check_planner_equals_run(case, mla_runs)


@pytest.mark.parametrize("case", LORA_LAYOUTS, ids=["lora-" + _layout_id(c) for c in LORA_LAYOUTS])
@pytest.mark.ranks
def test_planner_equals_ledger_and_run_json_lora(case, lora_runs):
    check_planner_equals_run(case, lora_runs)


def check_planner_equals_run(case, runs):
    cfg = _config(*case)
    try:
        supported(cfg)
    except ConfigError as e:
        pytest.skip(f"runtime does not run this layout yet: {e}")
    folder = runs[_layout_id(case)]
    if (folder / "error.txt").exists():
        pytest.fail(f"the runtime failed on this layout:\n{(folder / 'error.txt').read_text()}")
    comm = json.loads((folder / "comm.json").read_text())
    run = json.loads((folder / "run.json").read_text())
    steps = cfg.train.steps

    planned, states, off = _planned(cfg)
    measured = {(r["dim"], r["op"]): r for r in comm["rows"]}
    assert sorted(measured) == sorted(planned), "the planner predicts exactly the (dim, op) rows recorded"
    for key, row in planned.items():
        assert measured[key]["calls"] == row["calls"] * steps, key
        assert measured[key]["message_bytes"] == row["message_bytes"] * steps, key
        assert measured[key]["bytes_sent"] == pytest.approx(row["bytes_sent"] * steps, rel=1e-12, abs=0), key
    got = run["model_state_bytes_per_rank"]
    assert got["params"] == states["weights"]
    assert got["grads"] == states["grads"]
    assert got["optimizer"] == states["optimizer"]
    assert got["total"] == sum(states.values())
    if cfg.parallel.offload != "none":                # what left the device, where it went
        assert {k: got[k] for k in ("host", "disk")} == off


def test_single_rank_sends_nothing_and_counts_state():
    """One rank: no row at all, and fp32 model state = 4+4+8 bytes per parameter (tied once)."""
    from fivefold.train.trainer import Trainer

    cfg = _config({}, "fp32")
    tr = Trainer(cfg, quiet=True)
    tr.step(0)
    planned, states, off = _planned(cfg)
    assert planned == {} and tr.ledger.rows() == []
    phi = cfg.model.num_params()
    assert states == {"weights": 4 * phi, "grads": 4 * phi, "optimizer": 8 * phi}
    got = tr.model_state_bytes()
    assert (got["params"], got["grads"], got["optimizer"]) == (states["weights"], states["grads"], states["optimizer"])
