"""What the ride of deferred problems costs an SP layer without EP (``spmdmoe/moe/parallel/ride.py``; CPU, gloo).

    torchrun --nproc-per-node 4 benchmarks/ride_cost.py [--tokens 2048] [--dim 256] [--out FILE]

The same parallel layer stepped (forward + backward) with its ride and with the ride detached (``layer.admission.ride =
None``: no token exchange, no delayed read: the layer as it was before issue 24), candidates interleaved in every
rep, median of the reps, max over ranks; host wall time per step, since gloo on the CPU is synchronous
(``timing.timed_host``). Also
one ``from_local`` call with checks on and off (the same exchange in both modes since issue 24).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import spmdmoe
from spmdmoe.moe import MoE, MoEConfig, parallelize_moe
from timing import report, timed_host


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
    ride = layer.admission.ride
    full = torch.randn(args.tokens, args.dim, generator=torch.Generator().manual_seed(1))
    local = spmdmoe.shard(full, world).local

    def step() -> None:
        y = layer(spmdmoe.from_local(local, world, global_tokens=args.tokens))
        y.local.sum().backward()

    def wrap(on: bool) -> None:
        with spmdmoe.checks(on):
            spmdmoe.from_local(local, world, global_tokens=args.tokens)

    def with_ride(fn, attached):
        def call() -> None:
            layer.admission.ride = attached  # a detached ride leaves nothing pending for the attached one to read
            fn()
        return call

    fns = {"layer step, with the ride": with_ride(step, ride),
           "layer step, ride detached": with_ride(step, None),
           "from_local, checks on": with_ride(lambda: wrap(True), ride),
           "from_local, checks off": with_ride(lambda: wrap(False), ride)}
    ms = timed_host(fns, args.steps, args.reps)
    layer.admission.ride = ride
    lines = [f"torch {torch.__version__}, gloo, {dist.get_world_size()} CPU processes, SP layer without EP: T = "
             f"{args.tokens}, D = F = {args.dim}, E = {args.experts}, top-2, fp32", "",
             "| case | ms (median, max over ranks) |", "|---|---|"]
    lines += [f"| {name} | {v:.3f} |" for name, v in ms.items()]
    a, b = ms["layer step, with the ride"], ms["layer step, ride detached"]
    lines += ["", f"ride: {a - b:+.3f} ms per step ({a / b:.3f}x)"]
    if dist.get_rank() == 0:
        report("\n".join(lines), args.out)
    dist.barrier()
    spmdmoe.shutdown()

if __name__ == "__main__":
    main()
