"""spmdmoe's MoE layer next to torchtitan 0.3.0's, bf16 and FP8, eager and compiled, at one model shape per run.

    torchrun --nproc-per-node 1 benchmarks/vs_torchtitan.py --shape dsmoe16b [--out FILE]
    torchrun --nproc-per-node N benchmarks/vs_torchtitan.py --shape dsmoe16b --precision bf16   # N > 1: EP
    torchrun --nproc-per-node 2 benchmarks/vs_torchtitan.py --smoke     # CPU (gloo), tiny, no timing
    torchrun --nproc-per-node 2 benchmarks/vs_torchtitan.py --precision bf16 --profile FILE  # + our top CUDA ops
    torchrun --nproc-per-node 2 benchmarks/vs_torchtitan.py --precision bf16 --eager-only --shared 2  # quick: EP vs one GPU

Shapes (``--shape``, ``benchmarks/shapes.py``): dsmoe16b (2048 / 1408 / 64 / 6, 16k tokens), dsmoe16b-64k,
qwen3-30b (2048 / 768 / 128 / 8), qwen3-235b (4096 / 1536 / 128 / 8), dsv3-ep8 (7168 / 2048 / 32 / 8: one
EP-8 rank's 32 experts taking all 16k x 8 copies); ``--tokens`` overrides T. torchtitan is a benchmark-only
extra (``pip install --no-deps .whl/*.whl``: torchtitan, spmd_types, torchao, tyro, docstring_parser,
typeguard); without it the script says so and exits 0.

Both layers: same weights and inputs, bf16 activations, softmax scores, no shared experts (``--shared S``: S
of the routed experts' hidden size each, in both),
``load_balance_coeff`` set (the bias update is not timed), the gate GEMM in fp32, T tokens per rank.
N = 1: both on one GPU. N > 1: EP over all ranks (ours: ``parallelize_moe(ep_mesh=world)``; torchtitan's:
its all-to-all dispatcher wired to a 1-D "ep" mesh, each rank holding its slice of the experts).
Every candidate is timed in ONE rotation (``timing.timed``: interleaved, median of reps, max over ranks):

* spmdmoe bf16 / FP8 (``expert_precision="fp8_rowwise"``), eager and compiled (``torch.compile(layer,
  fullgraph=True)``; "graph breaks": fullgraph raised, so compiled without it);
* torchtitan bf16 / FP8, eager and compiled as torchtitan compiles a block (``fullgraph=True``,
  ``capture_scalar_outputs=True``, set for all rows). Its FP8: ``Float8GroupedExpertsConverter`` (torchao
  0.18's ``Float8TrainingOpConfig``: dynamic rowwise scales rounded to powers of two, fast accumulation
  in all three GEMMs, token groups padded to 16 by its dispatcher), with bf16 parameters (what FSDP2's
  bf16 ``param_dtype`` hands a block); it has no weight cache: it quantizes the weights every call.
  Where compiling fails (EP under its default ``spmd_types`` backend) the reason is shown and the
  compiled row runs under its ``partial_dtensor`` backend.

At N > 1 also our bf16 layer compiled with inductor's comm reordering passes
(``reorder_for_compute_comm_overlap``, off by default: may independent compute such as the shared experts
run under the all-to-alls?), our bf16 layer with ``ep_mode="sync_free"`` as a user's first call writes it (no
``max_tokens``: its first forward sizes the buffers), eager and compiled (its transport named in the row:
``SymmetricTransport`` on one NCCL host), and our bf16 and FP8 (cached) layers with all E experts on each GPU, run
eagerly on the rank's own T tokens with no EP (no collective): the one-GPU layer at the same tokens per
GPU, timed in the same rotation, so the table ends with EP's cost against one GPU (issue 42's gates).

Also in the rotation: our FP8 layer with the weight-gradient precision ``fp8_wgrad="auto"`` did not pick
(eager, compiled), and with ``--base DIR`` an older spmdmoe (``benchmarks/base_copy.sh``: bf16 eager and
compiled, FP8 cached eager and compiled), so a change is measured against the code before it in one process.

Each FP8 figure of ours comes under two weight policies, each on its own layer (own cache):
(a) "weights changed every step": one weight element is flipped in place before every step (what an
optimizer step does to the bytes), so the cache re-quantizes every step, fingerprint included: what a
training step costs without gradient accumulation; "(a) no cache" is the same with ``fp8_cache = None``
(quantized every call, no fingerprint: ``fully_shard_moe``'s setting, and the cheaper choice when weights
change every step); (b) "cached": the weights do not change between calls (micro-batches under
gradient accumulation, recomputes). Columns: fwd+bwd ms; step peak GiB (the most one step allocates
above what was allocated before it: weights, inputs and the FP8 cache excluded, gradients included; max
over ranks); persistent FP8 GiB (the cache: two e4m3 layouts of every weight and their scales); ratios.

Before timing, every candidate's output, input gradient and parameter gradients are compared with
torchtitan bf16 eager's on the same input (each candidate's gradients set to None first). Output and input
gradient: max abs diff, relative error ||diff|| / ||ref||, and the fraction of token rows whose own
relative error exceeds 2e-2 (bf16) or 0.25 (FP8: about 24 dB of quantization noise; gross errors only;
a row can flip experts on a near-tie, which fp32 gate GEMMs of other summation orders break
differently). Parameter gradients, matched by role (torchtitan's names read as ours, ``from_torchtitan``:
the router's gate, each expert weight, the shared experts' weights), each rank's own experts (a layer holding
all E experts on every rank, the one-GPU rows, has its expert gradients summed over the ranks first, as EP
sums them): the relative error ||diff|| / ||ref|| of every parameter, which must stay within 5e-2 (bf16) or
0.25 (FP8: the weight gradients' 21 dB gate, ``fp8_numerics.py``, is about 0.09; gross errors only), and
the fraction of units (each expert's slice of an expert weight, every other parameter whole) whose own
relative error exceeds that tolerance (one expert's gradient moves by about 1 / sqrt(its rows) when a row
flips). A gradient missing (None) counts as zeros, so a candidate that skips weight-gradient work is off by
1. With more than 1 % of rows off, a parameter off, or more than 1 % of units off, the run stops.

Then the ceiling table, on the same GPU in the same run (N = 1, CUDA): the device-to-device copy
bandwidth; each of the experts' six GEMMs (``benchmarks/expert_gemms.py``) in bf16 and in FP8 on the group
sizes this layer routed (the GEMMs alone, operands prepared); and the best FP8 / bf16 step ratio the
physics allows: ``best FP8 step = ours bf16 eager step - bf16 GEMMs + FP8 GEMMs + FP8-only bytes / copy
bandwidth``, where the FP8-only bytes are the least any FP8 path must move beyond bf16's (N = T * K):
every FP8 operand written once, 1 byte per element, by the kernel that produces its source (no re-read),
except ``x``, read once more and quantized once per token: ``3 T D + N (3 D + 6 F)`` bytes (rowwise
``x``; rowwise and per-group colwise ``h``, ``dy``, ``dh13``; colwise ``x``), plus their fp32 scales;
with the weights quantized every step (a), plus ``12 e F D`` (the weights read once, two e4m3 layouts
written).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib.metadata
import os
import sys
import traceback
import warnings
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from expert_gemms import gemms, operands
from older import config_in
from shapes import SHAPES, Shape
import spmdmoe
from spmdmoe.moe import MoE, MoEConfig, parallelize_moe
from spmdmoe.moe.checkpoint import from_torchtitan, to_torchtitan
from spmdmoe.moe.experts.fp8 import fp8_wgrad
from timing import kernel_table, report, timed

Fwd = Callable[[torch.Tensor], torch.Tensor]
TOLERANCE = 2e-2  # relative error of one row (output or input gradient) in bf16
TOLERANCE_FP8 = 0.25  # the same for FP8 rows against the bf16 reference (gross errors only)
GRAD_TOLERANCE = 5e-2  # relative error of one parameter gradient unit (an expert's slice, or a parameter) in bf16
GRAD_TOLERANCE_FP8 = 0.25  # the same for FP8 candidates against the bf16 reference (gross errors only)
ROWS_OFF = 1e-2  # fraction of rows, and of gradient units, allowed beyond them (routing flips on near-ties)
EXPERT_WEIGHTS = ("experts.w1", "experts.w2", "experts.w3")  # our names; (E or E / EP, ...) each


class Candidate(NamedTuple):
    fwd: Fwd
    module: torch.nn.Module  # whose gradients a step resets
    fp8: bool
    before: Optional[Callable[[], None]] = None  # run before every step (policy (a): change the weights)
    cache_gib: float = 0.0  # persistent FP8 weight bytes


def torchtitan_ready(script: str) -> bool:
    """Whether torchtitan imports (if not, ``script`` says so: nothing measured); on torch 2.11, which lacks
    ``torch.compiler._is_non_strict_tracing``, a stand-in for it (torchtitan's EP dispatcher calls it)."""
    try:
        import torchtitan.distributed.spmd_types  # noqa: F401
    except ImportError as exc:
        print(f"{script}: torchtitan is not importable ({exc}); install the benchmark extra with "
              "`pip install --no-deps .whl/*.whl`. Nothing measured.", flush=True)
        return False
    if not hasattr(torch.compiler, "_is_non_strict_tracing"):
        torch.compiler._is_non_strict_tracing = lambda: False  # type: ignore[attr-defined]
    return True


def build_torchtitan(cfg: MoEConfig, state: dict[str, torch.Tensor], dtype: torch.dtype,
                     device: torch.device, ep_mesh: Any, fp8: bool = False) -> torch.nn.Module:
    """torchtitan's MoE with ``state`` (our names) loaded, parameters in ``dtype``, buffers fp32; ``fp8``: its
    experts converted by ``Float8GroupedExpertsConverter`` (torchao's rowwise FP8 grouped GEMMs)."""
    from torchtitan.models.common.config_utils import (make_ffn_config, make_moe_config, make_routed_experts_config,
                                                       make_router_config)
    from torchtitan.models.common.param_init import skip_param_init  # every weight is loaded below

    E, D, F, K = cfg.num_experts, cfg.dim, cfg.hidden_dim, cfg.top_k
    tt_cfg = make_moe_config(
        num_experts=E, load_balance_coeff=cfg.load_balance_coeff,
        shared_experts=make_ffn_config(dim=D, hidden_dim=cfg.num_shared_experts * F,
                                       w1_param_init={"weight": skip_param_init},
                                       w2w3_param_init={"weight": skip_param_init}) if cfg.num_shared_experts else None,
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
    # parameters in dtype, buffers kept fp32. Not `p.data = p.data.to(dtype)`: on torchao's FP8 weight wrappers
    # that leaves the wrapper's dtype and its data's apart, and Dynamo then fails with "bf16 != fp32"
    buffers = {n: b.dtype for n, b in moe.named_buffers()}
    moe.to(dtype)
    for name, b in list(moe.named_buffers()):
        owner, _, leaf = name.rpartition(".")
        moe.get_submodule(owner)._buffers[leaf] = b.to(buffers[name])
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


def first_step(fwd: Fwd, xs: tuple[torch.Tensor, ...], g: torch.Tensor) -> Optional[str]:
    """A fwd+bwd on each of ``xs`` (the first compiles a compiled candidate; the next routes otherwise, so a
    size the compiled graph specialised on the first step's routing fails here, as a user's second batch would,
    not in the timing): None, or the first line of the error of some rank (``first_error``)."""
    def fwd_bwd(x: torch.Tensor) -> None:
        x.grad = None
        fwd(x).backward(g)
    return first_error([functools.partial(fwd_bwd, x) for x in xs])


def first_error(calls: list[Callable[[], object]]) -> Optional[str]:
    """``calls`` in order: None, or the first line of the first error of some rank (each rank's agreed). A
    failing candidate is a row of the table, and the run goes on (the failures seen so far raised on every rank
    alike: compile errors, and a compiled peer's size assertion; one raised on some ranks only, while the others
    wait in a collective, would hang until the NCCL timeout: out of memory, which routing can cause on one rank
    alone, is raised, not caught)."""
    error = None
    try:
        for call in calls:
            call()
    except torch.cuda.OutOfMemoryError:  # may hit one rank only (its routing): the run ends, no rank left waiting
        raise
    except Exception as exc:  # noqa: BLE001 - the row's result
        error = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"[:200]
        traceback.print_exc(limit=-12, file=sys.stderr)  # the row shows one line; the log keeps where it came from
    if dist.is_initialized():
        errors: list[Optional[str]] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e), None)
    return error


def plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain tensor: a DTensor's local shard; a wrapper subclass's (torchao's FP8 weights) inner tensor of
    the same shape, where it has one."""
    if isinstance(t, DTensor):
        return t.to_local()
    while type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        inner = [x for x in (getattr(t, n) for n in t.__tensor_flatten__()[0]) if x.shape == t.shape]
        if not inner:
            break
        t = inner[0]
    return t


def param_grads(module: torch.nn.Module, num_experts: int, copy: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter's gradient under our names (torchtitan's read as ours, ``from_torchtitan``), the expert
    weights' as this rank's slice of ``E / world`` experts (what EP holds): a layer holding all ``E`` experts on
    each of several ranks (a one-GPU row) has its expert gradients summed over the ranks first, in fp32, as EP's
    are (a collective: every rank calls this for the same modules in the same order). A missing gradient (None)
    is zeros. The gradients themselves (no copy: compared at once, as ``compare`` does), or ``copy``: copies in
    their own dtype (the reference's, kept while the other candidates step)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    out = {}
    for name, p in from_torchtitan(dict(module.named_parameters())).items():
        g = torch.zeros(p.shape, device=p.device, dtype=p.dtype) if p.grad is None else plain(p.grad).detach()
        if world > 1 and name.endswith(EXPERT_WEIGHTS) and p.shape[0] == num_experts:
            g = g.float()  # a copy
            dist.all_reduce(g)
            e = num_experts // world
            g = g[dist.get_rank() * e:(dist.get_rank() + 1) * e]
        out[name] = g.clone() if copy else g
    return out


def relative(dn: torch.Tensor, bn: torch.Tensor) -> torch.Tensor:
    """||diff|| / ||ref||, elementwise; 0 / 0 is 0 (equal), x / 0 is inf."""
    return torch.where(bn > 0, dn / bn.clamp_min(torch.finfo(bn.dtype).tiny), torch.where(dn > 0, torch.inf, 0.0))


def grad_errors(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], tolerance: float) -> list[float]:
    """Parameter gradients against ``ref`` (``param_grads``): [the largest ||diff|| / ||ref|| of one parameter,
    the largest of one unit, the fraction of units whose own relative error exceeds ``tolerance``]. Units: each
    expert's slice of an expert weight, every other parameter whole; a parameter missing on one side, or of
    another shape, is off in every unit (relative error inf)."""
    worst_param, worst_unit, units, off = 0.0, 0.0, 0, 0
    for name in sorted(set(grads) | set(ref)):
        a, b = grads.get(name), ref.get(name)
        n = b.shape[0] if b is not None and name.endswith(EXPERT_WEIGHTS) else 1
        if a is None or b is None or a.shape != b.shape:
            worst_param = worst_unit = float("inf")
            units, off = units + n, off + n
            continue
        a, b = a.float(), b.float()  # one parameter at a time in fp32
        d = a - b
        worst_param = max(worst_param, relative(d.norm(), b.norm()).item())
        dn, bn = (d.flatten(1).norm(dim=1), b.flatten(1).norm(dim=1)) if n > 1 else (d.norm().view(1), b.norm().view(1))
        worst_unit = max(worst_unit, relative(dn, bn).max().item())
        off += int((~(dn <= tolerance * bn)).sum())  # NaN counts as off
        units += n
    return [worst_param, worst_unit, off / max(units, 1)]


def compare(c: Candidate, ref: tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], x: torch.Tensor,
            g: torch.Tensor, num_experts: int) -> list[float]:
    """One step of ``c`` (its gradients set to None first) against ``ref`` (output, input gradient, parameter
    gradients): [max abs diff, ||diff|| / ||ref||, fraction of rows whose own relative error exceeds the row
    tolerance], each the max over output and input gradient; then ``grad_errors`` of its parameter gradients
    (the gradient tolerance); every figure the max over ranks."""
    c.module.zero_grad(set_to_none=True)
    x.grad = None
    y = c.fwd(x)
    y.backward(g)
    tolerance = TOLERANCE_FP8 if c.fp8 else TOLERANCE
    out = torch.zeros(3, dtype=torch.float64, device=x.device)
    for a, b in ((y.detach().float(), ref[0].float()), (x.grad.float(), ref[1].float())):
        d = a - b
        rows_off = (~(d.norm(dim=1) <= tolerance * b.norm(dim=1))).double().mean()  # NaN counts as off
        out = torch.maximum(out, torch.stack([d.abs().max(), d.norm() / b.norm(), rows_off]).double())
    grads = grad_errors(param_grads(c.module, num_experts), ref[2], GRAD_TOLERANCE_FP8 if c.fp8 else GRAD_TOLERANCE)
    out = torch.cat([out, torch.tensor(grads, dtype=torch.float64, device=x.device)])
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


def table(head: str, T: int, t: dict[str, float], mem: dict[str, float], cands: dict[str, Candidate],
          failed: dict[str, str], checks: dict[str, list[float]]) -> str:
    refs = [r for r in ("spmdmoe bf16 eager", "torchtitan bf16 compiled", "torchtitan FP8 compiled") if r in t]
    worst = {fp8: [max(c) for c in zip(*(c for n, c in checks.items() if cands[n].fp8 == fp8))] or None
             for fp8 in (False, True)}  # each figure's worst over the candidates of that precision
    agreement = "; ".join(f"{'FP8' if fp8 else 'bf16'} rows vs torchtitan bf16 eager (output, input grad): rel error "
                          f"<= {c[1]:.2g}, rows off by > {TOLERANCE_FP8 if fp8 else TOLERANCE}: <= {c[2]:.2%}; "
                          f"parameter gradients: rel error <= {c[3]:.2g} (worst unit <= {c[4]:.2g}), units off by > "
                          f"{GRAD_TOLERANCE_FP8 if fp8 else GRAD_TOLERANCE}: <= {c[5]:.2%}"
                          for fp8, c in worst.items() if c is not None)
    lines = [head, agreement, "", "| candidate | fwd+bwd ms | tokens/s per GPU | step peak GiB | persistent FP8 GiB | "
             + " | ".join(f"speedup vs {r}" for r in refs) + " |", "|---|---|---|---|---|" + "---|" * len(refs)]
    lines += [f"| {n} | {ms:.3f} | {T / ms * 1e3:,.0f} | {mem[n]:.2f} | {cands[n].cache_gib:.2f} | "
              + " | ".join(f"{t[r] / ms:.2f}" for r in refs) + " |" for n, ms in t.items()]
    return "\n".join(lines + [f"| {n} | {why} |" + " |" * (3 + len(refs)) for n, why in failed.items()])


ONE_GPU_BF16 = "spmdmoe bf16 eager, one GPU (all experts here, no EP)"
ONE_GPU_FP8 = "spmdmoe FP8 eager, cached (b), one GPU (all experts here, no EP)"
SYNC_FREE_BF16 = "spmdmoe bf16 eager, ep_mode='sync_free'"
ONE_NODE_BF16 = "spmdmoe bf16 eager, experts' weight gradients in their input gradient's node"


def against_one_gpu(world: int, t: dict[str, float]) -> str:
    """EP against the same layer on one GPU at the same tokens per GPU (issue 42's gates: EP 2 bf16 at most
    1.25x, goal 1.15x; FP8 / bf16 under EP at least what it is on one GPU), from the same rotation."""
    lines = []
    free = [n for n in t if n.startswith(SYNC_FREE_BF16)]
    same = ((ONE_GPU_BF16, "bf16", ("spmdmoe bf16 eager", *free, ONE_NODE_BF16, "spmdmoe bf16 compiled (fullgraph)")),
            (ONE_GPU_FP8, "FP8 cached (b)", ("spmdmoe FP8 eager, cached (b)", "spmdmoe FP8 compiled, cached (b) (fullgraph)")))
    for one, precision, names in same:  # each precision against its own one-GPU row (--precision runs one)
        for n in names:
            if one in t and n in t:
                lines.append(f"{n} / one GPU's {precision} eager: {t[n] / t[one]:.3f}x the time")
    if ONE_NODE_BF16 in t and "spmdmoe bf16 eager" in t:
        lines.append(f"the up-projection's weight gradients under dx's exchange (wgrad_later.py): "
                     f"{t[ONE_NODE_BF16] / t['spmdmoe bf16 eager']:.3f}x faster than in one node")
    pairs = (t.get("spmdmoe bf16 eager"), t.get("spmdmoe FP8 eager, cached (b)"), t.get(ONE_GPU_BF16), t.get(ONE_GPU_FP8))
    if all(pairs):
        ep_bf16, ep_fp8, one_bf16, one_fp8 = pairs
        lines.append(f"FP8 cached (b) speedup over bf16, eager: EP {world} {ep_bf16 / ep_fp8:.3f}x, "
                     f"one GPU {one_bf16 / one_fp8:.3f}x")
    return f"EP {world} against one GPU (same rotation, {world} ranks each running the one-GPU layer on its own "\
        "tokens):\n" + "\n".join(lines or ["(no one-GPU row)"])


def copy_tbps() -> float:
    """Device-to-device copy bandwidth (bytes read + written) of a 2 GiB bf16 buffer, TB/s."""
    a = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    ms = timed({"copy": lambda: b.copy_(a)}, 10, 15)["copy"]
    return 2 * a.numel() * a.element_size() / ms / 1e9


def ceilings(shape: Shape, sizes: list[int], t_bf16: float, t_fp8: dict[str, float], iters: int, reps: int) -> str:
    """The ceiling table (module docstring): copy bandwidth, the six GEMMs in bf16 and FP8, best FP8/bf16."""
    D, F, T, K = shape.D, shape.F, shape.T, shape.K
    e, N = len(sizes), sum(sizes)
    bw = copy_tbps()
    calls = gemms(operands(D, F, sizes, "cuda", seed=1))
    fns = {f"{name} {p}": fn for name, (_, bf16, fp8) in calls.items() for p, fn in (("bf16", bf16), ("fp8", fp8))}
    t = timed(fns, iters, reps)
    flops = {"forward up": 4, "forward down": 2, "dgrad down": 2, "dgrad up": 4, "wgrad down": 2, "wgrad up": 4}
    lines = [f"Ceilings on this GPU (same run): copy {bw:.2f} TB/s; the experts' GEMMs alone on this routing "
             f"(N = {N} rows in {e} groups, sizes {min(sizes)}..{max(sizes)})", "",
             "| GEMM | kind | bf16 ms | FP8 ms | bf16 / FP8 | bf16 TFLOP/s | FP8 TFLOP/s |", "|---|---|---|---|---|---|---|"]
    for name, (kind, _, _) in calls.items():
        fl = next(v for k, v in flops.items() if name.startswith(k)) * N * D * F
        a, b = t[f"{name} bf16"], t[f"{name} fp8"]
        lines.append(f"| {name} | {kind} | {a:.3f} | {b:.3f} | {a / b:.2f} | {fl / a / 1e9:.0f} | {fl / b / 1e9:.0f} |")
    sum_bf16 = sum(v for k, v in t.items() if k.endswith("bf16"))
    sum_fp8 = sum(v for k, v in t.items() if k.endswith("fp8"))
    # FP8 forward and dgrad GEMMs with the weight gradients unquantized (fp8_wgrad="bf16")
    sum_mixed = sum(v for k, v in t.items() if k.endswith("fp8") != k.startswith("wgrad"))
    bytes_b = 3 * T * D + N * (3 * D + 6 * F) + 4 * (T + 3 * N) + 4 * e * (2 * D + 3 * F)
    bytes_mixed = 3 * T * D + N * (2 * D + 3 * F) + 4 * (T + 3 * N)  # rowwise x, h, dy, dh13 only
    bytes_a = bytes_b + 12 * e * F * D
    lines += [f"| all six | | {sum_bf16:.3f} | {sum_fp8:.3f} | {sum_bf16 / sum_fp8:.2f} | | |", "",
              "| weights | FP8-only bytes (floor) | their time at copy bandwidth ms | best FP8 step ms | "
              "best FP8 / bf16 (speedup) | measured: ours FP8 eager (b: cached, a: no cache), ms (vs ours bf16 eager) |",
              "|---|---|---|---|---|---|"]
    for label, nbytes, key, gemm_ms in (("cached (b)", bytes_b, "b", sum_fp8),
                                        ("quantized every step (a)", bytes_a, "a", sum_fp8),
                                        ("cached (b), wgrad bf16", bytes_mixed, "b bf16 wgrad", sum_mixed)):
        best = t_bf16 - sum_bf16 + gemm_ms + nbytes / bw / 1e9
        got = t_fp8.get(key)
        measured = f"{got:.3f} ({t_bf16 / got:.2f}x)" if got else "–"
        lines.append(f"| {label} | {nbytes / 2**30:.2f} GiB | {nbytes / bw / 1e9:.3f} | {best:.3f} | "
                     f"{t_bf16 / best:.2f}x | {measured} |")
    lines.append(f"(bf16 step: ours bf16 eager, {t_bf16:.3f} ms. Without the FP8-only bytes, the GEMMs alone bound "
                 f"the step at {t_bf16 - sum_bf16 + sum_fp8:.3f} ms, {t_bf16 / (t_bf16 - sum_bf16 + sum_fp8):.2f}x.)")
    return "\n".join(lines)


def routed_sizes(layer: torch.nn.Module, x: torch.Tensor) -> list[int]:
    """The rows per local expert of one forward of ``layer`` on ``x`` (a host read: benchmark set-up only)."""
    seen: dict[str, Any] = {}

    def grab(module: torch.nn.Module, args: tuple, out: Any) -> None:  # returning a value would replace the output
        seen["offs"] = args[0].group_offsets
    hook = layer.experts.register_forward_hook(grab)
    with torch.no_grad():
        layer(x)
    hook.remove()
    ends = seen["offs"].tolist()
    return [b - a for a, b in zip([0, *ends[:-1]], ends)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="dsmoe16b", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=None, help="override the shape's tokens per rank")
    ap.add_argument("--precision", default="both", choices=["both", "bf16", "fp8"])
    ap.add_argument("--shared", type=int, default=0, help="shared experts (of the routed experts' hidden size) in "
                    "both layers: the model's 2 at dsmoe16b")
    for flag, default in (("--reps", 15), ("--iters", 5)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--eager-only", action="store_true", help="no compiled candidate (ours or torchtitan's): a "
                    "quick run of the eager rows, e.g. EP against one GPU")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", default=None, help="write rank 0's top CUDA ops of each timed spmdmoe (and "
                    "base) candidate here (eager against compiled: where a compiled step's time goes)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny dims, fp32, compile with aot_eager, no timing")
    ap.add_argument("--base", default=None, help="a folder holding `spmdmoe_base`, an older spmdmoe renamed "
                    "(benchmarks/base_copy.sh): its bf16 and FP8 layers (eager, compiled) join the rotation")
    args = ap.parse_args()
    if not torchtitan_ready("vs_torchtitan"):
        return
    from torchtitan.distributed.spmd_types import set_spmd_meshes

    torch._dynamo.config.capture_scalar_outputs = True  # as torchtitan's trainer sets it
    torch._dynamo.config.cache_size_limit = 64  # several layers of one class compiled in one process

    world, local_rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", "0"))
    shape = SHAPES[args.shape]
    if args.smoke:
        warnings.filterwarnings("ignore", message="In CPU autocast")  # its fp32 gate autocast: a no-op on CPU
        device, dtype, backend = torch.device("cpu"), torch.float32, "aot_eager"
        shape = Shape(64, 32, 8, 2, 37, "smoke")
    else:
        torch.cuda.set_device(local_rank)
        device, dtype, backend = torch.device("cuda", local_rank), torch.bfloat16, "inductor"
    if args.tokens:
        shape = shape._replace(T=args.tokens)
    D, F, E, K, T = shape.D, shape.F, shape.E, shape.K, shape.T
    cfg = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=K, load_balance_coeff=1e-3,
                    num_shared_experts=args.shared)
    ep_mesh = None
    if world > 1:
        dist.init_process_group("gloo" if args.smoke else "nccl", device_id=None if args.smoke else device)
        ep_mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("ep",))
        set_spmd_meshes(dense_mesh=ep_mesh, sparse_mesh=ep_mesh)
    rank = dist.get_rank() if world > 1 else 0
    precisions = {"both": (False, True), "bf16": (False,), "fp8": (True,)}[args.precision]

    torch.manual_seed(0)  # the same full weights on every rank
    state = {k: v.detach().clone() for k, v in MoE(cfg).to(device=device, dtype=dtype).state_dict().items()}

    def ours(precision: str, cache: bool = True, lib: Any = None, ep: bool = True, sync_free: bool = False,
             **extra: Any) -> torch.nn.Module:
        if lib is None:
            m = MoE(dataclasses.replace(cfg, expert_precision=precision, **extra)).to(device=device, dtype=dtype)
        else:  # the older copy: its own config class
            m = lib.MoE(config_in(lib, cfg, expert_precision=precision)).to(device=device, dtype=dtype)
        m.load_state_dict(state)
        if not cache:
            m.experts.fp8_cache = None
        if world == 1 or not ep:
            return m
        parallel = parallelize_moe if lib is None else lib.parallelize_moe  # the older copy's own, at EP > 1
        return parallel(m, ep_mesh=dist.group.WORLD, **(dict(ep_mode="sync_free") if sync_free else {}))  # no sizes

    def titan(m: torch.nn.Module) -> Fwd:
        return lambda t: m(t.view(1, T, D)).view(T, D)  # it takes (B, L, D)

    def flipper(layer: torch.nn.Module) -> Callable[[], None]:
        one = layer.experts.w2[:1, :1, :1]  # one element, flipped in place: new bytes, as an optimizer step makes

        def flip() -> None:
            with torch.no_grad():
                one.neg_()
        return flip

    gen = torch.Generator(device=device).manual_seed(1 + rank)
    x = torch.randn(T, D, device=device, dtype=dtype, generator=gen).requires_grad_()
    g = torch.randn(T, D, device=device, dtype=dtype, generator=gen)
    x2 = torch.randn(T, D, device=device, dtype=dtype, generator=gen).requires_grad_()  # a second batch: other routing
    xs = (x, x2)
    cands: dict[str, Candidate] = {}
    failed: dict[str, str] = {}

    def compiled(name: str, module: torch.nn.Module, fp8: bool, options: Optional[dict] = None, **extra: Any) -> None:
        if args.eager_only:
            return
        err = None
        for fullgraph in (True, False):
            fwd = torch.compile(module, fullgraph=fullgraph, backend=backend, options=options)
            if (err := first_step(fwd, xs, g)) is None:
                cands[f"{name} ({'fullgraph' if fullgraph else 'graph breaks'})"] = Candidate(fwd, module, fp8, **extra)
                return
            if rank == 0:
                print(f"{name}, fullgraph={fullgraph}: {err}", flush=True)
        failed[name] = f"does not compile: {err}"

    def titan_rows(fp8: bool) -> None:
        tag = "FP8" if fp8 else "bf16"
        try:
            tt = build_torchtitan(cfg, state, dtype, device, ep_mesh, fp8)
        except Exception as exc:  # noqa: BLE001 - e.g. its FP8 converter on a GPU without sm89
            failed[f"torchtitan {tag}"] = f"does not build: {type(exc).__name__}: {exc}"[:200]
            return
        eager = on_backend("partial_dtensor", titan(tt)) if args.smoke and world > 1 else titan(tt)
        cands[f"torchtitan {tag} eager"] = Candidate(eager, tt, fp8)
        if args.eager_only:
            return
        name, fwd = f"torchtitan {tag} compiled", titan(torch.compile(tt, fullgraph=True, backend=backend))
        if (err := first_step(fwd, xs, g)) is not None and world > 1:
            failed[name] = f"does not compile: {err}"
            name, fwd = f"torchtitan {tag} compiled, partial_dtensor backend", on_backend("partial_dtensor", fwd)
            err = first_step(fwd, xs, g)
        if err is None:
            cands[name] = Candidate(fwd, tt, fp8)
        else:
            failed[name] = f"does not compile: {err}"

    base = None
    if args.base:
        sys.path.insert(0, args.base)
        import spmdmoe_base.moe as base  # noqa: F811 - the older copy, under its own name and op namespace
    if False in precisions:
        bf16 = ours("bf16")
        cands["spmdmoe bf16 eager"] = Candidate(bf16, bf16, False)
        compiled("spmdmoe bf16 compiled", bf16, False)
        if world > 1 and not args.smoke:  # inductor may move independent compute (the shared experts) under the
            reordered = ours("bf16")      # all-to-alls: its comm reordering passes, off by default (issue 42)
            compiled("spmdmoe bf16 compiled, inductor comm reordering", reordered, False,
                     options={"reorder_for_compute_comm_overlap": True})
        if world > 1:  # the same layer, all E experts on this GPU, on this rank's own T tokens: no EP
            alone = ours("bf16", ep=False)
            cands[ONE_GPU_BF16] = Candidate(alone, alone, False)
            free = ours("bf16", sync_free=True)
            cands[f"{SYNC_FREE_BF16} ({type(free.transport).__name__})"] = Candidate(free, free, False)
            compiled(f"spmdmoe bf16 sync-free compiled ({type(free.transport).__name__})", free, False)
            joint = ours("bf16")  # the up-projection's weight gradients in its input gradient's node (one node):
            joint.experts.later_wgrad = lambda: None  # what running them under dx's exchange gains (wgrad_later.py)
            cands[ONE_NODE_BF16] = Candidate(joint, joint, False)
        if base is not None:
            old = ours("bf16", lib=base)
            cands["base bf16 eager"] = Candidate(old, old, False)
            compiled("base bf16 compiled", old, False)
            if world > 1:
                old_free = ours("bf16", lib=base, sync_free=True)
                cands["base bf16 eager, ep_mode='sync_free'"] = Candidate(old_free, old_free, False)
        titan_rows(False)
    if True in precisions:
        cached, changed, uncached = ours("fp8_rowwise"), ours("fp8_rowwise"), ours("fp8_rowwise", cache=False)
        gib = cached.experts.fp8_cache.nbytes() / 2**30
        cands["spmdmoe FP8 eager, cached (b)"] = Candidate(cached, cached, True, cache_gib=gib)
        cands["spmdmoe FP8 eager, weights changed every step (a)"] = Candidate(changed, changed, True, flipper(changed), gib)
        cands["spmdmoe FP8 eager, no cache (a)"] = Candidate(uncached, uncached, True)
        if world > 1:
            alone = ours("fp8_rowwise", ep=False)
            cands[ONE_GPU_FP8] = Candidate(alone, alone, True, cache_gib=alone.experts.fp8_cache.nbytes() / 2**30)
        compiled("spmdmoe FP8 compiled, cached (b)", cached, True, cache_gib=gib)
        compiled("spmdmoe FP8 compiled, weights changed every step (a)", changed, True, before=flipper(changed),
                 cache_gib=gib)
        other = "bf16" if fp8_wgrad(D, F, E // world, dtype) else "fp8"  # the weight-gradient precision "auto" did not pick
        forced = ours("fp8_rowwise", fp8_wgrad=other)
        cands[f"spmdmoe FP8 eager, cached (b), wgrad {other}"] = Candidate(forced, forced, True, cache_gib=gib)
        compiled(f"spmdmoe FP8 compiled, cached (b), wgrad {other}", forced, True, cache_gib=gib)
        if base is not None:
            old = ours("fp8_rowwise", lib=base)
            cands["base FP8 eager, cached (b)"] = Candidate(old, old, True, cache_gib=gib)
            compiled("base FP8 compiled, cached (b)", old, True, cache_gib=gib)
        titan_rows(True)

    ref_c = cands.get("torchtitan bf16 eager", next(iter(cands.values())))
    ref_c.module.zero_grad(set_to_none=True)  # the compile steps (first_step) left gradients on shared modules
    x.grad = None
    y_ref = ref_c.fwd(x)
    y_ref.backward(g)
    ref = (y_ref.detach(), x.grad.detach().clone(), param_grads(ref_c.module, E, copy=True))
    checks = {n: compare(c, ref, x, g, E) for n, c in cands.items() if c is not ref_c}
    for n, (abs_err, rel_err, off, grad_rel, unit_rel, units_off) in checks.items() if rank == 0 else ():
        print(f"{n} vs the reference (output, input grad): max abs diff {abs_err:.3g}, rel error {rel_err:.3g}, "
              f"rows off by > {TOLERANCE_FP8 if cands[n].fp8 else TOLERANCE}: {off:.3%}; parameter gradients: rel "
              f"error {grad_rel:.3g} (worst unit {unit_rel:.3g}), units off by > "
              f"{GRAD_TOLERANCE_FP8 if cands[n].fp8 else GRAD_TOLERANCE}: {units_off:.3%}", flush=True)
    if bad := {n: c for n, c in checks.items()
               if not (c[2] <= ROWS_OFF and c[3] <= (GRAD_TOLERANCE_FP8 if cands[n].fp8 else GRAD_TOLERANCE)
                       and c[5] <= ROWS_OFF)}:
        sys.exit(f"vs_torchtitan: more than {ROWS_OFF:.0%} of rows, or a parameter's gradient, or more than "
                 f"{ROWS_OFF:.0%} of gradient units, differ from the reference beyond their tolerance: {bad} (max abs, "
                 f"rel, fraction of rows; parameter gradients' worst rel, worst unit's rel, fraction of units): not "
                 f"the same layer; not timing it")

    if args.smoke:
        if rank == 0:
            print(f"OK: smoke, world {world}, candidates {list(cands)}, failed {failed or 'none'}", flush=True)
    else:
        def step_of(c: Candidate) -> Callable[[], None]:
            def step() -> None:  # as in training: gradients start from None (no accumulation add)
                if c.before is not None:
                    c.before()
                x.grad = None
                c.module.zero_grad(set_to_none=True)
                c.fwd(x).backward(g)
            return step

        steps = {n: step_of(c) for n, c in cands.items()}
        for n in list(steps):  # the warm-up, failures caught: a compiled peer failed on its 4th step (EP 2, torch 2.11)
            if (err := first_error([steps[n]] * 3)) is not None:
                failed[n] = f"fails in the warm-up steps: {err}"
                del steps[n]
        if not steps:
            sys.exit(f"vs_torchtitan: every candidate failed: {failed}")
        t = timed(steps, args.iters, args.reps)
        mem = {n: peak_gib(step, [c.module for c in cands.values()], x) for n, step in steps.items()}
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        head = (f"device: {world}x {torch.cuda.get_device_name()}, torch {torch.__version__}, torchtitan "
                f"{importlib.metadata.version('torchtitan')}, torchao {importlib.metadata.version('torchao')}, {date}, "
                f"`torchrun --nproc-per-node {world} {' '.join(sys.argv)}`\n"
                f"{shape.label()}: D={D} F={F} E={E} K={K} T/rank={T}, EP={world}; FP8 weight gradients "
                f"(fp8_wgrad=\"auto\"): {'FP8' if fp8_wgrad(D, F, E // world, dtype) else 'bf16'}")
        text = table(head, T, t, mem, cands, failed, checks)
        if world == 1 and "spmdmoe bf16 eager" in t:
            t_fp8 = {"b": t.get("spmdmoe FP8 eager, cached (b)"), "a": t.get("spmdmoe FP8 eager, no cache (a)")}
            auto_fp8 = fp8_wgrad(D, F, E, dtype)
            t_fp8["b bf16 wgrad"] = t_fp8["b"] if not auto_fp8 else t.get("spmdmoe FP8 eager, cached (b), wgrad bf16")
            if not auto_fp8:  # the pure-FP8 rows' measured figure is the forced-FP8 candidate
                t_fp8["b"] = t.get("spmdmoe FP8 eager, cached (b), wgrad fp8")
            text += "\n\n" + ceilings(shape, routed_sizes(cands["spmdmoe bf16 eager"].module, x), t["spmdmoe bf16 eager"],
                                      t_fp8, args.iters, args.reps)
        if world > 1:
            text += "\n\n" + against_one_gpu(world, t)
        if rank == 0:
            report(text, args.out)
        if args.profile:  # on every rank (the steps run collectives); rank 0 writes
            tables = [f"## {n}\n{kernel_table(step)}" for n, step in steps.items() if n.startswith(("spmdmoe", "base"))]
            if rank == 0:
                with open(args.profile, "w") as f:
                    f.write("\n\n".join(tables) + "\n")


if __name__ == "__main__":
    spmdmoe.shutdown(main())  # flush, tear the groups down, leave: no gloo exit abort
