"""What one rank holds of a run's state, and how it goes to and from a checkpoint: `RankState(model,
engine, mesh, dims)`.

Over the engine (its ZeRO shards or whole replicas, masters and moments), the layout (each parameter's
placement: which box of the single-process tensor this rank's piece is) and the dimensions (their state
gathering and the copies they alias), it knows:
- `param_boxes`: local parameter name -> (its single-process name, local shape, its box, whether it is a copy;
  a copy, the last pipeline stage's tied head, is read from its original and never written), recorded
  before the engine exists (ZeRO-3 frees the parameters' storage);
- `keys()`: every tensor a checkpoint of this layout must hold (the engine's sections, the frozen weights'
  model section alone, the buffers), `entries()`: this rank's pieces to write, nothing gathered;
- `fill(source, opt_t)`: its pieces read box by box from any weight source (the seeded init, a
  checkpoint, Hugging Face files), straight into the engine's tensors;
- `rng_state` / `set_rng_state`: its random streams; `full_state` / `load_full_state`: the whole
  single-process state, gathered from every rank (tests, exports of small models).
The trainer keeps what is the run's (steps, skips, the best evaluation) and writes them beside.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..comm import gather_objects
from ..parallel.parallelize import checkpoint_aliases, gather_state, split_state
from ..parallel.placement import placement_of
from . import checkpoint
from .checkpoint import SECTIONS, Box, box_of

FILL_CHUNK = 2**22   # elements a weight source is asked for at once when filling a rank's pieces (16 MiB fp32)


class RankState:
    def __init__(self, model: nn.Module, mesh, dims: list):
        self.model, self.mesh, self.dims = model, mesh, dims
        self.engine = None   # set once built (`attach`): the layout is recorded before it exists
        aliases = checkpoint_aliases(dims)
        self.param_boxes: dict[str, tuple[str, tuple, Box, bool]] = {
            name: (aliases.get(name, name), tuple(p.shape), box_of(p.shape, placement_of(p), mesh), name in aliases)
            for name, p in model.named_parameters()}

    def attach(self, engine) -> None:
        self.engine = engine

    def frozen(self) -> dict[str, nn.Parameter]:
        """This rank's frozen parameters by local name (LoRA's base weights, train.freeze): whole pieces
        no engine holds, each written to and read from checkpoints as its own tensor (no moments)."""
        return {n: q for n, q in self.model.named_parameters() if not q.requires_grad}

    def keys(self) -> set[str]:
        """Every section of what the engine trains, the weights alone of what is frozen, the buffers."""
        frozen = {self.param_boxes[n][0] for n in self.frozen()}
        names = {full for full, _, _, _ in self.param_boxes.values()} - frozen
        return ({f"{s}/{n}" for s in SECTIONS for n in names} | {f"model/{n}" for n in frozen}
                | {f"buffers/{n}" for n in checkpoint.persistent_buffers(self.model)})

    def entries(self) -> tuple[list[tuple[str, torch.Tensor, Box]], int]:
        """(key, tensor, box of the full tensor) of every piece this rank writes, and Adam's step count."""
        segments, opt_t = self.engine.local_state()
        entries = []
        for name, start, tensors in segments:
            full, shape, piece, copy = self.param_boxes[name]
            if copy:
                continue
            length = next(iter(tensors.values())).numel()
            for box, sizes, o in checkpoint.segment_chunks(piece, shape, start, length):
                n = math.prod(sizes)
                entries += [(f"{section}/{full}", flat[o:o + n].view(sizes), box) for section, flat in tensors.items()]
        for name, q in self.frozen().items():
            full, _, piece, copy = self.param_boxes[name]
            if not copy:                    # replicas: checkpoint.assign_writers picks one writer
                entries.append((f"model/{full}", q.detach(), piece))
        for name, b in checkpoint.persistent_buffers(self.model).items():
            entries.append((f"buffers/{name}", b, Box.whole(b.shape)))
        return entries, opt_t

    def fill(self, source, opt_t: int = 0) -> None:
        """Fill what this rank holds — its parameters' pieces and ZeRO shards, their fp32 masters and
        Adam moments, its persistent buffers — from `source` (model/init.py's protocol: the seeded init,
        a checkpoint's Reader, Hugging Face files), box by box, straight into the engine's tensors
        (engines' `load_local_state`). A rank reads only the boxes of its own pieces, and a fill holds
        beyond the rank's state only the source's buffers for at most FILL_CHUNK elements (a checkpoint
        none where its chunks are the boxes the rank needs: `Reader.read_into`) (ZeRO-1/2 in a
        16-bit dtype, which hold whole parameters, also one parameter's fp32 staging copy)."""
        def read_into(dst: torch.Tensor, name: str, start: int, section: str) -> None:
            """dst (1-D) = elements start.. of this rank's piece of `name` (flat, row-major)."""
            full, shape, piece, _ = self.param_boxes[name]
            for lo in range(0, dst.numel(), FILL_CHUNK):   # the source's own buffers stay within FILL_CHUNK elements
                n = min(FILL_CHUNK, dst.numel() - lo)
                for box, sizes, o in checkpoint.segment_chunks(piece, shape, start + lo, n):
                    source.read_into(f"{section}/{full}", box, dst[lo + o:lo + o + math.prod(sizes)].view(sizes))

        self.engine.load_local_state(read_into, opt_t)
        with torch.no_grad():
            for name, q in self.frozen().items():
                read_into(q.view(-1), name, 0, "model")
            for name, b in checkpoint.persistent_buffers(self.model).items():
                source.read_into(f"buffers/{name}", Box.whole(b.shape), b)

    def rng_state(self, device: torch.device) -> dict[str, torch.Tensor]:
        """This rank's random streams: the default generator (dropout), CUDA's, the modules' own."""
        state = {"cpu": torch.get_rng_state()}
        if device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(device)
        for name, m in self.model.named_modules():
            if isinstance(getattr(m, "generator", None), torch.Generator):
                state[f"gen/{name}"] = m.generator.get_state()
        return state

    def set_rng_state(self, state: dict[str, torch.Tensor], device: torch.device) -> None:
        torch.set_rng_state(state["cpu"])
        if "cuda" in state and device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], device)
        for name, m in self.model.named_modules():
            if f"gen/{name}" in state:
                m.generator.set_state(state[f"gen/{name}"])

    def full_state(self) -> dict:
        """Full model and optimizer state keyed by parameter name (fp32 masters), and the persistent
        buffers of every rank merged by name (replicas are equal). Call on every rank."""
        state = gather_state(self.dims, self.engine.full_state())
        buffers = {}
        for part in gather_objects(checkpoint.persistent_buffers(self.model)):   # bookkeeping exchange
            buffers.update(part)
        return {**state, "buffers": buffers}

    def load_full_state(self, state: dict) -> None:
        state = dict(state)
        checkpoint.load_buffers(self.model, state.pop("buffers", {}))
        self.engine.load_full_state(split_state(self.dims, state))
