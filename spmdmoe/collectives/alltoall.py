"""``all_to_all``: Varying rows with per-destination counts -> Varying (EP dispatch/combine).

Per rank one ``all_to_all_single`` of the rows, no padding; backward: the reverse exchange (:func:`all_to_all`).
Sync mode: the splits are host ints; device-side counts are exchanged on device first and read back in ONE counted
host transfer (``spmdmoe.host.to_host``), their problems riding that exchange (``spmdmoe.agreement`` mode (a)).
The sync-free path (no host read) is ``spmdmoe.moe.transports.sync_free``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed._functional_collectives as funcol

from .._dist import all_to_all_single
from ..agreement import (BIT, Field, Problem, agree, check_exchange, check_payload, mixed_ops_error,
                         problems_error, raise_if)
from ..autograd import GRAD_LEAF, always_recorded, collective_op, written
from ..host import DelayedRead, to_host, tracing
from ..types.mesh import MeshAxis, MeshLike, mesh_axis
from ..types.placement import Varying
from ..types.tensor import SPMDTensor, parse_count
from ._common import expect, restore_dim, result, rows_view

Counts = Union[Sequence[int], torch.Tensor]
_WIDTH = Field("count width (counts per destination)", fix="every rank must pass counts of the same shape")


def exchanged(local: torch.Tensor, send: list[int], recv: list[int], axis: MeshAxis, dim: int) -> torch.Tensor:
    """Rows to ranks by ``send`` splits, received source-major by ``recv`` splits (no autograd)."""
    rows = rows_view(local, dim)
    out = rows.new_empty((sum(recv), *rows.shape[1:]))
    all_to_all_single(out, rows, output_split_sizes=recv, input_split_sizes=send, group=axis.group)
    return restore_dim(written(out), dim)


class _AllToAll(torch.autograd.Function):
    """The exchange; backward is the exchange with send and receive splits swapped."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, send: list[int], recv: list[int], axis: MeshAxis, dim: int,  # type: ignore[override]
                grad_leaf: torch.Tensor) -> torch.Tensor:
        ctx.meta = (send, recv, axis, dim)
        return exchanged(local, send, recv, axis, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        send, recv, axis, dim = ctx.meta
        return _exchanged_op(grad, recv, send, axis, dim), None, None, None, None, None


_exchanged_op = collective_op(_AllToAll, exchanged)


def exchanged_op(local: torch.Tensor, send: list[int], recv: list[int], axis: MeshAxis, dim: int) -> torch.Tensor:
    """:func:`exchanged` with its backward (the reverse exchange), recorded on every rank whenever grad mode is on.
    Under ``torch.compile`` (split sizes traced scalars): torch's functional ``all_to_all_single_autograd`` on an
    input made to require grad (``always_recorded``)."""
    if not torch.compiler.is_compiling():
        return _exchanged_op(local, send, recv, axis, dim)
    rows = always_recorded(rows_view(local, dim))
    return restore_dim(funcol.all_to_all_single_autograd(rows, recv, send, axis.group), dim)


def _launched(local: torch.Tensor, send: list[int], recv: list[int], axis: MeshAxis, dim: int
              ) -> tuple[torch.Tensor, Any]:
    """:func:`exchanged` issued asynchronously: ``(out, work)``; ``out`` holds the rows once ``work.wait()``
    has run (eagerly on NCCL: the current stream then waits for NCCL's)."""
    rows = rows_view(local, dim)
    out = rows.new_empty((sum(recv), *rows.shape[1:]))
    work = all_to_all_single(out, rows, output_split_sizes=recv, input_split_sizes=send, group=axis.group,
                             async_op=True)
    return restore_dim(out, dim), work


class _InFlight:
    """One launched exchange between its two autograd nodes: its splits, the forward's work, the reverse exchange."""

    def __init__(self, send: list[int], recv: list[int], axis: MeshAxis, dim: int):
        self.send, self.recv, self.axis, self.dim = send, recv, axis, dim
        self.work: Any = None
        self.back: Optional[tuple[torch.Tensor, Any]] = None


class _AllToAllLaunched(torch.autograd.Function):
    """:class:`_AllToAll` issued asynchronously, read through :class:`_Waited`; backward waits for the reverse."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, flight: _InFlight, grad_leaf: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.flight = flight
        out, flight.work = _launched(local, flight.send, flight.recv, flight.axis, flight.dim)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, _grad: torch.Tensor) -> Any:  # type: ignore[override]
        flight: _InFlight = ctx.flight
        assert flight.back is not None, "the reverse exchange is launched by _Waited's backward"
        out, work = flight.back
        flight.back = None
        work.wait()
        return out, None, None


class _Waited(torch.autograd.Function):
    """The rows of a launched exchange, once it has finished; backward launches the reverse exchange."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, flight: _InFlight) -> torch.Tensor:  # type: ignore[override]
        ctx.flight = flight
        flight.work.wait()
        flight.work = None  # a work holds its tensors: the send and receive buffers would outlive the forward
        return out.view_as(out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        f: _InFlight = ctx.flight
        f.back = _launched(grad, f.recv, f.send, f.axis, f.dim)
        return grad, None


def exchange_launched(local: torch.Tensor, send: list[int], recv: list[int], axis: MeshAxis, dim: int
                      ) -> Callable[[], torch.Tensor]:
    """:func:`exchanged_op` started now and finished by the call it returns, which gives its rows (nothing may
    read them before): work issued in between runs while they travel (e.g. the shared experts under the EP
    combine). Backward, recorded as :func:`exchanged_op` records it: the reverse exchange, launched at the wait's
    node and waited for at the launch's (docs/design.md §5, step 3). First order only (``once_differentiable``).
    Under ``torch.compile`` it is :func:`exchanged_op`.

    The wait must be called on every path that launched: a forward that stops between launch and wait (a
    non-reentrant checkpoint's recomputation ends once it has the tensors it needs) leaves the exchange unjoined.
    The MoE layer's waits are each followed by an op that saves tensors for the backward (the experts; the
    combine's ``permute.weighted_combine``), so a recomputation of the layer reaches every wait."""
    if torch.compiler.is_compiling():
        out = exchanged_op(local, send, recv, axis, dim)
        return lambda: out
    if torch.is_grad_enabled() and (local.is_floating_point() or local.is_complex()):
        flight = _InFlight(send, recv, axis, dim)
        out = _AllToAllLaunched.apply(local, flight, GRAD_LEAF)
        return _Once(lambda: _Waited.apply(out, flight))
    out, work = _launched(local, send, recv, axis, dim)
    return _Once(lambda: (work.wait(), out)[1])


class _Once:
    """A launched exchange's wait: called once, it then holds nothing, so the receive buffer lives as long as
    its rows are in use, not as long as whoever keeps the call (a transport's closure, a layer's frame)."""

    def __init__(self, wait: Callable[[], torch.Tensor]):
        self.wait: Optional[Callable[[], torch.Tensor]] = wait

    def __call__(self) -> torch.Tensor:
        wait, self.wait = self.wait, None
        if wait is None:
            raise RuntimeError("a launched exchange is waited for once")
        return wait()


def exchange_with_codes(
    counts_nW: torch.Tensor, code: Union[int, torch.Tensor], axis: MeshAxis, op: str = "exchange_counts"
) -> tuple[list[int], list[int], list[int], torch.Tensor]:
    """Agreement mode (a): one check exchange of ``(n, W)`` counts plus the problem bits, one host read.

    ``W`` must be the same on every rank (a fact the caller has agreed). Returns this rank's flat send counts, the
    flat received counts (``W`` per source, source-major), every rank's problem bits (the same list on every rank,
    so callers raise together) and the received counts still on the device, ``(n, W)``. A rank in another check
    exchange of the same width raises on every rank.
    """
    width = counts_nW.shape[1]
    payload = check_payload(op, code, counts_nW)  # row r: [tag, bits, counts_nW[r], zeros], to rank r
    received = check_exchange(axis, payload)  # row r: what rank r sent here (nothing read on the host)
    mine, theirs = to_host(torch.stack([payload[:, :2 + width], received[:, :2 + width]]))
    raise_if(mixed_ops_error(op, theirs, ranks=axis.ranks))
    codes = [row[1] for row in theirs]
    return ([c for r in mine for c in r[2:]], [c for r in theirs for c in r[2:]], codes,
            received[:, 2:2 + width])


def exchange_split_sizes(
    copies_ne: torch.Tensor, rows_n: torch.Tensor, code: Union[int, torch.Tensor], axis: MeshAxis,
    details: Sequence[str] = (),
) -> Callable[[], tuple[list[int], list[int], list[int], list[int]]]:
    """The EP dispatch's count exchange: :func:`exchange_with_codes` of ``(n, e + 1)`` counts per destination
    rank (the copies for each of its ``e`` local experts, then the rows sent to it: ``moe/transports/dedup.py`` sends a
    token once per rank), with the sums the dispatch needs taken on the device first, so the one host read
    carries ``4n + e`` ints and no host loop grows with ``n * e``. Started now; the call it returns makes that
    read (on CUDA a copy started now, :class:`spmdmoe.host.DelayedRead`: the host issues what comes between while
    the counts travel, and waits for the copy alone) and gives the rows to send to and receive from each rank, the
    copies received per local expert, and every rank's problem bits. Eager, a rank in another check exchange
    (``from_local`` on its peers, say) raises on every rank, with ``details`` (this rank's problem) in the
    message; traced, the tags are not read (no data-dependent raise in a graph)."""
    n, e = copies_ne.shape
    payload = check_payload("MoE dispatch", code, torch.cat([copies_ne, rows_n.view(n, 1)], dim=1))
    received = check_exchange(axis, payload)
    traced = torch.compiler.is_compiling()
    table = torch.cat([payload[:, 2 + e], received[:, 2 + e], received[:, 2:2 + e].sum(0), received[:, 1],
                       *(() if traced else (received[:, 0],))])
    read = (lambda: to_host(table)) if tracing() else DelayedRead(table).get

    def read_split_sizes() -> tuple[list[int], list[int], list[int], list[int]]:
        host = read()
        codes = host[2 * n + e:3 * n + e]
        if not traced:
            raise_if(mixed_ops_error("MoE dispatch", list(zip(host[3 * n + e:], codes)), details, axis.ranks))
        return host[:n], host[n:2 * n], host[2 * n:2 * n + e], codes
    return read_split_sizes


def _exchange(send_counts: torch.Tensor, axis: MeshAxis, rows: Optional[int], width: int, op: str,
              bad: Optional[str] = None) -> tuple[list[int], list[int]]:
    """The count exchange at an agreed ``width``; a rank whose counts have another shape (or ``bad``,
    a problem its caller found) takes part with zeros and its problem bit set."""
    n = axis.size
    counts = send_counts.to(device=axis.metadata_device(), dtype=torch.int64)
    shaped = bad is None and counts.numel() == n * width and counts.dim() >= 1 and counts.shape[0] == n
    if shaped:
        flat = counts.reshape(n, width)
        wrong = (flat < 0).any()
        if rows is not None:
            wrong = wrong | (flat.sum() != rows)
        code: Union[int, torch.Tensor] = wrong.to(torch.int64) * BIT["counts"]
    else:
        flat, code = torch.zeros((n, width), dtype=torch.int64, device=counts.device), BIT["counts"]
    send, recv, codes, _ = exchange_with_codes(flat, code, axis)
    if codes[axis.rank]:
        detail = (f"rank {axis.rank}: send counts {send} must be non-negative and sum to the rows sent ({rows})"
                  if shaped else bad or f"rank {axis.rank}: send counts of shape {tuple(send_counts.shape)}, "
                  f"expected ({n},{'' if width == 1 else f' {width}'}) (one row per destination rank)")
        raise_if(problems_error(op, codes, [detail]))
    raise_if(problems_error(op, codes))
    return send, recv


def exchange_counts(
    send_counts: torch.Tensor, mesh: MeshLike, *, rows: Optional[int] = None
) -> tuple[list[int], list[int]]:
    """Device-side count exchange, then ONE host transfer: ``(send, recv)`` as flat host lists.

    ``send_counts`` is an int tensor of shape ``(n,)``, or ``(n, k)`` for ``k`` counts per destination (e.g. per
    local expert); ``recv`` has the same layout, ``recv[src]`` what rank ``src`` sends here. A negative count,
    counts that do not sum to ``rows`` or a wrong leading size raise ``SPMDLayoutError`` on every rank, carried by
    the count exchange itself. The width ``k`` sizes that exchange, so it is agreed first, in every checking mode
    (mode (b): one small check exchange and host read more). A fixed-width caller (the MoE layer, whose ``e`` was
    agreed at ``parallelize_moe``) uses the exchange directly.
    """
    axis = mesh_axis(mesh)
    n = axis.size
    shaped = send_counts.dim() >= 1 and send_counts.shape[0] == n
    width = send_counts[0].numel() if shaped else -1
    found = Problem()
    if not shaped:
        found.add("counts", f"rank {axis.rank}: send counts of shape {tuple(send_counts.shape)}, "
                            f"expected leading size {n} (one row per destination rank)")
    agree("exchange_counts", axis, found, [(_WIDTH, width)])
    return _exchange(send_counts, axis, rows, max(width, 1), "exchange_counts")


def all_to_all(
    x: SPMDTensor,
    send_counts: Counts,
    recv_counts: Optional[Sequence[int]] = None,
    *,
    mesh: Optional[MeshLike] = None,
) -> SPMDTensor:
    """Varying -> Varying: the first ``send_counts[0]`` rows go to rank 0, the next to rank 1, ...

    Per rank: one ``all_to_all_single`` of the rows, received source-major (``recv_counts[src]`` rows from each
    ``src``). No padding. Backward: the reverse all_to_all (splits swapped), recorded on every rank whenever grad
    mode is on.

    Counts: host lists (Python or NumPy ints) are used as given. Without ``recv_counts`` (or with ``send_counts`` a
    device tensor of shape ``(n,)``) they are exchanged on device and read back in one host transfer
    (:func:`exchange_counts`' exchange at width 1). Count lists of the wrong length, negative counts, or a
    ``send_counts`` sum that is not this rank's row count raise ``SPMDLayoutError`` on every rank: riding the count
    exchange, or with both host lists a check exchange of the send counts and one agreement (every checking mode;
    docs/design.md §6), which also catches a ``recv_counts`` that contradicts what the peers send.

    >>> import torch, spmdmoe
    >>> pg = spmdmoe.testing.single_process_group()
    >>> v = spmdmoe.SPMDTensor(torch.ones(3, 2), pg, spmdmoe.Varying())
    >>> spmdmoe.all_to_all(v, [3], [3]).local_tokens
    3
    """
    expect(x, "all_to_all", (Varying,), mesh)
    axis, dim = x.axis, x.token_dim
    if isinstance(send_counts, torch.Tensor):
        send, recv = _exchange(send_counts, axis, x.local_tokens, 1, "all_to_all")
    elif recv_counts is None:
        host = _ints(send_counts)
        bad = _count_problem(host, axis.size, "send_counts")
        counts = torch.zeros(0, dtype=torch.int64) if bad else torch.tensor(host, dtype=torch.int64)
        send, recv = _exchange(counts, axis, x.local_tokens, 1, "all_to_all", bad and f"rank {axis.rank}: {bad}")
    else:
        send, recv = _ints(send_counts), _ints(recv_counts)
        _check_host_counts(send, recv, x.local_tokens, axis)
    return result(x, exchanged_op(x.local, send, recv, axis, dim), Varying())


def _ints(counts: Sequence[Any]) -> list[Any]:
    """Counts as Python ints where they are ints of any kind (NumPy too); others are left for the check."""
    return [value if not kind else c for c, (value, kind) in zip(counts, map(parse_count, counts))]


def _check_host_counts(send: list[int], recv: list[int], rows: int, axis: MeshAxis) -> None:
    """Collective verdict on caller-given host counts: a check exchange of the send counts (each rank learns what
    every peer sends it) and its host read, then the bits' agreement (mode (b)). A ``recv_counts`` that contradicts
    the peers' is the receiving rank's problem, raised on every rank (not one gloo error and the others' hang)."""
    n = axis.size
    problem = (
        _count_problem(send, n, "send_counts")
        or _count_problem(recv, n, "recv_counts")
        or (None if sum(send) == rows else f"send_counts sum to {sum(send)} but this rank has {rows} rows")
    )
    # a rank with a problem of its own sends -1 (unknown): its peers do not blame their receive counts for it
    mine = torch.tensor([-1] * n if problem else send, dtype=torch.int64, device=axis.metadata_device())
    sent = exchange_with_codes(mine[:, None], 0, axis, "all_to_all")[1]  # sent[src]: src's count for this rank
    if problem is None:
        wrong = [src for src in range(n) if sent[src] >= 0 and sent[src] != recv[src]]
        if wrong:
            problem = (f"recv_counts {recv} expect {[recv[s] for s in wrong]} rows from rank(s) {wrong}, which send "
                       f"{[sent[s] for s in wrong]}; pass recv_counts=None to have them exchanged")
    found = Problem()
    if problem:
        found.add("counts", f"rank {axis.rank}: {problem}")
    agree("all_to_all", axis, found)


def _count_problem(counts: Sequence[Any], n: int, what: str) -> Optional[str]:
    if len(counts) != n:
        return f"{what} needs {n} entries (one per rank), found {len(counts)}"
    if any(parse_count(c)[1] for c in counts):
        return f"{what} must be non-negative ints that fit in int64, found {list(counts)}"
    return None
