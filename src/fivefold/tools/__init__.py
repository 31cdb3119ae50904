"""Every command, one module each with its `add_<cmd>_args` and `cmd_<cmd>` (cli.py imports only the one
that runs): `training` (train), `dryrun` (train --dry-run), `evaluate` (eval), `export` and `hf_export`,
`generate`, `report`, `tokenize`, `calibrate`, `plan`, `schedule` and `cluster` (with `fabric` and `wire`);
`run_plan` is what a run asks the planner. They build on train/, plan/ and what lies below; nothing below
imports them (import-linter contracts in pyproject.toml). This file imports nothing, so `fivefold plan`
loads only tools/plan.py of this floor.
"""
