"""Shard a batch whose token count does not divide by 4, check it, gather it back.

    torchrun --nproc-per-node 4 examples/shard_gather.py

Runs on gloo (CPU) by default, NCCL when every rank has a GPU. A minimal tour
of the types: the chunk rule, the collective layout check catching a bad
split on every rank, and an exact round trip through a collective. The main
job is ``examples/train_moe.py``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import spmdmoe


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=10, help="global token count (default 10: not divisible by 4)")
    parser.add_argument("--dim", type=int, default=4, help="feature size")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        print(f"launch me with torchrun, e.g.: torchrun --nproc-per-node 4 {sys.argv[0]}", file=sys.stderr)
        return 2

    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = spmdmoe.init_mesh(args.device, (n,), mesh_dim_names=("sp",))
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")

    # 1. Every rank builds the same batch and keeps its chunk: no communication.
    full = torch.arange(args.tokens * args.dim, dtype=torch.float32, device=device).view(args.tokens, args.dim)
    x = spmdmoe.shard(full, mesh)
    counts = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(n)]
    dist.all_gather(counts, torch.tensor([x.local_tokens], device=device))
    rows = [int(c) for c in counts]
    if rank == 0:
        print(f"T={x.global_tokens} on {n} ranks: rows per rank {rows}, "
              f"padded {x.padded_local_tokens} x {n} = {x.padded_global_tokens}")
        print(spmdmoe.types.layout.chunk_counts(args.tokens, n), "<- the chunk rule: padding only at the tail")

    # 2. Wrapping local shards checks the split across ranks (one tiny all-gather).
    y = spmdmoe.from_local(x.local.clone(), mesh)
    assert y.global_tokens == args.tokens  # T = sum of rows, never rows x world
    bad_rows = x.local_tokens + (1 if rank == n - 1 else 0)
    try:
        spmdmoe.from_local(torch.zeros(bad_rows, args.dim, device=device), mesh, global_tokens=args.tokens)
    except spmdmoe.SPMDLayoutError as e:
        if rank == 0:
            print(f"every rank rejected a bad split; rank 0 says:\n  {str(e).splitlines()[0]}")

    # 3. Gather back and compare with the full batch.
    gathered = spmdmoe.all_gather(y)
    ok = torch.equal(gathered.local, full)
    if rank == 0:
        print(f"all_gather -> {gathered.placement}, {tuple(gathered.local.shape)} rows, equal to the batch: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    spmdmoe.shutdown(main())  # flush, tear the groups down, run atexit handlers, leave: no gloo exit abort
