"""One torchrun rank of `benchmarks/network.py --latency-hops` and `--loss-probe` (a program the benchmark
runs, not a benchmark): the seconds of each collective on a pair of ranks on two nodes (ranks 0 and 2 of 2
nodes x 2) and on all 4, at 64 bytes and 1 MiB, printed by rank 0 as one JSON line after "PROBE ".

    latency_probe.py                      # medians of 15 calls (the latency hops)
    latency_probe.py --mean 60 1048576    # means of 60 calls at 1 MiB only (a lost frame's cost: the
                                          # rare slow call is the point, so the mean, not the median)

Torch, and fivefold's reduce-scatter (comm/ops.py: gloo's own is an all-reduce, not what fivefold runs);
run under torchrun on an emulated fabric."""
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

from fivefold.comm.ops import Group, reduce_scatter

REPS, SKIP = 15, 3
MEAN = "--mean" in sys.argv
if MEAN:
    REPS, SKIP = int(sys.argv[sys.argv.index("--mean") + 1]) + 3, 3
SIZES = tuple(int(x) for x in sys.argv[sys.argv.index("--mean") + 2:]) if MEAN else (64, 1 << 20)


def timed(fn) -> float:
    xs = []
    for _ in range(REPS):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t0)
    return (statistics.fmean if MEAN else statistics.median)(xs[SKIP:])


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    pair = dist.new_group([0, 2])          # one rank on each node (2 ranks a node)
    out = {}
    for nbytes in SIZES:
        for name, group, members in (("pair", pair, [0, 2]), ("all", None, list(range(world)))):
            k = len(members)
            n = max(nbytes // 4 // k * k, k)
            ops = 5
            if rank not in members:        # the barriers the members time with
                for _ in range(ops * REPS):
                    dist.barrier()
                continue
            x = torch.ones(n)

            def send():
                if rank == members[0]:
                    dist.send(x, members[-1])
                elif rank == members[-1]:
                    dist.recv(x, members[0])

            for op, fn in (("all_reduce", lambda: dist.all_reduce(x, group=group)),
                           ("all_gather", lambda: dist.all_gather_into_tensor(torch.empty(n * k), x, group=group)),
                           ("reduce_scatter", lambda: reduce_scatter(torch.empty(n // k), x, Group(
                               name, members, members.index(rank), group or dist.group.WORLD, backend="gloo"))),
                           ("all_to_all", lambda: dist.all_to_all_single(torch.empty(n), x, group=group)),
                           ("send", send)):
                out[f"{name}/{op}/{nbytes}"] = timed(fn)
    if rank == 0:
        print("PROBE " + json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
