"""`fivefold report RUN [RUN...]`: draw what training runs measured, several runs overlaid to compare layouts.

Reads each run folder (train/rundir.py): metrics.jsonl, and when present comm.json, run.json (for the
layout) and pipeline.json. Writes into `--out` (default: the first RUN's `report/` folder; files of the
same name there are replaced, nothing else is touched), as PNG or SVG:

    metrics.png          loss, gradient norm, tokens/s and learning rate over steps (step N: the N-th,
                         1-based), one line per run, the legend naming each run by folder and layout
                         ("dp2 tp1 pp2"); a run that evaluated also draws its eval loss (dashed, at the
                         steps that evaluated); panels for MFU (or TFLOP/s without a peak), peak memory
                         and the MoE routing imbalance when a run's metrics have them
    comm.png             the ledger's bytes sent (all ranks) per (dim, op), a bar per run in each group;
                         in a multi-node run each bar is split by the tier its groups cross (hatched:
                         between nodes; comm/ledger.py)
    pipeline-RUN.png     pipeline runs: the measured timeline above the simulated one (pipeline/timeline.py)
    links.png            runs on an emulated cluster (`fivefold cluster`, links.json): the bytes each tier's
                         links carried per step, sent and received, a line per run and tier

and prints a summary table: per run its steps, final loss, the last eval loss and perplexity (when the
run evaluated), tokens/s (all tokens over all step seconds), where recorded TFLOP/s and MFU (the same
tokens/s times the run's FLOPs per token), peak memory (the largest rank's), the last step's expert imbalance and
dropped share, bytes sent per parallel dimension and, when a run sent beyond one node, per tier. Needs
matplotlib (`pip install -e '.[plot]'` from the checkout); torch-free.
A run folder that is missing or holds no metrics is a one-line error (exit 2).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..comm.ledger import CommLedger, fmt_bytes
from ..config import ConfigError
from ..rules import install_hint

FORMATS = ("png", "svg")
# (metric, axis title) of the four panels of metrics.*
HATCH = {"intra": "", "inter": "//", "pcie": "..", "nvme": "xx"}   # comm.*: the tier of each part of a bar
PANELS = (("loss", "loss"), ("grad_norm", "gradient norm"), ("tokens_per_s", "tokens/s"), ("lr", "learning rate"))
# panels drawn when some run's metrics have them; tflops only where no run has mfu
OPTIONAL_PANELS = (("mfu", "MFU"), ("tflops", "achieved TFLOP/s"), ("peak_memory_gib", "peak memory, GiB (largest rank)"),
                   ("expert_imbalance", "MoE imbalance (max / mean expert load)"))


class ReportError(ConfigError):
    """A run folder the report cannot read, or matplotlib missing."""


@dataclass
class Run:
    """What one run folder holds, read once."""
    path: Path
    name: str
    layout: str
    metrics: list[dict]
    comm: list[dict]          # ledger rows summed over ranks; [] when comm.json is absent
    pipeline: dict | None     # pipeline.json; None when the run had no pipeline
    tiers: list[dict] = field(default_factory=list)   # the ledger's rows per (dim, op, tier); [] before tiers
    device: str = ""          # run.json's device ("cpu", "cuda:0"); "" when unknown
    links: dict | None = None  # links.json of a run on an emulated cluster (tools/cluster.py); None elsewhere

    @property
    def label(self) -> str:
        return f"{self.name} ({self.layout})"


# -- reading -----------------------------------------------------------------------------------
def read_metrics(path: Path) -> list[dict]:
    """The step records of metrics.jsonl, up to the first line a killed run cut short."""
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            break
    return [r for r in records if isinstance(r, dict) and "step" in r]


def layout_of(config: dict) -> str:
    """A run's layout in a few words: "dp2 tp1 pp2", plus cp, ep and ZeRO when used."""
    p = config.get("parallel", {})
    words = [f"dp{p.get('dp', 1)}", f"tp{p.get('tp', 1)}", f"pp{p.get('pp', 1)}"]
    words += [f"{k}{p[k]}" for k in ("cp", "ep") if p.get(k, 1) > 1]
    return " ".join(words + ([f"zero{p['zero']}"] if p.get("zero") else []))


def read_json(path: Path) -> dict | None:
    """A JSON file of the run, None when absent; unreadable is an error naming the file."""
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ReportError(f"{path}: not readable JSON ({e.__class__.__name__}: {e})") from None


def read_run(folder: str | Path, name: str | None = None) -> Run:
    """One run folder; no folder or no metrics is a ReportError."""
    path = Path(folder)
    if not path.is_dir():
        raise ReportError(f"{folder}: no such run folder (give the --out of a fivefold train run)")
    metrics_file = path / "metrics.jsonl"
    metrics = read_metrics(metrics_file) if metrics_file.exists() else []
    if not metrics:
        raise ReportError(f"{folder}: no metrics (metrics.jsonl is missing or empty: not a run folder, or a run "
                          f"that finished no step)")
    run_info = read_json(path / "run.json")
    comm = read_json(path / "comm.json")
    try:
        layout = layout_of(run_info["config"]) if run_info else "layout unknown"
        rows = CommLedger.from_rows(comm["rows"]).rows() if comm else []
        tiers = CommLedger.from_rows(comm["tiers"]).tier_rows() if comm and "tiers" in comm else []
    except (KeyError, TypeError, AttributeError) as e:
        raise ReportError(f"{folder}: run.json or comm.json is not fivefold's (missing {e})") from None
    links = read_json(path / "links.json")
    if links is not None and not (isinstance(links.get("steps"), list) and isinstance(links.get("fabric"), dict)):
        raise ReportError(f"{path / 'links.json'}: not fivefold cluster's (no steps or fabric)")
    return Run(path, name or path.resolve().name, layout, metrics, rows, read_json(path / "pipeline.json"), tiers,
               str((run_info or {}).get("device", "")), links)


def run_names(folders: list[str]) -> list[str]:
    """Each run's folder name, with its parent's name too where two runs share a folder name."""
    names = [Path(f).resolve().name for f in folders]
    return [f"{Path(f).resolve().parent.name}/{n}" if names.count(n) > 1 else n for f, n in zip(folders, names)]


# -- numbers -----------------------------------------------------------------------------------
def value(record: dict, key: str) -> float:
    """A step's metric; tokens_per_s is tokens / seconds; a null (non-finite) value is NaN."""
    if key == "tokens_per_s":
        seconds = record.get("seconds") or 0.0
        return record["tokens"] / seconds if seconds > 0 and record.get("tokens") is not None else math.nan
    if key == "peak_memory_gib":
        return record["peak_memory_bytes"] / 2**30 if record.get("peak_memory_bytes") else math.nan
    v = record.get(key)
    return math.nan if v is None else float(v)


def final_loss(run: Run) -> float:
    return next((r["loss"] for r in reversed(run.metrics) if r.get("loss") is not None), math.nan)


def final_eval(run: Run) -> tuple[float, float]:
    """(eval loss, eval perplexity) of the run's last evaluation; NaNs when it never evaluated."""
    r = next((r for r in reversed(run.metrics) if r.get("eval_loss") is not None), None)
    return (math.nan, math.nan) if r is None else (float(r["eval_loss"]), value(r, "eval_ppl"))


def tokens_per_second(run: Run) -> float:
    """All tokens over all step seconds."""
    done = [r for r in run.metrics if r.get("tokens") is not None and r.get("seconds")]
    seconds = sum(r["seconds"] for r in done)
    return sum(r["tokens"] for r in done) / seconds if seconds > 0 else math.nan


def run_speed(run: Run) -> tuple[float, float]:
    """(TFLOP/s, MFU) over the whole run: its tokens/s times the FLOPs per token its lines record
    (tflops / tokens_per_s), and MFU in the same proportion; NaN where the run did not record them."""
    r = next((r for r in reversed(run.metrics) if r.get("tflops") and r.get("tokens_per_s")), None)
    if r is None:
        return math.nan, math.nan
    rate = tokens_per_second(run) / r["tokens_per_s"]
    return r["tflops"] * rate, (r["mfu"] * rate if r.get("mfu") else math.nan)


def last(run: Run, key: str) -> float:
    """The last recorded value of `key` (NaN when none)."""
    return next((v for r in reversed(run.metrics) if not math.isnan(v := value(r, key))), math.nan)


def present(runs: list[Run], key: str) -> bool:
    return any(r.get(key) is not None for run in runs for r in run.metrics)


def bytes_by_dim(run: Run) -> dict[str, float]:
    out: dict[str, float] = {}
    for row in run.comm:
        out[row["dim"]] = out.get(row["dim"], 0.0) + row["bytes_sent"]
    return out


def bytes_by_tier(run: Run) -> dict[str, float]:
    out: dict[str, float] = {}
    for row in run.tiers:
        out[row["tier"]] = out.get(row["tier"], 0.0) + row["bytes_sent"]
    return out


def shown_tiers(runs: list[Run]) -> list[str]:
    """The tiers worth a column or a hatch: all of them when any run sent beyond one node (or over an
    offload link), else none."""
    tiers = sorted({t for run in runs for t in bytes_by_tier(run)},
                   key=lambda t: (list(HATCH).index(t) if t in HATCH else len(HATCH), t))   # innermost first
    return tiers if set(tiers) - {"intra", ""} else []


def summary(runs: list[Run]) -> str:
    """A table: per run, layout, steps, final loss, tokens/s, bytes sent per dimension and (when any run
    used several tiers) per tier."""
    dims = sorted({d for run in runs for d in bytes_by_dim(run)})
    tiers = shown_tiers(runs)
    evals = present(runs, "eval_loss")
    flops, mfu, memory = present(runs, "tflops"), present(runs, "mfu"), present(runs, "peak_memory_bytes")
    moe = present(runs, "expert_imbalance")
    header = (["run", "layout", "steps", "final loss"] + (["eval loss", "eval ppl"] if evals else []) + ["tokens/s"]
              + (["TFLOP/s"] if flops else []) + (["MFU"] if mfu else []) + (["peak mem"] if memory else [])
              + (["moe imbalance", "dropped"] if moe else [])
              + [f"sent {d}" for d in dims]
              + [f"{t or '?'} tier" for t in tiers])
    rows = []
    for run in runs:
        sent, on = bytes_by_dim(run), bytes_by_tier(run)
        ev = [f"{v:.4f}" if not math.isnan(v) else "-" for v in final_eval(run)] if evals else []
        tf, mf = run_speed(run)
        speed = ([shown(tf, "{:.3g}")] if flops else []) + ([shown(mf, "{:.1%}")] if mfu else [])
        speed += [shown(last(run, "peak_memory_gib"), "{:.2f} GiB")] if memory else []
        speed += [shown(last(run, "expert_imbalance"), "{:.3f}"), shown(last(run, "dropped_fraction"), "{:.1%}")] \
            if moe else []
        rows.append([run.name, run.layout, str(len(run.metrics)), f"{final_loss(run):.4f}", *ev,
                     f"{tokens_per_second(run):,.0f}", *speed] + [fmt_bytes(sent[d]) if d in sent else "-" for d in dims]
                    + [fmt_bytes(on[t]) if t in on else "-" for t in tiers])
    widths = [max(len(line[i]) for line in [header, *rows]) for i in range(len(header))]
    return "\n".join([*table_lines(header, rows, widths), *host_copies_note(runs, tiers)])


def host_copies_note(runs: list[Run], tiers: list[str]) -> list[str]:
    """A CPU run's "pcie" bytes crossed no bus: say so under the table."""
    cpu = [run.name for run in runs if run.device.startswith("cpu") and bytes_by_tier(run).get("pcie")]
    if "pcie" not in tiers or not cpu:
        return []
    return [f"pcie tier of {', '.join(cpu)}: the device is the CPU, so host and device are the same memory; these "
            f"bytes are offload's copies within it, not PCIe traffic"]


def table_lines(header: list[str], rows: list[list[str]], widths: list[int]) -> list[str]:
    return ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
            for line in [header, *rows]]


def shown(v: float, fmt: str) -> str:
    return "-" if math.isnan(v) else fmt.format(v)


# -- drawing -----------------------------------------------------------------------------------
def figure_class():
    """matplotlib's Figure (drawn without pyplot, so no global backend is switched)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ReportError(f"fivefold report draws with matplotlib, which is not installed: "
                          f"{install_hint('plot')}") from None
    return Figure


AXES = {"step": "step", "tokens": "tokens trained", "epoch": "epoch (passes over the training data)"}


def x_of(record: dict, axis: str) -> float:
    """Where a step's record sits on the x axis: its step, the tokens trained through it (metrics.jsonl's
    tokens_seen; step x tokens for a run older than it) or its epoch."""
    if axis == "step":
        return record["step"]
    if axis == "tokens":
        return record.get("tokens_seen", record["step"] * record.get("tokens", 0))
    return record["epoch"]


def check_axis(runs: list[Run], axis: str) -> None:
    """--x epoch needs every run's epochs (metrics.jsonl from a fivefold that records them)."""
    if axis not in AXES:
        raise ReportError(f"--x must be one of {', '.join(AXES)}, got {axis!r}")
    if axis == "epoch":
        old = [run.name for run in runs if any("epoch" not in r for r in run.metrics)]
        if old:
            raise ReportError(f"--x epoch: {', '.join(old)} recorded no epochs (metrics.jsonl from an older "
                              f"fivefold); valid: --x step or --x tokens")


def plot_metrics(runs: list[Run], path: Path, axis: str = "step") -> Path:
    """Panels over steps, tokens trained or epochs (`axis`: loss, gradient norm, tokens/s, learning rate,
    and `panels`' optional ones), a line per run."""
    from matplotlib.ticker import MaxNLocator

    shown_panels = panels(runs)
    rows = (len(shown_panels) + 1) // 2
    fig = figure_class()(figsize=(11, 3.75 * rows))
    axes = fig.subplots(rows, 2).ravel()
    for ax in axes[len(shown_panels):]:
        ax.set_visible(False)
    for ax, (key, title) in zip(axes, shown_panels):
        for run in runs:
            xs = [x_of(r, axis) for r in run.metrics]
            line, = ax.plot(xs, [value(r, key) for r in run.metrics], marker="." if len(xs) < 50 else None,
                            label=run.label)
            evals = [r for r in run.metrics if r.get("eval_loss") is not None]
            if key == "loss" and evals:
                ax.plot([x_of(r, axis) for r in evals], [r["eval_loss"] for r in evals], linestyle="--", marker="o",
                        color=line.get_color(), label=f"{run.label} eval")
        ax.set_title(title, loc="left", fontsize=10)
        ax.set_xlabel(AXES[axis])
        if axis == "step":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def panels(runs: list[Run]) -> list[tuple[str, str]]:
    """PANELS, then the OPTIONAL_PANELS some run has (TFLOP/s only when no run has MFU)."""
    keys = {"peak_memory_gib": "peak_memory_bytes"}
    have = [(k, t) for k, t in OPTIONAL_PANELS if present(runs, keys.get(k, k))]
    if any(k == "mfu" for k, _ in have):
        have = [(k, t) for k, t in have if k != "tflops"]
    return [*PANELS, *have]


def plot_comm(runs: list[Run], path: Path) -> Path:
    """Bytes sent (all ranks) per (dim, op): one group per pair, a bar per run; log scale when the
    bytes span more than two decades."""
    keys = sorted({(row["dim"], row["op"]) for run in runs for row in run.comm})
    fig = figure_class()(figsize=(max(6.0, 1.1 * len(keys) * max(1, len(runs)) ** 0.5 + 2), 4.8))
    ax = fig.subplots()
    width = 0.8 / len(runs)
    sent = [v for run in runs for row in run.comm if (v := row["bytes_sent"]) > 0]
    tiers = shown_tiers(runs)
    for i, run in enumerate(runs):
        rows = {(row["dim"], row["op"]): row["bytes_sent"] for row in run.comm}
        xs = [k + (i - (len(runs) - 1) / 2) * width for k in range(len(keys))]
        if not (tiers and run.tiers):
            ax.bar(xs, [rows.get(key, 0.0) for key in keys], width, label=run.label)
            continue
        parts = {(row["dim"], row["op"], row["tier"]): row["bytes_sent"] for row in run.tiers}
        bottom, color = [0.0] * len(keys), f"C{i % 10}"
        for tier in tiers:   # one stacked part per tier, hatched by tier
            h = [parts.get((*key, tier), 0.0) for key in keys]
            ax.bar(xs, h, width, bottom=bottom, color=color, hatch=HATCH.get(tier, "oo"), edgecolor="white",
                   label=run.label if tier == tiers[0] else None)
            bottom = [b + v for b, v in zip(bottom, h)]
    if tiers:
        from matplotlib.patches import Patch

        ax.add_artist(ax.legend(handles=[Patch(facecolor="white", edgecolor="grey", hatch=HATCH.get(t, "oo"),
                                               label=f"{t or '?'} tier") for t in tiers], fontsize=8, loc="upper right"))
    ax.set_xticks(range(len(keys)), [f"{dim}\n{op}" for dim, op in keys], fontsize=8)
    if sent and max(sent) / min(sent) > 100:
        ax.set_yscale("log")
    ax.set_ylabel("bytes sent, all ranks")
    ax.set_title("communication per (dim, op)" if keys else "communication: no comm.json in these runs",
                 loc="left", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    if keys:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def plot_links(runs: list[Run], path: Path) -> Path:
    """Bytes each tier's links carried per step (links.json "steps": rank 0's reads at step ends), sent
    (solid) and received (dashed), a line per run and tier."""
    from matplotlib.ticker import MaxNLocator

    fig = figure_class()(figsize=(9, 4.5))
    ax = fig.subplots()
    for i, run in enumerate(r for r in runs if r.links and r.links["steps"]):
        steps = run.links["steps"]
        for j, tier in enumerate(sorted({t for s in steps for t in s["by_tier"]})):
            for way, style in (("tx", "-"), ("rx", "--")):
                ax.plot([s["step"] for s in steps], [s["by_tier"].get(tier, {}).get(way, 0.0) / 1e6 for s in steps],
                        linestyle=style, marker=".", color=f"C{(i + j) % 10}",
                        label=f"{run.label}: {tier} links, {'sent' if way == 'tx' else 'received'}")
    ax.set_xlabel("step")
    ax.set_ylabel("MB per step (kernel counters)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title("bytes on the emulated cluster's links per step", loc="left", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def plot_pipeline(run: Run, path: Path) -> Path:
    """The run's measured pipeline timeline above the simulated one (the drawing the run wrote itself)."""
    from ..train.timeline import write_comparison

    info = run.pipeline
    try:
        title = f"{run.name}: {info['schedule']} pp={info['pp']} m={info['microbatches']}"
        return write_comparison(path, info["measured"]["timeline"], info["simulated_measured_costs"]["timeline"],
                                title)
    except (KeyError, TypeError) as e:
        raise ReportError(f"{run.path / 'pipeline.json'}: not a pipeline report (missing {e})") from None


def write_report(runs: list[Run], out: str | Path, fmt: str = "png", axis: str = "step") -> list[Path]:
    """Every drawing of the runs into `out` (the metrics over `axis`: step, tokens or epoch); returns the
    paths written."""
    if fmt not in FORMATS:
        raise ReportError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    check_axis(runs, axis)
    figure_class()   # before anything is written
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = [plot_metrics(runs, out / f"metrics.{fmt}", axis), plot_comm(runs, out / f"comm.{fmt}")]
    if any(run.links and run.links["steps"] for run in runs):
        written.append(plot_links(runs, out / f"links.{fmt}"))
    for run in runs:
        if run.pipeline:
            written.append(plot_pipeline(run, out / f"pipeline-{run.name.replace('/', '-')}.{fmt}"))
    return written


# -- command line ------------------------------------------------------------------------------
def add_report_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("runs", nargs="+", metavar="RUN", help="run folders (the --out of fivefold train), overlaid")
    ap.add_argument("--out", help="folder for the drawings (default: the first RUN's report/); files of the "
                    "same name in it are replaced")
    ap.add_argument("--format", choices=FORMATS, default="png", help="image format (default png)")
    ap.add_argument("--x", dest="axis", choices=list(AXES), default="step",
                    help="the metrics' x axis: step, tokens trained, or epoch of the training data (default step)")


def cmd_report(args: argparse.Namespace) -> int:
    try:
        runs = [read_run(folder, name) for folder, name in zip(args.runs, run_names(args.runs))]
        paths = write_report(runs, args.out or Path(args.runs[0]) / "report", args.format, args.axis)
    except ReportError as e:
        print(f"fivefold report: {e}", file=sys.stderr)
        return 2
    print(summary(runs))
    for path in paths:
        print(f"wrote {path}")
    return 0
