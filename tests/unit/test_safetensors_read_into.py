"""`SafetensorsFile.read_into`: a box read straight into the caller's tensor where it is contiguous in the
file's dtype (a restore stages nothing), through one box-sized buffer otherwise; the same values either way."""
import itertools
import threading

import pytest
import torch

from fivefold.model.hf_weights import SafetensorsFile, stream_safetensors


@pytest.fixture
def stored(tmp_path):
    tensors = {"a": torch.arange(60, dtype=torch.float32).view(3, 4, 5),
               "b": torch.linspace(-2, 2, 24, dtype=torch.bfloat16).view(4, 6),
               "s": torch.tensor(7.5, dtype=torch.float64)}
    path = tmp_path / "x.safetensors"
    stream_safetensors(path, {k: (tuple(t.shape), t.dtype) for k, t in tensors.items()}, tensors.__getitem__)
    return SafetensorsFile(path), tensors


def _boxes(shape):
    for offsets in itertools.product(*(range(n) for n in shape)):
        for sizes in itertools.product(*(range(1, n - o + 1) for o, n in zip(offsets, shape))):
            yield offsets, sizes


def test_every_box_read_straight_into_a_contiguous_tensor(stored, monkeypatch):
    f, tensors = stored
    monkeypatch.setattr(SafetensorsFile, "read", lambda *a: pytest.fail("staged through a buffer"))
    for name in ("a", "b"):
        full = tensors[name]
        for offsets, sizes in _boxes(full.shape):
            dst = torch.full(sizes, -1.0, dtype=full.dtype)
            n = f.read_into(name, offsets, sizes, dst)
            assert torch.equal(dst, full[tuple(slice(o, o + k) for o, k in zip(offsets, sizes))])
            assert n == dst.numel() * full.element_size()
    scalar = torch.zeros((), dtype=torch.float64)
    f.read_into("s", (), (), scalar)
    assert scalar.item() == 7.5


def test_a_strided_or_other_dtype_target_goes_through_one_buffer(stored):
    f, tensors = stored
    wide = torch.zeros(5, 4)                       # a transposed view: not contiguous
    f.read_into("a", (1, 0, 0), (1, 4, 5), wide.t().unsqueeze(0))
    assert torch.equal(wide.t(), tensors["a"][1])
    cast = torch.zeros(2, 6, dtype=torch.float32)  # bf16 in the file, fp32 wanted
    f.read_into("b", (2, 0), (2, 6), cast)
    assert torch.equal(cast, tensors["b"][2:].float())


def test_a_truncated_file_is_named(stored):
    f, _ = stored
    size = f.path.stat().st_size
    with open(f.path, "r+b") as fh:
        fh.truncate(size - 8)
    with pytest.raises(Exception, match="cut short"):
        f.read_into("s", (), (), torch.zeros((), dtype=torch.float64))


def test_a_short_read_is_continued_not_called_truncated(stored, monkeypatch):
    """One read(2) moves at most ~2 GiB on Linux: a run longer than what one call returns is read on."""
    import os

    f, tensors = stored
    real = os.preadv

    def at_most_12_bytes(fd, buffers, position):
        return real(fd, [buffers[0][:12]], position)

    monkeypatch.setattr(os, "preadv", at_most_12_bytes)
    dst = torch.empty(3, 4, 5)
    f.read_into("a", (0, 0, 0), (3, 4, 5), dst)
    assert torch.equal(dst, tensors["a"])


def test_a_box_outside_the_tensor_or_the_target_is_refused(stored):
    f, _ = stored
    with pytest.raises(Exception, match="outside"):
        f.read_into("a", (2, 0, 0), (2, 4, 5), torch.empty(2, 4, 5))
    with pytest.raises(ValueError, match="read into"):
        f.read_into("a", (0, 0, 0), (1, 4, 5), torch.empty(2, 4, 5))


def test_a_run_folders_file_is_opened_only_as_itself(stored, tmp_path):
    """The checkpoint's reader opens without following links (a link swapped in after its check is refused
    at the open) and refuses what is not a regular file, without blocking on a FIFO; an --init-hf folder's
    files may be links (the Hugging Face cache's are)."""
    import os

    from fivefold.config import ConfigError
    f, tensors = stored
    link = tmp_path / "link.safetensors"
    link.symlink_to(f.path)
    assert SafetensorsFile(link).tensors["a"][0] == (3, 4, 5)
    with pytest.raises(ConfigError, match="is a symbolic link"):
        SafetensorsFile(link, follow_links=False)
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    for follow in (True, False):
        refused = []

        def open_fifo():
            try:
                SafetensorsFile(fifo, follow_links=follow)
            except ConfigError as e:
                refused.append(str(e))
        opener = threading.Thread(target=open_fifo, daemon=True)   # a blocking open would hang here, not fail
        opener.start()
        opener.join(timeout=30)
        assert not opener.is_alive(), "opening a FIFO blocked"
        assert refused and "not a plain file" in refused[0]
    assert SafetensorsFile(f.path, follow_links=False).tensors["b"][0] == (4, 6)
