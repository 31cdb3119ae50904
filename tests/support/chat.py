"""Chat data made here: the ChatML and Llama 3 templates, conversations drawn from a seed, and a byte-level
BPE with their special tokens saved as a Hugging Face tokenizer folder (no download)."""
import numpy as np


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]


CHATML = ("{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
          "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
          "{{ message['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
          "{% endif %}")


LLAMA3 = ("{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>"
          "\n\n{{ message['content'] | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
          "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


WORDS = "the cat sat on a mat and asked why the sky is blue so the dog said light scatters in air".split()


def conversation(i: int) -> list[dict]:
    rng = np.random.default_rng(i)

    def text(n):
        return " ".join(rng.choice(WORDS, size=n))

    msgs = [{"role": "system", "content": "Answer briefly."}] if i % 3 == 0 else []
    for _ in range(1 + i % 2):
        msgs += [{"role": "user", "content": text(5 + i % 4)}, {"role": "assistant", "content": text(8 + i % 5)}]
    return msgs


def hf_tokenizer(folder, template: str):
    """A byte-level BPE trained here (no download) with the templates' special tokens, saved as a Hugging
    Face folder with its chat template."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(WORDS)] * 20, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"),
                                                bos_token="<|begin_of_text|>", eos_token="<|endoftext|>")
    fast.chat_template = template
    fast.save_pretrained(folder)
    return fast

