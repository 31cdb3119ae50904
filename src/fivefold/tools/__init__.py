"""The applications, one floor above `train/` and `plan/` (and below only the command line, cli.py):
`calibrate` (measure this machine into a planner topology), `evaluate` (`fivefold eval`), `generate`
(sample from a run or a Hugging Face folder), `hf_export` (a run as a Hugging Face folder), `report`
(draw runs' metrics, traffic and pipeline timelines) and `schedule` (simulate and draw a pipeline
schedule). They build on train/, plan/ and what lies below; nothing below imports them (import-linter
contracts in pyproject.toml).
"""
