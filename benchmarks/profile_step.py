"""Where one step of our MoE layer spends its time and its memory, per precision (1 GPU).

    python benchmarks/profile_step.py --shape dsmoe16b [--precision bf16,fp8_rowwise] [--compile] [--out FILE]

For each precision, on the same weights and input (bf16 activations, FP8 weights cached):

* kernels: torch profiler, CUDA time per kernel name summed over one step (the mean of 3 profiled
  steps), fill / zero kernels listed, and the device time of the torch ops that fill;
* memory: the step's peak above what was allocated before it (weights, input and FP8 cache excluded,
  gradients included, as ``vs_torchtitan.py`` counts it), and the tensors alive at that peak, grouped by
  the innermost spmdmoe frame that allocated them (``torch.cuda.memory._record_memory_history``); with
  ``--compile`` (the layer under ``torch.compile(fullgraph=True)``) the line of inductor's generated code
  that allocated them, where no spmdmoe frame is on the stack.

A diagnosis tool: the timings that compare candidates are ``vs_torchtitan.py``'s (interleaved).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import linecache
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from shapes import SHAPES  # noqa: E402
from timing import report  # noqa: E402

from spmdmoe.moe import MoE, MoEConfig  # noqa: E402


FILL_OPS = ("aten::fill_", "aten::zero_", "aten::zeros", "aten::new_zeros")


def kernels(step, n: int = 3) -> tuple[list[tuple[str, float, int]], list[tuple[str, float, int]]]:
    """(kernel name, ms per step, launches per step), most time first; and the same for the torch ops that
    fill (``FILL_OPS``: nested, so ``zeros`` includes its ``zero_`` and ``fill_``)."""
    acts = [torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    per_step = [(e.key, e.device_time_total / 1e3 / n, e.count // n, e.device_type) for e in prof.key_averages()
                if e.device_time_total > 0]
    rows = [r[:3] for r in per_step if r[3] == torch.autograd.DeviceType.CUDA]
    fills = [r[:3] for r in per_step if r[0] in FILL_OPS]
    return sorted(rows, key=lambda r: -r[1]), sorted(fills, key=lambda r: -r[1])


def frame_of(frames: list[dict]) -> str:
    """The innermost spmdmoe frame of an allocation's stack, else the line of inductor's generated code (its
    source text: the buffer it makes), else the innermost Python frame."""
    for f in frames:
        name = f.get("filename", "")
        if "spmdmoe" in name and "profile_step" not in name:
            return f"{name.split('spmdmoe/')[-1]}:{f.get('line')} {f.get('name')}"
    for f in frames:
        if "torchinductor" in f.get("filename", ""):
            return f"inductor: {linecache.getline(f['filename'], f.get('line', 0)).strip()[:100]}"
    return next((f"{f.get('filename', '?').split('/')[-1]}:{f.get('line')} {f.get('name')}" for f in frames
                 if f.get("filename", "").endswith(".py")), "?")


def memory(step) -> tuple[float, list[tuple[str, float, int]]]:
    """(peak GiB above the start, [(allocating frame, GiB alive at the peak, tensors)])."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
    step()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for ev in snap["device_traces"][torch.cuda.current_device()]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], frame_of(ev.get("frames", [])))
            total += ev["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif ev["action"] in ("free_requested",) and ev["addr"] in live:
            total -= live.pop(ev["addr"])[0]
    groups: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for size, where in at_peak.values():
        groups[where][0] += size / 2**30
        groups[where][1] += 1
    return peak / 2**30, sorted(((k, v[0], int(v[1])) for k, v in groups.items()), key=lambda r: -r[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="dsmoe16b", choices=sorted(SHAPES))
    ap.add_argument("--precision", default="bf16,fp8_rowwise")
    ap.add_argument("--top", type=int, default=22)
    ap.add_argument("--compile", action="store_true", help="the layer under torch.compile(fullgraph=True)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    s = SHAPES[args.shape]
    dev, dt = torch.device("cuda"), torch.bfloat16
    cfg = MoEConfig(dim=s.D, hidden_dim=s.F, num_experts=s.E, top_k=s.K, load_balance_coeff=1e-3)
    torch.manual_seed(0)
    gen = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(s.T, s.D, device=dev, dtype=dt, generator=gen).requires_grad_()
    g = torch.randn(s.T, s.D, device=dev, dtype=dt, generator=gen)
    lines = [f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, `python {' '.join(sys.argv)}`",
             f"shape {args.shape}: {s.label()}{', compiled (fullgraph)' if args.compile else ', eager'}"]
    for precision in args.precision.split(","):
        torch.manual_seed(0)
        layer = MoE(dataclasses.replace(cfg, expert_precision=precision)).to(device=dev, dtype=dt)
        fwd = torch.compile(layer, fullgraph=True) if args.compile else layer

        def step() -> None:
            x.grad = None
            layer.zero_grad(set_to_none=True)
            fwd(x).backward(g)

        for _ in range(3):
            step()
        rows, fill_sites = kernels(step)
        total = sum(r[1] for r in rows)
        lines += ["", f"### {precision}: kernels per step (sum {total:.2f} ms)", "", "| kernel | ms | launches |",
                  "|---|---|---|"]
        lines += [f"| {k[:90]} | {ms:.3f} | {c} |" for k, ms, c in rows[:args.top]]
        fills = [r for r in rows if any(w in r[0].lower() for w in ("fill", "zero"))]
        lines += [f"| (fills) {k[:80]} | {ms:.3f} | {c} |" for k, ms, c in fills if (k, ms, c) not in rows[:args.top]]
        lines += [f"| (fill op) {k} | {ms:.3f} | {c} |" for k, ms, c in fill_sites]
        layer.zero_grad(set_to_none=True)
        peak, groups = memory(step)
        lines += ["", f"### {precision}: memory, step peak {peak:.2f} GiB above the start; alive at the peak:", "",
                  "| allocated at | GiB | tensors |", "|---|---|---|"]
        lines += [f"| {w} | {gib:.3f} | {n} |" for w, gib, n in groups[:args.top]]
        del layer
        torch.cuda.empty_cache()
    report("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
