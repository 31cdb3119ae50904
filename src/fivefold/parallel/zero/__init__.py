"""ZeRO (Rajbhandari et al. 2020): optimizer state, gradients and parameters sharded over the data-parallel
group, and offloaded to host memory or files (Ren et al. 2021; ZeRO-Infinity), as one wing of parallel/:

    spec.py      `ZeroSpec`, the setting as one value (torch-free: the planner reads it)
    engine.py    `ZeroEngine`, built from a spec: units, hooks, the reduce-scatter, checkpoint state
    stages.py    what the parameters are between uses: `FullParams` (stages 1, 2), `ShardedParams` (stage 3)
    reduce.py    when a unit is reduced: `EachMicrobatch`, `OncePerStep` (torch-free)
    state.py     where the optimizer state lives: `DeviceState`; offload.py `HostState`, `DiskState`
    units.py     the flat, padded units and which modules gather them
    order.py     stage 3's gather and free order (torch-free: the planner replays it)

Nothing is imported here, so the planner's torch-free modules (spec, reduce, order) stay torch-free.
"""
