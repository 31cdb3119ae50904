"""A one-line progress bar for the training loop."""
from __future__ import annotations

import sys
import time


class Progress:
    """A one-line progress bar on stderr: step, loss, tokens/s."""

    def __init__(self, total: int, enabled: bool = True, width: int = 24):
        self.total, self.enabled, self.width = total, enabled, width
        self.tty = sys.stderr.isatty()
        self.t0 = time.perf_counter()
        self.tokens = 0

    def update(self, m: dict) -> None:
        if not self.enabled:
            return
        self.tokens += m["tokens"]
        done = m["step"] + 1
        rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
        fill = int(self.width * done / self.total)
        line = (f"step {done:>5}/{self.total} [{'#' * fill}{'.' * (self.width - fill)}] "
                f"loss {m['loss']:.4f}  grad {m['grad_norm']:.3f}  lr {m['lr']:.2e}  {rate:,.0f} tok/s")
        if self.tty:
            sys.stderr.write("\r" + line)
        elif done == 1 or done == self.total or done % max(self.total // 20, 1) == 0:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")
