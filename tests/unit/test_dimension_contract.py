"""The dimension contract (parallel/dimension.py): one base class declares every hook the trainer and
`parallelize` call, with its default; a misspelt hook fails when its class is made; every dimension
subclasses it; and the MoE layers learn what the dimensions decided from one `configure` call whose
sequence group comes from one rule (rules.moe_sequence_group), the one the planner counts too. Pure: no
ranks (the multi-rank exactness tests in test_tensor/test_context/test_expert/test_pipeline_runtime hold
the configured layers to the single-process run)."""
from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest
import torch

from fivefold import rules
from fivefold.comm import Group
from fivefold.config import Config
from fivefold.model import Transformer, loss_sum
from fivefold.model.moe import MoE
from fivefold.parallel.context import ContextParallelism
from fivefold.parallel.dimension import HOOKS, Dimension
from fivefold.parallel.expert import AllToAllDispatch, ExpertParallelism
from fivefold.parallel.pipeline.dimension import PipelineParallelism
from fivefold.parallel.parallelize import (configure_moe, direct_forward,
                                           direct_forward_backward, gather_state, loss_function, positions_of,
                                           split_state, step_functions)
from fivefold.parallel.tensor import TensorParallelism

from tests.support.paths import ROOT

SRC = ROOT / "src" / "fivefold"
CALLERS = [SRC / "train" / "trainer.py", SRC / "parallel" / "parallelize.py", SRC / "parallel" / "pipeline" / "runtime.py"]


class Plain(Dimension):
    """A dimension that shards nothing and declares no hook beyond the required two."""

    name = "plain"

    def apply(self, model):
        return model


def test_every_real_dimension_subclasses_the_contract():
    for cls in (TensorParallelism, ContextParallelism, ExpertParallelism, PipelineParallelism):
        assert issubclass(cls, Dimension), cls
        public = {n for k in cls.__mro__ if k not in Dimension.__mro__ for n in vars(k) if not n.startswith("_")}
        assert public <= set(HOOKS), (cls, public - set(HOOKS))


@pytest.mark.parametrize("typo", ["shard_batches", "gather_states", "loss_groups", "schedule_backward", "helper"])
def test_a_misspelt_hook_fails_at_class_creation_naming_the_hooks(typo):
    with pytest.raises(TypeError) as err:
        type("Typo", (Plain,), {typo: lambda self, *a: a})
    assert typo in str(err.value) and "shard_batch" in str(err.value) and "gather_state" in str(err.value)


def test_a_misspelt_hook_in_a_mixin_fails_too():
    class Mixin:
        def split_states(self, state):
            return state

    with pytest.raises(TypeError, match="split_states"):
        type("Mixed", (Mixin, Plain), {})


def test_name_and_apply_are_required():
    class NoApply(Dimension):
        name = "x"

    class NoName(Dimension):
        def apply(self, model):
            return model

    for cls in (NoApply, NoName):
        with pytest.raises(TypeError, match="name|apply"):
            cls()


def test_the_defaults_change_nothing():
    d = Plain()
    x_bs, y_bs = torch.arange(6).view(2, 3), torch.arange(6, 12).view(2, 3)
    assert d.shard_batch(x_bs, y_bs) == (x_bs, y_bs)
    assert d.positions is None and d.loss_group is None
    assert d.forward_backward is None and d.forward_only is None
    assert dict(d.checkpoint_aliases) == {}
    state = {"params": {"w": torch.ones(2)}, "step": 3}
    assert gather_state([d], state) is state and split_state([d], state) is state
    assert loss_function([d], loss_sum) is loss_sum
    assert step_functions([d]) == (direct_forward_backward, direct_forward)
    assert positions_of([d]) is None
    assert d.write(Path("."), None, 0) is None


def test_hooks_chain_in_the_documented_order():
    """loss and gather_state run in applied order, split_state in reverse; the first dimension that
    runs the step itself is the one used."""
    calls = []

    class Tagged(Plain):
        def __init__(self, tag):
            self.tag = tag

        def loss(self, loss_sum):
            calls.append(("loss", self.tag))
            return loss_sum

        def gather_state(self, state):
            calls.append(("gather", self.tag))
            return {**state, self.tag: True}

        def split_state(self, state):
            calls.append(("split", self.tag))
            return state

    dims = [Tagged("a"), Tagged("b")]
    loss_function(dims, loss_sum)
    assert gather_state(dims, {}) == {"a": True, "b": True}
    split_state(dims, {})
    assert calls == [("loss", "a"), ("loss", "b"), ("gather", "a"), ("gather", "b"), ("split", "b"), ("split", "a")]

    class Steps(Plain):
        def forward_backward(self, *args):
            return "fb"

        def forward_only(self, *args):
            return "fo"

    fb, fo = step_functions([Plain(), Steps()])
    assert (fb(), fo()) == ("fb", "fo")


def test_engines_subclass_the_engine_base():
    """The trainer calls every engine method directly: DDP and ZeRO subclass `Engine` (an ABC: a missing
    method fails when the engine is made); only ZeRO-3 has gathered parameters to release (its stage's
    `release`: the ZeRO engine is one class composed of a stage, parallel/zero/stages.py)."""
    from fivefold.parallel.data import DataParallelOptimizer
    from fivefold.parallel.engine import Engine
    from fivefold.parallel.zero.engine import ZeroEngine
    from fivefold.parallel.zero.stages import FullParams, ShardedParams

    assert issubclass(DataParallelOptimizer, Engine) and issubclass(ZeroEngine, Engine)
    assert DataParallelOptimizer.release_params is Engine.release_params
    assert ZeroEngine.release_params is not Engine.release_params
    assert ShardedParams.release is not FullParams.release

    class Partial(Engine):
        def set_sync(self, enabled):
            pass

    with pytest.raises(TypeError, match="abstract"):
        Partial()


def _attribute_names_on(var: str, tree: ast.AST) -> set[str]:
    return {n.attr for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == var}


def test_callers_use_only_declared_hooks_and_probe_none():
    """Every attribute the trainer and parallelize read off a dimension (`d.<hook>`) is declared on the
    base, and no hasattr/getattr in the trainer, parallelize or the pipeline runtime asks for a hook, an
    engine method or a MoE layer's settings (the behaviour is the tests above and the multi-rank ones)."""
    probed = set(HOOKS) | {"release_params", "global_sequences", "global_tokens", "step_stats",
                           "sum_sequence_parts", "sequence_parts", "dispatcher", "enter", "leave"}
    used = set()
    for path in CALLERS:
        tree = ast.parse(path.read_text())
        if path.name != "runtime.py":   # (the runtime holds no dimension: its `d` is a micro-batch's documents)
            used |= _attribute_names_on("d", tree)
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("hasattr", "getattr"):
                key = n.args[1]
                assert not (isinstance(key, ast.Constant) and key.value in probed), (path.name, n.lineno, key.value)
    assert used and used <= set(HOOKS), used - set(HOOKS)
    for hook in HOOKS:
        assert hasattr(Dimension, hook), hook


# -- the MoE layers' one configure call -----------------------------------------------------------

SEQUENCE_GROUP = {   # (tp, sp_mode, cp) -> the group a MoE layer sums its per-sequence statistics over
    (1, "none", 1): None, (1, "megatron", 1): None,
    (1, "none", 2): "cp", (1, "megatron", 2): "cp",
    (2, "none", 1): None, (2, "megatron", 1): "tp",          # no SP: each tp rank routes whole sequences
    (2, "none", 2): "cp", (2, "megatron", 2): "tp_cp",
}


@pytest.mark.parametrize("tp, sp_mode, cp", list(itertools.product((1, 2), ("none", "megatron"), (1, 2))))
def test_moe_sequence_group_rule(tp, sp_mode, cp):
    group = rules.moe_sequence_group(tp, sp_mode, cp)
    assert group == SEQUENCE_GROUP[(tp, sp_mode, cp)]
    parts = {None: 1, "tp": tp, "cp": cp, "tp_cp": tp * cp}[group]
    assert rules.moe_sequence_parts(tp, sp_mode, cp) == parts
    assert rules.moe_splits_rows(tp, sp_mode) == (tp > 1 and sp_mode != "megatron")


def moe_config(layers: int) -> Config:
    cfg = Config()
    m = cfg.model
    m.layers, m.hidden, m.heads, m.kv_heads, m.ffn, m.vocab = layers, 16, 2, 2, 32, 32
    m.experts, m.top_k, m.moe_ffn = 4, 2, 8
    return cfg


def fake_mesh(tp: int, cp: int, ep: int) -> dict:
    """Groups of the right sizes without process groups (configure only reads their sizes)."""
    def g(name, n):
        return Group(name, list(range(n)), 0)
    return {"tp": g("tp", tp), "cp": g("cp", cp), "tp_cp": g("tp_cp", tp * cp), "ep": g("ep", ep)}


@pytest.mark.parametrize("tp, sp_mode, cp, ep", [(2, "none", 1, 1), (2, "megatron", 2, 2), (1, "none", 2, 2),
                                                 (1, "none", 1, 1)])
def test_configure_tells_every_moe_layer_once(tp, sp_mode, cp, ep):
    cfg = moe_config(layers=2)
    cfg.parallel.tp, cfg.parallel.sp_mode, cfg.parallel.cp, cfg.parallel.ep = tp, sp_mode, cp, ep
    cfg.train.global_batch, cfg.train.seq_len = 8, 16
    model = Transformer(cfg.model, device="meta")
    configure_moe(model, fake_mesh(tp, cp, ep), cfg)
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    assert layers
    for moe in layers:
        assert moe.sequence_parts == rules.moe_sequence_parts(tp, sp_mode, cp)
        assert (moe.sum_sequence_parts is None) == (moe.sequence_parts == 1)
        assert isinstance(moe.enter, torch.nn.Identity) != rules.moe_splits_rows(tp, sp_mode)
        assert isinstance(moe.dispatcher, AllToAllDispatch) == (ep > 1)
        assert (moe.global_sequences, moe.global_tokens) == (8, 8 * 16)


def test_configure_takes_only_what_it_declares():
    cfg = moe_config(layers=1)
    moe = next(m for m in Transformer(cfg.model, device="meta").modules() if isinstance(m, MoE))
    with pytest.raises(TypeError):
        moe.configure(sequence_part=2)


def test_step_stats_are_taken_once():
    cfg = moe_config(layers=1)
    moe = next(m for m in Transformer(cfg.model, seed=0).modules() if isinstance(m, MoE))
    moe(torch.randn(2, 3, 16))
    moe(torch.randn(2, 3, 16))
    stats = moe.take_step_stats()
    assert stats is not None and int(stats.sum()) == 2 * 2 * 2 * 3   # two forwards of 6 tokens, top-2
    assert moe.take_step_stats() is None
