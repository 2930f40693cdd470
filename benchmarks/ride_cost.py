"""What the ride of deferred problems costs an SP layer without EP (``spmdmoe/moe/ride.py``; CPU, gloo).

    torchrun --nproc-per-node 4 benchmarks/ride_cost.py [--tokens 2048] [--dim 256] [--out FILE]

The same parallel layer stepped (forward + backward) with its ride and with the ride detached (``layer._ride =
None``: no token exchange, no delayed read: the layer as it was before issue 24), candidates interleaved in every
rep, median of the reps, max over ranks; host wall time per step, since gloo on the CPU is synchronous. Also
one ``from_local`` call with checks on and off (the same exchange in both modes since issue 24).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import spmdmoe
from spmdmoe.moe import MoE, MoEConfig, parallelize_moe


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    world = dist.group.WORLD
    torch.manual_seed(0)
    cfg = MoEConfig(dim=args.dim, hidden_dim=args.dim, num_experts=args.experts, top_k=2)
    layer = parallelize_moe(MoE(cfg), sp_mesh=world)
    ride = layer._ride
    full = torch.randn(args.tokens, args.dim, generator=torch.Generator().manual_seed(1))
    local = spmdmoe.shard(full, world).local

    def step() -> None:
        y = layer(spmdmoe.from_local(local, world, global_tokens=args.tokens))
        y.local.sum().backward()

    def wrap(on: bool) -> None:
        with spmdmoe.checks(on):
            spmdmoe.from_local(local, world, global_tokens=args.tokens)

    cases = {"layer step, with the ride": (lambda: step(), ride),
             "layer step, ride detached": (lambda: step(), None),
             "from_local, checks on": (lambda: wrap(True), ride),
             "from_local, checks off": (lambda: wrap(False), ride)}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(args.reps):
        for name in (list(cases) if r % 2 == 0 else list(reversed(cases))):
            fn, layer._ride = cases[name]
            fn()  # warm (and a detached ride leaves nothing pending behind)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                fn()
            times[name].append((time.perf_counter() - t0) / args.steps * 1e3)
    layer._ride = ride
    med = torch.tensor([statistics.median(v) for v in times.values()], dtype=torch.float64)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    ms = dict(zip(times, med.tolist()))
    lines = [f"torch {torch.__version__}, gloo, {dist.get_world_size()} CPU processes, SP layer without EP: T = "
             f"{args.tokens}, D = F = {args.dim}, E = {args.experts}, top-2, fp32", "",
             "| case | ms (median, max over ranks) |", "|---|---|"]
    lines += [f"| {name} | {v:.3f} |" for name, v in ms.items()]
    a, b = ms["layer step, with the ride"], ms["layer step, ride detached"]
    lines += ["", f"ride: {a - b:+.3f} ms per step ({a / b:.3f}x)"]
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
