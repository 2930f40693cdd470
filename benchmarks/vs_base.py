"""This spmdmoe's one-GPU MoE layer against an older one, side by side in one process: a change's cost.

    bash benchmarks/base_copy.sh REV /tmp/base && python benchmarks/vs_base.py --base /tmp/base [--shape dsmoe16b]

The older copy (``benchmarks/base_copy.sh``: the package at ``REV`` renamed ``spmdmoe_base``) and this one
build the same layer (same weights, ``load_balance_coeff`` set) in bf16 and in FP8 (``fp8_rowwise``, weight
cache warm: policy (b) of ``vs_torchtitan.py``), eager and compiled (``fullgraph=True``); only these eight
candidates, so the rotation is short and the medians tight. A fwd+bwd step each (input gradient and
parameter gradients, grads set to None), ``timing.timed``: interleaved, shuffled, median of ``--reps`` of
``--iters`` steps. Before timing, each candidate's output is compared with its base twin (max abs diff).
Prints ms per step and ours / base per precision and mode. ``--base-first``: the base's layers built first
(run both orders: an allocation-order effect flips with it, a code change does not).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import sys
from typing import Any, Callable

import torch

from older import config_in
from shapes import SHAPES
from spmdmoe.moe import MoE, MoEConfig
from timing import report, timed


def build(lib: Any, cfg: MoEConfig, precision: str, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    m = lib.MoE(config_in(lib, cfg, expert_precision=precision)).to(device="cuda", dtype=torch.bfloat16)
    m.load_state_dict(state)
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="a folder holding spmdmoe_base (benchmarks/base_copy.sh)")
    ap.add_argument("--shape", default="dsmoe16b", choices=sorted(SHAPES))
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--base-first", action="store_true", help="build (and first time) the base's layers first")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sys.path.insert(0, args.base)
    libs = {"ours": importlib.import_module("spmdmoe.moe"), "base": importlib.import_module("spmdmoe_base.moe")}
    if args.base_first:  # which copy is built first (memory placement) and leads the rotation
        libs = dict(reversed(list(libs.items())))
    s = SHAPES[args.shape]
    cfg = MoEConfig(dim=s.D, hidden_dim=s.F, num_experts=s.E, top_k=s.K, load_balance_coeff=1e-3)
    torch.manual_seed(0)
    state = {k: v.detach().clone() for k, v in MoE(cfg).to(device="cuda", dtype=torch.bfloat16).state_dict().items()}
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(s.T, s.D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    g = torch.randn(s.T, s.D, device="cuda", dtype=torch.bfloat16, generator=gen)
    fns: dict[str, Callable[[], None]] = {}
    outs: dict[str, torch.Tensor] = {}
    for precision in ("bf16", "fp8_rowwise"):
        for who, lib in libs.items():
            module = build(lib, cfg, precision, state)
            for mode, fwd in (("eager", module), ("compiled", torch.compile(module, fullgraph=True))):
                def step(fwd: Any = fwd, module: torch.nn.Module = module) -> None:
                    module.zero_grad(set_to_none=True)
                    x.grad = None
                    fwd(x).backward(g)
                name = f"{who} {precision} {mode}"
                fns[name] = step
                with torch.no_grad():
                    outs[name] = fwd(x).float()
    diffs = {n: (outs[n] - outs[n.replace("ours", "base")]).abs().max().item() for n in outs if n.startswith("ours")}
    ms = timed(fns, args.iters, args.reps)
    lines = [f"## ours vs base, one GPU layer ({datetime.date.today()}, {torch.cuda.get_device_name()}, torch "
             f"{torch.__version__}; `python benchmarks/vs_base.py {' '.join(sys.argv[1:])}`)", "",
             f"{s.label()}; fwd+bwd ms, median of {args.reps} x {args.iters}, eight candidates interleaved", "",
             "| precision, mode | ours ms | base ms | ours / base | max abs(ours - base) output |", "|---|---|---|---|---|"]
    for precision in ("bf16", "fp8_rowwise"):
        for mode in ("eager", "compiled"):
            a, b = ms[f"ours {precision} {mode}"], ms[f"base {precision} {mode}"]
            lines.append(f"| {precision}, {mode} | {a:.3f} | {b:.3f} | {a / b:.3f} | "
                         f"{diffs[f'ours {precision} {mode}']:.2e} |")
    report("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
