"""MoE layer fwd+bwd throughput next to its grouped GEMMs alone.

    torchrun --nproc-per-node N benchmarks/moe_layer.py [--tokens 16384] [--out FILE]

bf16, D=2048, F=1408, E=64, K=6 (DeepSeek-V2-Lite-like), T tokens per rank.
N = 1: ``MoE`` on one GPU. N > 1: ``parallelize_moe(moe, ep_mesh=world)``,
each rank with its own T tokens (EP = N). Rows:

* layer fwd+bwd: the whole layer (router, sort, dispatch incl. the one
  count sync, experts, combine, backward), CUDA events, median of reps,
  max over ranks;
* compiled: the same layer under ``torch.compile(fullgraph=True)`` (inductor);
* grouped GEMMs alone: the same 3 forward + 6 backward grouped GEMMs with
  the same group offsets on the same rows, without SwiGLU (what the layer
  cannot avoid); experts: the GEMMs with the SwiGLU kernels between them;
* overhead = 1 - GEMM time / layer time: routing, sorting, gathers,
  all-to-alls, syncs, SwiGLU elementwise work.

TFLOP/s counts the 18·R·D·F expert GEMM FLOPs (R routed rows) over each time;
compare with the measured bf16 grouped_mm fwd+bwd ceiling (314 / 544
TFLOP/s at 16k / 64k rows on an H200).

Also, interleaved with the default layer: the same layer with checks off
(``spmdmoe.set_checks(False)``: no input comparison, no non-finite pass) and
with a bf16 gate GEMM (``router_dtype="input"``, the fp32 default's cost);
the time of one ``update_expert_bias`` (its all-reduce and the one host read
of the agreement flags); and, under ``torch.cuda.set_sync_debug_mode("warn")``,
the synchronizing calls of one forward, backward and bias update.

``--precision fp8_rowwise`` profiles the FP8 layer alone. Do not set its figures beside a bf16 run of this
script: two processes timed apart disagreed (FP8 / bf16 1.03x here, 0.88x interleaved); the FP8 / bf16
comparison is ``benchmarks/vs_torchtitan.py``, every candidate in one rotation.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import warnings

import torch
import torch.distributed as dist

import spmdmoe
from spmdmoe.moe import MoE, MoEConfig, parallelize_moe
from spmdmoe.moe.experts.grouped import GroupedExperts, grouped_swiglu
from spmdmoe.moe.experts.gemm import grouped_mm, grouped_mm_pair
from timing import kernel_table, report, timed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=1408)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", default=None, help="write rank 0's top CUDA kernels of one step here")
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp8_rowwise"],
                    help="the routed experts' GEMMs (to profile one precision; compare precisions with "
                         "vs_torchtitan.py, which interleaves them in one process)")
    args = ap.parse_args()

    torch._dynamo.config.capture_scalar_outputs = True  # the EP split sizes, when compiled
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank = dist.get_rank() if world > 1 else 0

    cfg = MoEConfig(dim=args.dim, hidden_dim=args.hidden, num_experts=args.experts, top_k=args.top_k,
                    load_balance_coeff=1e-3, expert_precision=args.precision)
    torch.manual_seed(0)
    moe = MoE(cfg).to(device="cuda", dtype=torch.bfloat16)
    cheap_gate = MoE(dataclasses.replace(cfg, router_dtype="input")).to(device="cuda", dtype=torch.bfloat16)
    cheap_gate.load_state_dict(moe.state_dict())
    layer = parallelize_moe(moe, ep_mesh=dist.group.WORLD) if world > 1 else moe
    layer_bf16_gate = parallelize_moe(cheap_gate, ep_mesh=dist.group.WORLD) if world > 1 else cheap_gate
    gen = torch.Generator(device="cuda").manual_seed(1 + rank)
    x = torch.randn(args.tokens, args.dim, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    g = torch.randn(args.tokens, args.dim, device="cuda", dtype=torch.bfloat16, generator=gen)

    def step_of(module, checks: bool):
        def step() -> None:  # as in training: gradients start from None (no accumulation add)
            spmdmoe.set_checks(checks)
            x.grad = None
            module.zero_grad(set_to_none=True)
            module(x).backward(g)
        return step

    layer_step = step_of(layer, True)

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
    h_leaf = torch.randn(rows.shape[0], w[0].shape[1], device="cuda", dtype=rows.dtype, generator=gen).requires_grad_()
    gh = torch.randn(h_leaf.shape, device="cuda", dtype=rows.dtype, generator=gen)
    offs = routed.group_offsets

    def gemm_step() -> None:  # the three grouped GEMMs, forward and backward, on the same rows; no SwiGLU
        for p in (rows, h_leaf, *w):
            p.grad = None
        h1, h3, y = grouped_mm(rows, w[0], offs), grouped_mm(rows, w[2], offs), grouped_mm(h_leaf, w[1], offs)
        torch.autograd.backward([h1, h3, y], [gh, gh, gy])

    F_ = w[0].shape[1]
    packed = GroupedExperts(w[0].shape[0], w[0].shape[2], F_).to(device="cuda", dtype=rows.dtype)  # w1, w3 packed
    with torch.no_grad():  # the layer's weights (values matter: zeros would run the GEMMs at other clocks)
        for p, src in zip((packed.w1, packed.w2, packed.w3), w):
            p.copy_(src)
    gh13 = torch.cat([gh, gh], 1)

    def fused_step() -> None:  # the same GEMMs with the up-projections as one GEMM on [w1 | w3], as the layer runs
        for p in (rows, h_leaf, *packed.parameters()):
            p.grad = None
        h13, y = grouped_mm_pair(rows, packed.w1, packed.w3, offs), grouped_mm(h_leaf, packed.w2, offs)
        torch.autograd.backward([h13, y], [gh13, gy])

    def swiglu_step() -> None:  # the experts as the layer runs them (with SwiGLU)
        for p in (rows, *packed.parameters()):
            p.grad = None
        grouped_swiglu(routed_leaf, packed.w1, packed.w2, packed.w3).backward(gy)

    compiled = torch.compile(layer, fullgraph=True)
    compiled_step = step_of(compiled, True)
    t = timed({"layer": layer_step, "gemm": gemm_step}, args.iters, args.reps)
    t.update(timed({"experts": swiglu_step, "fused": fused_step}, args.iters, args.reps))
    t.update(timed({"layer": layer_step, "compiled": compiled_step}, args.iters, args.reps))
    # each comparison in a pair of its own (a third candidate in the rotation skewed the pair by up to 7 %)
    t.update(timed({"on": layer_step, "off": step_of(layer, False)}, args.iters, args.reps))
    t.update(timed({"fp32 gate": layer_step, "bf16 gate": step_of(layer_bf16_gate, True)}, args.iters, args.reps))
    t.update(timed({"update": layer.update_expert_bias}, args.iters, args.reps))
    spmdmoe.set_checks(True)
    t_layer, t_gemm = t["layer"], t["gemm"]
    syncs = {checks: sync_counts(layer, x, g, checks) for checks in (True, False)}
    R = torch.tensor([rows.shape[0]], device="cuda", dtype=torch.float64)
    if world > 1:
        dist.all_reduce(R, op=dist.ReduceOp.MAX)
    flops = 18 * R.item() * args.dim * args.hidden
    if rank == 0:
        head = (f"device: {world}x {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16 activations, experts {args.precision}, "
                f"D={args.dim} F={args.hidden} E={args.experts} K={args.top_k} T/rank={args.tokens}, EP={world}")
        lines = [
            head, "",
            f"| GPUs | layer fwd+bwd ms | compiled ({'fullgraph' if args.precision == 'bf16' else 'graph breaks'}) ms | tokens/s per GPU (eager / compiled) | "
            "3 grouped GEMMs alone ms | same, up-projections fused ms | experts (fused GEMMs + SwiGLU) ms | "
            "layer / 3 GEMMs | non-GEMM overhead | GEMM TFLOP/s in layer | GEMM TFLOP/s alone |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
            f"| {world} | {t_layer:.3f} | {t['compiled']:.3f} | {args.tokens / t_layer * 1e3:,.0f} / "
            f"{args.tokens / t['compiled'] * 1e3:,.0f} | {t_gemm:.3f} | {t['fused']:.3f} | {t['experts']:.3f} | "
            f"{t_layer / t_gemm:.3f} | "
            f"{1 - t_gemm / t_layer:.1%} | {flops / t_layer / 1e9:.0f} | {flops / t_gemm / 1e9:.0f} |",
            "",
            "| GPUs | layer, checks off ms | checks on / off | layer, bf16 gate ms | fp32 gate / bf16 gate | "
            "update_expert_bias ms | syncs fwd / bwd / update, checks on | checks off |",
            "|---|---|---|---|---|---|---|---|",
            f"| {world} | {t['off']:.3f} | {t['on'] / t['off']:.3f} | {t['bf16 gate']:.3f} | "
            f"{t['fp32 gate'] / t['bf16 gate']:.3f} | {t['update']:.3f} | {' / '.join(map(str, syncs[True]))} | "
            f"{' / '.join(map(str, syncs[False]))} |",
        ]
        text = "\n".join(lines)
        report(text, args.out)
    if args.profile:
        table = kernel_table(layer_step)
        if rank == 0:
            with open(args.profile, "w") as f:
                f.write(table)


def sync_counts(layer, x, g, checks: bool) -> tuple[int, int, int]:
    """Synchronizing calls CUDA's sync debug mode reports in one forward, its backward, and one bias update."""
    spmdmoe.set_checks(checks)
    out = []
    for phase in ("forward", "backward", "update"):
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            if phase == "forward":
                y = layer(x)
            elif phase == "backward":
                y.backward(g)
            else:
                layer.update_expert_bias()
            torch.cuda.set_sync_debug_mode("default")
        # only the reports of a synchronizing call (not the mode's own "prototype" notice)
        out.append(sum("called a synchronizing" in str(w.message) for w in seen))
    spmdmoe.set_checks(True)
    return out[0], out[1], out[2]


if __name__ == "__main__":
    spmdmoe.shutdown(main())  # flush, tear the groups down, leave: no gloo exit abort
