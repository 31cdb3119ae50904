"""ZeRO-3's prefetch depth (parallel.zero_prefetch, parallel/zero/order.py) moves when units are gathered,
nothing else: every depth trains to the same numbers with the same collectives."""
from __future__ import annotations

import pytest
import torch

from fivefold.config import ConfigError
from tests.support.reference import reference, run_steps
from tests.support.spawn import spawn_jobs
from tests.support.tiny import FP64, assert_states_close, tiny_config

DEPTHS = (0, 1, 3)


def config(depth: int) -> dict:
    c = tiny_config(dp=2, zero=3, microbatches=2, zero_prefetch=depth)
    c.model.layers = 3
    c.train.dtype = "fp64"
    return c.to_dict()


@pytest.mark.ranks
def test_every_depth_trains_to_the_same_numbers_with_the_same_collectives():
    """Depths 0, 1 and 3 bit for bit alike, and equal to the single process (fp64, to 1e-10)."""
    runs = spawn_jobs(2, [(str(d), run_steps, (config(d),)) for d in DEPTHS])
    single = tiny_config()
    single.model.layers, single.train.dtype = 3, "fp64"
    ref = reference(single)
    torch.testing.assert_close(torch.tensor(runs["3"][0]["losses"]), torch.tensor(ref["losses"]), rtol=1e-10, atol=0)
    assert_states_close(runs["3"][0]["state"], ref["state"], **FP64)
    for d in DEPTHS[1:]:
        for rank, (base, other) in enumerate(zip(runs["0"], runs[str(d)])):
            assert other["losses"] == base["losses"] and other["grad_norms"] == base["grad_norms"]
            if rank == 0:     # the full state is gathered to rank 0
                for name, t in base["state"].items():
                    assert other["state"][name].equal(t), name
            for a, b in zip(base["ledger"], other["ledger"]):      # step by step
                sent = [[(r["dim"], r["op"], r["calls"], r["bytes_sent"]) for r in rows] for rows in (a, b)]
                assert sent[0] == sent[1]


@pytest.mark.parametrize("bad", [-1, 17, 1.5, True])
def test_the_depth_is_checked(bad):
    c = tiny_config(dp=2, zero=3)
    c.parallel.zero_prefetch = bad
    with pytest.raises(ConfigError, match=r"parallel.zero_prefetch = .*valid: an integer 0 to 16"):
        c.validate(world_size=2)
