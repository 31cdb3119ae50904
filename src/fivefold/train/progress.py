"""Progress of the training loop on stderr.

On a terminal: one line (step, bar, loss, grad norm, lr, tokens/s; after an evaluation its loss and
perplexity) rewritten in place every step. Elsewhere (a log file, a pipe): whole lines, one at the run's
first step, one every `log_every` steps, one after each evaluation and one at the last step; `log_every` 0 means about 20 lines a run (every max(total // 20, 1) steps). A run resumed
at step `start` counts steps globally (done/total) and tokens/s over its own steps only.
"""
from __future__ import annotations

import sys
import time


class Progress:
    """Step, loss and tokens/s of a run of `total` steps, written to stderr (see the module docstring)."""

    def __init__(self, total: int, enabled: bool = True, width: int = 24, log_every: int = 0, start: int = 0):
        self.total, self.enabled, self.width, self.start = total, enabled, width, start
        self.every = log_every if log_every > 0 else max(total // 20, 1)
        self.tty = sys.stderr.isatty()
        self.t0 = time.perf_counter()
        self.tokens = 0          # this run's tokens (not those of the steps before `start`)

    def update(self, m: dict) -> None:
        """Record step m["step"] (0-based, global) with its "tokens", "loss", "grad_norm" and "lr"."""
        if not self.enabled:
            return
        self.tokens += m["tokens"]
        done = m["step"] + 1
        if self.tty:
            sys.stderr.write("\r" + self.line(m, done))
        elif self.logs(done) or "eval_loss" in m:   # an evaluation always gets its line
            sys.stderr.write(self.line(m, done) + "\n")
        sys.stderr.flush()

    def logs(self, done: int) -> bool:
        """Whether a non-terminal stderr gets a line after `done` steps."""
        return done == self.start + 1 or done == self.total or done % self.every == 0

    def line(self, m: dict, done: int) -> str:
        rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
        fill = min(int(self.width * done / max(self.total, 1)), self.width)
        return (f"step {done:>5}/{self.total} [{'#' * fill}{'.' * (self.width - fill)}] "
                f"loss {m['loss']:.4f}  grad {m['grad_norm']:.3f}  lr {m['lr']:.2e}  {rate:,.0f} tok/s"
                + (f"  eval {m['eval_loss']:.4f} (ppl {m['eval_ppl']:.2f})" if "eval_loss" in m else ""))

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")
