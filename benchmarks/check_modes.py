"""What the collective-checking mode costs per collective call, against the default checks (CPU, gloo).

    torchrun --nproc-per-node 4 benchmarks/check_modes.py [--rows 4096] [--width 1024] [--out FILE]

Candidates interleaved in every rep (the mode switched per call), median of the reps, max over ranks;
host wall time per call, since gloo on the CPU is synchronous (``timing.timed_host``). ``all_gather`` of a
Shard (the record only) and ``redistribute(Replicate -> Shard)`` (the record plus a checksum of the replicated
rows).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import spmdmoe
from timing import report, timed_host


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    world = dist.group.WORLD
    full = torch.randn(args.rows, args.width, generator=torch.Generator().manual_seed(0))
    x = spmdmoe.shard(full, world)
    rep = spmdmoe.from_local(full, world, placement=spmdmoe.Replicate())
    ops = {"all_gather (Shard)": lambda: spmdmoe.all_gather(x),
           "redistribute (Replicate -> Shard)": lambda: spmdmoe.redistribute(rep, spmdmoe.Shard(0))}
    modes = (True, "collectives")

    def in_mode(op: str, mode: object):
        def call() -> None:
            with spmdmoe.checks(mode):
                ops[op]()
        return call

    fns = {f"{op}|{mode}": in_mode(op, mode) for op in ops for mode in modes}
    us = {k: v * 1e3 for k, v in timed_host(fns, args.calls, args.reps).items()}
    lines = [f"torch {torch.__version__}, gloo, {dist.get_world_size()} CPU processes, {args.rows} x {args.width} fp32 "
             f"({args.rows * args.width * 4 / 2**20:.0f} MiB global)", "",
             "| collective | default checks us | collectives mode us | added us | ratio |", "|---|---|---|---|---|"]
    for op in ops:
        a, b = us[f"{op}|True"], us[f"{op}|collectives"]
        lines.append(f"| {op} | {a:.0f} | {b:.0f} | {b - a:+.0f} | {b / a:.2f}x |")
    if dist.get_rank() == 0:
        report("\n".join(lines), args.out)
    dist.barrier()
    spmdmoe.shutdown()

if __name__ == "__main__":
    main()
