"""`--init-hf`: a folder `transformers` wrote (several shard files) read slice by slice into each rank's
shards under tp2, pp2 and ep2: the first step's loss equals transformers' on the same batch, and each
rank reads its share of the files' bytes, not the whole model. Then `export --hf` of a 4-rank run
writes several shards that `from_pretrained` loads with equal logits."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from fivefold.config import Config, ConfigError, ModelConfig, ParallelConfig, TrainConfig  # noqa: E402
from fivefold.model.hf_weights import HFWeights, hf_config  # noqa: E402

from tests.support.spawn import spawn_jobs  # noqa: E402
from tests.support.tiny import perturb_qk_norms  # noqa: E402

pytestmark = pytest.mark.ranks

COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False)


def hf_folder(path, family: str):
    torch.manual_seed(0)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(intermediate_size=96, **COMMON))
    elif family == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(intermediate_size=96, **COMMON))
        with torch.no_grad():   # biases start at zero: make them matter
            for n, p in model.named_parameters():
                if n.endswith("bias"):
                    p.normal_(0, 0.5)
    elif family == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            intermediate_size=96, moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
            head_dim=12, **COMMON))
        perturb_qk_norms(model)   # the q/k norms start at one: make them matter
    else:
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
            router_jitter_noise=0.0, **COMMON))
    model.save_pretrained(path, max_shard_size="60KB")
    return model.eval()


def config(folder, **parallel) -> Config:
    cfg = Config(model=hf_config(folder), parallel=ParallelConfig(**parallel),
                 train=TrainConfig(steps=1, global_batch=4, seq_len=32, lr=1e-3, min_lr=1e-4, warmup=1, seed=7,
                                   data_limit_mb=0.05, checkpoint=False, init_hf=str(folder)))
    cfg.model.capacity_factor = 0.0
    return cfg


def first_step(rank, world, cfg_dict):
    from fivefold.train.trainer import Trainer

    t = Trainer(Config.from_dict(cfg_dict), rank, world, quiet=True)
    x_bs, y_bs = t.batches.local(0, 0, 1)
    loss = t.step(0)["loss"]
    held = sum(box.numel * 4 for _, _, box, _ in t.state.param_boxes.values())   # the boxes of this rank's pieces, fp32
    return {"loss": loss, "bytes": dict(t.source.bytes_read), "held": held, "x": x_bs, "y": y_bs}


def hf_loss(model, x_bs, y_bs) -> float:
    with torch.no_grad():
        logits = model(x_bs).logits
    return float(F.cross_entropy(logits.flatten(0, 1).double(), y_bs.flatten()))


FAMILIES = {"llama": [dict(tp=2), dict(pp=2, microbatches=2)], "qwen2": [dict(tp=2)],
            "mixtral": [dict(tp=2), dict(pp=2, microbatches=2), dict(dp=2, ep=2), dict(tp=2, ep=2), dict(tp=2, etp=2)],
            "qwen3_moe": [dict(tp=2, ep=2), dict(tp=2, etp=2, sp_mode="megatron")]}
CASES = [(f, p) for f, ps in FAMILIES.items() for p in ps]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case in one spawn of two ranks (process start-up is the slow part)."""
    folders, models, jobs = {}, {}, []
    for family in FAMILIES:
        folders[family] = tmp_path_factory.mktemp(family)
        models[family] = hf_folder(folders[family], family)
    for i, (family, par) in enumerate(CASES):
        jobs.append((str(i), first_step, (config(folders[family], **par).to_dict(),)))
    return folders, models, spawn_jobs(2, jobs)


@pytest.mark.parametrize("i", range(len(CASES)), ids=[f"{f}-{'-'.join(map(str, p))}" for f, p in CASES])
def test_first_step_equals_transformers_and_each_rank_reads_its_share(runs, i):
    folders, models, results = runs
    family, par = CASES[i]
    per_rank = results[str(i)]
    expected = hf_loss(models[family], per_rank[0]["x"], per_rank[0]["y"])
    for r in per_rank:
        assert r["loss"] == pytest.approx(expected, rel=1e-5)
    files = [f for f in os.listdir(folders[family]) if f.endswith(".safetensors")]
    assert len(files) > 2
    total = sum(os.path.getsize(folders[family] / f) for f in files)
    for r in per_rank:
        read = sum(r["bytes"].values())
        assert read == r["held"] and read < 0.8 * total, (read, r["held"], total)   # its share, never the model
    assert sum(sum(r["bytes"].values()) for r in per_rank) >= 0.9 * total   # together: everything


def test_a_bad_folder_is_one_line(tmp_path):
    folder = tmp_path / "m"
    hf_folder(folder, "llama")
    cfg = hf_config(folder)
    HFWeights(folder, cfg).check()
    other = ModelConfig(**{**cfg.__dict__, "ffn": 128})
    with pytest.raises(ConfigError, match="has shape"):
        HFWeights(folder, other).check()
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"].pop("model.norm.weight")
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="missing 1 tensor"):
        HFWeights(folder, cfg).check()


def fivefold_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "fivefold.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_cli_refuses_a_conflicting_set_in_one_line(tmp_path):
    folder = tmp_path / "m"
    hf_folder(folder, "llama")
    r = fivefold_cli("train", "--init-hf", str(folder), "--set", "model.hidden=128", "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "model.hidden = 64" in r.stderr and "drop model.hidden" in r.stderr


def test_cli_refuses_a_folder_missing_a_tensor_before_any_rank_starts(tmp_path):
    folder = tmp_path / "m"
    hf_folder(folder, "llama")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"].pop("model.layers.1.mlp.up_proj.weight")
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    r = fivefold_cli("train", "--init-hf", str(folder), "--seq-len", "32", "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "missing 1 tensor(s), e.g. ['model.layers.1.mlp.up_proj.weight']" in r.stderr
    assert not (tmp_path / "o").exists()


def test_export_hf_of_a_4_rank_run_writes_shards_from_pretrained_loads(tmp_path):
    """...and the folder's tokenizer became the run's (copied into the run, then into the export)."""
    from fivefold.tools.hf_export import byte_level_tokenizer

    folder, out, dest = tmp_path / "m", tmp_path / "run", tmp_path / "hf"
    hf_folder(folder, "mixtral")
    byte_level_tokenizer().save(str(folder / "tokenizer.json"))
    r = fivefold_cli("train", "--init-hf", str(folder), "--tp", "2", "--ep", "2", "--etp", "2", "--nproc", "4", "--steps", "2",
                     "--global-batch", "4", "--seq-len", "32", "--lr", "1e-3", "--set", "train.data_limit_mb=0.05",
                     "--set", "train.min_lr=1e-4", "--set", "train.warmup=1", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    r = fivefold_cli("export", str(out), "--hf", str(dest), "--max-shard-mb", "0.05")
    assert r.returncode == 0, r.stderr[-2000:]
    assert (out / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    assert (dest / "tokenizer.json").is_file()
    shards = sorted(p.name for p in dest.iterdir() if p.name.endswith(".safetensors"))
    assert len(shards) > 2 and (dest / "model.safetensors.index.json").is_file()
    from fivefold.train.checkpoint import to_model

    ours = to_model(out).eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(dest).eval()
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours(tokens), rtol=1e-5, atol=1e-5)


def test_a_folder_without_a_tokenizer_is_refused_unless_its_vocabulary_is_bytes(tmp_path):
    """Training on bytes would mean other tokens than the weights learned: a folder without tokenizer.json
    whose vocabulary is not 256 ids is one line (naming a SentencePiece tokenizer.model when there is one)."""
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(intermediate_size=96, **{**COMMON, "vocab_size": 300})
                                  ).save_pretrained(tmp_path / "m")
    r = fivefold_cli("train", "--init-hf", str(tmp_path / "m"), "--seq-len", "32", "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "has no tokenizer.json" in r.stderr, r.stderr
    (tmp_path / "m" / "tokenizer.model").write_bytes(b"\x00")
    r = fivefold_cli("train", "--init-hf", str(tmp_path / "m"), "--seq-len", "32", "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "SentencePiece tokenizer.model" in r.stderr, r.stderr


def test_a_shard_whose_tensors_share_bytes_is_refused(tmp_path):
    """A shard's last tensor moved to byte 0 in its header: its range still fits its shape and the file, but it
    would read the first tensor's bytes as its own (safetensors refuses such a header too)."""
    import struct

    from fivefold.model.hf_weights import SafetensorsFile

    folder = tmp_path / "m"
    hf_folder(folder, "llama")
    def header_of(path):
        raw = path.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        return raw, n, json.loads(raw[8:8 + n])

    shard = next(p for p in sorted(folder.glob("model-*.safetensors")) if len(header_of(p)[2]) > 3)
    raw, n, header = header_of(shard)
    SafetensorsFile(shard)   # the written shard reads
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    assert len(names) >= 2
    lo, hi = header[names[-1]]["data_offsets"]   # the last tensor moved to the start: inside the first one's bytes
    header[names[-1]]["data_offsets"] = [0, hi - lo]
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (n - len(body)) if len(body) <= n else b""
    assert len(body) == n
    shard.write_bytes(raw[:8] + body + raw[8 + n:])
    with pytest.raises(ConfigError, match="byte ranges must not overlap"):
        SafetensorsFile(shard)


def test_a_folder_of_fp8_weights_or_an_mtp_module_says_so(tmp_path):
    """DeepSeek-V3's released folder holds FP8 weights with block scales and its MTP layer past
    num_hidden_layers: the refusal names both instead of only "does not match its config.json"."""
    folder = tmp_path / "m"
    hf_folder(folder, "llama")
    cfg = hf_config(folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    some = next(iter(index["weight_map"].values()))
    index["weight_map"]["model.layers.0.self_attn.q_proj.weight_scale_inv"] = some
    index["weight_map"]["model.layers.2.self_attn.q_proj.weight"] = some     # 2 layers: layer 2 is past them
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=r"FP8 with block scales .* layer\(s\) \[2\] lie past num_hidden_layers = 2"):
        HFWeights(folder, cfg).check()
