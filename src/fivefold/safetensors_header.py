"""The header of a safetensors file, read from the file and checked against it: the one reader behind
fivefold's own checkpoints (train/verify.py) and Hugging Face folders (model/hf_weights.py).

The format: an 8-byte little-endian length n, then n bytes of a JSON object (tensor name -> dtype, shape,
byte range in the data after the header; and an optional "__metadata__" table of strings), then the data.
Read here: the length (at least 2, "{}", and at most the format's own limit and what the file holds), the
JSON, and that it is an object. What each caller then demands of the tensors differs: a checkpoint's ranges
tile its data exactly, a Hugging Face file's never overlap. Torch-free.
"""
from __future__ import annotations

import json
import os

MAX_HEADER = 100_000_000   # bytes: the safetensors crate's MAX_HEADER_SIZE, beyond which it refuses a file


def read_header(fd: int, path, error: type[Exception] = ValueError) -> tuple[dict, int]:
    """(the header object, the data's first byte) of the safetensors file open as `fd`; anything else is
    `error` naming `path`."""
    size = os.fstat(fd).st_size
    first = os.pread(fd, 8, 0)
    n = int.from_bytes(first, "little") if len(first) == 8 else -1
    if not 2 <= n <= min(MAX_HEADER, size - 8):
        raise error(f"{path} is not a safetensors file (header length {n}, file size {size})")
    raw = os.pread(fd, n, 8)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):   # UnicodeDecodeError is a ValueError
        raise error(f"{path} is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise error(f"{path} is not a safetensors file (its header is not a JSON object)")
    return header, 8 + n
