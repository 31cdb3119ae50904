"""`benchmarks/network.py --replan`: a finished run is planned again from its own files, against the
calibration taken in the minute before it (named after the run), with no namespace made. The run here is
written by hand: four steps, the links' payload per tier (the bytes less one header a packet, which the
row reads, not the counters' `by_tier`), the ledger's bytes per (dim, tier), the resolved config."""
import json
import sys
from pathlib import Path

from fivefold.config import Config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import network  # noqa: E402  (benchmarks/network.py)


def _finished_run(folder: Path, seconds: list[float], payload: float) -> dict:
    folder.mkdir(parents=True)
    cfg_dict = Config.from_dict({"parallel": {"tp": 2, "dp": 2}}).to_dict()
    (folder / "run.json").write_text(json.dumps({"config": cfg_dict}))
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "seconds": s}) + "\n"
                                                  for i, s in enumerate(seconds)))
    (folder / "comm.json").write_text(json.dumps({"tiers": [{"dim": "dp", "tier": "inter", "bytes_sent": 8.0e6}]}))
    (folder / "links.json").write_text(json.dumps({"steps": [{"step": i + 1, "payload": {"leaf": {"tx": payload}},
                                                              "by_tier": {"leaf": {"tx": payload + 1e4}}}
                                                             for i in range(len(seconds))]}))
    return cfg_dict


def test_replan_reads_the_run_and_plans_it_against_its_own_calibration(tmp_path):
    fab = network.fabric("two-nodes")
    run = tmp_path / "tp2-dp2-tp-cp-ep-dp-pp"
    _finished_run(run, [9.0, 1.5, 1.25, 1.75], 3.0e6)
    assert network._replanned(run, 4, fab) is None                  # no calibration of its minute: not planned
    cal = tmp_path / f"{run.name}.local-cpu-4.toml"
    cal.write_text((network.FABRICS / "two-nodes.toml").read_text())   # a topology file as calibrate writes one
    got = network._replanned(run, 4, fab)
    assert got["measured"]["step_s"] == 1.5                          # the median of the steps after the first
    assert got["measured"]["links"] == {"leaf": 3.0e6}
    assert got["measured"]["dim_tier"] == {("dp", "inter"): 2.0e6}   # per step
    assert got["calibrated_fp32_tflops"] == 0.06                      # the accelerator of the file named for the run
    cal.write_text(cal.read_text().replace("fp32 = 0.06", "fp32 = 0.03"))
    slower = network._replanned(run, 4, fab)
    assert slower["calibrated_fp32_tflops"] == 0.03 and slower["plan"]["step_s"] > got["plan"]["step_s"]
    assert slower["measured"] == got["measured"]                       # the run's own figures, as recorded
    row = network.mean_of_rounds([{"case": "tp2-dp2", "order": "tp-cp-ep-dp-pp", "fabric": "two-nodes", **got}])
    assert "| tp2-dp2 | tp-cp-ep-dp-pp | two-nodes |" in network.time_table([row])
