"""The analytic planner: memory, traffic per dimension and tier, bubble, step time and MFU of a layout,
and a search over layouts. No processes, no torch.distributed. Entry points: `estimate.estimate`,
`search.search`, `models.load_model`, `topology.load_topology`, and `cli.cmd_plan` (`fivefold plan`).
See docs/plan.md."""
