"""Draw pipeline timelines: one row per rank, a coloured block per compute action, idle time left grey.

A timeline is a list per rank of (kind, microbatch, chunk, start, end) — `Simulation.timeline` from the
simulator, or what a training run measured (same structure, seconds). `write_timeline(path, ...)` writes
SVG (hand-written, no dependency) or PNG (needs matplotlib: `pip install -e '.[plot]'`), chosen by the
file suffix. `write_comparison` puts a measured and a simulated timeline in two panels, one above the
other, each on its own time axis, for holding the runtime against the model; `draw_pipeline` draws a
training run's OUT/pipeline.svg from its pipeline report (the trainer calls it; parallel/ draws nothing).

Colours: F blue, B orange, I (input-gradient backward) red, W (weight-gradient backward) green; with
vpp > 1 a rank's later chunks are drawn lighter. Each block is labelled with its micro-batch number.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence
from xml.sax.saxutils import escape

from ..rules import install_hint
from ..parallel.pipeline.schedules import Block, timeline_stats
from ..parallel.pipeline.spec import Schedule

COLORS = {"F": "#4C78A8", "B": "#F58518", "I": "#E45756", "W": "#54A24B"}
NAMES = {"F": "forward", "B": "backward", "I": "input-grad backward", "W": "weight-grad backward"}
IDLE = "#E6E6E6"
LEFT, RIGHT, ROW, GAP, TITLE, AXIS = 70, 20, 26, 6, 34, 34


@dataclass
class Panel:
    """One timeline to draw, with its title and time unit."""
    timeline: Sequence[Sequence[Sequence]]
    title: str = ""
    unit: str = "time"

    @property
    def blocks(self) -> list[list[Block]]:
        return [[Block(*b) for b in row] for row in self.timeline]

    def heading(self) -> str:
        stats = timeline_stats(self.timeline)
        return f"{self.title}  bubble {stats['bubble']:.1%}".strip()


def lighten(color: str, amount: float) -> str:
    """Mix a #rrggbb colour with white; amount 0 keeps it, 1 gives white."""
    rgb = [int(color[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * amount):02x}" for c in rgb)


def block_color(block: Block, ranks: int, vpp: int) -> str:
    local = block.chunk // max(ranks, 1)
    return lighten(COLORS.get(block.kind, "#888888"), 0.45 * local / max(vpp - 1, 1) if vpp > 1 else 0.0)


def nice_step(span: float, ticks: int = 8) -> float:
    """A round tick spacing (1, 2 or 5 times a power of ten) giving about `ticks` ticks over `span`."""
    if span <= 0:
        return 1.0
    raw = span / ticks
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


def panel_height(panel: Panel) -> int:
    return TITLE + len(panel.timeline) * (ROW + GAP) + AXIS


def svg_panel(panel: Panel, top: float, width: float) -> list[str]:
    """SVG elements for one panel whose top edge is at `top`."""
    blocks = panel.blocks
    ranks = len(blocks)
    starts = [b.start for row in blocks for b in row]
    t0 = min(starts) if starts else 0.0
    span = max((b.end for row in blocks for b in row), default=1.0) - t0 or 1.0
    vpp = max((b.chunk // max(ranks, 1) for row in blocks for b in row), default=0) + 1
    scale = (width - LEFT - RIGHT) / span
    out = [f'<text x="{LEFT}" y="{top + 22}" font-size="15" font-weight="bold">{escape(panel.heading())}</text>']
    for r, row in enumerate(blocks):
        y = top + TITLE + r * (ROW + GAP)
        out.append(f'<text x="{LEFT - 8}" y="{y + ROW / 2 + 4}" font-size="12" text-anchor="end">rank {r}</text>')
        out.append(f'<rect x="{LEFT}" y="{y}" width="{span * scale:.2f}" height="{ROW}" fill="{IDLE}"/>')
        for b in row:
            x, w = LEFT + (b.start - t0) * scale, max((b.end - b.start) * scale, 0.5)
            out.append(f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{ROW}" '
                       f'fill="{block_color(b, ranks, vpp)}" stroke="white" stroke-width="0.6">'
                       f'<title>{b.kind} micro-batch {b.microbatch} chunk {b.chunk}: '
                       f'{b.start - t0:.4g} to {b.end - t0:.4g}</title></rect>')
            label = str(b.microbatch)
            size = min(11.0, w / (0.62 * len(label) + 0.4), ROW * 0.55)
            if size >= 5:
                out.append(f'<text x="{x + w / 2:.2f}" y="{y + ROW / 2 + size * 0.36:.2f}" font-size="{size:.1f}" '
                           f'text-anchor="middle" fill="white">{label}</text>')
    axis_y = top + TITLE + ranks * (ROW + GAP)
    out.append(f'<line x1="{LEFT}" y1="{axis_y}" x2="{LEFT + span * scale:.2f}" y2="{axis_y}" stroke="#444"/>')
    step = nice_step(span)
    for k in range(int(span / step + 1e-9) + 1):
        x = LEFT + k * step * scale
        out.append(f'<line x1="{x:.2f}" y1="{axis_y}" x2="{x:.2f}" y2="{axis_y + 4}" stroke="#444"/>')
        out.append(f'<text x="{x:.2f}" y="{axis_y + 16}" font-size="10" text-anchor="middle">{k * step:.4g}</text>')
    out.append(f'<text x="{LEFT + span * scale:.2f}" y="{axis_y + 30}" font-size="10" text-anchor="end">'
               f'{escape(panel.unit)}</text>')
    return out


def svg_legend(kinds: set[str], top: float) -> list[str]:
    out, x = [], LEFT
    for kind in ("F", "B", "I", "W"):
        if kind not in kinds:
            continue
        out.append(f'<rect x="{x}" y="{top}" width="14" height="14" fill="{COLORS[kind]}"/>')
        text = f"{kind} {NAMES[kind]}"
        out.append(f'<text x="{x + 19}" y="{top + 11}" font-size="11">{text}</text>')
        x += 30 + 6.5 * len(text)
    out.append(f'<rect x="{x}" y="{top}" width="14" height="14" fill="{IDLE}"/>')
    out.append(f'<text x="{x + 19}" y="{top + 11}" font-size="11">idle</text>')
    return out


def render_svg(panels: Sequence[Panel], width: int = 1000) -> str:
    """An SVG document with the panels one above the other and a legend at the bottom."""
    body, top = [], 0.0
    kinds = set()
    for panel in panels:
        body += svg_panel(panel, top, width)
        top += panel_height(panel)
        kinds |= {b.kind for row in panel.blocks for b in row}
    body += svg_legend(kinds, top + 4)
    height = top + 26
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height:.0f}" '
            f'viewBox="0 0 {width} {height:.0f}" font-family="sans-serif">')
    return "\n".join([head, f'<rect width="{width}" height="{height:.0f}" fill="white"/>'] + body + ["</svg>"]) + "\n"


def render_png(panels: Sequence[Panel], path: Path, width: int = 1000) -> None:
    """The same drawing with matplotlib (optional dependency)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError(f"PNG output needs matplotlib ({install_hint('plot')}); "
                           "or write .svg, which needs nothing") from e
    heights = [len(p.timeline) + 1.2 for p in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(width / 100, 0.45 * sum(heights) + 0.6),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, panel in zip(axes[:, 0], panels):
        png_panel(ax, panel)
    kinds = [k for k in COLORS if any(b.kind == k for p in panels for row in p.blocks for b in row)]
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in kinds]
    fig.legend(handles + [plt.Rectangle((0, 0), 1, 1, color=IDLE)],
               [f"{k} {NAMES[k]}" for k in kinds] + ["idle"], loc="lower center", ncol=5, fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def png_panel(ax, panel: Panel) -> None:
    blocks = panel.blocks
    ranks = len(blocks)
    t0 = min((b.start for row in blocks for b in row), default=0.0)
    span = max((b.end for row in blocks for b in row), default=1.0) - t0 or 1.0
    vpp = max((b.chunk // max(ranks, 1) for row in blocks for b in row), default=0) + 1
    for r, row in enumerate(blocks):
        ax.barh(r, span, left=0, height=0.8, color=IDLE)
        for b in row:
            ax.barh(r, b.end - b.start, left=b.start - t0, height=0.8, color=block_color(b, ranks, vpp),
                    edgecolor="white", linewidth=0.5)
            if (b.end - b.start) / span > 0.012:
                ax.text(b.start - t0 + (b.end - b.start) / 2, r, str(b.microbatch), ha="center", va="center",
                        fontsize=7, color="white")
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_xlim(0, span)
    ax.set_xlabel(panel.unit)
    ax.set_title(panel.heading(), loc="left", fontsize=10)


def write_panels(path: str | Path, panels: Sequence[Panel], width: int = 1000) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".png":
        render_png(panels, path, width)
    elif path.suffix.lower() == ".svg":
        path.write_text(render_svg(panels, width))
    else:
        raise ValueError(f"timeline drawings are .svg or .png, got {path.name!r}")
    return path


def write_timeline(path: str | Path, timeline: Sequence[Sequence[Sequence]], title: str = "",
                   unit: str = "time") -> Path:
    """Draw one timeline (simulated or measured) to an .svg or .png file."""
    return write_panels(path, [Panel(timeline, title, unit)])


def write_comparison(path: str | Path, measured: Sequence[Sequence[Sequence]],
                     simulated: Sequence[Sequence[Sequence]], title: str = "") -> Path:
    """Measured (seconds) above simulated (cost units), each with its own axis and bubble fraction."""
    prefix = f"{title}: " if title else ""
    return write_panels(path, [Panel(measured, f"{prefix}measured", "seconds"),
                               Panel(simulated, f"{prefix}simulated", "cost units")])


def draw_pipeline(out: str | Path, info: dict, drawing: str = "pipeline.svg") -> Path:
    """OUT/pipeline.svg (or .png) of a run's pipeline report (`parallel.pipeline.runtime.report`, the
    dict OUT/pipeline.json holds): the measured timeline above the simulated one (measured costs)."""
    return write_comparison(Path(out) / drawing, info["measured"]["timeline"],
                            info["simulated_measured_costs"]["timeline"], Schedule.from_dict(info).title())
