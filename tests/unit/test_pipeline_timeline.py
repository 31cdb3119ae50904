"""Timeline drawings (SVG by hand, PNG with matplotlib) and the `fivefold schedule` command."""
import argparse
import json
import xml.etree.ElementTree as ET

import pytest

from fivefold.config import ConfigError
from fivefold.parallel.pipeline import simulate_schedule
from fivefold.train.timeline import write_comparison, write_timeline
from fivefold.tools.schedule import add_schedule_args, cmd_schedule

SVG = "{http://www.w3.org/2000/svg}"


def texts(root):
    return [t.text for t in root.iter(f"{SVG}text")]


def test_svg_has_a_row_per_rank_a_block_per_action_and_the_bubble(tmp_path):
    sim = simulate_schedule("zb", 4, 8)
    path = write_timeline(tmp_path / "zb.svg", sim.timeline, "zb pp=4 m=8", "cost units")
    root = ET.parse(path).getroot()
    blocks = [r for r in root.iter(f"{SVG}rect") if r.find(f"{SVG}title") is not None]
    assert len(blocks) == 4 * 8 * 3  # F, I, W per micro-batch per stage
    assert {r.get("fill").upper() for r in blocks} == {"#4C78A8", "#E45756", "#54A24B"}
    words = texts(root)
    assert "zb pp=4 m=8  bubble 11.1%" in words
    assert [w for w in words if w and w.startswith("rank ")] == ["rank 0", "rank 1", "rank 2", "rank 3"]
    assert words.count("7") >= 12  # blocks labelled with their micro-batch
    assert any(w and w.startswith("W weight-grad") for w in words) and "idle" in words


def test_interleaved_chunks_are_shaded(tmp_path):
    sim = simulate_schedule("interleaved", 2, 4, 2)
    root = ET.parse(write_timeline(tmp_path / "il.svg", sim.timeline)).getroot()
    fills = {r.get("fill") for r in root.iter(f"{SVG}rect") if r.find(f"{SVG}title") is not None}
    assert len(fills) == 4  # F and B, each in two shades


def test_comparison_draws_two_panels_from_a_measured_timeline(tmp_path):
    simulated = simulate_schedule("1f1b", 2, 2).timeline
    measured = [[("F", 0, 0, 50.0, 50.1), ("F", 1, 0, 50.1, 50.2), ("B", 0, 0, 50.4, 50.6), ("B", 1, 0, 50.7, 50.9)],
                [("F", 0, 1, 50.1, 50.2), ("B", 0, 1, 50.2, 50.4), ("F", 1, 1, 50.4, 50.5), ("B", 1, 1, 50.5, 50.7)]]
    root = ET.parse(write_comparison(tmp_path / "cmp.svg", measured, simulated, "1f1b")).getroot()
    heads = [w for w in texts(root) if w and "bubble" in w]
    assert heads == ["1f1b: measured  bubble 33.3%", "1f1b: simulated  bubble 33.3%"]
    assert "seconds" in texts(root) and "cost units" in texts(root)


def test_png_needs_matplotlib(tmp_path):
    pytest.importorskip("matplotlib")
    sim = simulate_schedule("1f1b", 4, 8)
    path = write_timeline(tmp_path / "t.png", sim.timeline, "1f1b")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    path = write_comparison(tmp_path / "c.png", sim.timeline, sim.timeline)
    assert path.stat().st_size > 1000


def test_unknown_suffix(tmp_path):
    with pytest.raises(ValueError, match=".svg or .png"):
        write_timeline(tmp_path / "t.pdf", [[("F", 0, 0, 0, 1)]])


def run(argv):
    ap = argparse.ArgumentParser()
    add_schedule_args(ap)
    return cmd_schedule(ap.parse_args(argv))


def test_command_prints_bubble_and_in_flight(capsys, tmp_path):
    assert run(["--pp", "4", "--microbatches", "8", "--schedule", "1f1b", "--out", str(tmp_path / "t.svg")]) == 0
    out = capsys.readouterr().out
    assert "bubble 27.27%" in out and "(closed form (p-1)/(m+p-1) = 27.27%)" in out
    assert (tmp_path / "t.svg").exists()
    rows = [line.split() for line in out.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert [int(r[-1]) for r in rows] == [4, 3, 2, 1]


def test_command_json(capsys):
    assert run(["--pp", "4", "--microbatches", "8", "--schedule", "interleaved", "--vpp", "2", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["bubble"] == pytest.approx(3 / 19) and info["closed_form_bubble"] == pytest.approx(3 / 19)
    assert [r["peak_in_flight"] for r in info["ranks"]] == [11, 9, 7, 5]
    assert len(info["timeline"]) == 4


def test_command_rejects_bad_layouts():
    with pytest.raises(ConfigError, match="divisible by pp"):
        run(["--pp", "4", "--microbatches", "6", "--schedule", "interleaved", "--vpp", "2"])
    with pytest.raises(ConfigError, match="vpp > 1 needs the interleaved schedule"):
        run(["--pp", "4", "--microbatches", "8", "--schedule", "zb", "--vpp", "2"])
