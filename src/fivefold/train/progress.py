"""Progress of the training loop on stderr: the console line.

    step   100/200 [############............] loss 2.7141  grad 0.565  lr 1.90e-03  19,924 tok/s
        0.21 TFLOP/s  MFU 3.1%  mem 0.41 GiB  ETA 1m23s  moe 1.08 drop 0.2%  eval 2.6610 (ppl 14.31)

(one line). Step N is the N-th optimizer step of the run, counted globally (steps done, as in
metrics.jsonl, checkpoints/step-N and the banner). tokens/s, TFLOP/s and MFU are those of the steps
since the previous line (their tokens over their step seconds: the same definition as metrics.jsonl's
`tokens_per_s`, averaged; TFLOP/s (GFLOP/s below 0.1 TFLOP/s) and MFU from speed.py, shown only when
known); `mem` is the largest peak
memory so far of any rank (the device's on CUDA, the process's resident set on the CPU: `peak_memory_bytes`); ETA
is the wall time left at this run's pace so far (evaluations and checkpoints included); `moe` the
routing imbalance (max / mean tokens per expert over every MoE layer) and `drop` the share of
assignments capacity dropped, when the model has experts; `slowest` the step's slowest rank and its
node (busy seconds outside collectives: train/trainer.py "Stragglers") when the ranks span nodes; `eval`
after an evaluation.

On a terminal the line is rewritten in place every step. Elsewhere (a log file, a pipe): whole lines,
one at the run's first step, one every `log_every` steps, one after each evaluation and one at the last
step; `log_every` 0 means about 20 lines a run (every max(total // 20, 1) steps). A run resumed at step
`start` counts steps globally (done/total) and its rates over its own steps only.
"""
from __future__ import annotations

import sys
import time

from .speed import Speed


class Progress:
    """The console line of a run of `total` steps, written to stderr (see the module docstring)."""

    def __init__(self, total: int, enabled: bool = True, width: int = 24, log_every: int = 0, start: int = 0,
                 speed: Speed | None = None):
        self.total, self.enabled, self.width, self.start = total, enabled, width, start
        self.every = log_every if log_every > 0 else max(total // 20, 1)
        self.speed = speed or Speed()
        self.tty = sys.stderr.isatty()
        self.t0 = time.perf_counter()
        self.window = [0.0, 0.0]   # tokens and step seconds since the last line

    def update(self, m: dict) -> None:
        """Record step m["step"] (1-based, global: steps done) with its "tokens", "seconds", "loss",
        "grad_norm" and "lr" (and what else the line shows, when the record has it)."""
        if not self.enabled:
            return
        self.window[0] += m["tokens"]
        self.window[1] += m.get("seconds") or 0.0
        done = m["step"]
        if self.tty:
            sys.stderr.write("\r" + self.line(m, done))
        elif self.logs(done) or "eval_loss" in m:   # an evaluation always gets its line
            sys.stderr.write(self.line(m, done) + "\n")
        else:
            return
        sys.stderr.flush()
        self.window = [0.0, 0.0]

    def logs(self, done: int) -> bool:
        """Whether a non-terminal stderr gets a line after `done` steps."""
        return done == self.start + 1 or done == self.total or done % self.every == 0

    def line(self, m: dict, done: int) -> str:
        fill = min(int(self.width * done / max(self.total, 1)), self.width)
        return (f"step {done:>5}/{self.total} [{'#' * fill}{'.' * (self.width - fill)}] "
                f"loss {m['loss']:.4f}  grad {m['grad_norm']:.3f}  lr {m['lr']:.2e}" + seen_text(m)
                + rates_text(self.speed.scalars(*self.window)) + memory_text(m) + self.eta_text(done)
                + moe_text(m) + straggler_text(m)
                + (f"  eval {m['eval_loss']:.4f} (ppl {m['eval_ppl']:.2f})" if "eval_loss" in m else ""))

    def eta_seconds(self, done: int) -> float | None:
        """Time left at this run's pace: wall seconds per step so far x steps left (0 after the last step;
        None before a step ran). metrics.jsonl's `eta_s`."""
        ran, left = done - self.start, self.total - done
        if ran <= 0:
            return None
        return (time.perf_counter() - self.t0) / ran * max(left, 0)

    def eta_text(self, done: int) -> str:
        eta = self.eta_seconds(done)
        return f"  ETA {duration(eta)}" if eta else ""

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")


def seen_text(m: dict) -> str:
    """Tokens trained so far and the epochs of the data they make."""
    if "tokens_seen" not in m:
        return ""
    return f"  {count_text(m['tokens_seen'])} tok (epoch {m['epoch']:.3g})"


def count_text(n: float) -> str:
    """1.23M, 456k, 789: a count at a glance."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"


def rates_text(s: dict) -> str:
    """tokens/s, and TFLOP/s and MFU where known."""
    if "tokens_per_s" not in s:
        return ""
    return (f"  {s['tokens_per_s']:,.0f} tok/s" + (f"  {flops_text(s['tflops'])}" if "tflops" in s else "")
            + (f"  MFU {s['mfu']:.1%}" if "mfu" in s else ""))


def flops_text(tflops: float) -> str:
    """Achieved FLOP/s: TFLOP/s from 0.1 up, GFLOP/s below (a CPU run)."""
    return f"{tflops:.3g} TFLOP/s" if tflops >= 0.1 else f"{tflops * 1e3:.3g} GFLOP/s"


def straggler_text(m: dict) -> str:
    """The step's slowest rank and its node by busy seconds (outside collectives), when the ranks span nodes."""
    if "slowest_node" not in m:
        return ""
    return f"  slowest r{m['slowest_rank']}@n{m['slowest_node']} {m['slowest_busy_s']:.2f} s"


def memory_text(m: dict) -> str:
    peak = m.get("peak_memory_bytes")
    return f"  mem {peak / 2**30:.2f} GiB" if peak else ""


def moe_text(m: dict) -> str:
    """Routing imbalance (max / mean expert load) and dropped share, when the model has experts."""
    if m.get("expert_imbalance") is None:
        return ""
    return f"  moe {m['expert_imbalance']:.2f} drop {m.get('dropped_fraction') or 0.0:.1%}"


def duration(seconds: float) -> str:
    """1h02m, 3m05s, 42s."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"
