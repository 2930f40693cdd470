"""Timing shared by the benchmarks: interleaved candidates (median, max over ranks) timed with CUDA events or,
on the CPU, host wall time; and host time per call (back to back, or each from an idle device)."""

from __future__ import annotations

import random
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist


def shuffled(names: list[str], rep: int) -> list[str]:
    """The candidates' order in repetition ``rep``: shuffled, seeded by ``rep`` (the same on every rank, which run
    the candidates' collectives together), so no candidate always follows the same one."""
    return random.Random(rep).sample(names, len(names))


def _interleaved(fns: dict[str, Callable[[], object]], reps: int, run: Callable[[Callable[[], object]], float],
                 device: "str | torch.device") -> dict[str, float]:
    """Median over ``reps`` of ``run(fn)`` for each fn, max over ranks: the candidates interleaved within every
    rep, in a shuffled order (seeded by the rep: the same on every rank), a barrier before each (a rotated order,
    used until 2026-11-30, kept each candidate behind the same one in every rep but the first)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for rep in range(reps):
        for name in shuffled(names, rep):
            if dist.is_initialized():
                dist.barrier()
            times[name].append(run(fns[name]))
    t = torch.tensor([statistics.median(v) for v in times.values()], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(fns, t.tolist()))


def _warm(fns: dict[str, Callable[[], object]]) -> None:
    for fn in fns.values():
        for _ in range(3):
            fn()


def timed(fns: dict[str, Callable[[], object]], iters: int, reps: int) -> dict[str, float]:
    """Median over ``reps`` of the mean time per call (ms) of each fn, CUDA events, max over ranks.

    The candidates are interleaved within every rep, in a shuffled order (no
    candidate always follows the same one), so drift (clocks, cache state,
    other tenants) and the previous candidate's wake hit all of them alike.
    Three warm-up calls each first.
    """
    _warm(fns)

    def run(fn: Callable[[], object]) -> float:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters

    return _interleaved(fns, reps, run, "cuda")


def timed_host(fns: dict[str, Callable[[], object]], iters: int, reps: int) -> dict[str, float]:
    """:func:`timed` in host wall time (ms per call), for CPU runs (gloo is synchronous there)."""
    _warm(fns)

    def run(fn: Callable[[], object]) -> float:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters * 1e3

    return _interleaved(fns, reps, run, "cpu")


def issued_us(fns: dict[str, Callable[[], object]], calls: int = 20, reps: int = 15) -> dict[str, float]:
    """Host time to issue one call (us) of each fn, from an idle device: every call starts after a synchronize
    and is timed up to its return, before the device finishes, so a full launch queue never blocks it (back to
    back, a call that launches faster than the device runs waits for queue space: its "host time" is then the
    device's). A call that reads the host waits for the device there: that wait is its host time too. Mean of
    ``calls`` a rep, median over ``reps`` with the candidates interleaved (:func:`_interleaved`), max over ranks."""
    _warm(fns)

    def run(fn: Callable[[], object]) -> float:
        total = 0.0
        for _ in range(calls):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            total += time.perf_counter() - t0
        torch.cuda.synchronize()
        return total / calls * 1e6

    return _interleaved(fns, reps, run, "cuda")


def host_us(fn, calls: int = 200) -> float:
    """Host time to issue one call (us): eager Python + launch, no device wait."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t = torch.tensor([(t1 - t0) / calls * 1e6], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _profiled(fn: Callable[[], object], calls: int, acts: list) -> Any:
    """``calls`` calls of ``fn`` under ``torch.profiler`` with ``acts``, from an idle device."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof


def _timeline(prof: Any) -> tuple[list[tuple[float, float, str]], float, dict[tuple[str, str], float]]:
    """A profile's device activity (user annotations left out): the kernels ``(start us, end us, name)`` in start
    order, the time the device was busy (the union of their intervals, us), and the idle time between them
    summed by the names (cut to 30 characters) of the kernels around it."""
    ks = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation)
    gaps: dict[tuple[str, str], float] = {}
    busy, end, before = 0.0, ks[0][0] if ks else 0.0, ""
    for start, stop, name in ks:
        if start > end:
            gaps[(before[:30], name[:30])] = gaps.get((before[:30], name[:30]), 0.0) + start - end
        busy += max(0.0, stop - max(start, end))
        end, before = max(end, stop), name
    return ks, busy, gaps


def idle_gaps(fn: Callable[[], object], calls: int = 5, top: int = 3) -> tuple[float, float, str]:
    """``calls`` calls of ``fn`` back to back, profiled on the device only (no CPU activity: the host runs at its
    own speed): ``(span ms, idle ms, gaps)`` a call, the span from the first kernel's start to the last one's end,
    idle the part of it no kernel ran (the device waited for the host, or for a read of it), and the ``top``
    largest idle times summed by the kernels around them (``"us after A before B"``). Timeline of one step for
    the table of ``host_cost.py``: what of the step the host leaves exposed."""
    ks, busy, gaps = _timeline(_profiled(fn, calls, [torch.profiler.ProfilerActivity.CUDA]))
    span = (ks[-1][1] - ks[0][0]) / calls / 1e3
    worst = sorted(gaps.items(), key=lambda kv: -kv[1])[:top]
    return span, span - busy / calls / 1e3, "; ".join(f"{v / calls:.0f} us after {a} before {b}" for (a, b), v in worst)


def kernel_table(fn: Callable[[], object], calls: int = 3, rows: int = 25) -> str:
    """``calls`` calls of ``fn`` under ``torch.profiler`` (CPU and CUDA; kernels replayed from a CUDA graph
    included): the top ``rows`` ops by total CUDA time, as torch prints them, after two figures per call: the
    kernel time summed over streams (as torch's "Self CUDA time total": device events, user annotations left out)
    and the time the GPU was busy (the union of those kernels' intervals). Their difference is kernel time that
    ran concurrently (communication under compute, or a collective spinning beside a GEMM)."""
    prof = _profiled(fn, calls, [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
    kernels, busy, _ = _timeline(prof)
    summed = sum(stop - start for start, stop, _ in kernels)
    return (f"kernel time per call: {summed / calls / 1e3:.3f} ms summed over streams, "
            f"{busy / calls / 1e3:.3f} ms GPU busy (their union)\n"
            + prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows))


def report(text: str, out: "str | None") -> None:
    """Print a result table and append it to ``out`` (when given), with a blank line after."""
    print(text, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(text + "\n\n")
