"""spmdmoe's MoE layer next to torchtitan 0.3.0's MoE module: same config, weights and inputs, one run.

    torchrun --nproc-per-node N benchmarks/vs_torchtitan.py [--tokens 16384] [--out FILE]
    torchrun --nproc-per-node N benchmarks/vs_torchtitan.py --smoke     # CPU (gloo), tiny, no timing

torchtitan is a benchmark-only extra (``pip install --no-deps .whl/*.whl``: torchtitan, spmd_types,
torchao, tyro, docstring_parser, typeguard); without it the script says so and exits 0.

bf16, D=2048, F=1408, E=64, K=6, softmax scores, no shared experts, ``load_balance_coeff`` set (the
bias update is not timed), gate GEMM in fp32 in both, T tokens per rank. N = 1: both on one GPU.
N > 1: EP over all ranks for both (ours: ``parallelize_moe(ep_mesh=world)``; torchtitan's: its
all-to-all dispatcher wired to a 1-D "ep" mesh, each rank holding its slice of the experts). Rows:

* spmdmoe eager / compiled: ``MoE`` (checks on) and ``torch.compile(layer, fullgraph=True)`` ("graph
  breaks": fullgraph raised, so compiled with ``fullgraph=False``);
* torchtitan eager / compiled: its ``MoE`` from ``make_moe_config``, compiled as torchtitan does
  (``module.compile(fullgraph=True)``, ``capture_scalar_outputs=True``, set for all rows). Where that
  fails (EP under its default ``spmd_types`` backend) the reason is shown, and the compiled row runs
  under its ``partial_dtensor`` backend (functional all-to-alls; the eager row keeps the default);
* ms: one fwd+bwd, gradients set to None first, candidates interleaved, median of reps, max over
  ranks; peak step GiB: the most one step allocates above what was allocated before it (weights and
  inputs excluded, gradients included), max over ranks; speedup: torchtitan's ms / the row's ms.

Before timing, every candidate's output and input gradient are compared with torchtitan eager's on
the same input: max abs diff, relative error ||diff|| / ||ref||, and the fraction of token rows whose
own relative error exceeds 2e-2 (a row can flip experts on a near-tie, which fp32 gate GEMMs of other
summation orders break differently); with more than 1 % of such rows the run stops.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import os
import sys
import warnings
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from spmdmoe.moe import MoE, MoEConfig, parallelize_moe
from spmdmoe.moe.checkpoint import to_torchtitan
from timing import report, timed

Fwd = Callable[[torch.Tensor], torch.Tensor]
TOLERANCE = 2e-2  # relative error of one row (output or input gradient) in bf16
TOLERANCE_FP8 = 0.25  # the same with FP8 experts on both sides (gross errors only)
ROWS_OFF = 1e-2  # fraction of rows allowed beyond it (routing flips on near-ties)


def build_torchtitan(cfg: MoEConfig, state: dict[str, torch.Tensor], dtype: torch.dtype,
                     device: torch.device, ep_mesh: Any, fp8: bool = False) -> torch.nn.Module:
    """torchtitan's MoE with ``state`` (our names) loaded, parameters in ``dtype``, buffers fp32; ``fp8``: its
    experts converted by ``Float8GroupedExpertsConverter`` (torchao's rowwise FP8 grouped GEMMs)."""
    from torchtitan.models.common.config_utils import make_moe_config, make_routed_experts_config, make_router_config
    from torchtitan.models.common.param_init import skip_param_init  # every weight is loaded below

    E, D, F, K = cfg.num_experts, cfg.dim, cfg.hidden_dim, cfg.top_k
    tt_cfg = make_moe_config(
        num_experts=E, load_balance_coeff=cfg.load_balance_coeff, shared_experts=None,
        router=make_router_config(dim=D, num_experts=E, top_k=K, score_func="softmax",
                                  gate_param_init={"weight": skip_param_init}),
        routed_experts=make_routed_experts_config(
            dim=D, hidden_dim=F, num_experts=E, top_k=K, comm_backend="standard",
            param_init={n: skip_param_init for n in ("w1_EFD", "w2_EDF", "w3_EFD")}))
    if fp8:
        from torchtitan.components.quantization.float8 import Float8GroupedExpertsConverter as Converter

        tt_cfg = Converter(Converter.Config(model_compile_enabled=True)).convert(tt_cfg)
    with torch.device(device):
        moe = tt_cfg.build()
    for p in moe.parameters():  # not moe.to(dtype): that would round its fp32 buffers too
        p.data = p.data.to(dtype)
    moe.load_state_dict(to_torchtitan(state))  # its orientation is ours: w1/w3 (E, F, D), w2 (E, D, F)
    if ep_mesh is not None:  # this rank's contiguous slice of the experts, as its all-to-all expects
        e, r = E // ep_mesh.size(), ep_mesh.get_local_rank()
        inner = moe.routed_experts.inner_experts
        for name in ("w1_EFD", "w2_EDF", "w3_EFD"):
            setattr(inner, name, torch.nn.Parameter(getattr(inner, name).detach()[r * e:(r + 1) * e].clone()))
        moe.routed_experts.token_dispatcher.wire_meshes(ep_mesh=ep_mesh)
    return moe


def on_backend(spmd_backend: str, fwd: Fwd) -> Fwd:
    """``fwd`` under another of torchtitan's SPMD backends (its ``parallelism.spmd_backend`` option)."""
    from torchtitan.distributed.utils import get_spmd_backend, set_spmd_backend

    def call(t: torch.Tensor) -> torch.Tensor:
        before = get_spmd_backend()
        set_spmd_backend(spmd_backend)
        try:
            return fwd(t)
        finally:
            set_spmd_backend(before)
    return call


def first_step(fwd: Fwd, x: torch.Tensor, g: torch.Tensor) -> Optional[str]:
    """One fwd+bwd (compiles a compiled candidate): None, or the first line of the error of some rank."""
    error = None
    try:
        x.grad = None
        fwd(x).backward(g)
    except Exception as exc:  # noqa: BLE001 - the row's result
        error = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"[:200]
    if dist.is_initialized():
        errors: list[Optional[str]] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e), None)
    return error


def compare(fwd: Fwd, ref: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, g: torch.Tensor,
            tolerance: float = TOLERANCE) -> list[float]:
    """Output and input gradient against ``ref``: [max abs diff, ||diff|| / ||ref||, fraction of rows
    whose own relative error exceeds ``tolerance``], each the max over the two and over ranks."""
    x.grad = None
    y = fwd(x)
    y.backward(g)
    out = torch.zeros(3, dtype=torch.float64, device=x.device)
    for a, b in ((y.detach().float(), ref[0].float()), (x.grad.float(), ref[1].float())):
        d = a - b
        rows_off = (~(d.norm(dim=1) <= tolerance * b.norm(dim=1))).double().mean()  # NaN counts as off
        out = torch.maximum(out, torch.stack([d.abs().max(), d.norm() / b.norm(), rows_off]).double())
    if dist.is_initialized():
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out.tolist()


def peak_gib(step: Callable[[], None], modules: list[torch.nn.Module], x: torch.Tensor) -> float:
    """The most one step allocates above what was allocated before it (GiB), max over ranks."""
    for m in modules:
        m.zero_grad(set_to_none=True)
    x.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    t = torch.tensor([(torch.cuda.max_memory_allocated() - base) / 2**30], device="cuda")
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def table(head: str, T: int, t: dict[str, float], mem: dict[str, float], failed: dict[str, str],
          checks: dict[str, list[float]], refs: tuple[str, ...], tolerance: float) -> str:
    def speedup(ref: str, ms: float) -> str:
        ref_ms = [v for n, v in t.items() if n.startswith(ref)]
        return f"{ref_ms[0] / ms:.2f}" if ref_ms else "–"

    agreement = (f"vs {refs[-1]} (output, input grad): rel error <= {max(c[1] for c in checks.values()):.2g}"
                 f", rows off by > {tolerance}: <= {max(c[2] for c in checks.values()):.2%}")
    lines = [head, agreement, "", "| candidate | fwd+bwd ms | tokens/s per GPU | peak step GiB | "
             + " | ".join(f"speedup vs {r}" for r in refs) + " |", "|---|---|---|---|" + "---|" * len(refs)]
    lines += [f"| {n} | {ms:.3f} | {T / ms * 1e3:,.0f} | {mem[n]:.2f} | "
              + " | ".join(speedup(r, ms) for r in refs) + " |" for n, ms in t.items()]
    return "\n".join(lines + [f"| {n} | {why} |" + " |" * (2 + len(refs)) for n, why in failed.items()])


def main() -> None:
    ap = argparse.ArgumentParser()
    for flag, default in (("--tokens", 16384), ("--reps", 15), ("--iters", 5)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny dims, fp32, compile with aot_eager, no timing")
    ap.add_argument("--fp8", action="store_true", help="FP8 rowwise experts on both sides (+ bf16 rows to compare)")
    args = ap.parse_args()
    try:
        from torchtitan.distributed.spmd_types import set_spmd_meshes
    except ImportError as exc:
        print(f"vs_torchtitan: torchtitan is not importable ({exc}); install the benchmark extra with "
              "`pip install --no-deps .whl/*.whl`. Nothing measured.", flush=True)
        return
    if not hasattr(torch.compiler, "_is_non_strict_tracing"):  # torch 2.11 lacks it; its EP dispatcher calls it
        torch.compiler._is_non_strict_tracing = lambda: False  # type: ignore[attr-defined]
    torch._dynamo.config.capture_scalar_outputs = True  # as torchtitan's trainer sets it

    world, local_rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", "0"))
    if args.smoke:
        warnings.filterwarnings("ignore", message="In CPU autocast")  # its fp32 gate autocast: a no-op on CPU
        device, dtype, backend, (D, F, E, K, T) = torch.device("cpu"), torch.float32, "aot_eager", (64, 32, 8, 2, 37)
    else:
        torch.cuda.set_device(local_rank)
        device, dtype, backend = torch.device("cuda", local_rank), torch.bfloat16, "inductor"
        D, F, E, K, T = 2048, 1408, 64, 6, args.tokens
    cfg = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=K, load_balance_coeff=1e-3)
    ep_mesh = None
    if world > 1:
        dist.init_process_group("gloo" if args.smoke else "nccl", device_id=None if args.smoke else device)
        ep_mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("ep",))
        set_spmd_meshes(dense_mesh=ep_mesh, sparse_mesh=ep_mesh)
    rank = dist.get_rank() if world > 1 else 0

    torch.manual_seed(0)  # the same full weights on every rank
    moe = MoE(cfg).to(device=device, dtype=dtype)
    state = {k: v.detach().clone() for k, v in moe.state_dict().items()}
    bf16_rows: dict[str, torch.nn.Module] = {}
    if args.fp8:  # the bf16 rows to beat: our eager layer and torchtitan's compiled one
        bf16_rows["spmdmoe bf16 eager"] = parallelize_moe(moe, ep_mesh=dist.group.WORLD) if world > 1 else moe
        bf16_rows["torchtitan bf16 compiled"] = build_torchtitan(cfg, state, dtype, device, ep_mesh)
        moe = MoE(dataclasses.replace(cfg, expert_precision="fp8_rowwise")).to(device=device, dtype=dtype)
        moe.load_state_dict(state)
    ours = parallelize_moe(moe, ep_mesh=dist.group.WORLD) if world > 1 else moe
    tt_eager, tt_comp = (build_torchtitan(cfg, state, dtype, device, ep_mesh, args.fp8) for _ in range(2))
    tag = " FP8" if args.fp8 else ""
    gen = torch.Generator(device=device).manual_seed(1 + rank)
    x = torch.randn(T, D, device=device, dtype=dtype, generator=gen).requires_grad_()
    g = torch.randn(T, D, device=device, dtype=dtype, generator=gen)

    def titan(m: torch.nn.Module) -> Fwd:
        return lambda t: m(t.view(1, T, D)).view(T, D)  # it takes (B, L, D)

    # name -> (forward, the module whose grads a step resets); a compiled one compiles on its first step
    cands: dict[str, tuple[Fwd, torch.nn.Module]] = {f"spmdmoe{tag} eager": (ours, ours)}
    failed: dict[str, str] = {}
    for fullgraph in (True, False):
        ours_c = torch.compile(ours, fullgraph=fullgraph, backend=backend)
        if (err := first_step(ours_c, x, g)) is None:
            cands[f"spmdmoe{tag} compiled ({'fullgraph' if fullgraph else 'graph breaks'})"] = (ours_c, ours)
            break
        if rank == 0:
            print(f"spmdmoe compiled, fullgraph={fullgraph}: {err}", flush=True)
    else:
        failed[f"spmdmoe{tag} compiled"] = f"does not compile: {err}"
    if args.fp8:  # as a training step pays it: the weights change every step, so they are quantized every step
        caches = [m.fp8_cache for m in ours.modules() if getattr(m, "fp8_cache", None) is not None]

        def requantized(t: torch.Tensor) -> torch.Tensor:
            for cache in caches:
                cache.invalidate()
            return ours(t)
        cands[f"spmdmoe{tag} eager, weights quantized every step"] = (requantized, ours)
    # gloo (smoke) lacks the uneven list all_to_all of its default backend: the functional one there
    tt_eager_fwd = on_backend("partial_dtensor", titan(tt_eager)) if args.smoke and world > 1 else titan(tt_eager)
    cands[f"torchtitan{tag} eager"] = (tt_eager_fwd, tt_eager)
    tt_comp.compile(fullgraph=True, backend=backend)
    name, tt_fwd = f"torchtitan{tag} compiled", titan(tt_comp)
    if (err := first_step(tt_fwd, x, g)) is not None and world > 1:
        failed[name] = f"does not compile: {err}"
        name, tt_fwd = "torchtitan compiled, partial_dtensor backend", on_backend("partial_dtensor", tt_fwd)
        err = first_step(tt_fwd, x, g)
    if err is None:
        cands[name] = (tt_fwd, tt_comp)
    else:
        failed[name] = f"does not compile: {err}"
    for name, module in bf16_rows.items():
        if "compiled" in name:
            module.compile(fullgraph=True, backend=backend)
        fwd = titan(module) if name.startswith("torchtitan") else module
        if (err := first_step(fwd, x, g)) is None:
            cands[name] = (fwd, module)
        else:
            failed[name] = f"does not run: {err}"

    x.grad = None
    y_ref = tt_eager_fwd(x)
    y_ref.backward(g)
    ref = (y_ref.detach(), x.grad.detach().clone())
    # FP8 rows carry about 24 dB of quantization noise each (and the two sides round scales differently)
    tolerance = TOLERANCE_FP8 if args.fp8 else TOLERANCE
    checks = {n: compare(fwd, ref, x, g, tolerance) for n, (fwd, _) in cands.items() if n != f"torchtitan{tag} eager"}
    for n, (abs_err, rel_err, off) in checks.items() if rank == 0 else ():
        print(f"{n} vs torchtitan{tag} eager (output, input grad): max abs diff {abs_err:.3g}, rel error "
              f"{rel_err:.3g}, rows off by > {tolerance}: {off:.3%}", flush=True)
    if bad := {n: c for n, c in checks.items() if not c[2] <= ROWS_OFF}:
        sys.exit(f"vs_torchtitan: more than {ROWS_OFF:.0%} of rows differ from torchtitan eager's beyond relative "
                 f"error {tolerance}: {bad} (max abs, rel, fraction of rows): not the same layer; not timing it")

    if args.smoke:
        if rank == 0:
            print(f"OK: smoke, world {world}, candidates {list(cands)}, failed {failed or 'none'}", flush=True)
    else:
        def step_of(fwd: Fwd, module: torch.nn.Module) -> Callable[[], None]:
            def step() -> None:  # as in training: gradients start from None (no accumulation add)
                x.grad = None
                module.zero_grad(set_to_none=True)
                fwd(x).backward(g)
            return step

        steps = {n: step_of(fwd, module) for n, (fwd, module) in cands.items()}
        t = timed(steps, args.iters, args.reps)
        mem = {n: peak_gib(step, [ours, tt_eager, tt_comp, *bf16_rows.values()], x) for n, step in steps.items()}
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        head = (f"device: {world}x {torch.cuda.get_device_name()}, torch {torch.__version__}, torchtitan "
                f"{importlib.metadata.version('torchtitan')}, {date}, "
                f"`torchrun --nproc-per-node {world} {' '.join(sys.argv)}`\n"
                f"{'FP8 rowwise experts' if args.fp8 else 'bf16'}, D={D} F={F} E={E} K={K} T/rank={T}, EP={world}")
        refs = (("spmdmoe bf16 eager", "torchtitan bf16 compiled", "torchtitan FP8 compiled", "torchtitan FP8 eager")
                if args.fp8 else ("torchtitan compiled", "torchtitan eager"))
        if rank == 0:
            report(table(head, T, t, mem, failed, checks, refs, tolerance), args.out)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
