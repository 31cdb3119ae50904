"""LoRA and frozen weights (model/lora.py): held to transformers + PEFT on the same batches under 1 rank, tp2,
ZeRO-3 and pp2; adapters' checkpoints resume bit for bit; the merged export and the PEFT export load in
transformers / peft with the run's logits; frozen weights have no gradient, state or traffic."""
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from fivefold.config import Config, ConfigError, ParallelConfig, TrainConfig  # noqa: E402
from fivefold.model.hf_weights import hf_config  # noqa: E402
from fivefold.model.lora import adapter_init  # noqa: E402
from fivefold.shapes import Box  # noqa: E402

from tests.support.spawn import spawn_jobs  # noqa: E402

QWEN2 = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False, intermediate_size=96)
RANK, ALPHA, STEPS = 4, 8.0, 3
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora") / "qwen2"
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**QWEN2)).save_pretrained(folder)
    return folder


def lora_config(folder, out=None, steps=STEPS, **parallel) -> Config:
    return Config(model=hf_config(folder), parallel=ParallelConfig(**parallel),
                  train=TrainConfig(steps=steps, global_batch=4, seq_len=32, lr=1e-2, min_lr=1e-3, warmup=1, seed=7,
                                    checkpoint=out is not None, checkpoint_every=2, out=str(out or "unused"),
                                    init_hf=str(folder), lora_rank=RANK, lora_alpha=ALPHA, lora_targets=HF_TARGETS))


def lora_steps(rank, world, cfg_dict):
    from fivefold.train.trainer import Trainer

    t = Trainer(Config.from_dict(cfg_dict), rank, world, quiet=True)
    rows = [t.batches.rows(i, 0, t.cfg.train.global_batch) for i in range(STEPS)]
    losses = [t.step(i)["loss"] for i in range(STEPS)]
    dp = t.ledger.total(dim="dp", op="all_reduce")
    trained = [p for p in t.model.parameters() if p.requires_grad]
    return {"losses": losses, "rows": rows, "dp_bytes": dp, "trained": sum(p.numel() for p in trained),
            "n_trainable": t.n_trainable, "all_frozen_without_grad": all(
                p.grad is None for p in t.model.parameters() if not p.requires_grad)}


def peft_losses(folder, rows, cfg: Config) -> list[float]:
    """transformers + PEFT on the same batches: AdamW as fivefold's (decoupled decay of 2-D tensors, the same
    schedule, clipping at train.grad_clip), the adapters' A set to fivefold's seeded start."""
    from fivefold.train.optim import lr_at

    t = cfg.train
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                                       target_modules=HF_TARGETS))
    hf_to_ours = {"self_attn.q_proj": "attn.wq", "self_attn.k_proj": "attn.wk", "self_attn.v_proj": "attn.wv",
                  "self_attn.o_proj": "attn.wo", "mlp.gate_proj": "mlp.gate", "mlp.up_proj": "mlp.up",
                  "mlp.down_proj": "mlp.down"}
    params = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            layer = name.split("layers.")[1].split(".")[0]
            module = next(ours for hf, ours in hf_to_ours.items() if f".{hf}." in name)
            kind = "lora_A" if "lora_A" in name else "lora_B"
            ours = f"layers.{layer}.{module}.{kind}"
            p.copy_(adapter_init(ours, p.shape, (0, 0), p.shape, t.seed))
            params.append(p)
    opt = torch.optim.AdamW(params, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, weight_decay=t.weight_decay,
                            foreach=False)
    losses = []
    for step, (x_bs, y_bs) in enumerate(rows):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, t.lr, t.min_lr, t.warmup, t.steps, t.lr_schedule, t.decay_fraction)
        logits = model(x_bs).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y_bs.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


LAYOUTS = [dict(tp=2), dict(dp=2, zero=3), dict(pp=2, microbatches=2), dict(dp=2)]
MOE_LAYOUTS = {"ep": dict(dp=2, ep=2), "sp": dict(tp=2, sp_mode="megatron"),
               "folded": dict(tp=2, ep=2, sp_mode="megatron")}   # ep folded onto the tp pair


@pytest.fixture(scope="module")
def spawned(base):
    """Every multi-rank job of this file's equality tests, in one 1-rank and one 2-rank spawn (process
    start-up is the slow part): job name -> every rank's result."""
    from tests.support.tiny import tiny_config

    frozen = tiny_config(dp=2)
    frozen.train.steps = 2
    freeze = Config.from_dict(frozen.to_dict())
    freeze.train.freeze = ["embed.*", "layers.0.*"]
    one = spawn_jobs(1, [("peft", lora_steps, (lora_config(base).to_dict(),)),
                         ("moe", tiny_lora_steps, (tiny_lora().to_dict(),)),
                         ("freeze-one", frozen_steps, (freeze_layout().to_dict(),))])
    two = spawn_jobs(2, [(f"peft-{i}", lora_steps, (lora_config(base, **p).to_dict(),)) for i, p in enumerate(LAYOUTS)]
                     + [(f"moe-{k}", tiny_lora_steps, (tiny_lora(**p).to_dict(),)) for k, p in MOE_LAYOUTS.items()]
                     + [("all", frozen_steps, (frozen.to_dict(),)), ("frozen", frozen_steps, (freeze.to_dict(),))]
                     + [(f"freeze-{k}", frozen_steps, (freeze_layout(**p).to_dict(),)) for k, p in FREEZE_LAYOUTS.items()])
    return {**one, **two}


@pytest.mark.ranks
def test_lora_steps_equal_transformers_with_peft_under_one_rank_tp2_zero3_and_pp2(base, spawned):
    single = spawned["peft"][0]
    expected = peft_losses(base, single["rows"], lora_config(base))
    assert expected[-1] < expected[0] - 1e-3          # the adapters learn: the equality below means something
    assert single["losses"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    for i, layout in enumerate(LAYOUTS):
        for r in spawned[f"peft-{i}"]:
            assert r["losses"] == pytest.approx(expected, rel=1e-5, abs=1e-6), layout
            assert r["all_frozen_without_grad"] and r["n_trainable"] == single["n_trainable"], layout
    # data parallelism reduces the adapters alone: the dp2 ledger's bytes are those of the trained tensors
    dp2 = spawned[f"peft-{LAYOUTS.index(dict(dp=2))}"][0]
    per_step = dp2["dp_bytes"] / STEPS
    assert per_step == pytest.approx(2 * (2 - 1) / 2 * 4 * single["n_trainable"], rel=0.02)


def lora_run(rank, world, cfg_dict, steps=None):
    """Train (to `steps`, else train.steps) with checkpoints, resuming from the run folder when one exists."""
    from pathlib import Path

    from fivefold.train.trainer import Trainer

    cfg = Config.from_dict(cfg_dict)
    t = Trainer(cfg, rank, world, quiet=True)
    out = Path(cfg.train.out)
    history = t.run(out, resume="auto" if (out / "checkpoints").is_dir() else None)
    return [m["loss"] for m in history["history"]] if isinstance(history, dict) else history


def cli(*args):
    return subprocess.run([sys.executable, "-m", "fivefold.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=600)


@pytest.mark.ranks
def test_a_lora_run_resumes_bit_for_bit_and_its_exports_load_in_transformers_and_peft(base, tmp_path):
    """ZeRO-3 over 2 ranks: 4 steps straight against 2 + a resume to 4 (the adapters' moments and the frozen
    base come back from the checkpoint); then `export --hf` (merged W + scale·BA) loads in transformers and
    `export --peft` in peft over the base folder, each with the run's logits."""
    from fivefold.train.checkpoint import to_model

    straight = lora_config(base, tmp_path / "straight", steps=4, dp=2, zero=3)
    cut = lora_config(base, tmp_path / "cut", steps=2, dp=2, zero=3)
    resumed = lora_config(base, tmp_path / "cut", steps=4, dp=2, zero=3)
    a = spawn_jobs(2, [("s", lora_run, (straight.to_dict(),)), ("c", lora_run, (cut.to_dict(),))])
    b = spawn_jobs(2, [("r", lora_run, (resumed.to_dict(),))])
    losses = lambda run: [json.loads(x)["loss"] for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert losses("cut") == losses("straight") and len(losses("cut")) == 4, (a, b)

    ours = to_model(tmp_path / "cut").eval()
    x_bs = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ours(x_bs)
    from fivefold.train.checkpoint import export_peft
    from fivefold.tools.hf_export import export_hf_folder

    export_hf_folder(tmp_path / "cut", tmp_path / "merged")      # `export --hf` (the walk below runs the CLI)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    export_peft(tmp_path / "cut", tmp_path / "adapter")          # `export --peft`
    base_model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base_model, tmp_path / "adapter").eval()
    with torch.no_grad():
        plain = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()(x_bs).logits
        assert (plain - expected).abs().max() > 1e-3          # the adapters moved the model
        torch.testing.assert_close(merged(x_bs).logits, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(adapted(x_bs).logits, expected, rtol=1e-5, atol=1e-5)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (RANK, ALPHA, sorted(HF_TARGETS))


def frozen_steps(rank, world, cfg_dict):
    from fivefold.model.init import InitSource
    from fivefold.train.trainer import Trainer

    t = Trainer(Config.from_dict(cfg_dict), rank, world, quiet=True)
    before = {n: p.detach().clone() for n, p in t.model.named_parameters() if not p.requires_grad}
    losses = [t.step(i)["loss"] for i in range(2)]
    source = InitSource(t.cfg.model, t.cfg.train.seed)
    unchanged = all(torch.equal(before[n], p) for n, p in t.model.named_parameters() if n in before)
    at_init = all(torch.equal(p, source.read(f"model/{n}", Box.whole(p.shape), p.shape).to(p.dtype))
                  for n, p in t.model.named_parameters() if n in before)
    return {"losses": losses, "frozen": sorted(before), "unchanged": unchanged, "at_init": at_init,
            "dp_bytes": t.ledger.total(dim="dp", op="all_reduce"), "n_trainable": t.n_trainable,
            "n_params": t.n_params}


@pytest.mark.ranks
def test_frozen_weights_keep_their_values_and_data_parallelism_reduces_the_rest_only(spawned):
    full, part = spawned["all"][0], spawned["frozen"][0]
    assert part["frozen"] and all(n.startswith(("embed.", "layers.0.")) for n in part["frozen"])
    assert part["unchanged"] and part["at_init"] and not full["frozen"]
    assert part["losses"][0] == full["losses"][0] and part["losses"][1] != full["losses"][1]
    assert part["n_params"] == full["n_params"] > part["n_trainable"]
    assert part["dp_bytes"] / full["dp_bytes"] == pytest.approx(part["n_trainable"] / full["n_trainable"], rel=0.02)


FREEZE_LAYOUTS = {"tp-sp": dict(tp=2, sp_mode="megatron"), "zero3": dict(dp=2, zero=3),
                  "pp": dict(pp=2, microbatches=2)}


def freeze_layout(**parallel) -> Config:
    """The embedding and layer 0's attention frozen (every pipeline stage keeps a weight to train)."""
    from tests.support.tiny import tiny_config

    cfg = tiny_config(**parallel)
    cfg.train.steps, cfg.train.freeze = 2, ["embed.*", "layers.0.attn.*"]
    return cfg


@pytest.mark.ranks
def test_frozen_weights_under_tp_sp_zero3_and_pp_equal_one_rank(spawned):
    one = spawned["freeze-one"][0]
    assert one["unchanged"] and one["losses"][1] != one["losses"][0]
    for k in FREEZE_LAYOUTS:
        for r in spawned[f"freeze-{k}"]:
            assert r["losses"] == pytest.approx(one["losses"], rel=1e-5), k
            assert r["unchanged"], k


def test_lora_and_freeze_settings_are_refused_in_one_line(base, tmp_path):
    with pytest.raises(ConfigError, match="lora_targets must name linear layers"):
        Config(train=TrainConfig(lora_rank=4, lora_targets=["router"])).validate()
    with pytest.raises(ConfigError, match="lora_rank must be >= 0"):
        Config(train=TrainConfig(lora_rank=-1)).validate()
    with pytest.raises(ConfigError, match=r"train.lora_rank \(10,000\) must be <= model.hidden"):
        Config(train=TrainConfig(lora_rank=10_000)).validate()   # 1e308 in a config file was an allocation
    from fivefold.train.trainer import supported
    from tests.support.tiny import tiny_config

    idle = tiny_config(pp=2, microbatches=2)
    idle.train.freeze = ["embed.*", "layers.0.*"]
    with pytest.raises(ConfigError, match=r"leaves pipeline stage\(s\) \[0\] of 2 nothing to train"):
        supported(idle)
    idle.train.freeze = ["*"]
    with pytest.raises(ConfigError, match="freezes every parameter"):
        supported(idle)
    # from the command line: one line, exit 2, before any rank starts
    r = cli("train", "--steps", "1", "--out", tmp_path / "x", "--lora-rank", "4", "--freeze", "layer.*")
    assert r.returncode == 2 and "train.freeze pattern 'layer.*' matches no parameter" in r.stderr \
        and len(r.stderr.strip().splitlines()) == 1, r.stderr
    from fivefold.train.checkpoint import export_peft
    from fivefold.train.trainer import Trainer
    from tests.support.tiny import tiny_config

    plain = tiny_config()
    plain.train.steps, plain.train.checkpoint = 1, True
    Trainer(plain, quiet=True).run(tmp_path / "plain")
    with pytest.raises(ConfigError, match="was not trained with LoRA"):
        export_peft(tmp_path / "plain", tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()


def tiny_lora(**parallel) -> Config:
    from tests.support.tiny import tiny_config

    cfg = tiny_config(**parallel)
    cfg.model.experts, cfg.model.top_k, cfg.model.shared_experts, cfg.model.capacity_factor = 4, 2, 1, 0.0
    cfg.train.lora_rank, cfg.train.lora_alpha, cfg.train.lr = 4, 8.0, 3e-2
    return cfg


def tiny_lora_steps(rank, world, cfg_dict):
    """Three steps on the first step's batch: its loss falls when the adapters train (three different batches'
    losses need not: which way they go depends on the corpus)."""
    from fivefold.train.trainer import Trainer

    t = Trainer(Config.from_dict(cfg_dict), rank, world, quiet=True)
    return {"losses": [t.step(0)["loss"] for _ in range(3)],
            "experts_frozen": all(not p.requires_grad for n, p in t.model.named_parameters() if ".experts." in n)}


@pytest.mark.ranks
def test_lora_of_a_mixture_of_experts_under_expert_and_sequence_parallelism_equals_one_rank(spawned):
    """Adapters on attention and the shared expert; routed experts frozen: dp2 x ep2 and tp2 + SP equal one rank."""
    one = spawned["moe"][0]
    assert one["experts_frozen"] and one["losses"][2] < one["losses"][0] - 1e-3
    for k in MOE_LAYOUTS:
        for rank in spawned[f"moe-{k}"]:
            assert rank["losses"] == pytest.approx(one["losses"], rel=1e-5), k


@pytest.mark.ranks
def test_the_readme_walk_from_jsonl_to_a_lora_run_to_a_merged_chat_folder(tmp_path):
    """README "Fine-tuning": chat records -> `tokenize --format chat` -> `train --init-hf --lora-rank` on tp2 ->
    `export --hf` (merged, with the run's chat template and the base folder's turn-end id) -> transformers
    renders the template as the run did, loads the weights with the run's logits, and `generate --chat`
    stops at the turn's end."""
    from tests.support.chat import CHATML, conversation, hf_tokenizer

    from fivefold.train.checkpoint import to_model

    tok = hf_tokenizer(tmp_path / "base", CHATML)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**{**QWEN2, "vocab_size": 320, "eos_token_id": end})
                                  ).save_pretrained(tmp_path / "base")
    sampling = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
                "pad_token_id": tok.convert_tokens_to_ids("<|endoftext|>")}   # Qwen2-Instruct's kind of defaults
    gen = json.loads((tmp_path / "base" / "generation_config.json").read_text())
    (tmp_path / "base" / "generation_config.json").write_text(json.dumps({**gen, **sampling}))
    tok_config = json.loads((tmp_path / "base" / "tokenizer_config.json").read_text())
    (tmp_path / "base" / "tokenizer_config.json").write_text(json.dumps(
        {**tok_config, "pad_token": "<|endoftext|>", "padding_side": "left"}))   # the base's tokenizer settings
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps({"messages": conversation(i)}) + "\n" for i in range(60)))
    steps = [("tokenize", tmp_path / "sft.jsonl", "--format", "chat", "--tokenizer", tmp_path / "base" / "tokenizer.json",
              "--out", tmp_path / "sft.bin"),
             ("train", "--nproc", "2", "--tp", "2", "--init-hf", tmp_path / "base", "--data", tmp_path / "sft.bin",
              "--lora-rank", "8", "--steps", "4", "--global-batch", "4", "--seq-len", "32", "--out", tmp_path / "run"),
             ("export", tmp_path / "run", "--hf", tmp_path / "merged"),
             ("generate", tmp_path / "run", "--chat", "--prompt", "the cat", "--max-tokens", "8")]
    for argv in steps:
        r = cli(*argv)
        assert r.returncode == 0, (argv[0], r.stderr[-2000:])
    merged = tmp_path / "merged"
    assert end in json.loads((merged / "generation_config.json").read_text())["eos_token_id"]   # the turn's end
    kept = transformers.GenerationConfig.from_pretrained(merged)   # the base's sampling, not greedy decoding
    assert {k: getattr(kept, k) for k in sampling} == sampling
    assert json.loads((merged / "config.json").read_text())["pad_token_id"] == sampling["pad_token_id"]
    theirs = transformers.AutoTokenizer.from_pretrained(merged)
    assert (theirs.pad_token, theirs.padding_side) == ("<|endoftext|>", "left")   # kept from the base folder
    messages = conversation(3)
    assert theirs.apply_chat_template(messages, tokenize=False) == tok.apply_chat_template(messages, tokenize=False)
    x_bs = torch.tensor([tok.apply_chat_template(messages, tokenize=True, return_dict=False)[:32]])
    with torch.no_grad():
        expected = to_model(tmp_path / "run").eval()(x_bs)
        got = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()(x_bs).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
