"""Host cost of one MoE layer step (forward + backward, eager), ours next to torchtitan 0.3.0's MoE.

    torchrun --nproc-per-node 1 benchmarks/host_cost.py [--shape dsv3-debug] [--tokens 1024,4096,16384] [--out FILE]
    torchrun --nproc-per-node N benchmarks/host_cost.py ...     # EP over the N GPUs
    torchrun --nproc-per-node 2 benchmarks/host_cost.py --smoke # CPU (gloo), tiny: the op counts, no timing
    ... --ops                                                  # also each stage's host time op by op (profiler)

Per candidate and token count (T tokens a rank, bf16, the same weights; columns):

* host us: the host time to issue one step (``timing.issued_us``: each step from an idle device, timed to its
  return; candidates interleaved, median, max over ranks). A step that reads the host waits for the device there,
  and that wait counts. "host / GPU" near 1: the step is host-bound (the device waits for the launches);
* GPU ms: the step's time with the device waited for (``timing.timed``: CUDA events, candidates interleaved, median);
* launches: kernel launches and async copies/fills a step (the CUDA runtime and driver calls in ``torch.profiler``);
* ops: ATen ops dispatched a step (a ``TorchDispatchMode`` counting every op that reaches the kernels' level,
  autograd's included): on a GPU each is at least one launch or host work.
* idle: of five steps back to back, profiled on the device alone, the time a step's kernels leave the GPU idle
  (``timing.idle_gaps``; rank 0's) and where: the host left behind, or a read of the device waited for.

Candidates: torchtitan's MoE (its all-to-all dispatcher on an "ep" mesh at N > 1); ours ``parallelize_moe`` with
EP over the ranks, ``ep_mode`` "sync" and "sync_free" (as a user's first call writes it: no ``max_tokens``); at
N = 1 also the plain ``MoE`` (no parallel wrapper). The DeepSeek-V3 debug shape (``dsv3-debug``: 256 / 256 / 8 / 3,
two shared experts' worth of hidden units) is the torchtitan debug model's MoE; ``--shape dsmoe16b --tokens 4096``
the 16B shape at 4k tokens. On one GPU also the plain ``MoE`` graphed: ``torch.compile(mode="reduce-overhead")``
against the same layer eager, with each one's step peak memory.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import statistics
import sys
import time
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(__file__))
from shapes import SHAPES, Shape  # noqa: E402
from timing import idle_gaps, issued_us, report, timed  # noqa: E402
from vs_torchtitan import build_torchtitan, on_backend, torchtitan_ready  # noqa: E402

import spmdmoe  # noqa: E402
from spmdmoe.moe import MoE, MoEConfig, parallelize_moe  # noqa: E402

LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaMemcpyAsync",
            "cudaMemsetAsync")


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += 1
        return func(*args, **(kwargs or {}))


def ops_per_step(step: Callable[[], None]) -> int:
    step()
    with _Ops() as mode:
        step()
    return mode.count


def launches_per_step(step: Callable[[], None], steps: int = 3) -> float:
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.name in LAUNCHES) / steps


STAGES = ("admission.admit", "weights", "rows.gather", "_route", "_dispatch", "experts.forward", "_combine",
          "_shared", "rows.scatter", "admission.release")


@contextlib.contextmanager
def stages_wrapped(layer: torch.nn.Module, wrap: Callable[[str, Callable], Callable]) -> Iterator[None]:
    """Each of our layer's stage methods (``STAGES``) replaced by ``wrap(stage, method)`` for this measurement
    only (instance attributes, removed after: the class's methods again)."""
    wrapped = []
    for stage in STAGES:
        owner_name, _, attr = stage.rpartition(".")
        owner = getattr(layer, owner_name) if owner_name else layer
        wrapped.append((owner, attr))
        setattr(owner, attr, wrap(stage, getattr(owner, attr)))
    try:
        yield
    finally:
        for owner, attr in wrapped:
            delattr(owner, attr)


def with_wait(name: str, fn: Callable, around: Callable[[str, Callable], object]) -> Callable:
    """``fn`` called through ``around(name, call)``; for ``_combine`` its returned wait too (the combine's)."""
    def call(*a: object, **k: object) -> object:
        out = around(name, lambda: fn(*a, **k))
        if callable(out) and name == "_combine":
            wait = out
            return lambda: around(name + " wait", wait)
        return out
    return call


def stage_us(layer: torch.nn.Module, x: torch.Tensor, g: torch.Tensor, steps: int = 30) -> dict[str, float]:
    """Host us a step by stage of our layer's forward (``layer.py``'s ``forward`` / ``_moe``; ``_combine``
    includes the wait it returns), the whole forward and the backward; each step from an idle device, median
    over ``steps``."""
    spent: dict[str, list[float]] = {name: [] for name in (*STAGES, "forward", "backward")}

    def timer(name: str, call: Callable) -> object:
        t0 = time.perf_counter()
        out = call()
        if name.endswith(" wait"):
            spent[name[:-5]][-1] += time.perf_counter() - t0
        else:
            spent[name].append(time.perf_counter() - t0)
        return out

    with stages_wrapped(layer, lambda name, fn: with_wait(name, fn, timer)):
        for _ in range(steps + 3):
            layer.zero_grad(set_to_none=True)
            x.grad = None
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            y = layer(x)
            t1 = time.perf_counter()
            y.backward(g)
            t2 = time.perf_counter()
            spent["forward"].append(t1 - t0)
            spent["backward"].append(t2 - t1)
    return {name: statistics.median(v[3:]) * 1e6 for name, v in spent.items() if v}


def op_tables(layer: torch.nn.Module, step: Callable[[], None], steps: int = 3, top: int = 8) -> list[str]:
    """Where each stage's host time goes (``--ops``): per stage of our layer's forward, its top-level ops (ATen
    ops, autograd Functions, collectives) by host us, and the backward's autograd nodes, from ``torch.profiler``
    (CPU activity, ``steps`` steps after one warm-up, means a step). The profiler adds its own cost to every op:
    this says where the time goes, ``stage_us`` how much."""
    def marked(name: str, call: Callable) -> object:
        with torch.profiler.record_function("stage: " + name):
            return call()

    with stages_wrapped(layer, lambda name, fn: with_wait(name, fn, marked)):
        step()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                if torch.cuda.is_available():
                    torch.cuda.synchronize()  # each step from an idle device, as issued_us times it
                step()
    groups: dict[str, dict[str, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for e in prof.events():
        if e.name.startswith("stage: "):
            for child in e.cpu_children:
                groups[e.name[7:]][child.name].append(child.cpu_time_total)
        elif e.name.startswith("autograd::engine::evaluate_function: "):
            groups["backward"][e.name[37:]].append(e.cpu_time_total)
    lines = []
    for stage, ops in groups.items():
        total = sum(map(sum, ops.values())) / steps
        ranked = sorted(ops.items(), key=lambda kv: -sum(kv[1]))
        lines.append(f"| {stage} | {sum(map(len, ops.values())) / steps:.0f} | {total:.0f} | " + ", ".join(
            f"{name} {sum(v) / steps:.0f} ({len(v) / steps:g}x)" for name, v in ranked[:top]) + " |")
    return ["| stage | top-level ops a step | their host us | the largest (us, calls a step) |", "|---|---|---|---|",
            *lines]


def graphed(layer: torch.nn.Module, eager_step: Callable[[], None], x: torch.Tensor, g: torch.Tensor) -> str:
    """The layer's step under ``torch.compile(layer, mode="reduce-overhead", fullgraph=True)`` (inductor's CUDA
    graphs: one flag) against the same layer eager, interleaved; and each one's step peak memory (allocated,
    after warm-up: the graphed step's pool included)."""
    run = torch.compile(layer, mode="reduce-overhead", fullgraph=True)

    def step() -> None:
        layer.zero_grad(set_to_none=True)
        x.grad = None
        run(x).backward(g)

    def peak_gib(fn: Callable[[], None]) -> float:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / 2**30

    t = timed({"eager": eager_step, "graphed": step}, iters=5, reps=9)
    return (f"\nours, plain MoE, torch.compile(mode=\"reduce-overhead\"): {t['graphed']:.3f} ms a step, eager "
            f"{t['eager']:.3f} ms ({t['eager'] / t['graphed']:.2f}x the graphed step); step peak memory "
            f"{peak_gib(step):.2f} GiB graphed, {peak_gib(eager_step):.2f} GiB eager")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="dsv3-debug", choices=sorted(SHAPES))
    ap.add_argument("--tokens", default="1024,4096,16384", help="tokens a rank, comma-separated")
    ap.add_argument("--shared", type=int, default=None, help="shared experts (of F each); default: the debug "
                    "model's 2 at dsv3-debug, else 0")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--ops", action="store_true", help="also where each stage's host time goes, op by op (op_tables)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torchtitan_ready("host_cost"):
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.spmd_types import set_spmd_meshes

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.smoke:
        device, dtype, shape, tokens = torch.device("cpu"), torch.float32, Shape(32, 16, 8, 2, 0, "smoke"), [37]
    else:
        torch.cuda.set_device(local)
        device, dtype, shape = torch.device("cuda", local), torch.bfloat16, SHAPES[args.shape]
        tokens = [int(t) for t in args.tokens.split(",")]
    dist.init_process_group("gloo" if args.smoke else "nccl", device_id=None if args.smoke else device)
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("ep",))
    set_spmd_meshes(dense_mesh=mesh, sparse_mesh=mesh)
    shared = args.shared if args.shared is not None else (2 if args.shape == "dsv3-debug" else 0)
    cfg = MoEConfig(dim=shape.D, hidden_dim=shape.F, num_experts=shape.E, top_k=shape.K, load_balance_coeff=1e-3,
                    num_shared_experts=shared)
    torch.manual_seed(0)
    state = {k: v.detach().clone() for k, v in MoE(cfg).to(device=device, dtype=dtype).state_dict().items()}

    def ours(ep: bool = True, **options: object) -> torch.nn.Module:
        m = MoE(cfg).to(device=device, dtype=dtype)
        m.load_state_dict(state)
        return parallelize_moe(m, ep_mesh=dist.group.WORLD, **options) if ep else m

    sync, plain = f"ours, EP {world} sync", "ours, plain MoE (no parallel wrapper)"
    lines = [f"host cost of one layer step (forward + backward, eager), {shape.D} / {shape.F} / {shape.E} / "
             f"{shape.K}, {shared} shared, {world} rank(s), {dtype}, torch {torch.__version__}, "
             f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}"]
    for T in tokens:
        # fresh layers for each T: a sync-free layer without max_tokens sizes its buffers on its first forward, and
        # a later forward that routes more stands in zero rows and records a capacity problem (checked below)
        layers: dict[str, torch.nn.Module] = {
            "torchtitan MoE": build_torchtitan(cfg, state, dtype, device, mesh if world > 1 else None),
            sync: ours(),
            f"ours, EP {world} sync_free (no max_tokens)": ours(ep_mode="sync_free"),
        }
        if world == 1:
            layers[plain] = ours(ep=False)
        gen = torch.Generator(device=device).manual_seed(1 + dist.get_rank())
        x = torch.randn(T, shape.D, device=device, dtype=dtype, generator=gen).requires_grad_()
        g = torch.randn(T, shape.D, device=device, dtype=dtype, generator=gen)

        def step_of(name: str, layer: torch.nn.Module) -> Callable[[], None]:
            fwd = layer
            if name.startswith("torchtitan"):
                fwd = lambda t: layer(t.view(1, T, -1)).view(T, -1)  # noqa: E731  (it takes (B, L, D))
                if args.smoke and world > 1:  # its default backend's all-to-all is uneven: not on gloo
                    fwd = on_backend("partial_dtensor", fwd)

            def step() -> None:
                layer.zero_grad(set_to_none=True)
                x.grad = None
                fwd(x).backward(g)
            return step

        steps = {name: step_of(name, layer) for name, layer in layers.items()}
        ops = {name: ops_per_step(s) for name, s in steps.items()}
        lines.append(f"\nT = {T} tokens a rank")
        ours = [name for name in layers if name.startswith("ours, EP")]
        tables = [line for name in ours if args.ops for line in (f"\n{name}: host time by op\n",
                                                                  *op_tables(layers[name], steps[name]))]
        if args.smoke:
            lines += [f"| {name} | {ops[name]} ATen ops |" for name in steps] + tables
        else:
            gpu = timed(steps, iters=5, reps=9)
            stages = {name: stage_us(layers[name], x, g) for name in ours}
            host = issued_us(steps)
            launches = {name: launches_per_step(s) for name, s in steps.items()}
            idle = {name: idle_gaps(s) for name, s in steps.items()}
            base = host["torchtitan MoE"]
            lines.append("| candidate | host us | GPU ms | host / GPU | launches | ATen ops | host vs torchtitan | "
                         "idle ms of a back-to-back step | its largest idle times |")
            lines.append("|---|---|---|---|---|---|---|---|---|")
            for name in steps:
                lines.append(f"| {name} | {host[name]:.0f} | {gpu[name]:.3f} | {host[name] / 1e3 / gpu[name]:.2f}"
                             f" | {launches[name]:.0f} | {ops[name]} | {host[name] / base:.2f}x | "
                             f"{idle[name][1]:.3f} of {idle[name][0]:.3f} | {idle[name][2]} |")
            if world == 1:
                lines.append(graphed(layers[plain], steps[plain], x, g))
            columns = next(iter(stages.values()))
            lines.append("\nhost us a step by stage (forward stages, then the whole forward and backward):\n")
            lines.append("| candidate | " + " | ".join(columns) + " |")
            lines.append("|" + "---|" * (len(columns) + 1))
            lines += [f"| {name} | " + " | ".join(f"{v:.0f}" for v in row.values()) + " |"
                      for name, row in stages.items()]
            lines += tables
        # raises on every rank if a layer recorded a problem (a sync-free buffer too small: a step that stood in
        # zero rows would have been timed)
        spmdmoe.check_errors()
    if dist.get_rank() == 0:
        report("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
    spmdmoe.shutdown(0)  # flush, tear the groups down, leave: no gloo exit abort
