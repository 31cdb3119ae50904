"""A small corpus of sentences (DOCS), a tiny model's flags for it, and the one-line error check of the
tokenizer commands."""


WORDS = ("the quick brown fox jumps over the lazy dog while seven zebras quietly hum old songs; "
         "naïve café owners count 12 345 coins — déjà vu").split()


DOCS = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(8 + i % 13)) + "." for i in range(240)]


TINY = ["--set", "model.hidden=32", "--set", "model.layers=2", "--set", "model.ffn=64", "--set", "model.heads=2",
        "--set", "model.kv_heads=2", "--set", "model.max_seq=32", "--seq-len", "16", "--global-batch", "8",
        "--set", "train.warmup=1"]


def one_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line]
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]

