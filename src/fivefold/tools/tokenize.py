"""`fivefold tokenize INPUT... --tokenizer T --out data.bin`: text, JSON lines, Parquet or `datasets` folders
into a token file for training (the work: train/tokenize.py `tokenize`; its format: that module's docstring)."""
from __future__ import annotations

import os
import sys

from ..config import ConfigError
from ..train.tokenize import MASK_SUFFIX, tokenize


def add_tokenize_args(ap) -> None:
    ap.add_argument("inputs", nargs="+", metavar="INPUT",
                    help="text files, .jsonl(.gz) / .parquet / .arrow files, or datasets save_to_disk folders")
    ap.add_argument("--tokenizer", help="a Hugging Face tokenizer.json or a tiktoken BPE file "
                    "(default: UTF-8 bytes, vocab 256, no end-of-text token)")
    ap.add_argument("--out", required=True, help="the token file to write (its header: OUT.idx.json, "
                    "document offsets: OUT.idx.npy)")
    ap.add_argument("--field", default="text", help="the JSON field or table column holding the text (default: text)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                    help="tokenizing processes (default: one per CPU core)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing token file")
    ap.add_argument("--eos", default="", metavar="TOKEN", help="the end-of-text token put after each document "
                    "(default: the first of <|endoftext|>, <|end_of_text|>, </s>, ... the vocabulary holds; none: no token)")
    ap.add_argument("--bos", default="", metavar="TOKEN", help="a start-of-text token put before each document "
                    "(default: none)")
    ap.add_argument("--format", dest="fmt", choices=("text", "chat", "prompt-completion"), default="text",
                    help="text: the --field of each record is a document; chat: records with \"messages\" rendered "
                    "by a chat template, the loss on the assistant turns only; prompt-completion: records with "
                    "\"prompt\" and \"completion\", the loss on the completion only (a loss mask OUT.mask)")
    ap.add_argument("--chat-template", metavar="HF_FOLDER", help="the Hugging Face folder whose chat template "
                    "renders --format chat (chat_template.jinja or tokenizer_config.json; default: the --tokenizer's "
                    "folder)")
    ap.add_argument("--errors", choices=("strict", "replace"), default="strict", help="bytes that are not UTF-8 "
                    "in text and JSON-lines inputs: strict (an error naming the file and byte offset) or replace "
                    "(U+FFFD)")


def cmd_tokenize(args) -> int:
    if args.workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {args.workers}")
    try:
        h = tokenize(args.inputs, args.tokenizer, args.out, args.field, args.workers, args.overwrite,
                     errors=args.errors, eos=args.eos, bos=args.bos, fmt=args.fmt, chat_template=args.chat_template)
    except KeyboardInterrupt:   # Ctrl-C: the temporary files are gone, nothing was renamed into place
        print(f"\nfivefold tokenize: interrupted; nothing written to {args.out}", file=sys.stderr)
        return 130
    print(f"wrote {args.out}: {h['tokens']:,} {h['dtype']} tokens in {h['documents']:,} documents "
          f"(vocab {h['vocab_size']:,}, tokenizer {h['tokenizer']['name']})")
    if "loss_mask" in h:
        print(f"  loss mask {args.out}{MASK_SUFFIX}: {h['loss_mask']['trained']:,} of {h['tokens']:,} tokens trained "
              f"({h['instructions']})")
    return 0
