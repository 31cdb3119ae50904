"""The planner's `Layout` is derived from the runtime's config: every `Layout` field has a source in
`plan.layout.LAYOUT_SOURCES`, every `ParallelConfig` field is read there or placed in
`PARALLEL_ELSEWHERE`, and `from_config` copies each copied field as it is."""
from dataclasses import field, fields, make_dataclass

import pytest

from fivefold.config import Config, ParallelConfig, TrainConfig
from fivefold.plan.layout import LAYOUT_SOURCES, PARALLEL_ELSEWHERE, Layout, from_config

PARTS = {"parallel": ParallelConfig, "train": TrainConfig}


def names(cls: type) -> set[str]:
    return {f.name for f in fields(cls)}


def gaps(layout: type = Layout, parallel: type = ParallelConfig) -> list[str]:
    """What the table fails to place: Layout fields without a source, ParallelConfig fields neither read
    nor placed elsewhere, fields placed twice, reads of fields that do not exist."""
    out = [f"Layout.{n} has no source" for n in sorted(names(layout) - set(LAYOUT_SOURCES))]
    out += [f"LAYOUT_SOURCES.{n} is no Layout field" for n in sorted(set(LAYOUT_SOURCES) - names(layout))]
    reads = [key for src in LAYOUT_SOURCES.values() for key in src.reads]
    parts = {**PARTS, "parallel": parallel}
    out += [f"{key} is no config field" for key in reads
            if key.partition(".")[0] not in parts or key.partition(".")[2] not in names(parts[key.partition(".")[0]])]
    read = {key.partition(".")[2] for key in reads if key.startswith("parallel.")}
    out += [f"ParallelConfig.{n} is not placed" for n in sorted(names(parallel) - read - set(PARALLEL_ELSEWHERE))]
    out += [f"ParallelConfig.{n} is both read and placed elsewhere" for n in sorted(read & set(PARALLEL_ELSEWHERE))]
    out += [f"PARALLEL_ELSEWHERE.{n} is no ParallelConfig field" for n in sorted(set(PARALLEL_ELSEWHERE) - names(parallel))]
    return out


def test_every_field_is_placed():
    assert gaps() == []


def test_a_new_parallel_field_is_caught():
    grown = make_dataclass("ParallelConfig", [("dualpipe", bool, field(default=False))], bases=(ParallelConfig,))
    assert gaps(parallel=grown) == ["ParallelConfig.dualpipe is not placed"]


def test_a_new_layout_field_is_caught():
    grown = make_dataclass("Layout", [("chunks", int, field(default=1))], bases=(Layout,), frozen=True)
    assert gaps(layout=grown) == ["Layout.chunks has no source"]


def test_planner_only_and_fixed_fields_say_why():
    for name, src in LAYOUT_SOURCES.items():
        if src.planner_only or not src.reads or src.make is not None:
            assert src.why, name
    assert all(PARALLEL_ELSEWHERE.values())


def test_layout_stays_a_hashable_cache_key():
    a, b = from_config(Config())[0], from_config(Config())[0]
    assert a == b and hash(a) == hash(b)
    with pytest.raises(AttributeError):
        a.tp = 2


def busy_config() -> Config:
    """A config whose copied fields all differ from their defaults (that validates or not: from_config
    only copies)."""
    cfg = Config()
    p, t = cfg.parallel, cfg.train
    p.tp, p.pp, p.dp, p.cp, p.ep, p.zero = 2, 4, 3, 2, 2, 3
    p.sp_mode, p.cp_mode, p.ulysses, p.vpp, p.schedule = "megatron", "hybrid", 2, 2, "interleaved"
    p.order, p.partition, p.bucket_mb, p.reshard_after_forward = "tp-cp-dp-pp", "llama3", 12.5, False
    p.reduce_each_microbatch, p.microbatch_group, p.offload, p.microbatches = True, 4, "cpu", 8
    p.overlap_grad_reduce = False
    t.recompute, t.global_batch = "selective", 48
    return cfg


def test_from_config_copies_every_copied_field():
    cfg = busy_config()
    layout, _ = from_config(cfg)
    for name, src in LAYOUT_SOURCES.items():
        if src.reads and src.make is None:
            part, _, key = src.reads[0].partition(".")
            assert getattr(layout, name) == getattr(getattr(cfg, part), key), name
    assert layout.micro_batch == 48 // (3 * 8)
    assert layout.overlap_grad_reduce is False and layout.overlap_param_gather is False
    assert layout.ep_overlap is False and layout.recompute_norm_mla is False
    cfg.parallel.pp = 1
    assert from_config(cfg)[0].overlap_grad_reduce is True   # one backward: reduced as it ends
