"""Activation memory, counted: the bytes autograd keeps for backward (its saved tensors).

`ActivationMeter` wraps a step's forward and backward in `torch.autograd.graph.saved_tensors_hooks`:
each tensor saved for backward is counted when packed and uncounted when autograd frees it (the packed
handle is dropped with the graph), so `peak` is the most activation memory alive at once — across every
micro-batch a pipeline schedule keeps in flight. It counts storages, not tensors (a tensor saved twice,
or two views of one buffer, count once) and skips parameters and views of them (a linear saves its
weight's transpose), which are model state, not activations.
This is what context parallelism divides by cp and recomputation trades for time; unlike RSS it does
not depend on the allocator or the machine.
"""
from __future__ import annotations

import torch
from torch import nn


class _Held:
    """A saved tensor while autograd keeps it; releases its count when the graph drops it."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor: torch.Tensor, meter: "ActivationMeter", key):
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self):
        meter = getattr(self, "meter", None)   # torch.compile may copy a handle without __init__
        if meter is not None:
            meter.release(self.key)


class ActivationMeter:
    def __init__(self):
        self.live: dict = {}     # storage key -> [bytes, handles alive]
        self.now = 0
        self.peak = 0

    def pack(self, t: torch.Tensor):
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter) or t.layout != torch.strided:
            return t   # a parameter, or a view of one (a linear saves weight.t()): model state, not activations
        storage = t.untyped_storage()
        key = (t.device, storage._cdata)   # the storage itself (fake tensors of a dry run share data_ptr 0)
        entry = self.live.get(key)
        if entry is None:
            entry = self.live[key] = [storage.nbytes(), 0]
            self.now += entry[0]
            self.peak = max(self.peak, self.now)
        entry[1] += 1
        return _Held(t, self, key)

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def release(self, key) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[key]

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
