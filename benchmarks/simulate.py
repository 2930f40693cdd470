"""Plan a DeepSeek-V3-sized MoE layer at up to 1024 ranks in ONE process, with torch's fake process group.

    python benchmarks/simulate.py [--out FILE] [--quick] [--base DIR]

Nothing is communicated and no weight is allocated: this process plays one rank of a ``dp x sp x ep``
mesh of the fake group (``torch.testing._internal.distributed.fake_pg``: collectives return at once and
leave their outputs unfilled), builds ``MoE(E=256, K=8, D=7168, F=2048)`` on the meta device, runs
``parallelize_moe`` (the plan validation and the agreement exchange, whose tables are synthetic: every
rank sends this rank's row, as a job whose ranks agree would) and then forwards of ``T`` meta tokens
through the sync-free EP transport (the layout math, the count-table planning, the static capacity
buffers, the offsets; shapes only; ``max_tokens`` = the tokens per SP rank, so no host read). Reported
per mesh: host milliseconds per layer forward (median after one warm-up; on meta every op is
dispatched and the plain-torch references stand in for the Triton kernels, so this is the Python and
dispatch cost of the whole forward, not a GPU-run figure; ``--reps``), this rank's parameter GiB (bf16) and the
sync-free experts' buffer rows ``R``, lossless and at ``capacity_factor=1.25``, next to the rows actually routed.
The sync transport cannot run here: its host read of the split sizes needs real counts.
``--base DIR``: an older spmdmoe beside this one (``benchmarks/base_copy.sh``), its layer built on the same
fake group and its forwards interleaved with ours (shuffled order), so a change's host cost is read as a ratio
from one process.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import spmdmoe
from older import config_in
from timing import shuffled
from spmdmoe.moe import MoEConfig
from spmdmoe.moe.transports.sync_free import capacity_rows

CFG = MoEConfig(dim=7168, hidden_dim=2048, num_experts=256, top_k=8)
# (dp, sp, ep): EP 2..256, and 1024 ranks in all as dp x sp x ep
MESHES = [(1, 1, 2), (1, 1, 8), (1, 1, 64), (1, 1, 256), (4, 1, 256), (2, 2, 256), (16, 1, 64), (1, 4, 256)]
TOKENS = (4096, 65536)


def simulate(dp: int, sp: int, ep: int, tokens: int, libs: dict[str, Any], reps: int = 6, rank: int = 1) -> tuple[dict[str, float], float, int, int]:
    """Host ms per forward of each library's layer (``libs``: name -> an spmdmoe package), this rank's
    parameter GiB and the buffer rows, for one mesh and token count."""
    world = dp * sp * ep
    dist.init_process_group("fake", store=FakeStore(), rank=rank % world, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (dp, sp, ep), mesh_dim_names=("dp", "sp", "ep"))
        sp_mesh = mesh["sp"] if sp > 1 else None
        x = torch.empty(tokens // sp if sp > 1 else tokens, CFG.dim, device="meta", dtype=torch.bfloat16)
        calls = {}
        for name, lib in libs.items():
            with torch.device("meta"):
                moe = lib.moe.MoE(config_in(lib.moe, CFG)).to(torch.bfloat16)
            layer = lib.moe.parallelize_moe(moe, sp_mesh=sp_mesh, ep_mesh=mesh["ep"],
                                            dp_mesh=mesh["dp"] if dp > 1 else None, device="meta",
                                            ep_mode="sync_free", max_tokens=tokens // sp)
            inp = lib.from_local(x, sp_mesh, global_tokens=tokens) if sp_mesh is not None else x
            calls[name] = (layer, inp)
        params = sum(p.numel() * p.element_size() for p in calls[""][0].parameters()) / 2**30
        times: dict[str, list[float]] = {name: [] for name in calls}
        names = list(calls)
        for rep in range(reps):
            for name in shuffled(names, rep):
                layer, inp = calls[name]
                t0 = time.perf_counter()
                layer(inp)
                times[name].append(time.perf_counter() - t0)
        t_max, e = tokens // sp, CFG.num_experts // ep
        R = [capacity_rows(t_max, CFG.top_k, e, ep, c)[1] for c in (None, 1.25)]
        return {n: statistics.median(t[1:]) * 1e3 for n, t in times.items()}, params, *R
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="the 1024-rank meshes at 4096 tokens only (CI)")
    ap.add_argument("--reps", type=int, default=6, help="forwards per layer (the first is not counted)")
    ap.add_argument("--base", default=None, help="a folder holding spmdmoe_base (benchmarks/base_copy.sh)")
    args = ap.parse_args()
    libs: dict[str, Any] = {"": spmdmoe}
    if args.base:
        sys.path.insert(0, args.base)
        libs["base"] = importlib.import_module("spmdmoe_base")
    # the agreement's check exchange is not filled by the fake group: every rank sends this rank's row
    for lib in libs.values():
        lib.agreement.exchange_rows = lambda axis, row, *_: [[int(v) for v in row]] * (
            dist.get_world_size() if axis is None else axis.size)
    meshes = [m for m in MESHES if m[0] * m[1] * m[2] == 1024] if args.quick else MESHES
    lines = [f"torch {torch.__version__}, fake process group, one simulated rank; MoE E={CFG.num_experts} "
             f"K={CFG.top_k} D={CFG.dim} F={CFG.hidden_dim} bf16 on meta, ep_mode='sync_free' (lossless)", "",
             "| dp x sp x ep | ranks | T per SP group | host ms per layer forward | parameters GiB per rank | "
             "experts' buffer rows R, lossless | R at capacity_factor 1.25 | routed rows T*K/sp |"
             + (" base host ms | ours / base |" if args.base else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|---|" if args.base else "")]
    for dp, sp, ep in meshes:
        for T in TOKENS[:1] if args.quick else TOKENS:
            ms, gib, R, R125 = simulate(dp, sp, ep, T, libs, args.reps)
            lines.append(f"| {dp} x {sp} x {ep} | {dp * sp * ep} | {T} | {ms['']:.2f} | {gib:.2f} | {R:,} | {R125:,} | "
                         f"{T * CFG.top_k // sp:,} |"
                         + (f" {ms['base']:.2f} | {ms[''] / ms['base']:.3f} |" if args.base else ""))
            print(lines[-1], flush=True)
    text = "\n".join(lines)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n\n")
    print(text)


if __name__ == "__main__":
    main()
