"""MoE layer fwd+bwd throughput next to its grouped GEMMs alone.

    torchrun --nproc-per-node N benchmarks/moe_layer.py [--tokens 16384] [--out FILE]

bf16, D=2048, F=1408, E=64, K=6 (DeepSeek-V2-Lite-like), T tokens per rank.
N = 1: ``MoE`` on one GPU. N > 1: ``parallelize_moe(moe, ep_mesh=world)``,
each rank with its own T tokens (EP = N). Rows:

* layer fwd+bwd: the whole layer (router, sort, dispatch incl. the one
  count sync, experts, combine, backward), CUDA events, median of reps,
  max over ranks;
* grouped GEMMs alone: the same 3 forward + 6 backward grouped GEMMs with
  the same group offsets on the same rows (what the layer cannot avoid);
* overhead = 1 - GEMM time / layer time: routing, sorting, gathers,
  all-to-alls, syncs, SwiGLU elementwise work.

TFLOP/s counts the 18·R·D·F expert GEMM FLOPs (R routed rows) over each time;
compare with the measured bf16 grouped_mm fwd+bwd ceiling (314 / 544
TFLOP/s at 16k / 64k rows on an H200).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import spmdmoe
from spmdmoe.moe import MoE, MoEConfig, parallelize_moe
from spmdmoe.moe.experts import grouped_swiglu
from timing import report, timed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=1408)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", default=None, help="write rank 0's top CUDA kernels of one step here")
    args = ap.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank = dist.get_rank() if world > 1 else 0
    spmdmoe.set_checks(False)

    cfg = MoEConfig(dim=args.dim, hidden_dim=args.hidden, num_experts=args.experts, top_k=args.top_k)
    torch.manual_seed(0)
    moe = MoE(cfg).to(device="cuda", dtype=torch.bfloat16)
    layer = parallelize_moe(moe, ep_mesh=dist.group.WORLD) if world > 1 else moe
    gen = torch.Generator(device="cuda").manual_seed(1 + rank)
    x = torch.randn(args.tokens, args.dim, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    g = torch.randn(args.tokens, args.dim, device="cuda", dtype=torch.bfloat16, generator=gen)

    def layer_step() -> None:  # as in training: gradients start from None (no accumulation add)
        x.grad = None
        layer.zero_grad(set_to_none=True)
        layer(x).backward(g)

    # the same grouped GEMMs alone, on a routed buffer with this rank's real group offsets
    captured = {}

    def grab(module, args, out) -> None:  # a hook that returned a value would replace the output
        captured["routed"] = args[0]

    hook = layer.experts.register_forward_hook(grab)
    layer(x)
    hook.remove()
    routed = captured["routed"]
    rows = routed.x_RD.detach().clone().requires_grad_()
    routed_leaf = type(routed)(rows, routed.group_offsets, routed.capacity, routed.group_sizes, None)
    w = [p.detach().clone().requires_grad_() for p in (layer.experts.w1, layer.experts.w2, layer.experts.w3)]
    gy = torch.randn(rows.shape, device="cuda", dtype=rows.dtype, generator=gen)

    def gemm_step() -> None:
        rows.grad = None
        for p in w:
            p.grad = None
        grouped_swiglu(routed_leaf, *w).backward(gy)

    t = timed({"layer": layer_step, "gemm": gemm_step}, args.iters, args.reps)
    t_layer, t_gemm = t["layer"], t["gemm"]
    R = torch.tensor([rows.shape[0]], device="cuda", dtype=torch.float64)
    if world > 1:
        dist.all_reduce(R, op=dist.ReduceOp.MAX)
    flops = 18 * R.item() * args.dim * args.hidden
    if rank == 0:
        head = (f"device: {world}x {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, "
                f"D={args.dim} F={args.hidden} E={args.experts} K={args.top_k} T/rank={args.tokens}, EP={world}")
        lines = [
            head, "",
            "| GPUs | layer fwd+bwd ms | tokens/s per GPU | grouped GEMMs alone ms | non-GEMM overhead | GEMM TFLOP/s in layer | GEMM TFLOP/s alone |",
            "|---|---|---|---|---|---|---|",
            f"| {world} | {t_layer:.3f} | {args.tokens / t_layer * 1e3:,.0f} | {t_gemm:.3f} | {1 - t_gemm / t_layer:.1%} | "
            f"{flops / t_layer / 1e9:.0f} | {flops / t_gemm / 1e9:.0f} |",
        ]
        text = "\n".join(lines)
        report(text, args.out)
    if args.profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                layer_step()
            torch.cuda.synchronize()
        if rank == 0:
            with open(args.profile, "w") as f:
                f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
