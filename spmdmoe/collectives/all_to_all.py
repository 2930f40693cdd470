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
from ._common import expect, restore_dim, result, rows_view, to_host

Counts = Union[Sequence[int], torch.Tensor]


class _AllToAll(torch.autograd.Function):
    """Rows to ranks by ``send`` splits, received by ``recv`` splits; backward swaps them."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, send: list[int], recv: list[int], axis: MeshAxis, dim: int) -> torch.Tensor:  # type: ignore[override]
        ctx.meta = (send, recv, axis, dim)
        rows = rows_view(local, dim)
        out = rows.new_empty((sum(recv), *rows.shape[1:]))
        all_to_all_single(out, rows, output_split_sizes=recv, input_split_sizes=send, group=axis.group)
        return restore_dim(out, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        send, recv, axis, dim = ctx.meta
        return _AllToAll.apply(grad, recv, send, axis, dim), None, None, None, None


def exchange_counts(send_counts: torch.Tensor, mesh: MeshLike) -> tuple[list[int], list[int]]:
    """Device-side count exchange, then one host transfer: ``(send, recv)`` as host lists.

    ``send_counts`` is an int tensor of shape ``(n,)`` (or ``(n, k)`` for k
    counts per destination, e.g. per local expert); ``recv[src]`` is what rank
    ``src`` sends here. Returned lists are flat, row-major.
    """
    axis = mesh_axis(mesh)
    send_t = send_counts.to(device=axis.metadata_device(), dtype=torch.int64).contiguous()
    if send_t.shape[0] != axis.size:
        raise SPMDLayoutError(
            f"rank {axis.rank}: send_counts needs one row per destination rank: expected leading size "
            f"{axis.size}, found shape {tuple(send_t.shape)}"
        )
    recv_t = torch.empty_like(send_t)
    all_to_all_single(recv_t, send_t, group=axis.group)
    both = to_host(torch.stack([send_t.reshape(-1), recv_t.reshape(-1)]))
    return both[0], both[1]


def _count_problem(counts: Sequence[int], n: int, what: str) -> Optional[str]:
    if len(counts) != n:
        return f"{what} needs {n} entries (one per rank), found {len(counts)}"
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
        return f"{what} must be non-negative ints, found {list(counts)}"
    return None


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

    Checks (when checking is on): count lists of the wrong length, negative
    counts, or a ``send_counts`` sum that is not this rank's row count raise
    ``SPMDLayoutError`` on every rank together (one tiny all-reduce). A
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
        send, recv = exchange_counts(counts, axis)
    else:
        send, recv = list(send_counts), list(recv_counts)
    if checks_enabled():
        problem = (
            _count_problem(send, axis.size, "send_counts")
            or _count_problem(recv, axis.size, "recv_counts")
            or (None if sum(send) == x.local_tokens else f"send_counts sum to {sum(send)} but this rank has {x.local_tokens} rows")
        )
        flags = torch.zeros(axis.size, dtype=torch.int32, device=axis.metadata_device())
        flags[axis.rank] = problem is not None
        _dist_all_reduce(flags, group=axis.group)
        bad = [r for r, f in enumerate(to_host(flags)) if f]
        if bad:
            mine = f"; this rank: {problem}" if problem else ""
            raise SPMDLayoutError(f"rank {axis.rank}: all_to_all rejected the counts of ranks {bad}{mine}")
    return result(x, _AllToAll.apply(x.local, send, recv, axis, dim), Varying())
