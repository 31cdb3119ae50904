"""`fivefold generate` and `fivefold export --hf`: seeded sampling, the KV cache gives the same tokens as
re-running the sequence, top-k/top-p, and the Hugging Face folder loads in transformers with equal
logits and a working tokenizer."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fivefold import cli
from fivefold.tools.generate import Sampling, load_run, next_token, sample, sample_batch
from fivefold.model.attention import KVCache
from fivefold.tokenizer import load_tokenizer, save_to_run
from fivefold.train import checkpoint
from fivefold.train.trainer import Trainer

from tests.support.spawn import ranks
from tests.support.tiny import tiny_config

transformers = pytest.importorskip("transformers")

MOE = {
    "mixtral": dict(experts=4, top_k=2, moe_ffn=32),
    "qwen2_moe": dict(experts=4, top_k=2, moe_ffn=32, shared_experts=1, shared_expert_gate=True,
                      router="softmax_topk", dense_layers=1),
}
TEXT = "the quick brown fox jumps over the lazy dog. " * 40


def run_config(vocab=256, **model):
    cfg = tiny_config(**model.pop("parallel", {}))
    cfg.model.vocab = vocab
    for k, v in model.items():
        setattr(cfg.model, k, v)
    cfg.train.steps, cfg.train.checkpoint, cfg.train.checkpoint_every = 2, True, 0
    return cfg


def train_rank(rank, world, cfg_dict, out):
    from fivefold.config import Config

    Trainer(Config.from_dict(cfg_dict), rank, world, quiet=True).run(out)


def hf_tokenizer_file(path):
    """A small byte-level BPE tokenizer.json trained here (no download), with <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run folders: dense (trained on tp=2 ranks), the two MoE families (one process), and a dense run
    that trained with a Hugging Face tokenizer."""
    root = tmp_path_factory.mktemp("gen")
    out = {"dense": root / "dense"}
    ranks(train_rank, 2, run_config(parallel=dict(tp=2)).to_dict(), str(out["dense"]), timeout_s=120)
    for name, model in MOE.items():
        out[name] = root / name
        Trainer(run_config(**model), quiet=True).run(out[name])
    tok_file = hf_tokenizer_file(root / "bpe.json")
    tok = load_tokenizer(tok_file)
    out["bpe"] = root / "bpe"
    tokens = np.array(tok.encode(TEXT), dtype=np.int64)
    bpe = run_config(vocab=tok.vocab_size)
    bpe.train.tokenizer = str(tok_file)     # the checkpoint records its digest (generate and export check it)
    Trainer(bpe, tokens=tokens, quiet=True).run(out["bpe"])
    save_to_run(tok_file, out["bpe"])
    return out


def fivefold(capsys, *args):
    """(exit status, stdout, stderr) of the CLI in this process."""
    code = cli.main([str(a) for a in args])
    got = capsys.readouterr()
    return code, got.out, got.err


@pytest.mark.ranks
def test_a_seed_gives_the_same_text_and_another_seed_another(runs, capsys):
    args = ("generate", runs["dense"], "--prompt", "The ", "--max-tokens", 24, "--temperature", 1.0)
    a = fivefold(capsys, *args, "--seed", 1)
    assert a[0] == 0 and a[1].startswith("The ") and "24 tokens" in a[2], a[2]
    assert fivefold(capsys, *args, "--seed", 1)[1] == a[1]
    assert fivefold(capsys, *args, "--seed", 2)[1] != a[1]
    assert fivefold(capsys, *args, "--seed", 1, "--no-cache")[1] == a[1]


@pytest.mark.parametrize("name", ["dense", "mixtral", "qwen2_moe"])
@pytest.mark.ranks
def test_the_kv_cache_gives_the_tokens_of_a_full_rerun(runs, name):
    model, tok = load_run(runs[name])
    prompt = tok.encode("over the ")
    for s in (Sampling(40, temperature=0.0), Sampling(40, temperature=1.0, top_p=0.9, seed=3)):
        cached = sample(model, prompt, s)
        s.use_cache = False
        assert sample(model, prompt, s) == cached
    # the logits themselves: a prompt, a chunk and single tokens against the cache = one full forward
    tokens_bs = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    cache = KVCache(model.cfg.layers)
    with torch.no_grad():
        parts = [model(tokens_bs[:, a:b], cache=cache) for a, b in ((0, 7), (7, 12), (12, 13), (13, 14))]
        full_bsv = model(tokens_bs[:, :14])
    torch.testing.assert_close(torch.cat(parts, 1), full_bsv, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["dense", "qwen2_moe"])
@pytest.mark.ranks
def test_prompts_in_one_batch_give_each_prompts_own_tokens_and_transformers_greedy_ones(runs, tmp_path, capsys, name):
    """Prompts of 2, 9 and 5 tokens left-padded into one batch: greedy, each row's tokens are the ones the
    prompt gets alone and the ones transformers' `generate` gives (greedy, from the exported folder); sampled,
    each row draws what its prompt draws alone (its own generator, the same seed)."""
    from transformers import AutoModelForCausalLM

    model, tok = load_run(runs[name])
    prompts = [tok.encode(t) for t in ("ov", "the lazy dog", "fox j")]
    assert len({len(p) for p in prompts}) == 3
    greedy = Sampling(12, temperature=0.0)
    batch = sample_batch(model, prompts, greedy)
    assert batch == [sample(model, p, greedy) for p in prompts]
    hot = Sampling(12, temperature=1.0, top_p=0.95, seed=7)
    assert sample_batch(model, prompts, hot) == [sample(model, p, hot) for p in prompts]
    stop = batch[1][3]                                   # one row stops early, the others go on
    stopped = sample_batch(model, prompts, greedy, eos_id=stop)
    assert stopped == [sample(model, p, greedy, eos_id=stop) for p in prompts] and len(stopped[1]) <= 4
    code, _, err = fivefold(capsys, "export", runs[name], "--hf", tmp_path / "hf")
    assert code == 0, err
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    for p, ours in zip(prompts, batch):
        theirs = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(p):].tolist()
        assert theirs == ours


@pytest.mark.ranks
def test_top_k_1_and_a_tiny_top_p_are_greedy(runs):
    model, tok = load_run(runs["mixtral"])
    prompt = tok.encode("the lazy")
    greedy = sample(model, prompt, Sampling(30, temperature=0.0))
    assert sample(model, prompt, Sampling(30, temperature=1.5, top_k=1, seed=5)) == greedy
    assert sample(model, prompt, Sampling(30, temperature=1.5, top_p=1e-6, seed=5)) == greedy


def test_top_k_and_top_p_keep_only_the_likely_tokens():
    logits_v = torch.tensor([2.0, 1.5, 1.0, -1.0, -3.0]).log_softmax(0)
    gen = torch.Generator().manual_seed(0)
    picks = lambda s: {next_token(logits_v, s, gen) for _ in range(300)}   # noqa: E731
    assert picks(Sampling(temperature=1.0, top_k=2)) == {0, 1}
    probs = logits_v.exp()
    assert picks(Sampling(temperature=1.0, top_p=float(probs[0] + probs[1] - 1e-4))) == {0, 1}
    assert picks(Sampling(temperature=1.0)) >= {0, 1, 2, 3}


@pytest.mark.ranks
def test_generation_stops_at_the_end_of_text_token(runs):
    model, tok = load_run(runs["dense"])
    prompt = tok.encode("fox")
    greedy = sample(model, prompt, Sampling(20, temperature=0.0))
    stop = greedy[-1]   # as if the last greedy token were the end of text: it stops at its first appearance
    assert sample(model, prompt, Sampling(20, temperature=0.0), eos_id=stop) == greedy[:greedy.index(stop) + 1]


@pytest.mark.parametrize("name", ["dense", "mixtral", "qwen2_moe"])
@pytest.mark.ranks
def test_export_hf_loads_in_transformers_with_equal_logits(runs, tmp_path, capsys, name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dest = tmp_path / "hf"
    code, out, err = fivefold(capsys, "export", runs[name], "--hf", dest)
    assert code == 0, err
    hf = AutoModelForCausalLM.from_pretrained(dest).eval()
    assert hf.config.model_type == ("llama" if name == "dense" else name)
    assert hf.config.eos_token_id is None and hf.config.bos_token_id is None   # bytes: no special tokens
    ours = checkpoint.to_model(runs[name]).eval()
    tokens_bs = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens_bs).logits, ours(tokens_bs), rtol=1e-5, atol=1e-5)
    text = "héllo, wörld\n"
    hf_tok = AutoTokenizer.from_pretrained(dest)   # the byte-level tokenizer.json written for the export
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == list(text.encode())
    assert hf_tok.decode(list(text.encode())) == text
    # the same sampler on the exported folder: the same text for the same seed
    args = ("--prompt", "The ", "--max-tokens", 16, "--seed", 4)
    assert fivefold(capsys, "generate", "--hf", dest, *args)[1] == fivefold(capsys, "generate", runs[name], *args)[1]
    assert fivefold(capsys, "export", runs[name], dest, "--hf")[0] == 2   # never into a non-empty folder


@pytest.mark.ranks
def test_a_run_with_a_hugging_face_tokenizer(runs, tmp_path, capsys):
    from transformers import AutoTokenizer

    tok = load_tokenizer(runs["bpe"] / "tokenizer.json")
    code, out, err = fivefold(capsys, "generate", runs["bpe"], "--prompt", "the quick", "--max-tokens", 8)
    assert code == 0 and out.startswith("the quick"), err
    dest = tmp_path / "hf"
    assert fivefold(capsys, "export", runs["bpe"], "--hf", dest)[0] == 0
    assert json.loads((dest / "config.json").read_text())["eos_token_id"] == tok.eos_id
    assert json.loads((dest / "tokenizer_config.json").read_text())["eos_token"] == "<|endoftext|>"
    hf_tok = AutoTokenizer.from_pretrained(dest)
    assert hf_tok.eos_token_id == tok.eos_id
    assert hf_tok(TEXT[:60], add_special_tokens=False)["input_ids"] == tok.encode(TEXT[:60])
    args = ("--prompt", "the lazy", "--max-tokens", 8, "--seed", 2)
    assert fivefold(capsys, "generate", "--hf", dest, *args)[1] == fivefold(capsys, "generate", runs["bpe"], *args)[1]


@pytest.mark.parametrize("args,rule", [
    (["--prompt", ""], "--prompt must not be empty"),
    (["--prompt", "a", "--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["--prompt", "a", "--temperature", "-1"], "--temperature must be >= 0"),
    (["--prompt", "a", "--top-k", "-2"], "--top-k must be >= 0"),
    (["--prompt", "a", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--prompt", "a", "--checkpoint", "step-9"], "no such checkpoint"),
    (["--prompt", "x" * 64], "the prompt must be 1..63 tokens"),
    (["--prompt", "caf\udce9"], "--prompt is not valid UTF-8: byte 0xe9 at character 3"),   # argv's Latin-1 bytes
])
@pytest.mark.ranks
def test_bad_input_is_one_line_and_exit_2(runs, capsys, args, rule):
    code, out, err = fivefold(capsys, "generate", runs["dense"], *args)
    assert code == 2 and rule in err and len(err.strip().splitlines()) == 1, err


def test_missing_runs_and_checkpoints_are_named(tmp_path, capsys):
    code, _, err = fivefold(capsys, "generate", tmp_path / "nope", "--prompt", "a")
    assert code == 2 and "no such run folder" in err
    code, _, err = fivefold(capsys, "generate", tmp_path, "--prompt", "a")
    assert code == 2 and "holds no complete checkpoint" in err
    code, _, err = fivefold(capsys, "generate", "--hf", tmp_path, "--prompt", "a")
    assert code == 2 and "not a Hugging Face model folder" in err
    code, _, err = fivefold(capsys, "export", tmp_path)
    assert code == 2 and "export needs a destination" in err


@pytest.mark.ranks
def test_a_full_context_stops_with_a_note(runs, capsys):
    code, out, err = fivefold(capsys, "generate", runs["dense"], "--prompt", "x" * 60, "--max-tokens", 10)
    assert code == 0 and out.startswith("x" * 60) and "stopped after 4 tokens: the context is full" in err


def test_a_temperature_so_small_it_overflows_is_greedy(runs, capsys):
    args = ("generate", runs["dense"], "--prompt", "The ", "--max-tokens", 8)
    greedy = fivefold(capsys, *args, "--temperature", 0)
    tiny = fivefold(capsys, *args, "--temperature", 1e-45)
    assert tiny[0] == 0 and tiny[1] == greedy[1], tiny[2]


def test_export_hf_to_a_file_or_under_one_is_one_line(runs, tmp_path, capsys):
    (tmp_path / "file").write_text("mine")
    for dest in (tmp_path / "file", tmp_path / "file" / "hf"):
        code, _, err = fivefold(capsys, "export", runs["dense"], "--hf", dest)
        assert code == 2 and "file" in err and len(err.strip().splitlines()) == 1, err
    assert (tmp_path / "file").read_text() == "mine"


@pytest.mark.ranks
def test_a_replaced_tokenizer_is_refused_by_generate_eval_and_export(runs, tmp_path, capsys):
    """The run folder's tokenizer copy is held to the digest its checkpoint recorded: replaced (or added to
    a byte-level run), generate, eval and export --hf each stop with one line instead of using it."""
    import shutil

    for name, other in (("bpe", hf_tokenizer_file(tmp_path / "other.json")), ("dense", runs["bpe"] / "tokenizer.json")):
        run = tmp_path / f"copy-{name}"
        shutil.copytree(runs[name], run)
        if name == "bpe":   # another tokenizer of the same kind and size: same vocabulary, other ids
            (tmp_path / "other.json").write_text((tmp_path / "other.json").read_text().replace('"the"', '"teh"'))
        shutil.copy(other, run / "tokenizer.json")
        data = tmp_path / "text.txt"
        data.write_text(TEXT * 4)
        for args in (("generate", run, "--prompt", "the"), ("export", run, "--hf", tmp_path / f"hf-{name}"),
                     ("eval", run, "--data", data, "--seq-len", "16", "--global-batch", "2")):
            code, _, err = fivefold(capsys, *args)
            assert code == 2 and "is not the tokenizer the run trained with" in err and err.count("\n") == 1, (args, err)
        assert not (tmp_path / f"hf-{name}").exists()


@pytest.mark.ranks
def test_export_hf_is_whole_or_absent(runs, tmp_path, capsys, monkeypatch):
    """The folder appears only once written whole: a failure midway leaves no folder (and no temporary), and a
    killed export's temporary (its process gone) is removed by the next export into the same folder."""
    from fivefold.train import checkpoint as ck

    dest = tmp_path / "hf"

    def half(ckpt, folder, *a, **k):
        (Path(folder)).mkdir(parents=True)
        (Path(folder) / "config.json").write_text("{}")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ck, "export_hf", half)
    with pytest.raises(OSError):
        from fivefold.tools.hf_export import export_hf_folder
        export_hf_folder(runs["dense"], dest)
    assert not dest.exists() and not list(tmp_path.iterdir())
    monkeypatch.undo()
    stale = tmp_path / ".hf.fivefold-export-999999999"   # no such process
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    mine = tmp_path / ".other.fivefold-export-999999999"  # another destination's: not ours to judge here
    mine.mkdir()
    code, _, err = fivefold(capsys, "export", runs["dense"], "--hf", dest)
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.fivefold-export-999999999", "hf"]
