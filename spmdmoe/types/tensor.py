"""``SPMDTensor``: a local tensor plus its layout on one mesh axis.

The source of truth for token counts: spmdmoe never derives a global shape from ``local.shape * world``.

=========================  ===============================================
attribute                  meaning
=========================  ===============================================
``local``                  this rank's valid rows (autograd flows through)
``mesh`` / ``axis``        the mesh object given / its :class:`MeshAxis`
``placement``              ``Shard(d)``, ``Replicate()``, ``Partial()``, ``Varying()``
``token_dim``              the token dimension of ``local``
``global_tokens``          ``T``: valid rows of the global tensor
``local_tokens``           rows held here (chunk rule for Shard, ``T`` otherwise)
``padded_local_tokens``    ``ceil(T / n)``: rows per rank inside a collective
``padded_global_tokens``   ``padded_local_tokens * n``
``buffer``                 optional backing storage with spare tail rows
=========================  ===============================================

Construction checks only this rank's rows against this rank's metadata, with no communication (``SPMDTensor(...)``,
:meth:`SPMDTensor.from_buffer`, :meth:`SPMDTensor.with_local`, :func:`spmdmoe.shard`); a value that differs on
another rank goes unnoticed until the next collective: :func:`spmdmoe.from_local` and
:func:`spmdmoe.testing.check_layout` make the cross-rank check. What each checks, and the collective-checking
mode's hand-off of a local error (:data:`LOCAL_ERROR_HOOKS`): ``docs/design.md`` §3 ("Construction") and §6.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any, Callable, Iterator, Optional

import torch
import torch.utils._pytree as pytree

from . import layout
from .errors import SPMDLayoutError, SPMDTokenCountError
from .mesh import MeshAxis, MeshLike, mesh_axis
from .placement import Partial, Placement, Replicate, Shard, Varying

__all__ = ["SPMDTensor"]

_SLOTS = ("_local", "_axis", "_placement", "_global_tokens", "_token_dim", "_buffer")

# Called as ``hook(op, axis, error)`` just before a local constructor raises ``error`` on this rank alone. The
# collective-checking mode (``spmdmoe.collective_check``, which registers one) hands the error to the axis' next
# collective check, so the peers that go on into that collective raise it too instead of waiting there for this
# rank. This module itself talks to no rank.
LOCAL_ERROR_HOOKS: list[Callable[[str, "MeshAxis", Exception], None]] = []


@contextlib.contextmanager
def rejecting(op: str, axis: "MeshAxis") -> Iterator[None]:
    """The local checks of ``op`` on ``axis``: an ``SPMDLayoutError`` raised inside goes to
    :data:`LOCAL_ERROR_HOOKS` first, then on up (this rank alone raises it)."""
    try:
        yield
    except SPMDLayoutError as e:
        for hook in LOCAL_ERROR_HOOKS:
            hook(op, axis, e)
        raise


def _rows_expected(placement: Placement, total: int, axis: MeshAxis) -> int:
    if isinstance(placement, Shard):
        return layout.local_tokens(total, axis.size, axis.rank)
    return total


def _buffer_rows(placement: Placement, total: int, axis: MeshAxis) -> int:
    if isinstance(placement, Shard):
        return layout.padded_local_tokens(total, axis.size)
    return layout.padded_global_tokens(total, axis.size)


class SPMDTensor:
    """A local ``torch.Tensor`` with its placement and token counts on one mesh axis.

    Immutable and cheap to build; a pytree node (leaf: ``local``; context: the layout), so ``torch.compile`` and
    ``torch.utils._pytree`` see through it.

    Args:
        local: this rank's valid rows.
        mesh: a 1-D ``DeviceMesh``, ``(DeviceMesh, name)``, ``ProcessGroup`` or ``MeshAxis``.
        placement: ``Shard(dim)``, ``Replicate()``, ``Partial()`` or ``Varying()``.
        global_tokens: ``T``; required except for ``Varying``.
        token_dim: the token dimension of ``Replicate``/``Partial``/``Varying`` (``Shard``: its ``dim``). Default 0.

    Raises:
        SPMDLayoutError: ``local`` does not hold this rank's rows for ``T`` (checked on this rank only: see the module
            docstring for what is not checked across ranks).

    Example (one process, world size 1, so rank 0 holds every row):

    >>> import torch, torch.distributed as dist, spmdmoe
    >>> pg = spmdmoe.testing.single_process_group()
    >>> x = spmdmoe.SPMDTensor(torch.ones(5, 3), pg, spmdmoe.Shard(0), global_tokens=5)
    >>> x.local_tokens, x.padded_global_tokens
    (5, 5)
    >>> y = x.with_local(x.local * 2)
    >>> y.placement
    Shard(dim=0)
    """

    __slots__ = _SLOTS

    _local: torch.Tensor
    _axis: MeshAxis
    _placement: Placement
    _global_tokens: Optional[int]
    _token_dim: int
    _buffer: Optional[torch.Tensor]

    def __init__(
        self,
        local: torch.Tensor,
        mesh: MeshLike,
        placement: Placement,
        *,
        global_tokens: Optional[int] = None,
        token_dim: int = 0,
    ) -> None:
        axis = mesh_axis(mesh)
        with rejecting("SPMDTensor(...)", axis):
            dim = _check_token_dim(local, placement, token_dim, axis)
            total = None if isinstance(placement, Varying) else _check_total(global_tokens, axis)
            if total is not None and local.shape[dim] != _rows_expected(placement, total, axis):
                raise SPMDLayoutError(_bad_rows_message(placement, total, axis, local.shape[dim], dim))
        _init(self, local, axis, _normalised(placement, dim), total, dim, None)

    # ------------------------------------------------------------------ builders
    @classmethod
    def _new(
        cls,
        local: torch.Tensor,
        axis: MeshAxis,
        placement: Placement,
        global_tokens: Optional[int],
        token_dim: int,
        buffer: Optional[torch.Tensor] = None,
    ) -> "SPMDTensor":
        """Trusted constructor for library code: no checks at all."""
        self = object.__new__(cls)
        _init(self, local, axis, placement, global_tokens, token_dim, buffer)
        return self

    @classmethod
    def from_buffer(
        cls,
        buffer: torch.Tensor,
        mesh: MeshLike,
        placement: Placement,
        *,
        global_tokens: int,
        token_dim: int = 0,
    ) -> "SPMDTensor":
        """Wrap storage that holds the valid rows followed by spare tail rows.

        ``buffer`` has ``padded_local_tokens`` rows along the token dimension for ``Shard`` and ``padded_global_tokens``
        rows for ``Partial``/``Replicate``; ``.local`` is the view of the valid rows. A producer that writes into such a
        buffer lets a collective send it without a padding copy. Local checks only (row count, contiguity); nothing
        across ranks.
        """
        axis = mesh_axis(mesh)
        with rejecting("SPMDTensor.from_buffer", axis):
            if isinstance(placement, Varying):
                raise SPMDLayoutError(f"rank {axis.rank}: Varying tensors have no padded layout; build them with "
                                      "SPMDTensor(...)")
            dim = _check_token_dim(buffer, placement, token_dim, axis)
            total = _check_total(global_tokens, axis)
            want = _buffer_rows(placement, total, axis)
            if buffer.shape[dim] != want:
                raise SPMDLayoutError(
                    f"rank {axis.rank}: a {placement} buffer for global_tokens={total} on {axis.size} "
                    f"ranks must have {want} rows along dim {dim}, found {buffer.shape[dim]}; "
                    f"allocate it with spmdmoe.padded_empty(...)"
                )
            if not buffer.is_contiguous():
                raise SPMDLayoutError(
                    f"rank {axis.rank}: a padded buffer must be contiguous so a collective can send it "
                    f"without a copy, found strides {buffer.stride()} for shape {tuple(buffer.shape)}; "
                    "allocate it with spmdmoe.padded_empty(...)"
                )
        local = buffer.narrow(dim, 0, _rows_expected(placement, total, axis))
        return cls._new(local, axis, _normalised(placement, dim), total, dim, buffer)

    def with_local(self, local: torch.Tensor) -> "SPMDTensor":
        """The same layout around new local data (e.g. after a row-wise op).

        The token dimension must keep its size; other dimensions and the dtype may change. Raises
        :class:`SPMDLayoutError` otherwise. Only row-wise (per-token) ops keep a ``Shard`` meaningful, and only linear
        ops keep a ``Partial`` one: that part is the caller's promise. Not checked across ranks: a width or dtype that
        one rank changes and the others do not (use :func:`spmdmoe.testing.check_layout` in tests).
        """
        dim = self._token_dim
        if local.dim() <= dim or local.shape[dim] != self._local.shape[dim]:
            with rejecting("SPMDTensor.with_local", self._axis):  # on failure only: no cost in the forward
                raise SPMDLayoutError(
                    f"rank {self._axis.rank}: with_local must keep the token dimension {dim}: expected "
                    f"{self._local.shape[dim]} rows (layout {self._placement}, global_tokens="
                    f"{self._global_tokens}), found shape {tuple(local.shape)}; apply row-wise ops "
                    "to .local, or rebuild the layout with spmdmoe.from_local"
                )
        return SPMDTensor._new(local, self._axis, self._placement, self._global_tokens, dim)

    # ------------------------------------------------------------------ attributes
    @property
    def local(self) -> torch.Tensor:
        """This rank's valid rows (a view of ``buffer`` when there is one)."""
        return self._local

    @property
    def mesh(self) -> Any:
        """The mesh object this tensor was built with (DeviceMesh, ProcessGroup, ...)."""
        return self._axis.source

    @property
    def axis(self) -> MeshAxis:
        """The normalised mesh axis."""
        return self._axis

    @property
    def placement(self) -> Placement:
        return self._placement

    @property
    def token_dim(self) -> int:
        return self._token_dim

    @property
    def buffer(self) -> Optional[torch.Tensor]:
        """Backing storage with spare tail rows, or ``None``."""
        return self._buffer

    @property
    def global_tokens(self) -> int:
        """``T``, the valid rows of the global tensor (undefined for ``Varying``)."""
        if self._global_tokens is None:
            raise SPMDLayoutError(
                "a Varying tensor has no global tensor, so no global_tokens; use .local_tokens "
                "(this rank's rows)"
            )
        return self._global_tokens

    @property
    def local_tokens(self) -> int:
        """Valid rows held by this rank."""
        return self._local.shape[self._token_dim]

    @property
    def padded_local_tokens(self) -> int:
        """``ceil(T / n)``: rows each rank contributes to a collective."""
        if self._global_tokens is None:
            return self.local_tokens
        return layout.padded_local_tokens(self._global_tokens, self._axis.size)

    @property
    def padded_global_tokens(self) -> int:
        """``padded_local_tokens * n``: the virtually padded global length."""
        return layout.padded_global_tokens(self.global_tokens, self._axis.size)

    @property
    def global_shape(self) -> torch.Size:
        """The logical global shape (``local.shape`` with ``T`` on the token dim)."""
        shape = list(self._local.shape)
        shape[self._token_dim] = self.global_tokens
        return torch.Size(shape)

    @property
    def dtype(self) -> torch.dtype:
        return self._local.dtype

    @property
    def device(self) -> torch.device:
        return self._local.device

    @property
    def requires_grad(self) -> bool:
        return self._local.requires_grad

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("SPMDTensor is immutable: build a new one with with_local(...)")

    def __repr__(self) -> str:
        if self._global_tokens is None:
            counts = f"local_tokens={self.local_tokens}"
        else:
            counts = (
                f"global_tokens={self._global_tokens}, local_tokens={self.local_tokens}, "
                f"padded={self.padded_local_tokens}x{self._axis.size}"
            )
        return (
            f"SPMDTensor({self._placement}, rank {self._axis.rank}/{self._axis.size}, {counts}, "
            f"local={tuple(self._local.shape)} {self._local.dtype} on {self._local.device})"
        )


def _init(self: SPMDTensor, *values: Any) -> None:
    """Set the slots, in ``_SLOTS``' order: local, axis, placement, global tokens, token dim, buffer."""
    for name, value in zip(_SLOTS, values):
        object.__setattr__(self, name, value)


def _normalised(placement: Placement, dim: int) -> Placement:
    return Shard(dim) if isinstance(placement, Shard) and placement.dim != dim else placement


def _check_token_dim(t: torch.Tensor, placement: Placement, token_dim: int, axis: MeshAxis) -> int:
    if not isinstance(placement, (Shard, Replicate, Partial, Varying)):
        raise SPMDLayoutError(
            f"rank {axis.rank}: expected a placement Shard(d), Replicate(), Partial() or Varying(), "
            f"found {placement!r}"
        )
    dim = placement.dim if isinstance(placement, Shard) else token_dim
    nd = t.dim()
    if not -nd <= dim < nd or nd == 0:
        raise SPMDLayoutError(
            f"rank {axis.rank}: token dim {dim} is out of range for a tensor of shape "
            f"{tuple(t.shape)} ({nd} dims); pass a dim in [{-nd}, {nd})"
        )
    return dim % nd


_COUNT_PROBLEMS = {
    "tokens_type": "global_tokens must be a non-negative int (a Python or NumPy int, or a 1-element int tensor)",
    "tokens_negative": "global_tokens must be a non-negative int",
    "tokens_range": "global_tokens must fit in int64",
}


def parse_count(value: Any) -> tuple[int, str]:
    """``(int(value), "")``, or ``(value or -1, kind)`` naming why ``value`` is not a token count.

    Never raises: a rank with a bad count must still join the exchange that tells its peers (``spmdmoe.agreement``).
    """
    if isinstance(value, bool) or getattr(type(value), "__index__", None) is None:
        return -1, "tokens_type"
    try:
        v = operator.index(value)
    except (TypeError, ValueError, RuntimeError):
        return -1, "tokens_type"
    if v < 0:
        return v, "tokens_negative"
    return (v, "") if v < 2**63 else (v, "tokens_range")


def count_message(value: Any, kind: str, rank: int) -> str:
    shown = repr(value) if len(repr(value)) < 60 else f"a {type(value).__name__}"
    return f"rank {rank}: {_COUNT_PROBLEMS[kind]}, found {type(value).__name__} {shown}"


def _check_total(total: Any, axis: MeshAxis) -> int:
    value, kind = parse_count(total)
    if kind:
        raise SPMDTokenCountError(count_message(total, kind, axis.rank))
    return value


def _bad_rows_message(placement: Placement, total: int, axis: MeshAxis, rows: int, dim: int) -> str:
    expected = _rows_expected(placement, total, axis)
    if isinstance(placement, Shard):
        rule = layout.chunk_counts(total, axis.size) if axis.size <= 16 else "chunk rule"
        fix = (
            f"cut the global tensor with spmdmoe.shard(x, mesh) or rows [{layout.chunk_offset(total, axis.size, axis.rank)}"
            f":{layout.chunk_offset(total, axis.size, axis.rank) + expected}), or declare the real global_tokens"
        )
        return (
            f"rank {axis.rank}: bad SP split for global_tokens={total} on {axis.size} ranks: expected "
            f"{expected} rows along dim {dim} (chunk rule {rule}), found {rows}; fix: {fix}"
        )
    return (
        f"rank {axis.rank}: a {placement} tensor with global_tokens={total} must hold all {total} rows "
        f"along dim {dim}, found {rows}; declare global_tokens={rows} or pass the full tensor"
    )


def _flatten_with_keys(x: SPMDTensor) -> tuple[list[tuple[Any, torch.Tensor]], tuple[Any, ...]]:
    """The pytree node: leaf ``local`` (key ``local``), context ``(axis, placement, global tokens, token dim)``."""
    return [(pytree.GetAttrKey("local"), x._local)], (x._axis, x._placement, x._global_tokens, x._token_dim)


pytree.register_pytree_node(
    SPMDTensor,
    lambda x: ([x._local], _flatten_with_keys(x)[1]),
    lambda leaves, ctx: SPMDTensor._new(leaves[0], *ctx),
    serialized_type_name="spmdmoe.SPMDTensor",
    flatten_with_keys_fn=_flatten_with_keys,
)
