"""Sync-free EP against sync EP: a stack of MoE layers fwd+bwd, eager and CUDA-graphed, and the row moves.

    torchrun --nproc-per-node N benchmarks/sync_free.py [--tokens 4096] [--layers 4] [--shape dsmoe16b] [--out FILE]
    torchrun --nproc-per-node 4 benchmarks/sync_free.py --smoke      # CPU/gloo: runs every candidate once

bf16, a shape of ``benchmarks/shapes.py`` (default DeepSeek-MoE-16B: D=2048, F=1408, E=64, K=6), EP = N (each rank its own T tokens; ``max_tokens = T``), a stack of
``--layers`` MoE layers on a residual stream (``h = h + layer(h)``: without it the activations shrank about a
thousandfold a layer at the default init, and the fourth layer's router saw ties, every token on the same six
experts, one rank doing all the expert work: `benchmarks/ARCHIVE.md`, issue 42, the 12:55 UTC run of
2026-11-27; ``--no-residual`` runs that stack again). Candidates, interleaved
(``timing.timed``), median, max over ranks:

* ``sync eager``: ``ep_mode="sync"``, one host read of the split sizes per layer forward;
* ``sync-free eager``: ``ep_mode="sync_free"`` lossless: on NCCL on one host the symmetric-memory transport
  (``moe/transports/symmetric.py``: only the rows that cross, read from the peers), a token once per rank (``moe/transports/dedup.py``);
* ``sync-free eager, all-to-all``: the same over the padded even all-to-all (``SPMDMOE_EP_SYMMETRIC=0``: the
  transport of gloo and of several hosts; ``S = T`` rows per rank pair);
* ``sync-free graphed``: the symmetric stack's forward and backward captured in ONE CUDA graph, replayed;
* ``sync-free graphed, capacity_factor c`` for c in ``--graph-order`` (a smaller experts' buffer; overflow
  checked once after the timing, as ``update_expert_bias`` would).

``--profile FILE``: rank 0's top CUDA ops of each timed candidate (3 steps each, graphs replayed).
``--host-profile FILE``: where an eager step's host time goes (rank 0, cProfile of 3 steps of each eager
candidate, by own time) and the host cost of one call of each launch the step makes many of (the row
kernels through their custom op and launched directly, an NCCL all-to-all, a plain torch op).

Each graph is captured on a stack of its own (same seed, same weights), in ``--graph-order`` (the capacity
factors and ``lossless``, comma-separated; a key twice: a second graph), one alive at a time: captured, timed
in a rotation with the eager candidates (its ratio is to that rotation's sync eager step), checked (a lossless
graph's replay bit for bit against the sync eager step, on every rank, its parameters' gradients as the gate
below; a capacity factor's overflow: an overflowed graph dropped rows, and its time does not count), profiled,
freed.

The gate, before timing: the eager stacks' output and input gradient against the sync eager stack's, bit for
bit (reported), and every parameter's gradient within ``GRAD_TOLERANCE`` = 1e-2 relative (||diff|| / ||sync's||,
each parameter, max over ranks; bitwise reported): beyond it the run stops, so a stack that skipped
weight-gradient work is not timed. The weight gradients are not held to bits: the expert buffers' rows, and so
the sums' order, differ between the transports. With two graphs of the stack
alive at once and replayed by turns, the lossless one ran 1.2-1.9x slower than eager in five runs of six
(every kernel that touches the experts' rows, GEMMs included; cause not found), alone at eager speed or faster
(`benchmarks/ARCHIVE.md`, issue 42, the 12:55 UTC run of 2026-11-27); ``--graphs-together`` keeps them all
alive and times them in one rotation, as this benchmark did before.

Also: per layer, the smallest capacity factor that would have dropped nothing on this routing
(:func:`needed_factors`), peak memory of one step per candidate, and the row moves alone, the first layer's
routing, every rank moving at once: the symmetric transport's dispatch and combine reads (``peer_dispatch`` + ``peer_pull_sum``, with
their barriers; called eagerly, where at 4k tokens the host's launches set the pace, and replayed from a CUDA graph
each, their device time) against an even NCCL ``all_to_all_single`` of the same rows each way (a token once per rank it
needs), against the peer-copy ceiling (a copy-engine ``copy_`` of the same off-rank bytes from the peer's
buffer, each way), and the padded exchange (two even ``all_to_all_single`` of ``Q = N*S`` rows). A design probe
beside them (issue 42: the moves under compute): the dispatch's bytes moved by the copy engines (stage, barrier,
every peer's whole staged block by ``copy_``, barrier; no SM work but the barriers), and a GEMM of about the
experts' up-projection size alone, then with each dispatch on a side stream at once (does the move hide under it,
and does the GEMM slow down), and with the even NCCL all-to-all launched before it (the all-to-all transports'
overlap). And what FP8 rows on the wire would save: the dispatch op and the even all-to-all with rows of
``D + 16`` bytes (a row's e4m3 and its fp32 scale, padded to keep rows 16-byte aligned) instead of ``2 D``.
``--moves-only``: the row moves alone (no stack timing, no graphs); ``--no-moves``: the stack alone. The stack's
table is written before the moves run.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from typing import Any, Callable, Optional
from unittest import mock

import torch
import torch.distributed as dist

import spmdmoe
from spmdmoe.moe import MoE, MoEConfig, parallelize_moe
from spmdmoe.moe.routing.permute import count_per_expert
from spmdmoe.moe.transports.dedup import destinations
from spmdmoe.moe.transports.symmetric import TIMEOUT_MS, SymmetricTransport
from spmdmoe.moe.transports.sync_free import capacity_rows
from spmdmoe.testing import capture_training_step

from shapes import SHAPES

_base: list[MoE] = []


def build(cfg: MoEConfig, layers: int, dtype: torch.dtype, device: torch.device, T: int, **ep: object) -> torch.nn.ModuleList:
    """A candidate's stack: the same single-device layers (made once, on the device: initialising them on the
    CPU under torchrun's one OpenMP thread took ~8 s a layer) parallelized with ``ep``."""
    if not _base:
        torch.manual_seed(0)  # the same weights on every rank and for every candidate
        with torch.device(device):
            _base.extend(MoE(cfg).to(dtype=dtype) for _ in range(layers))
    return torch.nn.ModuleList([parallelize_moe(m, ep_mesh=dist.group.WORLD, **ep) for m in _base])


RESIDUAL = [True]  # --no-residual: each layer's output is the next one's input, nothing added


def run(stack: torch.nn.ModuleList, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    h = x
    for layer in stack:
        h = h + layer(h) if RESIDUAL[0] else layer(h)
    (h.float() * g).sum().backward()
    return h


GRAD_TOLERANCE = 1e-2  # ||diff|| / ||sync eager's|| of one parameter's gradient (the weight-gradient sums may
# run in another order: the expert buffers' rows differ between transports, so they are not held to bits)


def grads_of(stack: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter's gradient in the stack's order (a missing one as zeros), copied."""
    return [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in stack.parameters()]


def worst_grad_error(grads: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """The largest ||diff|| / ||ref|| of one parameter's gradient against ``ref`` (inf where the parameters'
    count or shapes differ, or where a reference of zeros meets non-zeros), max over ranks (a collective)."""
    worst = 0.0 if len(grads) == len(ref) else float("inf")
    for a, b in zip(grads, ref):
        if a.shape != b.shape:
            worst = float("inf")
            continue
        d, r = (a.float() - b.float()).norm().item(), b.float().norm().item()
        worst = max(worst, d / r if r > 0 else (float("inf") if d > 0 else 0.0))
    flag = torch.tensor([worst], dtype=torch.float64, device=ref[0].device if ref else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item()


def graphed(stack: torch.nn.ModuleList, x: torch.Tensor, g: torch.Tensor
            ) -> tuple[Callable[[], None], Callable[[], tuple[torch.Tensor, torch.Tensor]]]:
    """The stack's fwd+bwd captured once (after a warm-up on a side stream): the replay, and a function that
    returns the last replay's output and input gradient (the graph's static tensors)."""
    graph, out = capture_training_step(lambda: run(stack, x, g), stack, x)
    return graph.replay, lambda: (out, x.grad)


def needed_factors(stack: torch.nn.ModuleList, x: torch.Tensor, g: torch.Tensor, E: int, K: int) -> list[float]:
    """Per layer, the smallest ``capacity_factor`` that would not have dropped a row on this step's routing (one
    eager step of ``stack``, every rank's layer inputs as the step made them): the sync-free transport's two
    demands (``SyncFreeTransport._record``), the most rows a rank sends another over a slot's balanced rows
    ``T * K / n``, and the most copies a rank's experts receive over theirs ``T * K`` (``capacity_rows``), the
    larger of the two; the same on every rank."""
    ids: list[torch.Tensor] = []
    hooks = [layer.router.register_forward_hook(lambda _m, _a, out: ids.append(out.ids_TK)) for layer in stack]
    try:
        stack.zero_grad(set_to_none=True)
        x.grad = None
        run(stack, x, g)
    finally:
        for hook in hooks:
            hook.remove()
    n, T = dist.get_world_size(), x.shape[0]
    e, balanced = E // n, max(T * K, 1)
    factors = []
    for ids_TK in ids:
        need_Tn = destinations(ids_TK, e, n)
        mine = torch.cat([count_per_expert(ids_TK, E), need_Tn.sum(0)]).to(torch.int64)
        parts = [torch.empty_like(mine) for _ in range(n)]
        dist.all_gather(parts, mine)
        table = torch.stack(parts)  # [source, E + n], as the transport's count table
        slot = int(table[:, E:].max())
        rows = int(table[:, :E].sum(0).view(n, e).sum(1).max())
        factors.append(max(slot * n / balanced, rows / balanced))
    return factors


GEMM_ALONE = "GEMM alone (2T x D x 2F bf16)"  # the probes' compute: about the experts' up-projection


def symmetric_moves(transport: SymmetricTransport, x_TD: torch.Tensor, ids_TK: torch.Tensor, T: int, n: int,
                    D: int) -> tuple[dict[str, Callable[[], object]], int]:
    """The symmetric transport's two reads with this routing (the dispatch: every rank's ids and weights, then
    the tokens with an expert here; the combine: a row back per token and rank visited), and the peer-copy
    ceiling: a copy-engine ``copy_`` of this rank's off-rank rows' bytes from the next rank's buffer, every
    rank at once, each way; the design probes (module docstring): the dispatch by the copy engines, pulled and
    pushed, and a GEMM alone and beside each dispatch (:data:`GEMM_ALONE`); and the number of those rows."""
    from spmdmoe.moe.transports.dedup import pack_meta
    from spmdmoe.moe.transports.symmetric import _buffer, _peers, _regions, peer_dispatch, peer_pull_sum

    e, me, group = transport.local_experts, transport.axis.rank, transport.axis.group.group_name
    need_Tn = destinations(ids_TK, e, n)
    meta_TW = pack_meta(ids_TK, torch.rand(ids_TK.shape, device=ids_TK.device))
    mask_Q = peer_dispatch(x_TD, meta_TW, need_Tn, group, T, me * e, me * e + e)[2]
    y_QD = torch.randn(n * T, D, device=x_TD.device, dtype=x_TD.dtype)
    crossing = int(need_Tn[:, [d for d in range(n) if d != me]].sum())  # this rank's rows that peers read
    # (the transport's own size for this T: the buffer does not grow here, which would leave views stale)
    st = _buffer(group, x_TD.device, _regions([(n * T * D, x_TD.dtype), (n * T * meta_TW.shape[1], meta_TW.dtype)])[1])
    peers = _peers(st, x_TD.dtype)
    src = peers.views[(me + 1) % n][: crossing * D]
    dst = torch.empty_like(src)
    dispatch = lambda: peer_dispatch(x_TD, meta_TW, need_Tn, group, T, me * e, me * e + e)  # noqa: E731
    # FP8 rows on the wire (issue 42), the bytes they would take: a row's e4m3 and its fp32 scale padded to 16
    # bytes (rows stay 16-byte aligned), D + 16 bytes, moved as D / 2 + 8 bf16 (the op copies bits)
    x8_TD = torch.randn(T, D // 2 + 8, device=x_TD.device, dtype=x_TD.dtype)
    dispatch8 = lambda: peer_dispatch(x8_TD, meta_TW, need_Tn, group, T, me * e, me * e + e)  # noqa: E731
    combine = lambda: peer_pull_sum(y_QD, need_Tn, mask_Q, group, T)  # noqa: E731
    # a design probe (issue 42: pull by the copy engines, under compute): the dispatch's bytes moved by copy_
    # (the copy engines, no SM) instead of the Triton reads: stage x and the ids, barrier, each peer's whole staged
    # block copied (every token, needed or not: at EP 2 top-6 of 64, 98.8 % are), barrier
    rows_all = peers.views
    meta_peers = _peers(st, meta_TW.dtype).views
    W, size = meta_TW.shape[1], x_TD.element_size()
    x_off = _regions([(T * W, meta_TW.dtype), (T * D, x_TD.dtype)])[0][1] // size  # peer_dispatch's staging layout
    order = [(me + 1 + j) % n for j in range(n)]  # each rank from its next peer on (the pull kernel's order)
    ce_x = torch.empty(n * T, D, device=x_TD.device, dtype=x_TD.dtype)
    ce_meta = torch.empty(n * T, W, device=x_TD.device, dtype=meta_TW.dtype)

    def ce_dispatch() -> None:
        meta_peers[me][: T * W].view(T, W).copy_(meta_TW)
        rows_all[me][x_off: x_off + T * D].view(T, D).copy_(x_TD)
        st.hdl.barrier(channel=0, timeout_ms=TIMEOUT_MS)
        for s in order:
            ce_meta[s * T: (s + 1) * T].copy_(meta_peers[s][: T * W].view(T, W))
            ce_x[s * T: (s + 1) * T].copy_(x_TD if s == me else rows_all[s][x_off: x_off + T * D].view(T, D))
        st.hdl.barrier(channel=0, timeout_ms=TIMEOUT_MS)

    # pushed instead (NVLink writes, as NCCL and DeepEP's kernels move rows; pulls are reads): each rank's ids and
    # rows copied into every rank's buffer at its source slot by copy_, barrier, each rank's n slots copied out
    # into its own tensors, barrier
    p_x = _regions([(n * T * W, meta_TW.dtype), (n * T * D, x_TD.dtype)])[0][1] // size

    def ce_push() -> None:
        for d in order:
            meta_peers[d][me * T * W: (me + 1) * T * W].view(T, W).copy_(meta_TW)
            rows_all[d][p_x + me * T * D: p_x + (me + 1) * T * D].view(T, D).copy_(x_TD)
        st.hdl.barrier(channel=0, timeout_ms=TIMEOUT_MS)
        ce_meta.copy_(meta_peers[me][: n * T * W].view(n * T, W))
        ce_x.copy_(rows_all[me][p_x: p_x + n * T * D].view(n * T, D))
        st.hdl.barrier(channel=0, timeout_ms=TIMEOUT_MS)

    # what runs beside a GEMM: an (M, D) x (D, 2F)-like bf16 GEMM of about the experts' up-projection size
    a = torch.randn(2 * T, D, device=x_TD.device, dtype=x_TD.dtype)
    b = torch.randn(D, 2816, device=x_TD.device, dtype=x_TD.dtype)
    gemm = lambda: a @ b  # noqa: E731
    side = torch.cuda.Stream(x_TD.device)

    def beside(move: Callable[[], object]) -> Callable[[], None]:
        def both() -> None:  # the GEMM on the compute stream, the move on a side stream, joined after
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                move()
            gemm()
            main.wait_stream(side)
        return both

    return {  # (the keys name rank 0's counts; timed pairs the candidates by position)
        "copy-engine dispatch (stage, barrier, every peer's whole block by copy_, barrier)": ce_dispatch,
        GEMM_ALONE: gemm,
        "GEMM + symmetric dispatch op on a side stream": beside(dispatch),
        "GEMM + copy-engine dispatch on a side stream": beside(ce_dispatch),
        "copy-engine push dispatch (every rank's block written into each peer's slot by copy_, barrier, copied "
        "out, barrier)": ce_push,
        "GEMM + copy-engine push on a side stream": beside(ce_push),
        "symmetric dispatch op (stage, ids of every rank, the rows with an expert here, 2 barriers)": dispatch,
        "symmetric combine op (stage, a row per token and rank visited, 2 barriers)": combine,
        # the same ops replayed from CUDA graphs: their device time, without the host's launches
        "symmetric dispatch op, graphed": capture_training_step(dispatch, torch.nn.Module(), warmup=1)[0].replay,
        "symmetric dispatch op, e4m3 rows + fp32 scale (D + 16 bytes a row), graphed":
            capture_training_step(dispatch8, torch.nn.Module(), warmup=1)[0].replay,
        "symmetric combine op, graphed": capture_training_step(combine, torch.nn.Module(), warmup=1)[0].replay,
        f"peer-copy ceiling: copy_ of {crossing} rows from the peer, x 2": lambda: [dst.copy_(src) for _ in range(2)],
    }, crossing


def row_moves(stacks: dict[str, torch.nn.ModuleList], x: torch.Tensor, T: int, n: int, D: int, E: int, S: int,
              device: torch.device, dtype: torch.dtype, iters: int, reps: int) -> tuple[dict[str, float], list[str]]:
    """The row moves alone, the first layer's routing (module docstring): ``Q = n * S`` rows each way (the padded
    exchange) against the rows the sync transport sends (a token once per rank it needs) in one even exchange
    each way, and the symmetric transport's ops and probes; their times (ms, max over ranks) and the report's
    lines."""
    rows_free = torch.randn(n * S, D, device=device, dtype=dtype)
    out_free = torch.empty_like(rows_free)
    first = stacks["sync eager"][0]
    ids_TK = first.router(x.detach(), first.expert_bias, first.router.gate.weight).ids_TK
    # one size on every rank (an even exchange of sizes that differ by rank is not a valid all-to-all: the runs
    # before issue 44's fix passed each rank its own): the busiest rank's rows, whose moves set the
    # symmetric ops' time too (timed: max over ranks)
    sent_ = torch.tensor([int(destinations(ids_TK, E // n, n).sum())], device=device)
    dist.all_reduce(sent_, op=dist.ReduceOp.MAX)
    sent = -(-int(sent_) // n) * n
    rows_even = torch.randn(sent, D, device=device, dtype=dtype)
    out_even = torch.empty_like(rows_even)
    # e4m3 + an fp32 scale, padded to 16 bytes: D + 16 bytes a row (rows of D + 4 bytes, 4-byte aligned, took
    # NCCL 0.553 ms against 0.584 for bf16's 2D: `benchmarks/ARCHIVE.md`, issue 42, the 19:41 UTC run of 2026-11-27)
    rows_fp8 = torch.randn(sent, D // 2 + 8, device=device, dtype=dtype)
    out_fp8 = torch.empty_like(rows_fp8)
    moves = {
        f"padded all-to-all dispatch + combine (2 x Q = 2 x {n * S} rows)": lambda: [dist.all_to_all_single(out_free, rows_free) for _ in range(2)],
        f"even all_to_all_single of the busiest rank's rows sent ({sent}) x 2": lambda: [dist.all_to_all_single(out_even, rows_even) for _ in range(2)],
        "the same x 1": lambda: dist.all_to_all_single(out_even, rows_even),
        "the same x 1, e4m3 rows + fp32 scale (D + 16 bytes a row)": lambda: dist.all_to_all_single(out_fp8, rows_fp8),
    }
    crossing = 0
    if isinstance(first_free := stacks["sync-free eager"][0].transport, SymmetricTransport):
        peer_moves, crossing = symmetric_moves(first_free, x.detach(), ids_TK, T, n, D)
        moves.update(peer_moves)
        gemm = peer_moves[GEMM_ALONE]

        def a2a_beside() -> None:  # NCCL's own stream: launched, the GEMM, waited for (the all-to-all transports'
            works = [dist.all_to_all_single(out_even, rows_even, async_op=True) for _ in range(2)]  # overlap)
            gemm()
            for w in works:
                w.wait()
        moves["GEMM + the even all_to_all_single x 2, launched before it"] = a2a_beside
    from timing import timed

    moves = timed(moves, iters, reps)

    lines = ["", "| row moves | ms |", "|---|---|"]
    lines += [f"| {name} | {ms:.3f} |" for name, ms in moves.items()]
    if crossing:
        from spmdmoe.moe.transports import symmetric

        GB = crossing * D * 2 / 1e9
        staging = sum(st.buf.numel() for st in symmetric._staging.values()) / 2**30
        lines += [f"rank 0's rows that its peer reads: {crossing} ({GB * 1e3:.0f} MB a direction); the dispatch op "
                  f"{GB / moves[next(k for k in moves if k.startswith('symmetric dispatch'))] * 1e3:.0f} GB/s of "
                  f"them eagerly, {GB / moves['symmetric dispatch op, graphed'] * 1e3:.0f} GB/s graphed; the "
                  f"peer-copy ceiling "
                  f"{2 * GB / moves[next(k for k in moves if k.startswith('peer-copy'))] * 1e3:.0f} GB/s",
                  f"the symmetric staging buffer (held for the job, not in the peak column): {staging:.2f} GiB"]
    return moves, lines


def host_profile(eager: dict[str, Callable[[], None]], x: torch.Tensor, n: int, D: int, dtype: torch.dtype,
                 device: torch.device) -> str:
    """Where an eager step's host time goes: cProfile of 3 steps of each candidate (top 30 by own time), and
    the host time of one call (us, max over ranks) of each launch a step makes many of, small inputs."""
    import cProfile
    import io
    import pstats

    from spmdmoe.kernels.fan_out import fan_out_triton
    from spmdmoe.kernels.gather_sum import gather_sum_triton
    from timing import host_us

    parts = []
    for name, step in eager.items():
        prof = cProfile.Profile()
        torch.cuda.synchronize()
        prof.enable()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
        parts.append(f"## {name}: cProfile of 3 steps\n{out.getvalue()}")
    src = torch.randn(256, D, device=device, dtype=dtype)
    index = torch.randint(0, 512, (256, 2), device=device)
    big = torch.randn(512, D, device=device, dtype=dtype)
    rows = torch.randn(64 * n, D, device=device, dtype=dtype)
    got = torch.empty_like(rows)
    calls = {
        "torch.add (a plain aten op)": lambda: torch.add(src, src),
        "spmdmoe fan_out (custom op)": lambda: fan_out_triton.op(src, index, 512),
        "spmdmoe fan_out (launcher called directly)": lambda: fan_out_triton(src, index, 512),
        "spmdmoe gather_sum (custom op)": lambda: gather_sum_triton.op(big, index),
        "spmdmoe gather_sum (launcher called directly)": lambda: gather_sum_triton(big, index),
        "dist.all_to_all_single (64 rows a rank)": lambda: dist.all_to_all_single(got, rows),
    }
    lines = ["| one call | host us |", "|---|---|"] + [f"| {k} | {host_us(f):.1f} |" for k, f in calls.items()]
    return "\n".join(lines) + "\n\n" + "\n".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--shape", default="dsmoe16b", choices=sorted(SHAPES),
                    help="D, F, E, K of this model (benchmarks/shapes.py); the tokens per GPU are --tokens")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--max-tokens-factor", type=float, default=1.0,
                    help="the sync-free layers' max_tokens over the tokens a rank routes (1: sized exactly, the best "
                         "case for static buffers; 1.25: a batch that varies by up to a quarter)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU/gloo, tiny dims, fp32: every candidate once, no timing")
    ap.add_argument("--profile", default=None, help="write rank 0's top CUDA ops of each timed candidate here")
    ap.add_argument("--host-profile", default=None, help="write where an eager step's host time goes here")
    ap.add_argument("--graph-order", default="lossless,1.25",
                    help="the order the graphs are captured in: capacity factors and 'lossless'")
    ap.add_argument("--no-residual", action="store_true",
                    help="no residual stream: the stack this benchmark ran before (its deep layers route on ties)")
    ap.add_argument("--graphs-together", action="store_true",
                    help="keep every graph alive and time them all in one rotation (by default each graph is "
                         "captured, timed with the eager candidates and freed before the next)")
    ap.add_argument("--moves-only", action="store_true",
                    help="time the row moves alone (no stack timing, no graphs of the stack)")
    ap.add_argument("--no-moves", action="store_true",
                    help="skip the row moves (the stack's table alone)")
    ap.add_argument("--dump-after", type=float, default=0,
                    help="seconds: then print every thread's stack and exit (a hang shows where it is)")
    args = ap.parse_args()
    RESIDUAL[0] = not args.no_residual
    smoke = args.smoke
    if args.dump_after:
        import faulthandler
        faulthandler.dump_traceback_later(args.dump_after, exit=True)
    t0 = time.time()

    def progress(what: str) -> None:
        if dist.get_rank() == 0:
            print(f"[{time.time() - t0:6.1f} s] {what}", flush=True)
    if smoke:
        dist.init_process_group("gloo")
        device, dtype, (D, F, E, K) = torch.device("cpu"), torch.float32, (32, 16, 8, 2)
    else:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device, dtype, (D, F, E, K) = torch.device("cuda", local), torch.bfloat16, SHAPES[args.shape][:4]
        dist.init_process_group("nccl", device_id=device)
    n, rank, T, L = dist.get_world_size(), dist.get_rank(), args.tokens, args.layers
    cfg = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=K, load_balance_coeff=1e-3)
    gen = torch.Generator(device=device).manual_seed(1 + rank)
    x = torch.randn(T, D, device=device, dtype=dtype, generator=gen).requires_grad_()
    g = torch.randn(T, D, device=device, dtype=torch.float32, generator=gen)

    def sync_free(c: Optional[float]) -> torch.nn.ModuleList:
        return build(cfg, L, dtype, device, T, ep_mode="sync_free", max_tokens=int(args.max_tokens_factor * T),
                     capacity_factor=c)

    stacks = {"sync eager": build(cfg, L, dtype, device, T), "sync-free eager": sync_free(None)}
    with mock.patch.dict(os.environ, {"SPMDMOE_EP_SYMMETRIC": "0"}):
        stacks["sync-free eager, all-to-all"] = sync_free(None)
    transports = {name: type(stack[0].transport).__name__ for name, stack in stacks.items()}
    progress("built")

    # the lossless sync-free stacks and the sync stack agree bit for bit (same rows, same order) in the output and
    # input gradient, and every parameter's gradient within GRAD_TOLERANCE of the sync stack's (the gate: a stack
    # that skipped weight-gradient work would otherwise be timed as faster)
    outs, grads = [], []
    for name in ("sync eager", "sync-free eager", "sync-free eager, all-to-all"):
        stacks[name].zero_grad(set_to_none=True)
        x.grad = None
        outs.append((run(stacks[name], x, g).detach(), x.grad.clone()))
        grads.append(grads_of(stacks[name]))
    same = all(torch.equal(a, b) for other in outs[1:] for a, b in zip(outs[0], other))
    grad_error = max(worst_grad_error(other, grads[0]) for other in grads[1:])
    same_grads = all(torch.equal(a, b) for other in grads[1:] for a, b in zip(grads[0], other))
    grads_text = (f"parameter gradients vs sync: bitwise {same_grads}, worst rel error {grad_error:.2g} "
                  f"(<= {GRAD_TOLERANCE}: {grad_error <= GRAD_TOLERANCE})")
    agree = f"sync-free == sync bitwise: {same}; {grads_text}"
    progress(f"eager steps compared: {agree}")
    if not grad_error <= GRAD_TOLERANCE:
        raise SystemExit(f"sync_free: a parameter's gradient differs from the sync stack's by more than "
                         f"{GRAD_TOLERANCE} (relative): {grad_error:.3g}; not timing it")
    factors = needed_factors(stacks["sync eager"], x, g, E, K)
    if smoke:
        if rank == 0:
            print(f"OK: smoke, {n} ranks, sync-free == sync bitwise: {same}, candidates {list(stacks)}, capacity "
                  f"factor needed per layer {[round(f, 3) for f in factors]}; {grads_text}", flush=True)
        assert same
        return

    from timing import kernel_table, report, timed

    steps, mem = {}, {}
    for name, stack in stacks.items():
        def eager(stack: torch.nn.ModuleList = stack) -> None:
            stack.zero_grad(set_to_none=True)
            x.grad = None
            run(stack, x, g)
        torch.cuda.synchronize()  # peak memory of one eager step (a graph's pool is reserved at capture)
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        eager()
        torch.cuda.synchronize()
        mem[name] = (torch.cuda.max_memory_allocated() - start) / 2**30
        steps[name] = eager
    # the graphs, each on a stack of its own, in --graph-order (module docstring); by default one alive at a time,
    # timed in a rotation of its own with the eager candidates (with two graphs of the stack alive at once and
    # replayed by turns the lossless one ran slower in five runs of six: the module docstring; --graphs-together)
    progress("peak memory measured")
    eager_steps = dict(steps)
    t: dict[str, float] = {}
    ratio: dict[str, float] = {}  # each candidate against the sync eager step of its own rotation
    tables: dict[str, str] = {}
    pools: dict[str, float] = {}
    checks: dict[str, str] = {}
    overflowed: list[str] = []

    def measure(graphs: dict[str, Any]) -> None:
        """Times the eager candidates and ``graphs`` (name: ``(replay, result, capacity factor, stack)``) in one
        rotation; checks each graph (bitwise, or its overflow) and profiles it while it is alive."""
        got = timed({**eager_steps, **{k: v[0] for k, v in graphs.items()}}, args.iters, args.reps)
        for name, ms in got.items():
            if name in graphs or name not in t:
                t[name], ratio[name] = ms, got["sync eager"] / ms
        for name, (replay, result, c, own) in graphs.items():
            if c is None:  # a lossless graph's last replay against the sync eager step, bit for bit, every rank
                flag = torch.tensor([float(not all(torch.equal(a, b) for a, b in zip(outs[0], result())))], device=device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                err = worst_grad_error(grads_of(own), grads[0])  # its parameters' gradients, as the eager gate
                checks[name] = (f"replay == sync eager bitwise: {not flag.item()}, parameter gradients' worst rel "
                                f"error {err:.2g} (<= {GRAD_TOLERANCE}: {err <= GRAD_TOLERANCE})")
            else:  # dropped copies add zero: the output and input gradient stay finite (every rank)
                flag = torch.tensor([float(not all(torch.isfinite(t).all() for t in result()))], device=device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                finite = f"output and input gradient finite: {not flag.item()}"
                try:
                    for layer in own:
                        layer.check_capacity()
                    checks[name] = f"no overflow, {finite}"
                except Exception as exc:  # SPMDCapacityError: the factor was too small for this routing
                    overflowed.append(f"{c}: {type(exc).__name__}")
                    checks[name] = f"overflowed ({type(exc).__name__}): its time does not count; {finite}"
            if args.profile:
                tables[name] = kernel_table(replay)
        progress(f"timed {list(graphs) or 'the eager candidates'}")

    alive: dict[str, Any] = {}
    for key in [k for k in args.graph_order.split(",") if k and not args.moves_only]:
        c = None if key == "lossless" else float(key)
        name = "sync-free graphed" if c is None else f"sync-free, capacity_factor {c} (graphed)"
        while name in pools:  # a key given twice: a second graph of the same stack kind, captured later
            name += " again"
        if not args.graphs_together:  # the last graph and its stack freed (a parallel layer sits in a reference
            alive.clear()  # cycle, and its gradients live in the graph's pool: collected before the cache empties)
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        own = sync_free(c)
        transports[name] = type(own[0].transport).__name__
        before = torch.cuda.memory_reserved()
        replay, result = graphed(own, x.detach().clone().requires_grad_(), g)
        pools[name] = (torch.cuda.memory_reserved() - before) / 2**30
        alive[name] = (replay, result, c, own)
        del replay, result, own  # (alive holds the graph: cleared, it is freed before the next capture)
        progress(f"captured {name}")
        if not args.graphs_together:
            measure(dict(alive))
    if args.graphs_together:
        measure(dict(alive))
    alive.clear()
    gc.collect()
    if not t and not args.moves_only:  # --graph-order "": the eager candidates alone
        measure({})

    head = [f"device: {n}x {torch.cuda.get_device_name()}, torch {torch.__version__}, EP={n}, D={D} F={F} E={E} K={K}, "
            f"T/rank={T}, {L} layers{'' if RESIDUAL[0] else ' (no residual)'}, bf16; {agree}"]
    S, _ = capacity_rows(T, K, E // n, n, None)
    if not args.moves_only:  # the stack's table first: a row move that fails below cannot take it along
        lines = head + ["", "| candidate | stack fwd+bwd ms | vs sync eager (same rotation) |", "|---|---|---|"]
        lines += [f"| {name} | {ms:.3f} | {ratio[name]:.2f}x |" for name, ms in t.items()]
        lines += ["", "| stack (eager step) | peak step GiB above the inputs |", "|---|---|"]
        lines += [f"| {name} | {gib:.2f} |" for name, gib in mem.items()]
        lines += ["", f"capacity overflow after the timing: {overflowed or 'none'}; lossless slot S = {S} rows "
                      f"(Q = {n * S} rows per buffer vs {T * K} routed rows per rank); the smallest capacity_factor "
                      f"that drops nothing, per layer: {', '.join(f'{f:.3f}' for f in factors)}", "",
                  f"transports: {transports}",
                  "graphs (" + ("all alive, timed together" if args.graphs_together else "one alive at a time") + "): "
                  + "; ".join(f"{k}: pool {pools[k]:.2f} GiB reserved at capture, {checks[k]}" for k in pools)]
        if rank == 0:
            report("\n".join(lines), args.out)
    if not args.no_moves:
        moves, lines = row_moves(stacks, x, T, n, D, E, S, device, dtype, args.iters, args.reps)
        progress("row moves timed")
        if rank == 0:
            report("\n".join(head + lines), args.out)
    if args.host_profile:
        text = host_profile({k: v for k, v in steps.items() if "eager" in k}, x, n, D, dtype, device)
        if rank == 0:
            with open(args.host_profile, "w") as f:
                f.write(text)
    if args.profile:  # where each candidate's step goes (the graphed ones replayed while alive): kernels, copies, fills
        tables = {**{name: kernel_table(step) for name, step in eager_steps.items()}, **tables}
        if rank == 0:
            with open(args.profile, "w") as f:
                f.write("\n\n".join(f"## {name}\n{table}" for name, table in tables.items()) + "\n")


if __name__ == "__main__":
    # after main() returns: its CUDA graphs, which captured NCCL work, must be gone before the groups are torn
    # down, or ncclCommDestroy waits forever (pytorch/pytorch#115388; the benchmark held 2 GPUs after its table)
    spmdmoe.shutdown(main())
