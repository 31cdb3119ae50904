"""Instruction data (train/instructions.py, `fivefold tokenize --format chat|prompt-completion`): a chat
template renders as transformers' `apply_chat_template` renders it, the ids are its ids, and the loss
mask keeps the assistant turns (the completion) only. Then supervised fine-tuning of a transformers-written
Qwen2 on that token file: the first step's loss is transformers' mean over the targets with labels = -100
elsewhere, under 1 rank, tp2, pp2, dp2 and cp2, and the later steps agree across layouts."""
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from fivefold.config import Config, ConfigError, ParallelConfig, TrainConfig  # noqa: E402
from fivefold.model.hf_weights import hf_config  # noqa: E402
from fivefold.tokenizer import load_tokenizer  # noqa: E402
from fivefold.train.data import make_batches  # noqa: E402
from fivefold.train.instructions import ChatTemplate, encode_record  # noqa: E402
from fivefold.train.tokenize import mask_path, open_loss_mask, open_token_file, read_header, tokenize  # noqa: E402

from tests.support.spawn import spawn_jobs  # noqa: E402
from tests.support.chat import CHATML, LLAMA3, conversation, hf_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    return {name: (root / name, hf_tokenizer(root / name, t)) for name, t in (("chatml", CHATML), ("llama3", LLAMA3))}


@pytest.mark.parametrize("name", ["chatml", "llama3"])
def test_the_template_renders_and_tokenizes_as_transformers_and_masks_the_assistant_turns(folders, name):
    folder, fast = folders[name]
    template = ChatTemplate.from_folder(folder)
    tok = load_tokenizer(folder / "tokenizer.json")
    for i in range(8):
        msgs = conversation(i)
        for gen in (False, True):
            assert template.render(msgs, gen) == fast.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        ids, mask = encode_record("chat", {"messages": msgs}, f"record {i}", tok, template)
        expected = fast.apply_chat_template(msgs, tokenize=True)
        expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
        assert ids.tolist() == list(expected)
        trained = fast.decode([t for t, m in zip(ids.tolist(), mask.tolist()) if m])
        answers = [m["content"] for m in msgs if m["role"] == "assistant"]
        end = "<|im_end|>\n" if name == "chatml" else "<|eot_id|>"
        assert trained == "".join(a + end for a in answers), trained
        assert mask.sum() < len(mask) and mask[0] == 0


def test_prompt_completion_trains_the_completion_and_its_end(folders):
    folder, fast = folders["chatml"]
    tok = load_tokenizer(folder / "tokenizer.json")
    ids, mask = encode_record("prompt-completion", {"prompt": "why is the sky", "completion": " blue so"}, "r", tok, None)
    assert ids.tolist() == tok.encode("why is the sky blue so") + [tok.eos_id]
    assert fast.decode([t for t, m in zip(ids.tolist(), mask.tolist()) if m]) == " blue so<|endoftext|>"
    for bad, words in (({"prompt": "x"}, "\"prompt\" and \"completion\""), ({"prompt": "x", "completion": ""}, "empty")):
        with pytest.raises(ConfigError, match=words):
            encode_record("prompt-completion", bad, "input a.jsonl:3", tok, None)
    with pytest.raises(ConfigError, match="a.jsonl:3: message 0"):
        encode_record("chat", {"messages": [{"role": "user"}]}, "input a.jsonl:3", tok, ChatTemplate.from_folder(folder))
    with pytest.raises(ConfigError, match="no assistant turn"):
        encode_record("chat", {"messages": [{"role": "user", "content": "hi"}]}, "r", tok,
                      ChatTemplate.from_folder(folder))


def chat_token_file(folder, tmp_path, n=120):
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": conversation(i)}) + "\n" for i in range(n)))
    out = tmp_path / "chat.bin"
    tokenize([data], folder / "tokenizer.json", out, fmt="chat", progress=False)
    return out


def test_tokenize_writes_the_mask_beside_the_tokens_and_a_changed_mask_is_refused(folders, tmp_path):
    folder, _ = folders["chatml"]
    out = chat_token_file(folder, tmp_path, n=20)
    h = read_header(out)
    mask = np.fromfile(mask_path(out), dtype=np.uint8)
    assert h["instructions"] == "chat" and h["documents"] == 20 and len(mask) == h["tokens"]
    assert h["loss_mask"]["trained"] == int(mask.sum()) and 0 < mask.sum() < len(mask)
    assert open_loss_mask(out, verify=True) is not None
    mask[3] ^= 1
    mask.tofile(mask_path(out))
    with pytest.raises(ConfigError, match="does not match its header"):
        open_loss_mask(out, verify=True)
    mask_path(out).write_bytes(b"\x01" * 5)
    with pytest.raises(ConfigError, match="5 bytes for"):
        open_loss_mask(out)
    with pytest.raises(ConfigError, match="holds records, not text or tokens: tokenize it first"):
        make_batches(TrainConfig(data=[str(tmp_path / "chat.jsonl")], seq_len=16, global_batch=2), 320)


def test_batches_set_the_masked_targets_to_ignore_and_count_the_rest(folders, tmp_path):
    folder, _ = folders["chatml"]
    out = chat_token_file(folder, tmp_path, n=40)
    train = TrainConfig(data=[str(out)], tokenizer=str(folder / "tokenizer.json"), seq_len=32, global_batch=4)
    b = make_batches(train, 320)
    mask = np.fromfile(mask_path(out), dtype=np.uint8)
    offs = b.offsets(3).tolist()
    x, y = b.rows(3, 0, 4)
    for r, o in enumerate(offs):
        keep = mask[o + 1:o + 33] == 1
        assert (y[r][torch.from_numpy(~keep)] == -100).all()
        assert y[r][torch.from_numpy(keep)].tolist() == np.fromfile(out, dtype=np.uint16)[o + 1:o + 33][keep].tolist()
    assert b.loss_tokens(3) == int((y != -100).sum()) < b.tokens_per_step() and b.masked
    # train.loss_mask off: the loss over the whole conversation (TRL's default without assistant_only_loss)
    whole = make_batches(TrainConfig(data=[str(out)], tokenizer=str(folder / "tokenizer.json"), seq_len=32,
                                     global_batch=4, loss_mask=False), 320)
    x_all, y_all = whole.rows(3, 0, 4)
    assert not whole.masked and whole.loss_tokens(3) == whole.tokens_per_step() and (y_all != -100).all()
    assert torch.equal(x_all, x) and torch.equal(y_all[y != -100], y[y != -100])


COMMON = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False, intermediate_size=96)


def sft_config(model_folder, tok_folder, data, **parallel) -> Config:
    cfg = Config(model=hf_config(model_folder), parallel=ParallelConfig(**parallel),
                 train=TrainConfig(steps=3, global_batch=4, seq_len=32, lr=1e-3, min_lr=1e-4, warmup=1, seed=7,
                                   checkpoint=False, init_hf=str(model_folder), data=[str(data)],
                                   tokenizer=str(tok_folder / "tokenizer.json")))
    return cfg


def sft_steps(rank, world, cfg_dict):
    from fivefold.train.trainer import Trainer

    t = Trainer(Config.from_dict(cfg_dict), rank, world, quiet=True)
    x_bs, y_bs = t.batches.rows(0, 0, t.cfg.train.global_batch)
    losses = [t.step(i) for i in range(3)]
    return {"losses": [m["loss"] for m in losses], "loss_tokens": [m["loss_tokens"] for m in losses], "x": x_bs, "y": y_bs}


LAYOUTS = [dict(dp=2), dict(tp=2), dict(pp=2, microbatches=2), dict(cp=2), dict(dp=2, zero=3)]


@pytest.mark.ranks
def test_sft_loss_is_transformers_labels_minus_100_under_every_layout(folders, tmp_path):
    folder, _ = folders["chatml"]
    data = chat_token_file(folder, tmp_path)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON))
    model.save_pretrained(tmp_path / "qwen2")
    model.eval()
    jobs = [(str(i), sft_steps, (sft_config(tmp_path / "qwen2", folder, data, **p).to_dict(),))
            for i, p in enumerate(LAYOUTS)]
    results = spawn_jobs(2, jobs)
    one = results["0"][0]
    with torch.no_grad():
        logits = model(one["x"]).logits
    expected = float(F.cross_entropy(logits.flatten(0, 1).double(), one["y"].flatten(), ignore_index=-100))
    assert one["loss_tokens"][0] == int((one["y"] != -100).sum()) < one["y"].numel()
    unmasked = float(F.cross_entropy(logits.flatten(0, 1).double(), one["y"].clamp(min=0).flatten()))
    assert abs(unmasked - expected) > 1e-3          # the mask changes the loss: the equality below means something
    for i, layout in enumerate(LAYOUTS):
        for r in results[str(i)]:
            assert r["losses"][0] == pytest.approx(expected, rel=1e-5), layout
            assert r["losses"] == pytest.approx(one["losses"], rel=1e-5), layout


def test_generate_stops_where_the_folder_says_and_chats_through_its_template(folders, tmp_path, capsys):
    """A transformers-written Qwen2 with a generation_config.json naming a second end-of-turn id: greedy
    `fivefold generate --hf` gives transformers' `generate` tokens and stops where it stops; --chat sends
    the prompt through the folder's template; --stop cuts the text."""
    import shutil

    from fivefold import cli
    from fivefold.tools.generate import Sampling, load_hf, sample
    from fivefold.tools.stops import stop_ids

    folder, fast = folders["chatml"]
    torch.manual_seed(1)
    hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON)).eval()
    model_dir = tmp_path / "qwen2"
    hf.save_pretrained(model_dir)
    for f in folder.iterdir():
        shutil.copy(f, model_dir / f.name)
    prompt = fast.encode("why the sky", add_special_tokens=False)
    free = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                       pad_token_id=0)[0, len(prompt):].tolist()
    end = next((t for i, t in enumerate(free) if i >= 2 and t not in free[:i] and t != fast.eos_token_id), None)
    assert end is not None, free           # a token greedy decoding first reaches at step 3 or later
    stop_at = free.index(end)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [fast.eos_token_id, end]}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)[0, len(prompt):]
    model, tok = load_hf(model_dir, "cpu")
    stops = stop_ids(tok, model_dir)
    assert stops == {fast.eos_token_id, end}
    ours = sample(model, prompt, Sampling(12, temperature=0.0), stops, tok.vocab_size)
    assert ours == theirs.tolist() == free[:stop_at + 1]
    chat = fast.apply_chat_template([{"role": "user", "content": "why the sky"}], add_generation_prompt=True,
                                    tokenize=False)
    code = cli.main(["generate", "--hf", str(model_dir), "--prompt", "why the sky", "--chat", "--temperature", "0",
                     "--max-tokens", "6", "--prompt", "the cat"])
    out = capsys.readouterr()
    expected = sample(model, tok.encode(chat), Sampling(6, temperature=0.0), stops, tok.vocab_size)
    text = tok.decode(expected[:-1] if expected[-1] in stops else expected)
    assert code == 0 and out.out.startswith("why the sky\n" + text) and out.out.count("\n") >= 2, out
    cut = tok.decode([ours[1]])          # the second token's text: the output stops before it
    assert cut and ours[1] not in stops
    code = cli.main(["generate", "--hf", str(model_dir), "--prompt", "why the sky", "--temperature", "0",
                     "--max-tokens", "12", "--stop", cut])
    printed = capsys.readouterr().out
    assert code == 0 and printed == "why the sky" + tok.decode(ours[:-1]).split(cut)[0] + "\n"


@pytest.mark.ranks
def test_sft_of_a_mixture_of_experts_under_expert_parallelism(folders, tmp_path):
    """The same loss for a transformers-written Qwen2-MoE (dropless) under dp2 x ep2 as transformers'
    with labels = -100 on the same batch."""
    folder, _ = folders["chatml"]
    data = chat_token_file(folder, tmp_path)
    torch.manual_seed(0)
    moe = dict(COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
               shared_expert_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.0)
    model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**moe))
    model.save_pretrained(tmp_path / "moe")
    model.eval()
    cfg = sft_config(tmp_path / "moe", folder, data, dp=2, ep=2)
    cfg.model.capacity_factor, cfg.model.aux_loss_coef = 0.0, 0.0
    results = spawn_jobs(2, [("moe", sft_steps, (cfg.to_dict(),))])["moe"]
    with torch.no_grad():
        logits = model(results[0]["x"]).logits
    expected = float(F.cross_entropy(logits.flatten(0, 1).double(), results[0]["y"].flatten(), ignore_index=-100))
    for r in results:
        assert r["losses"][0] == pytest.approx(expected, rel=1e-5)


def test_a_completion_ends_with_the_tokenizer_folders_eos_token_as_trl_appends_it(folders, tmp_path):
    """TRL's SFTTrainer ends a completion with its tokenizer's eos_token: an Instruct model's end of turn
    (tokenizer_config.json, Qwen2-Instruct's <|im_end|>), not the end-of-text fivefold found by name."""
    import shutil

    from fivefold.train.tokenize import open_token_file

    base, fast = folders["chatml"]
    instruct = tmp_path / "instruct"
    shutil.copytree(base, instruct)
    config = json.loads((instruct / "tokenizer_config.json").read_text())
    (instruct / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|im_end|>"}))
    data = tmp_path / "pc.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"why is the sky {i}", "completion": " blue so"}) + "\n"
                            for i in range(3)))
    ends = {}
    for name, folder, eos in (("instruct", instruct, ""), ("base", base, ""), ("--eos", instruct, "<|endoftext|>")):
        out = tmp_path / f"{name.strip('-')}.bin"
        tokenize([data], folder / "tokenizer.json", out, fmt="prompt-completion", progress=False, eos=eos)
        ids = open_token_file(out)[0].tolist()
        mask = np.fromfile(mask_path(out), dtype=np.uint8).tolist()
        # a record's end: its last trained token (the next record's prompt is not trained)
        ends[name] = {t for i, t in enumerate(ids) if mask[i] and (i + 1 == len(ids) or not mask[i + 1])}
    assert ends == {"instruct": {fast.convert_tokens_to_ids("<|im_end|>")},
                    "base": {fast.convert_tokens_to_ids("<|endoftext|>")},
                    "--eos": {fast.convert_tokens_to_ids("<|endoftext|>")}}


CHATML_GENERATION = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
                     "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
                     "{% endgeneration %}{{ '\\n' }}{% else %}{{ message['content'] + '<|im_end|>' + '\\n' }}{% endif %}"
                     "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_generation_blocks_mask_the_assistant_tokens_as_transformers_does(tmp_path):
    """A template with {% generation %} blocks (TRL's assistant_only_loss) was refused; its blocks' tokens are
    now the trained ones, equal to transformers' apply_chat_template(return_assistant_tokens_mask=True)."""
    fast = hf_tokenizer(tmp_path / "gen", CHATML_GENERATION)
    template = ChatTemplate.from_folder(tmp_path / "gen")
    assert template.marks_generation and not ChatTemplate(CHATML).marks_generation
    tok = load_tokenizer(tmp_path / "gen" / "tokenizer.json")
    for i in range(6):
        msgs = conversation(i)
        ids, mask = encode_record("chat", {"messages": msgs}, f"record {i}", tok, template)
        theirs = fast.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert ids.tolist() == list(theirs["input_ids"])
        assert mask.tolist() == list(theirs["assistant_masks"])
        assert fast.decode([t for t, m in zip(ids.tolist(), mask.tolist()) if m]) == "".join(
            m["content"] + "<|im_end|>" for m in msgs if m["role"] == "assistant")   # the "\n" after is context


def test_sharegpt_and_conversational_prompt_completion_records(folders, tmp_path):
    """ShareGPT's {"conversations": [{"from", "value"}]} is the conversation its messages are; TRL's
    conversational prompt-completion trains what the template renders after the prompt's generation prompt
    (the template closes the turn: no end token added), as TRL's completion mask does."""
    folder, fast = folders["chatml"]
    template = ChatTemplate.from_folder(folder)
    tok = load_tokenizer(folder / "tokenizer.json")
    msgs = conversation(2)
    share = {"conversations": [{"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]),
                                "value": m["content"]} for m in msgs]}
    got, want = encode_record("chat", share, "r", tok, template), encode_record("chat", {"messages": msgs}, "r", tok, template)
    assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()
    with pytest.raises(ConfigError, match="conversations turn 0 needs \"from\""):
        encode_record("chat", {"conversations": [{"from": "narrator", "value": "x"}]}, "r", tok, template)
    prompt = [{"role": "user", "content": "what is blue"}]
    completion = [{"role": "assistant", "content": "the sky"}]
    ids, mask = encode_record("prompt-completion", {"prompt": prompt, "completion": completion}, "r", tok, template)
    before = fast.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    full = fast.apply_chat_template(prompt + completion, tokenize=False)
    assert ids.tolist() == tok.encode(full)
    assert fast.decode([t for t, m in zip(ids.tolist(), mask.tolist()) if m]) == full[len(before):]
    assert full[len(before):] == "the sky<|im_end|>\n"
    with pytest.raises(ConfigError, match="needs a chat template"):
        encode_record("prompt-completion", {"prompt": prompt, "completion": completion}, "r", tok, None)


def records_file(folder, tmp_path, n=60):
    """Short prompt-completion records (8-20 tokens): several fit a row of 33 tokens."""
    data = tmp_path / "pc.jsonl"
    data.write_text("".join(json.dumps({"prompt": "why is the sky " * (1 + i % 3), "completion": f" blue so {i}"})
                            + "\n" for i in range(n)))
    out = tmp_path / "pc.bin"
    tokenize([data], folder / "tokenizer.json", out, fmt="prompt-completion", progress=False)
    return out


def test_records_stay_whole_padded_or_packed_and_what_is_cut_is_counted(folders, tmp_path):
    """train.records: every record in one row, from its first token, each once an epoch; padding and the
    target after a record's end untrained; best-fit decreasing packs rows (never past seq_len + 1);
    a record past a row is cut or dropped, and counted."""
    from fivefold.train.data import RecordBatches, best_fit_decreasing

    folder, _ = folders["chatml"]
    out = records_file(folder, tmp_path)
    tokens = np.asarray(open_token_file(out)[0][:])
    base = dict(data=[str(out)], tokenizer=str(folder / "tokenizer.json"), seq_len=32, global_batch=4)
    padded = make_batches(TrainConfig(records="padded", **base), 320)
    packed = make_batches(TrainConfig(records="packed", document_mask=True, **base), 320)
    assert isinstance(padded, RecordBatches) and len(padded.bins) == 60 and padded.cut == padded.dropped == 0
    assert len(packed.bins) < 30 and sorted(r for b in packed.bins for r in b) == sorted(padded.records)
    assert all(sum(n for _, n in b) <= 33 for b in packed.bins)
    for b in (padded, packed):
        seen = [r for j in range(len(b.bins)) for r in b.bin_of(j)]            # one epoch of rows
        assert sorted(seen) == sorted(b.records)
        win, keep, ids = b.row(5)
        at = 0
        for k, (lo, n) in enumerate(b.bin_of(5)):
            assert win[at:at + n].tolist() == tokens[lo:lo + n].tolist() and set(ids[at:at + n]) == {k}
            assert keep[at + n - 1] == 0 if at + n - 1 < 32 else True          # the next record's first token
            at += n
        assert (win[at:] == 0).all() and not keep[at:].any()                    # padding, untrained
    assert packed.summary()["padding"] < padded.summary()["padding"]
    for b in (padded, packed):   # the loss divisor: the trained targets of the step's rows
        for step in (0, 3):
            assert b.loss_tokens(step) == int((b.rows(step, 0, 4)[1] != -100).sum())
            docs = b.local_documents(step, 1, 2)
            assert torch.equal(docs, torch.from_numpy(np.stack([b.row(step * 4 + r)[2][:-1] for r in (2, 3)])))
    short = dict(base, seq_len=12)
    cut = make_batches(TrainConfig(records="padded", record_overflow="truncate", **short), 320)
    drop = make_batches(TrainConfig(records="padded", record_overflow="drop", **short), 320)
    assert cut.cut > 0 and cut.dropped == 0 and drop.dropped == cut.cut and drop.cut == 0
    assert best_fit_decreasing([(0, 5), (5, 4), (9, 3), (12, 2)], 7) == [[(0, 5), (12, 2)], [(5, 4), (9, 3)]]
    with pytest.raises(ConfigError, match=r"records = packed .* \(train.document_mask\)"):
        TrainConfig(records="packed").validate()


def records_steps(rank, world, cfg_dict):
    from fivefold.train.trainer import Trainer

    t = Trainer(Config.from_dict(cfg_dict), rank, world, quiet=True)
    x_bs, y_bs = t.batches.rows(0, 0, t.cfg.train.global_batch)
    return {"losses": [t.step(i)["loss"] for i in range(3)], "x": x_bs, "y": y_bs, "records": t.run_info().get("records")}


@pytest.mark.parametrize("records", ["padded", "packed"])
def test_whole_records_train_alike_under_every_layout(folders, tmp_path, records):
    """Padded and packed rows equal one process under dp, tp, pp and cp; padded rows' first loss is
    transformers' with labels -100 on the padding (a row is one record: no mask needed)."""
    folder, _ = folders["chatml"]
    data = records_file(folder, tmp_path)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON))
    model.save_pretrained(tmp_path / "qwen2")

    def config(**parallel):
        cfg = sft_config(tmp_path / "qwen2", folder, data, **parallel)
        cfg.train.records, cfg.train.document_mask = records, records == "packed"
        return cfg.to_dict()
    one = records_steps(0, 1, config())
    assert one["records"]["rows"] == (60 if records == "padded" else one["records"]["rows"]) and one["records"]["cut"] == 0
    layouts = [dict(dp=2), dict(tp=2), dict(pp=2, microbatches=2), dict(cp=2)]
    results = spawn_jobs(2, [(str(i), records_steps, (config(**p),)) for i, p in enumerate(layouts)])
    for i, layout in enumerate(layouts):
        for r in results[str(i)]:
            assert r["losses"] == pytest.approx(one["losses"], rel=1e-5), layout
    if records == "padded":
        with torch.no_grad():
            logits = model.eval()(one["x"]).logits
        expected = float(F.cross_entropy(logits.flatten(0, 1).double(), one["y"].flatten(), ignore_index=-100))
        assert one["losses"][0] == pytest.approx(expected, rel=1e-5)


def test_stream_rows_say_how_many_records_they_cut(folders, tmp_path):
    """The default (train.records = stream) cuts records across rows; it says how many, on the console and in
    run.json, never silently."""
    from fivefold.train.trainer import records_line

    folder, _ = folders["chatml"]
    out = records_file(folder, tmp_path)
    b = make_batches(TrainConfig(data=[str(out)], tokenizer=str(folder / "tokenizer.json"), seq_len=32,
                                 global_batch=4), 320)
    tokens = np.asarray(open_token_file(out)[0][:])
    starts = np.asarray(read_header(out)["doc_starts"] if "doc_starts" in read_header(out) else
                        [r[0] for r in make_batches(TrainConfig(data=[str(out)], tokenizer=str(folder / "tokenizer.json"),
                                                                seq_len=32, global_batch=4, records="padded"), 320).records])
    ends = np.append(starts[1:], len(tokens))
    want = sum(1 for lo, hi in zip(starts, ends) if hi > (lo // 32) * 32 + 33)   # no window [32k, 32k + 33) holds it
    assert b.stream_records == {"mode": "stream", "records": 60, "cut": want} and 0 < want < 60
    assert f"{want:,} of 60 records straddle rows" in records_line(b.stream_records, "stream")
