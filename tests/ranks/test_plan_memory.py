"""Memory per stage: partition, ZeRO, activations (flash, CP, Ulysses), schedules, experts per EP rank."""
import pytest

from fivefold.config import ConfigError
from fivefold.plan.layout import Layout, Workload, check
from fivefold.plan.activations import layer_acts, stage_activations
from fivefold.plan.buffers import zero_buffers
from fivefold.plan.memory import memory
from fivefold.plan.units import model_states, stage_layers, stage_params


def counts(layers, pp, vpp=1, partition="even"):
    return tuple(len(r) for r in stage_layers(layers, pp, vpp, partition))
from fivefold.plan.models import PRESETS, PlanModel

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


def test_interleaved_micro_batch_group_holds_what_the_simulator_holds():
    """Layout.microbatch_group N: stage s holds min(2(p-s-1) + (v-1)·N + 1, m·v) chunks, the simulator's peak
    for the same lists; 0 means p; the planner refuses a group the schedule refuses, in one line."""
    from dataclasses import replace

    from fivefold.parallel.pipeline.schedules import simulate_schedule

    w = Workload(seq=4096, global_batch=32)                         # m = 32 micro-batches of one sequence
    p, v = 4, 2
    base = Layout(pp=p, dp=1, vpp=v, schedule="interleaved")
    assert memory(LLAMA8, base, w).stages[0]["activations"] == \
        memory(LLAMA8, replace(base, microbatch_group=p), w).stages[0]["activations"]
    per_chunk = None
    for n in (4, 8, 16, 32):
        lay = Layout(pp=p, dp=1, vpp=v, schedule="interleaved", microbatch_group=n)
        check(LLAMA8, lay, w)
        peaks = simulate_schedule("interleaved", p, 32, v, microbatch_group=n).peak_in_flight
        for s in range(p):
            acts = stage_activations(LLAMA8, lay, w, s)
            if s in (1, 2):                                         # no embedding or head: layers only
                per_chunk = per_chunk or acts / peaks[s]
                assert acts == pytest.approx(per_chunk * peaks[s], rel=1e-12)
        assert "n%d" % n in lay.short() and lay.to_dict()["microbatch_group"] == n
    for bad, rule in ((3, "between pp"), (33, "between pp"), (5, "last group"), (-1, "integer >= 0")):
        with pytest.raises(ConfigError, match=rule):
            check(LLAMA8, Layout(pp=p, dp=1, vpp=v, schedule="interleaved", microbatch_group=bad), w)
    with pytest.raises(ConfigError, match="applies to the interleaved schedule"):
        check(LLAMA8, Layout(pp=p, dp=1, schedule="1f1b", microbatch_group=8), w)


def test_full_recompute_keeps_layer_inputs():
    """Korthikanti §4.3: full recompute stores each layer's input (2sbh, /t with SP) plus, while one
    layer is recomputed, that layer's activations beyond its input (already kept); the embedding's
    output is the first layer's input (parallel/recompute.py keeps it once)."""
    w, T, h = Workload(seq=4096, global_batch=1), 4096, LLAMA8.hidden
    none = stage_activations(LLAMA8, Layout(tp=8, pp=2, sp_mode="megatron"), w, 0)
    full = stage_activations(LLAMA8, Layout(tp=8, pp=2, sp_mode="megatron", recompute="full"), w, 0)
    emb = T * 2 * h / 8
    one_layer = (none - emb) / 16
    assert full == pytest.approx(16 * T * 2 * h / 8 + one_layer - emb)   # emb: one layer input


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



def test_parallel_block_stores_the_block_input_once():
    """GPT-NeoX's parallel attention + MLP normalises the block input twice: stored once, not twice."""
    from dataclasses import replace

    neox = PlanModel(name="neox", vocab=50432, hidden=4096, layers=32, heads=32, kv_heads=32, ffn=16384,
                     tie_embeddings=False, max_seq=8192, mlp="gelu", norm="layer", linear_bias=True, parallel_residual=True)
    seq = replace(neox, parallel_residual=False)
    w = Workload(seq=2048)
    assert (layer_acts(seq, 0, w).replicated - layer_acts(neox, 0, w).replicated) == 2 * 4096

# -- ZeRO-3 buffers: the root unit (embedding, final norm, head) held as the runtime holds it -----------
BIG_VOCAB = PlanModel(name="big-vocab", vocab=32000, hidden=256, layers=4, heads=4, kv_heads=4, ffn=512,
                      tie_embeddings=False, max_seq=512)


def test_zero3_buffers_hold_the_root_unit_and_its_gradient():
    """Outside a pipeline the root is gathered for the whole forward and backward and its gradient lives
    through the whole backward; with two micro-batches the previous one's root reduction is still in
    flight: w·(R + 2B) + g·R + g·(R + r) + 2g·(B + b) (memory.zero_buffers)."""
    n, w, g = 4, 2, 4                                    # bf16 weights, fp32 gradients
    lay, work = Layout(dp=n, zero=3), Workload(seq=512, global_batch=8)     # 2 micro-batches
    R = BIG_VOCAB.embed_params + BIG_VOCAB.head_params   # untied: embedding, final norm, head
    B = BIG_VOCAB.layer_params(0)
    r, b = -(-R // n), -(-B // n)
    expected = w * (R + 2 * B) + g * R + g * (R + r) + 2 * g * (B + b)
    assert zero_buffers(BIG_VOCAB, lay, work, 0) == expected
    assert R > 10 * B and expected > w * R + g * R > 10 * (2 * w * B)   # the root dwarfs two gathered blocks
    # one micro-batch: nothing in flight from before; the peak is at the root's own reduction or a block's
    one = zero_buffers(BIG_VOCAB, lay, Workload(seq=512, global_batch=4), 0)
    assert one == max(w * R + g * (R + r) + 2 * g * (B + b), w * (R + 2 * B) + g * R + 3 * g * (B + b))


def test_zero3_buffers_under_a_pipeline_keep_the_root_and_the_stage_gradient():
    """pp > 1: the root (embedding on the first stage; final norm and head on the last) gathered all step,
    one block at a time, the stage's full gradient, then end-of-step reductions (three results at most)."""
    n, w, g = 2, 2, 4
    lay, work = Layout(pp=2, dp=n, zero=3), Workload(seq=512, global_batch=8)
    B = BIG_VOCAB.layer_params(0)
    for stage, R in ((0, BIG_VOCAB.embed_params), (1, BIG_VOCAB.head_params)):
        G = R + 2 * B                                    # two blocks per stage
        shards = sorted([-(-R // n), -(-B // n), -(-B // n)])
        peak = max(w * (R + B) + g * G, w * R + g * G + g * sum(shards))
        assert zero_buffers(BIG_VOCAB, lay, work, stage) == peak


def test_zero3_without_resharding_gathers_every_unit():
    """reshard_after_forward=False: every unit stays gathered from its forward to its backward."""
    lay, work = Layout(dp=8, zero=3, reshard_after_forward=False), Workload(seq=4096, global_batch=8)
    kept = zero_buffers(LLAMA8, lay, work, 0)
    assert kept >= 2 * LLAMA8.num_params()
    assert kept > 2 * zero_buffers(LLAMA8, Layout(dp=8, zero=3), work, 0)


PEAK = [0]   # bytes, written by the hooks `watch_zero3` installs


def watch_zero3(patch=setattr) -> None:
    """Record in PEAK the largest total of ZeRO-3's gathered units, gradient buffers and reductions in
    flight, read from the runtime's tensors after every allocation and free. `patch` sets the wrapped
    methods (pytest's monkeypatch.setattr in the test process; once per spawned rank)."""
    from fivefold.parallel.zero import engine as zero, stages as zero_stage

    if zero_stage.ShardedParams._gather_async.__name__ == "watched":
        return
    watching = []   # the engine whose stage gathers and frees (set by its zero_grad, which __init__ calls)

    def note(engine) -> None:   # a freed unit keeps its (empty) gathered buffer: count storages' bytes
        alive = {id(u.full): u.full for u in engine.units if u.full is not None}
        alive.update({id(u.grad): u.grad for u in engine.units if u.grad is not None})
        for _, _, result, grad in engine._inflight:
            alive.update({id(result): result, id(grad): grad})
        PEAK[0] = max(PEAK[0], sum(min(t.numel() * t.element_size(), t.untyped_storage().nbytes())
                                   for t in alive.values()))

    class Watched(list):          # a reduction's result buffer exists from its launch
        def __init__(self, engine):
            super().__init__(engine._inflight)
            self.engine = engine

        def append(self, item):
            super().append(item)
            note(self.engine)

    def watch(cls, name):
        original = getattr(cls, name)

        def watched(self, *args):
            if isinstance(self, zero.ZeroEngine):
                watching[:] = [self]
            engine = watching[0]
            if not isinstance(engine._inflight, Watched):
                engine._inflight = Watched(engine)
            out = original(self, *args)
            note(engine)
            return out
        patch(cls, name, watched)

    for name in ("zero_grad", "_unit_grad", "_fold"):
        watch(zero.ZeroEngine, name)
    for name in ("_gather_async", "_free_unit"):
        watch(zero_stage.ShardedParams, name)


def measured_zero3_peak(rank: int, world: int, cfg_dict: dict, patch=setattr) -> int:
    """ZeRO-3's peak buffer bytes over the second step of a real run (`watch_zero3`)."""
    import torch

    from fivefold.config import Config
    from fivefold.train.trainer import Trainer

    torch.set_num_threads(1)
    watch_zero3(patch)
    trainer = Trainer(Config.from_dict(cfg_dict), rank, world, quiet=True)
    trainer.step(0)
    PEAK[0] = 0
    trainer.step(1)
    return PEAK[0]


def _zero3_config(**parallel):
    from tests.support.tiny import tiny_config

    cfg = tiny_config(**parallel)
    cfg.model.vocab, cfg.model.layers = 2048, 3          # the root unit is 7x a block
    cfg.train.dtype = "bf16"
    return cfg


def _planned_buffers(cfg, stage: int) -> float:
    from fivefold.plan.layout import from_config
    from fivefold.plan.models import from_model_config

    layout, work = from_config(cfg)
    return zero_buffers(from_model_config(cfg.model), layout, work, stage)


def test_zero3_buffers_equal_the_runtime_single_rank(monkeypatch):
    cfg = _zero3_config(dp=1, zero=3, microbatches=2)
    assert measured_zero3_peak(0, 1, cfg.to_dict(), monkeypatch.setattr) == _planned_buffers(cfg, 0)


@pytest.mark.parametrize("depth", [0, 2, 3])
def test_zero3_buffers_follow_the_prefetch_depth(monkeypatch, depth):
    """parallel.zero_prefetch: the runtime gathers `depth` slots ahead and the planner replays the same
    order (zero/order.py), to the byte; a deeper prefetch holds more."""
    cfg = _zero3_config(dp=1, zero=3, microbatches=2, zero_prefetch=depth)
    assert measured_zero3_peak(0, 1, cfg.to_dict(), monkeypatch.setattr) == _planned_buffers(cfg, 0)
    plans = [_planned_buffers(_zero3_config(dp=1, zero=3, microbatches=2, zero_prefetch=d), 0) for d in range(4)]
    assert plans[0] < plans[1] < plans[2] == plans[3]      # 3 blocks: depth 2 holds as many as any deeper


def run_zero3_jobs(rank: int, world: int, jobs: list) -> list:
    return [measured_zero3_peak(rank, world, job) for job in jobs]


@pytest.mark.ranks
def test_zero3_buffers_equal_the_runtime_sharded_and_pipelined():
    """dp=2 (shards, a micro-batch's reductions in flight into the next) and pp=2 (root kept all step,
    end-of-step reductions), measured on two gloo ranks."""
    from tests.support.spawn import ranks

    cfgs = [_zero3_config(dp=2, zero=3, microbatches=2), _zero3_config(pp=2, dp=1, zero=3, microbatches=2)]
    per_rank = ranks(run_zero3_jobs, 2, [c.to_dict() for c in cfgs])
    for rank, peaks in enumerate(per_rank):
        assert peaks[0] == _planned_buffers(cfgs[0], 0)
        assert peaks[1] == _planned_buffers(cfgs[1], rank)     # pp outermost: rank r is stage r


def test_uneven_chunks_are_walked_in_the_runtimes_order():
    """With chunks of different sizes (Llama 3's first and last chunk one layer fewer) the interleaved peak
    is the maximum, over the rank's own action list (`build_schedule`), of the activations held: each F
    adds its chunk's, each B frees them. Equal chunks give in_flight x the stage."""
    from fivefold.parallel.pipeline.schedules import B, F, build_schedule
    from fivefold.plan.activations import in_flight, interleaved_peak

    p, v = 4, 3
    for m, group in ((8, 0), (12, 0), (8, 8), (10, 5)):
        ranks = build_schedule("interleaved", p, m, v, microbatch_group=group)
        for s in range(p):
            weights = tuple(float(1 + 10 * c + s) for c in range(v))     # distinct per local chunk
            held = peak = 0.0
            for a in ranks[s]:
                if a.kind == F:
                    held += weights[a.chunk // p]
                    peak = max(peak, held)
                elif a.kind == B:
                    held -= weights[a.chunk // p]
            assert interleaved_peak(p, s, m, v, group, weights) == pytest.approx(peak)
            assert interleaved_peak(p, s, m, v, group, (2.0,) * v) == pytest.approx(
                in_flight("interleaved", p, s, m, v, group) * 2.0 * v)
    # Llama 3 405B on 16 stages, v = 2: stage 0's first chunk has 3 layers, not 4, so it holds less than
    # the uniform estimate would say; the middle stages are unchanged
    w = Workload(seq=8192, global_batch=16)
    lay = Layout(pp=16, tp=8, sp_mode="megatron", vpp=2, schedule="interleaved", partition="llama3")
    acts = [memory(L405, lay, w).stages[s]["activations"] for s in (0, 1)]
    assert acts[0] < acts[1]


@pytest.mark.parametrize("q_lora", [24, 0])
@pytest.mark.parametrize("tp", [1, 2])
def test_latent_attention_tensors_are_the_runtimes(tp, q_lora):
    """The planner lists a latent-attention layer's tensors as the runtime registers them, with the
    runtime's tp split (down-projections and latent norms whole on every rank, tagged "norm"), so ZeRO
    units and partial-gradient sets are exact."""
    from fivefold.model import Transformer
    from fivefold.plan.units import ExpertSplit, exact_tensors, layer_tensors
    from fivefold.plan.models import from_model_config

    from tests.support.tiny import tiny_config

    cfg = tiny_config(mla=True).model
    cfg.q_lora_rank, cfg.experts, cfg.moe_ffn, cfg.dense_layers = q_lora, 4, 32, 1
    plan = from_model_config(cfg)
    assert exact_tensors(plan)
    meta = Transformer(cfg, device="meta")
    whole = ("norm", "q_a.", "kv_a.", "router", "experts", "shared")   # replicated over tp in the runtime
    for i in range(cfg.layers):
        want = [(p.numel() // (1 if any(w in n for w in whole) else tp), not n.startswith("mlp.experts"))
                for n, p in meta.layers[i].named_parameters()]
        got = [(e, not ex) for e, ex, _ in layer_tensors(plan, i, tp, ExpertSplit())]
        assert got == want
        tags = {n: tag for (n, _), (_, _, tag) in zip(meta.layers[i].named_parameters(), layer_tensors(plan, i, tp, ExpertSplit()))}
        assert all(tags[n] == "norm" for n in tags if "q_a." in n or "kv_a." in n or "norm" in n)
