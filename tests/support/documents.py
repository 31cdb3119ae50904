"""A token file of short byte-level documents with their offsets."""
import numpy as np

from fivefold.tokenizer import load_tokenizer
from fivefold.train.tokenize import TokenFileWriter


def write_documents(path, count=400, seed=0):
    """A token file of `count` byte-level documents of 2..12 tokens; returns the document lengths."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 13, count)
    w = TokenFileWriter(path, load_tokenizer(None))
    for n in lengths:
        w.write(rng.integers(0, 256, n))
        w.end_document()
    w.commit()
    return lengths

