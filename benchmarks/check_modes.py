"""What the collective-checking mode costs per collective call, against the default checks (CPU, gloo).

    torchrun --nproc-per-node 4 benchmarks/check_modes.py [--rows 4096] [--width 1024] [--out FILE]

Candidates interleaved in every rep (the mode switched per call), median of the reps, max over ranks; host
wall time per call, since gloo on the CPU is synchronous. ``all_gather`` of a Shard (the record only) and
``redistribute(Replicate -> Shard)`` (the record plus a checksum of the replicated rows).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import spmdmoe


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
    times: dict[tuple[str, object], list[float]] = {(op, m): [] for op in ops for m in modes}
    for r in range(args.reps):
        order = list(times) if r % 2 == 0 else list(reversed(times))
        for op, mode in order:
            with spmdmoe.checks(mode):
                ops[op]()  # warm
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    ops[op]()
                times[(op, mode)].append((time.perf_counter() - t0) / args.calls * 1e6)
    med = torch.tensor([statistics.median(v) for v in times.values()], dtype=torch.float64)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    us = dict(zip(times, med.tolist()))
    lines = [f"torch {torch.__version__}, gloo, {dist.get_world_size()} CPU processes, {args.rows} x {args.width} fp32 "
             f"({args.rows * args.width * 4 / 2**20:.0f} MiB global)", "",
             "| collective | default checks us | collectives mode us | added us | ratio |", "|---|---|---|---|---|"]
    for op in ops:
        a, b = us[(op, True)], us[(op, "collectives")]
        lines.append(f"| {op} | {a:.0f} | {b:.0f} | {b - a:+.0f} | {b / a:.2f}x |")
    if dist.get_rank() == 0:
        text = "\n".join(lines)
        print(text, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(text + "\n\n")
    dist.barrier()
    spmdmoe.shutdown()


if __name__ == "__main__":
    main()
