"""Every rank agrees: the one mechanism behind every check whose verdict can differ between ranks.

A rank never raises alone (its peers would wait in their next collective until the process-group timeout): it sets
a *problem bit* (:data:`KINDS`) and keeps its own detail; the bits and the *fields* that must be equal everywhere
form a small int64 row, and every rank derives the same verdict from the exchanged rows. The rows travel (a) riding
the EP count exchange (``exchange_counts``), (b) in :func:`agree`'s check exchange, or (c) recorded in a layer's
``sticky.ProblemFlag`` and raised at the step boundary. (a), (b) and ``check_errors`` share one collective, the
*check exchange* (:func:`check_payload`, :func:`check_exchange`: ``CHECK_WORDS`` int64 a peer, ``[tag, bits,
payload..., zeros]``, the tag from :data:`OPS`), so a rank in one check while its peers are in another raises with
them (:func:`mixed_ops_error`). The modes, which check takes which, their cost: ``docs/design.md`` §6. What this
covers and what it cannot:

======================================================  ==============================================================
covered (every rank raises)                             not covered (the ranks wait until the process-group timeout)
======================================================  ==============================================================
any two of: ``from_local``, ``parallelize_moe``,         a rank that skips a data collective (a gather, a
``load_state_dict``, ``init_mesh`` and ``product_axis``, scatter, the rows' all-to-all) or meets one with a check;
``exchange_counts``, ``all_to_all``'s host-count check,  the EP count exchange of a layer with more than
``sync_grads``' agreement, ``spmdmoe.testing``'s checks, ``CHECK_WORDS - 3`` = 125 local experts (its width is a
``check_errors``, and the sync EP layer's count exchange  multiple of ``CHECK_WORDS``) against a narrower check;
(eager)                                                 the SP token exchange (``token_exchange.py``: an all-gather
                                                        that good ranks do not read), sync-free transports (no
                                                        host read) and a compiled graph (its count exchange's tags
                                                        are not read); the bias update's count all-reduce
======================================================  ==============================================================
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence, Union

import torch
import torch.distributed as dist

from ._dist import all_to_all_single
from .collective_check import check_collective
from .host import to_host
from .types.checks import checks_mode
from .types.errors import (
    MoEConfigError,
    SPMDDeviceError,
    SPMDDtypeError,
    SPMDLayoutError,
    SPMDMeshError,
    SPMDRoutingError,
    SPMDCapacityError,
    SPMDCollectiveError,
    SPMDShapeError,
    SPMDTokenCountError,
)
from .types.mesh import MeshAxis, mesh_axis

__all__ = [
    "KINDS",
    "Kind",
    "Problem",
    "ProblemSink",
    "Field",
    "agree",
    "verdict",
    "exchange_rows",
    "problems_error",
    "local_problem",
    "check_payload",
    "check_exchange",
    "mixed_ops_error",
    "raise_if",
    "world_axis",
    "alone",
    "global_rank",
    "dtype_code",
    "dtype_name",
]


@dataclass(frozen=True)
class Kind:
    name: str
    error: type[Exception]
    what: str


# One bit per kind, in this order. When several kinds are reported, the error raised is the type of
# the first one listed (the most specific first: a device problem outranks a count problem).
KINDS: tuple[Kind, ...] = (
    Kind("device", SPMDDeviceError, "tensor on a device the backend cannot use"),
    Kind("tokens_type", SPMDTokenCountError, "global_tokens is not an int"),
    Kind("tokens_negative", SPMDTokenCountError, "global_tokens is negative"),
    Kind("tokens_range", SPMDTokenCountError, "global_tokens does not fit in int64"),
    Kind("not_tensor", SPMDLayoutError, "not a torch.Tensor"),
    Kind("token_dim", SPMDLayoutError, "token dim out of range"),
    Kind("placement", SPMDLayoutError, "unknown placement"),
    Kind("mesh", SPMDMeshError, "mesh argument not usable as one axis"),
    Kind("counts", SPMDLayoutError, "bad counts"),
    Kind("input_layout", SPMDLayoutError, "input is not in the layer's layout"),
    Kind("input_mesh", SPMDMeshError, "input lives on another mesh axis"),
    Kind("dtype", SPMDDtypeError, "input dtype is not the layer's"),
    Kind("width", SPMDShapeError, "input width is not the model dim"),
    Kind("config", MoEConfigError, "MoE config or plan cannot work"),
    Kind("state_dict", SPMDLayoutError, "state dict entry cannot be loaded"),
    Kind("nonfinite", SPMDRoutingError, "non-finite router logits (NaN or inf in the rank's input rows or gate "
         "weight: skip the step, or find the source with torch.isfinite on the layer's input)"),
    Kind("failed", AssertionError, "check failed"),
    Kind("capacity", SPMDCapacityError, "more rows than the sync-free EP buffers hold (the fix: a larger "
         "max_tokens or capacity_factor in parallelize_moe or swap_moe, or ep_mode='sync')"),
    Kind("grad_mode", SPMDCollectiveError, "it ran the forward with grad off while its peers had it on (their "
                                           "backward would wait for it: torch.no_grad() on some ranks only)"),
    Kind("grad_set", SPMDLayoutError,
         "it trains another set of parameters than its peers' (reduce_grads) or than agreed (sync_grads)"),
)
BIT = {kind.name: 1 << i for i, kind in enumerate(KINDS)}
GRAD_OFF = 1 << 62  # not a problem: a marker riding with the bits (this rank's forward runs with grad off)


def grad_mode_codes(codes: Sequence[int]) -> list[int]:
    """Exchanged codes with the :data:`GRAD_OFF` marker resolved: a ``grad_mode`` problem on the ranks with grad
    off when some rank has it on (their backward would wait for those ranks), else nothing."""
    off = [bool(c & GRAD_OFF) for c in codes]
    mixed = any(off) and not all(off)
    return [(c & ~GRAD_OFF) | (BIT["grad_mode"] if mixed and o else 0) for c, o in zip(codes, off)]


class ProblemSink(Protocol):
    """Where a forward's problem is kept when it is not raised at once: a layer's ``sticky.ProblemFlag``."""

    def record(self, bits: Union[int, torch.Tensor], device: torch.device, details: Sequence[str] = ()) -> None: ...


@dataclass
class Problem:
    """What this rank found, from where it is found to where it is raised: problem bits (one per kind,
    :data:`KINDS`), the detail messages only this rank can write, and the sink that keeps them when they are
    not raised at once (a parallel layer's sticky flag; ``None``: nowhere, e.g. an agreement that raises now).

    ``bits`` is a host int while only host checks have run (``if problem:`` reads it); a device-side check
    (non-finite router logits, :meth:`add_device`) makes it a device int64 scalar, which is never read on the
    host in the forward (that would sync): the transport sends it along an exchange or :meth:`record` s it.
    """

    bits: Union[int, torch.Tensor] = 0
    details: list[str] = dataclasses.field(default_factory=list)
    flag: Optional[ProblemSink] = None

    def add(self, kind: str, detail: str) -> None:
        """A problem of ``kind`` (a name of :data:`KINDS`) found on the host, with this rank's message."""
        self.bits = self.bits | BIT[kind]
        self.details.append(detail)

    def add_device(self, bits: torch.Tensor) -> None:
        """OR device-side bits (an int64 scalar) in, with no host read (onto no host bits: the bits themselves,
        no kernel)."""
        self.bits = bits if isinstance(self.bits, int) and self.bits == 0 else self.bits | bits

    def record(self, bits: Union[int, torch.Tensor], device: torch.device) -> None:
        """Keep ``bits`` (this problem's, or the share of them an exchange left to this rank) in :attr:`flag`."""
        if self.flag is not None:
            self.flag.record(bits, device, self.details)

    def __bool__(self) -> bool:
        if isinstance(self.bits, torch.Tensor):
            raise TypeError("a Problem with device-side bits cannot be tested on the host without a sync; "
                            "hand it to a transport, which carries or records it")
        return bool(self.bits)


@dataclass(frozen=True)
class Field:
    """A value every rank must agree on; ``show`` prints one value, ``fix`` says what to do."""

    name: str
    error: type[Exception] = SPMDLayoutError
    show: Callable[[int], str] = str
    fix: str = ""


_DTYPES = [getattr(torch, name) for name in (
    "float32", "float64", "float16", "bfloat16", "complex64", "complex128", "int8", "int16", "int32", "int64",
    "uint8", "bool", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
) if hasattr(torch, name)]


def dtype_code(dtype: torch.dtype) -> int:
    """A small int for ``dtype`` (an agreement field): its index in a fixed table, or -1."""
    return _DTYPES.index(dtype) if dtype in _DTYPES else -1


def dtype_name(code: int) -> str:
    return str(_DTYPES[code]).replace("torch.", "") if 0 <= code < len(_DTYPES) else "another dtype"


def world_axis() -> MeshAxis:
    """The default process group as a :class:`MeshAxis`."""
    return mesh_axis(dist.group.WORLD)  # type: ignore[arg-type]


# The check exchange: the one collective shape of every exchange above that is read on the host (modes (a) and
# (b), and ``check_errors``), so that any two of them meet as the same collective and can read each other.
CHECK_WORDS = 128  # int64 columns a rank sends each peer (a payload past 126 words takes a multiple of it)
_TAG = 0x5350_4D44 << 24  # "SPMD": a tag is _TAG + the op's index in OPS (counts or zeros never read as a tag)
# Every check exchange, by the name its errors use; a new one is added here.
OPS: tuple[str, ...] = (
    "from_local", "parallelize_moe", "load_state_dict", "init_mesh", "exchange_counts", "all_to_all",
    "sync_grads", "spmdmoe.testing check", "expert layout", "mesh grid", "MoE dispatch", "check_errors",
    "sequence_parallel",
)


def check_width(words: int) -> int:
    """The columns a check exchange sends each peer for a payload of ``words`` int64 (two header words more)."""
    return CHECK_WORDS * max(1, -(-(words + 2) // CHECK_WORDS))


def check_payload(op: str, bits: Union[int, torch.Tensor], payload_nW: torch.Tensor) -> torch.Tensor:
    """What this rank sends each peer in ``op``'s check exchange: an ``(n, check_width(W))`` int64 table whose
    row ``r`` goes to rank ``r``: ``[tag of op, bits, payload_nW[r], zeros]`` (device ops only, no host read).
    ``bits``: this rank's problem bits (a host int or a device int64 scalar), the same in every row."""
    n, width = payload_nW.shape
    send = torch.zeros((n, check_width(width)), dtype=torch.int64, device=payload_nW.device)
    send[:, 0] = _tag(op)
    send[:, 1] = bits
    send[:, 2:2 + width] = payload_nW
    return send


def check_exchange(axis: MeshAxis, send: torch.Tensor) -> torch.Tensor:
    """One ``all_to_all_single`` of a :func:`check_payload` table: row ``r`` of the result is what rank ``r``
    sent here. Two check exchanges of the same width meet as the same collective, whatever their ops."""
    received = torch.empty_like(send)
    all_to_all_single(received, send, group=axis.group)
    return received


def _tag(op: str) -> int:
    """``op``'s tag: its index in :data:`OPS`, or for another name (a caller's own agreement) its CRC-32."""
    return _TAG + (OPS.index(op) if op in OPS else 1 << 16 | zlib.crc32(op.encode()) & 0xFFFF)


def _op_name(tag: int) -> str:
    if 0 <= tag - _TAG < len(OPS):
        return OPS[tag - _TAG]
    return "another agreement" if 0 <= tag - _TAG < 1 << 17 else "an exchange that is not one of spmdmoe's checks"


def mixed_ops_error(op: str, heads: Sequence[Sequence[int]], details: Sequence[str] = (),
                    ranks: Optional[Sequence[int]] = None) -> Optional[Exception]:
    """The error every rank raises when the ``[tag, bits]`` heads it received name more than one op (``None``
    when every rank is in the same one): ranks out of step (one in ``from_local``, its peers in a layer's count
    exchange, say). Any rank's problem bits decide the type (the problem is why they went apart: a rank that
    skipped an exchange its input made wrong); otherwise :class:`SPMDCollectiveError`."""
    tags = [int(h[0]) for h in heads]
    if len(set(tags)) == 1:
        return None
    ranks = list(range(len(heads))) if ranks is None else list(ranks)
    where: dict[str, list[int]] = {}
    for r, t in zip(ranks, tags):
        where.setdefault(_op_name(t), []).append(r)
    apart = "; ".join(f"rank(s) {rs} in {name}" for name, rs in where.items())
    why = (f"ranks are in different spmdmoe exchanges ({apart}): every rank must make the same spmdmoe calls in "
           f"the same order (a tensor built locally on some ranks where the others call from_local, a call made "
           f"under a rank-dependent condition)")
    problem = problems_error(op, [int(h[1]) & ~GRAD_OFF for h in heads], details, ranks)
    if problem is not None:
        return type(problem)(f"{problem}\n  {why}")
    return SPMDCollectiveError(f"{op}: {why}")


def raise_if(error: Optional[Exception]) -> None:
    """Raise ``error`` (a verdict: :func:`problems_error`, :func:`mixed_ops_error`, :func:`verdict`), if any."""
    if error is not None:
        raise error


def exchange_rows(axis: Optional[MeshAxis], row: Union[Sequence[int], torch.Tensor], op: str,
                  bits: Union[int, torch.Tensor] = 0) -> list[list[int]]:
    """Every rank's ``row`` (same length everywhere), in rank order: one check exchange, one host read.

    ``axis`` ``None`` means the world; ``op``: the exchange's name in :data:`OPS`; ``bits``: this rank's problem
    bits, which decide the error when ranks turn out to be in different exchanges (:func:`mixed_ops_error`,
    raised on every rank). Without an initialised process group the table is this rank's row alone.
    """
    if not dist.is_initialized():
        return [[int(v) for v in (row.tolist() if isinstance(row, torch.Tensor) else row)]]
    axis = world_axis() if axis is None else axis
    device = axis.metadata_device()
    mine = row.to(device=device, dtype=torch.int64) if isinstance(row, torch.Tensor) else torch.tensor(
        [v if -(2**63) <= v < 2**63 else -(2**63) for v in map(int, row)], dtype=torch.int64, device=device)
    received = check_exchange(axis, check_payload(op, bits, mine.view(1, -1).expand(axis.size, -1)))
    table = to_host(received[:, :2 + mine.numel()])
    raise_if(mixed_ops_error(op, table, ranks=axis.ranks))
    return [r[2:] for r in table]


def global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def alone() -> bool:
    """Whether this process is the whole job (nobody could wait on it in a collective)."""
    return not dist.is_initialized() or dist.get_world_size() == 1


def _kinds(bits: int) -> list[Kind]:
    return [kind for i, kind in enumerate(KINDS) if bits >> i & 1]


def problems_error(
    op: str, bits_by_rank: Sequence[int], details: Sequence[str] = (), ranks: Optional[Sequence[int]] = None
) -> Optional[Exception]:
    """The error every rank raises for these per-rank bits (``None`` when all are zero)."""
    ranks = list(range(len(bits_by_rank))) if ranks is None else list(ranks)
    bad = [(r, b) for r, b in zip(ranks, bits_by_rank) if b]
    if not bad:
        return None
    error = next(kind.error for i, kind in enumerate(KINDS) if any(b >> i & 1 for _, b in bad))
    parts = "; ".join(f"rank {r}: " + ", ".join(k.what for k in _kinds(b)) for r, b in bad)
    own = "".join(f"\n  this rank: {d}" for d in details)
    return error(f"{op} rejected the input on {len(bad)} of {len(bits_by_rank)} ranks ({parts}){own}")


def local_problem(bits: int, details: Sequence[str]) -> Optional[Exception]:
    """This rank's problem alone (``None``: none), for a verdict that names the ranks itself (the collective-checking
    mode's): the error of its most specific kind, saying what each kind is, then this rank's details."""
    kinds = _kinds(bits)
    return kinds[0].error(", ".join(k.what for k in kinds) + "".join(f"; {d}" for d in details)) if kinds else None


def disagreement_error(op: str, fields: Sequence[Field], table: Sequence[Sequence[int]]) -> Optional[Exception]:
    """The error for the first field whose values differ between ``[bits, *fields, ...]`` rows (``None`` if all
    agree)."""
    for i, field in enumerate(fields, 1):
        values = [row[i] for row in table]
        if len(set(values)) > 1:
            if len(values) <= 16:
                shown = "per rank [" + ", ".join(field.show(v) for v in values) + "]"
            else:
                groups: dict[int, list[int]] = {}
                for r, v in enumerate(values):
                    groups.setdefault(v, []).append(r)
                shown = "; ".join(f"{field.show(v)} on ranks {rs}" for v, rs in groups.items())
            fix = field.fix or f"every rank must pass the same {field.name}"
            return field.error(f"{op}: ranks disagree on the {field.name}: {shown}; {fix}")
    return None


def agree(
    op: str,
    axis: Optional[MeshAxis],
    found: Problem,
    fields: Sequence[tuple[Field, int]] = (),
    extra: Sequence[int] = (),
    global_ranks: bool = False,
) -> list[list[int]]:
    """Mode (b): exchange ``[bits, *fields, *extra]`` and raise the same error everywhere, or return the table.

    Raises when any rank found a problem (the most specific kind's error type, naming every offending rank, with this
    rank's details) or a field differs between ranks. ``extra`` columns are returned for the caller's own rules, which
    it must derive from the table alone so every rank agrees. Ranks are named by index in ``axis`` (or global rank).
    """
    if checks_mode() == "collectives":  # a rank in another check meets this one's record (not a hang)
        check_collective(op, world_axis() if axis is None else axis, None, None, {"grad_enabled": None})
    row = [found.bits, *(value for _, value in fields), *extra]
    table = exchange_rows(axis, row, op, found.bits)
    raise_if(verdict(op, axis, table, found, [f for f, _ in fields], global_ranks))
    return table


def verdict(op: str, axis: Optional[MeshAxis], table: Sequence[Sequence[int]], found: Problem,
            fields: Sequence[Field] = (), global_ranks: bool = False) -> Optional[Exception]:
    """:func:`agree`'s error for an exchanged ``table`` of ``[bits, *fields, ...]`` rows (``None``: all agree), for
    a caller that decides from the table whether to raise now or to agree again over more ranks."""
    ranks = None
    if global_ranks and dist.is_initialized():
        ranks = (world_axis() if axis is None else axis).ranks
    return problems_error(op, [r[0] for r in table], found.details, ranks) or disagreement_error(op, fields, table)
