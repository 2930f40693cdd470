"""spmdmoe collectives vs raw torch.distributed vs DTensor, side by side.

    torchrun --nproc-per-node 4 benchmarks/collectives.py [--rows 4096 16384] [--hidden 2048]

bf16, per-rank rows T in --rows, even (global 4T) and uneven (global 4T-1).
Rows: all_gather (Shard -> Replicate) and reduce_scatter (Partial -> Shard,
with and without a pre-padded producer buffer; ours and DTensor under
``torch.no_grad()``, like the raw calls, plus ours with grad mode on, which
records the backward on every rank). Each time is the median over
repeats of the mean over --iters back-to-back calls, CUDA events, max over
ranks. "raw" is the torch.distributed tensor collective on the same bytes
(p rows per rank, no padding work). busbw = (n-1)/n * padded bytes / time.
Then the eager host overhead per call on a tiny tensor (time to issue calls).
Prints a markdown table; --out appends it to a file.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial as DPartial
from torch.distributed.tensor import Replicate as DReplicate
from torch.distributed.tensor import Shard as DShard

import spmdmoe
from spmdmoe import Partial, Shard, SPMDTensor
from spmdmoe._dist import all_gather_single, reduce_scatter_single
from spmdmoe.types import layout
from timing import host_us, report, timed


def try_add(fns: dict, name: str, fn) -> None:
    """Add a candidate if one call works (the same outcome on every rank)."""
    try:
        fn()
        torch.cuda.synchronize()
        fns[name] = fn
    except Exception as e:  # noqa: BLE001
        if dist.get_rank() == 0:
            print(f"note: {name} unavailable: {type(e).__name__}: {str(e)[:200]}", flush=True)


def chunk_views(t: torch.Tensor, total: int, n: int) -> list:
    """Row views of ``t`` at the chunk rule's offsets (no copy)."""
    return [t[layout.chunk_offset(total, n, r) : layout.chunk_offset(total, n, r) + c] for r, c in enumerate(layout.chunk_counts(total, n))]


def no_grad(fn):
    """``fn`` under ``torch.no_grad()``: like for like with the raw collectives (no autograd). With grad
    mode on, every floating-point collective records its backward (``spmdmoe.autograd``)."""

    def run():
        with torch.no_grad():
            return fn()

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    n, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cuda", (n,))
    H, dt = args.hidden, torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(rank)
    rand = lambda *s: torch.randn(*s, device="cuda", dtype=dt, generator=gen)  # noqa: E731

    lines = [
        f"| op | T/rank | global T | ours ms | raw ms | DTensor ms | ours/raw | DTensor/ours | busbw GB/s (ours) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for rows in args.rows:
        for uneven in (False, True):
            G = n * rows - (1 if uneven else 0)
            p = layout.padded_local_tokens(G, n)
            mine = layout.local_tokens(G, n, rank)
            nbytes = p * n * H * 2
            busbw = lambda ms: (n - 1) / n * nbytes / (ms * 1e-3) / 1e9  # noqa: E731

            # all_gather: Shard -> Replicate
            local = rand(mine, H)
            x = SPMDTensor(local, mesh, Shard(0), global_tokens=G)
            send, out = rand(p, H), torch.empty(p * n, H, device="cuda", dtype=dt)
            dtensor = DTensor.from_local(local, mesh, [DShard(0)], shape=(G, H), stride=(H, 1))
            pre = spmdmoe.padded_empty(mesh, Shard(0), G, (H,), dtype=dt, device="cuda")
            pre.local.copy_(local)
            fns = {
                "all_gather": no_grad(lambda: spmdmoe.all_gather(x)),
                "all_gather (pre-padded)": no_grad(lambda: spmdmoe.all_gather(pre)),
                "all_gather (grad mode on: backward recorded)": lambda: spmdmoe.all_gather(x),
                "raw": lambda: all_gather_single(out, send),
                "dtensor": no_grad(lambda: dtensor.redistribute(mesh, [DReplicate()])),
            }
            if uneven:  # the copy-free alternative: NCCL's uneven list all_gather (grouped broadcasts)
                views = chunk_views(out, G, n)
                try_add(fns, "raw uneven list all_gather (no pad copy)", lambda: dist.all_gather(views, local))
            t = timed(fns, args.iters, args.reps)
            for name in [k for k in fns if k not in ("raw", "dtensor")]:
                ours, raw, dtt = t[name], t["raw"], t["dtensor"]
                lines.append(f"| {name} | {rows} | {G} | {ours:.3f} | {raw:.3f} | {dtt:.3f} | {ours / raw:.3f} | {dtt / ours:.2f} | {busbw(ours):.0f} |")
            del out, dtensor, pre

            # reduce_scatter: Partial -> Shard, plain input and pre-padded producer buffer
            part = rand(G, H)
            y = SPMDTensor(part, mesh, Partial(), global_tokens=G)
            pre = spmdmoe.padded_empty(mesh, Partial(), G, (H,), dtype=dt, device="cuda")
            pre.local.copy_(part)
            big, small = rand(p * n, H), torch.empty(p, H, device="cuda", dtype=dt)
            dpart = DTensor.from_local(part, mesh, [DPartial()], shape=(G, H), stride=(H, 1))
            fns = {
                "reduce_scatter": no_grad(lambda: spmdmoe.reduce_scatter(y)),
                "reduce_scatter (pre-padded)": no_grad(lambda: spmdmoe.reduce_scatter(pre)),
                "reduce_scatter (grad mode on: backward recorded)": lambda: spmdmoe.reduce_scatter(y),
                "raw": lambda: reduce_scatter_single(small, big),
                "dtensor": no_grad(lambda: dpart.redistribute(mesh, [DShard(0)])),
            }
            if uneven:  # the copy-free alternative: NCCL's uneven list reduce_scatter (grouped reduces)
                views, mine_out = chunk_views(part, G, n), torch.empty(mine, H, device="cuda", dtype=dt)
                try_add(fns, "raw uneven list reduce_scatter (no pad copy)", lambda: dist.reduce_scatter(mine_out, views))
            t = timed(fns, args.iters, args.reps)
            for name in [k for k in fns if k not in ("raw", "dtensor")]:
                ours, raw, dtt = t[name], t["raw"], t["dtensor"]
                lines.append(f"| {name} | {rows} | {G} | {ours:.3f} | {raw:.3f} | {dtt:.3f} | {ours / raw:.3f} | {dtt / ours:.2f} | {busbw(ours):.0f} |")
            del part, pre, big, small, dpart, y
            torch.cuda.empty_cache()

    # eager host overhead on a tiny tensor: what Python adds per call
    lines += ["", "| eager host time per call, tiny all_gather (x 16 features) | even 2n rows, us | uneven 2n-1 rows, us |", "|---|---|---|"]
    host: dict[str, list[float]] = {}
    for G in (2 * n, 2 * n - 1):
        tiny = torch.randn(layout.local_tokens(G, n, rank), 16, device="cuda", dtype=dt)
        leaf = tiny.clone().requires_grad_()
        x = SPMDTensor(tiny, mesh, Shard(0), global_tokens=G)
        xg = SPMDTensor(leaf, mesh, Shard(0), global_tokens=G)
        dtensor = DTensor.from_local(tiny, mesh, [DShard(0)], shape=(G, 16), stride=(16, 1))
        dgrad = DTensor.from_local(leaf, mesh, [DShard(0)], shape=(G, 16), stride=(16, 1))
        send, out = torch.randn(2, 16, device="cuda", dtype=dt), torch.empty(2 * n, 16, device="cuda", dtype=dt)
        for name, fn in (
            ("spmdmoe.all_gather under no_grad", no_grad(lambda: spmdmoe.all_gather(x))),
            ("spmdmoe.all_gather, grad mode on, input without grad (backward recorded)", lambda: spmdmoe.all_gather(x)),
            ("spmdmoe.all_gather, input requires grad (backward recorded)", lambda: spmdmoe.all_gather(xg)),
            ("raw all_gather_into_tensor (same bytes)", lambda: all_gather_single(out, send)),
            ("DTensor redistribute(Shard(0) -> Replicate)", lambda: dtensor.redistribute(mesh, [DReplicate()])),
            ("DTensor redistribute, input requires grad", lambda: dgrad.redistribute(mesh, [DReplicate()])),
            ("spmdmoe.from_local with its cross-rank check (all-gather + sync)",
             lambda: spmdmoe.from_local(tiny, mesh, global_tokens=G)),
        ):
            host.setdefault(name, []).append(host_us(fn, calls=50 if "from_local" in name else 200))
    lines += [f"| {name} | {v[0]:.1f} | {v[1]:.1f} |" for name, v in host.items()]
    if rank == 0:
        head = (f"device: {n}x {torch.cuda.get_device_name()}, torch {torch.__version__}, NCCL "
                f"{'.'.join(map(str, torch.cuda.nccl.version()))}, bf16, H={H}, iters={args.iters}, reps={args.reps}")
        text = "\n".join([head, "", *lines])
        report(text, args.out)


if __name__ == "__main__":
    spmdmoe.shutdown(main())  # flush, tear the groups down, leave: no gloo exit abort
