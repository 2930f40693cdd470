"""``all_to_all``: Varying rows with per-destination counts -> Varying (EP dispatch/combine).

Sync mode: split sizes must be host ints for ``all_to_all_single``. When only
device-side counts exist, :func:`exchange_counts` exchanges them on device
(one small ``all_to_all_single``) and then makes ONE explicit host transfer of
both send and receive splits (counted by ``host_sync_count``). A sync-free
path with a static capacity comes later.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch

from .._dist import all_reduce as _dist_all_reduce
from .._dist import all_to_all_single
from ..types.checks import checks_enabled
from ..types.errors import SPMDLayoutError
from ..types.mesh import MeshAxis, MeshLike, mesh_axis
from ..types.placement import Varying
from ..types.tensor import SPMDTensor
from ._common import differentiable, expect, restore_dim, result, rows_view, to_host

Counts = Union[Sequence[int], torch.Tensor]


def exchanged(local: torch.Tensor, send: list[int], recv: list[int], axis: MeshAxis, dim: int) -> torch.Tensor:
    """Rows to ranks by ``send`` splits, received source-major by ``recv`` splits (no autograd)."""
    rows = rows_view(local, dim)
    out = rows.new_empty((sum(recv), *rows.shape[1:]))
    all_to_all_single(out, rows, output_split_sizes=recv, input_split_sizes=send, group=axis.group)
    return restore_dim(out, dim)


class _AllToAll(torch.autograd.Function):
    """The exchange; backward is the exchange with send and receive splits swapped."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, send: list[int], recv: list[int], axis: MeshAxis, dim: int) -> torch.Tensor:  # type: ignore[override]
        ctx.meta = (send, recv, axis, dim)
        return exchanged(local, send, recv, axis, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        send, recv, axis, dim = ctx.meta
        return exchanged_op(grad, recv, send, axis, dim), None, None, None, None


exchanged_op = differentiable(_AllToAll, exchanged)


def exchange_counts(
    send_counts: torch.Tensor, mesh: MeshLike, *, rows: Optional[int] = None
) -> tuple[list[int], list[int]]:
    """Device-side count exchange, then ONE host transfer: ``(send, recv)`` as flat host lists.

    ``send_counts`` is an int tensor of shape ``(n,)``, or ``(n, k)`` for ``k``
    counts per destination (e.g. per local expert); the returned ``recv`` has
    the same layout with ``recv[src]`` what rank ``src`` sends here. Problems
    are checked on device and travel with the counts, so a bad input on one
    rank (wrong leading size, a negative count, counts that do not sum to
    ``rows``) raises ``SPMDLayoutError`` on every rank, with no extra
    collective and no extra sync.
    """
    axis = mesh_axis(mesh)
    n = axis.size
    counts = send_counts.to(device=axis.metadata_device(), dtype=torch.int64)
    if counts.dim() >= 1 and counts.shape[0] == n:
        flat = counts.reshape(n, -1)
        bad = (flat < 0).any()
        if rows is not None:
            bad = bad | (flat.sum() != rows)
        code: Union[int, torch.Tensor] = bad.to(torch.int64)
    else:  # wrong shape: still take part, with the error flag set
        width = counts[0].numel() if counts.dim() >= 1 and counts.shape[0] > 0 else 1
        flat, code = torch.zeros((n, width), dtype=torch.int64, device=counts.device), 2
    send, recv, codes = exchange_with_codes(flat, code, axis)
    if any(codes):
        bad_ranks = [r for r, c in enumerate(codes) if c]
        own = ""
        if codes[axis.rank] == 2:
            own = f"; this rank's send_counts have shape {tuple(send_counts.shape)}, expected leading size {n}"
        elif codes[axis.rank]:
            own = f"; this rank's send_counts {send} (rows to send: {rows})"
        raise SPMDLayoutError(
            f"rank {axis.rank}: exchange_counts rejected the send counts of ranks {bad_ranks}: "
            f"counts must be non-negative, one row per destination, summing to the rows sent{own}"
        )
    return send, recv


def exchange_with_codes(
    counts_nW: torch.Tensor, code: Union[int, torch.Tensor], axis: MeshAxis
) -> tuple[list[int], list[int], list[int]]:
    """One ``all_to_all_single`` of ``(n, W)`` counts plus a problem code, one host transfer.

    Returns this rank's flat send counts, the flat received counts (``W`` per
    source, source-major) and every rank's code (the same list on every rank),
    so callers raise together without another collective.
    """
    n, width = counts_nW.shape
    payload = torch.empty((n, width + 1), dtype=torch.int64, device=counts_nW.device)
    payload[:, :width] = counts_nW
    payload[:, width] = code
    received = torch.empty_like(payload)
    all_to_all_single(received, payload, group=axis.group)
    mine, theirs = to_host(torch.stack([payload, received]))
    codes = [row[width] for row in theirs]
    return [c for r in mine for c in r[:width]], [c for r in theirs for c in r[:width]], codes


def all_to_all(
    x: SPMDTensor,
    send_counts: Counts,
    recv_counts: Optional[Sequence[int]] = None,
    *,
    mesh: Optional[MeshLike] = None,
) -> SPMDTensor:
    """Varying -> Varying: the first ``send_counts[0]`` rows go to rank 0, the next to rank 1, ...

    Per rank: one ``all_to_all_single`` of the rows, received source-major
    (``recv_counts[src]`` rows from each ``src``). No padding.

    Counts: host lists are used as given. Without ``recv_counts`` (or with
    ``send_counts`` as a device tensor) they are exchanged on device and read
    back with one explicit host transfer (:func:`exchange_counts`).

    Checks: count lists of the wrong length, negative counts, or a
    ``send_counts`` sum that is not this rank's row count raise
    ``SPMDLayoutError`` on every rank together. When counts are exchanged this
    rides along with the exchange (always on, free); with both host lists given
    and checking on, it costs one tiny all-reduce and one sync. A
    ``recv_counts`` that does not match what the peers send is the caller's
    contract (``exchange_counts`` produces matching ones).

    Backward: the reverse all_to_all (send and receive splits swapped).

    >>> import torch, spmdmoe
    >>> pg = spmdmoe.testing.single_process_group()
    >>> v = spmdmoe.SPMDTensor(torch.ones(3, 2), pg, spmdmoe.Varying())
    >>> spmdmoe.all_to_all(v, [3], [3]).local_tokens
    3
    """
    expect(x, "all_to_all", (Varying,), mesh)
    axis, dim = x.axis, x.token_dim
    if isinstance(send_counts, torch.Tensor) or recv_counts is None:
        counts = send_counts if isinstance(send_counts, torch.Tensor) else torch.tensor(list(send_counts))
        send, recv = exchange_counts(counts, axis, rows=x.local_tokens)
    else:
        send, recv = list(send_counts), list(recv_counts)
        if checks_enabled():
            _check_host_counts(send, recv, x.local_tokens, axis)
    return result(x, exchanged_op(x.local, send, recv, axis, dim), Varying())


def _check_host_counts(send: list[int], recv: list[int], rows: int, axis: MeshAxis) -> None:
    """Collective verdict on caller-given host counts (one tiny all-reduce, one sync)."""
    problem = (
        _count_problem(send, axis.size, "send_counts")
        or _count_problem(recv, axis.size, "recv_counts")
        or (None if sum(send) == rows else f"send_counts sum to {sum(send)} but this rank has {rows} rows")
    )
    flags = torch.zeros(axis.size, dtype=torch.int32, device=axis.metadata_device())
    flags[axis.rank] = problem is not None
    _dist_all_reduce(flags, group=axis.group)
    bad = [r for r, f in enumerate(to_host(flags)) if f]
    if bad:
        mine = f"; this rank: {problem}" if problem else ""
        raise SPMDLayoutError(f"rank {axis.rank}: all_to_all rejected the counts of ranks {bad}{mine}")


def _count_problem(counts: Sequence[int], n: int, what: str) -> Optional[str]:
    if len(counts) != n:
        return f"{what} needs {n} entries (one per rank), found {len(counts)}"
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
        return f"{what} must be non-negative ints, found {list(counts)}"
    return None
