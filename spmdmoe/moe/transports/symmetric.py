"""The sync-free EP transport over CUDA symmetric memory: each rank reads its peers' rows over NVLink.

Legend: ``T`` tokens routed here (at most ``Tm = T_max``), ``K`` top-k, ``D`` model dim, ``E`` experts, ``e``
local experts, ``n`` EP ranks, ``Q = n * Tm`` rows received (source ``s``'s token ``t`` at row ``s * Tm + t``),
``R`` the experts' rows (a static capacity), ``W = 2K`` a token's ids and weights.

:class:`SymmetricTransport` keeps ``SyncFreeTransport``'s contract (static sizes, no host sync, a graph captures
it, fullgraph compile, the overflow kept on the device and raised on every rank) and its results bit for bit, but
uses no NCCL and pads nothing on the wire: a rank reads only the rows that cross (its receive buffers are
``(n * Tm, D)``, rows no token fills zero). Per forward, two ops, each stage, barrier, read, barrier:
``spmdmoe::peer_dispatch`` (every rank's ids and weights, from which each derives the same experts' demand and
overflow verdict, then from each source the tokens that have an expert here) and ``spmdmoe::peer_pull_sum`` (each
source sums its tokens' rows from the ranks they visited, in rank order); backward ``spmdmoe::peer_pull_rows`` and
``spmdmoe::peer_dispatch_backward``. The barriers are bounded by :data:`TIMEOUT_MS` (a peer that never arrives
traps); a compiled, checkpointed layer needs :func:`checkpoint_policy`; :func:`symmetric_usable` says where it
applies (NCCL, one host). The moves, the staging buffer and its limits: ``docs/design.md`` §5.1 ("On one host").
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch._higher_order_ops.effects import _register_effectful_op
from torch._library.effects import EffectType
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ...autograd import always_recorded
from ...kernels.backend import op_required
from ...kernels.peer_rows import PeerRows, pull_rows, pull_sum
from ...agreement import Problem
from ...types.errors import MoEConfigError
from ...types.mesh import MeshAxis
from .dedup import destinations, pack_meta, received_order
from .routed import RoutedTokens, routed_copies
from .sync_free import SyncFreeTransport

__all__ = ["SymmetricTransport", "symmetric_usable", "TIMEOUT_MS", "PEER_OPS", "checkpoint_policy"]

# a barrier's bound (ms); SPMDMOE_PEER_TIMEOUT_MS overrides it (torchtitan's default comm timeout is 300 s)
TIMEOUT_MS = int(os.environ.get("SPMDMOE_PEER_TIMEOUT_MS", 300_000))

_one_host: dict[str, bool] = {}


def symmetric_usable(axis: MeshAxis) -> bool:
    """Whether :class:`SymmetricTransport` serves ``axis``: NCCL, CUDA symmetric memory importable, every rank of
    the group on this host with peer access to the others' GPUs (asked where the ranks number the GPUs alike),
    and ``SPMDMOE_EP_SYMMETRIC`` not ``0``. A collective over the group whenever NCCL serves it (building a
    sync-free layer, ``set_ep_mode``: every rank of it asks at the same point): the setting all-gathered each
    time (differing between ranks: ``MoEConfigError`` on every rank, never two transports), the hardware the
    first time (hostnames and GPUs, then each rank's verdict); every rank gets the same answer."""
    if not _nccl(axis):
        return False
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError:
        return False
    name, n = axis.group.group_name, axis.size
    if name not in _one_host:
        gpu = torch.cuda.current_device() if torch.cuda.is_available() else -1
        mine = (socket.gethostname(), os.environ.get("CUDA_VISIBLE_DEVICES"), gpu)
        seen: list[Any] = [None] * n
        torch.distributed.all_gather_object(seen, mine, group=axis.group)
        usable = len({host for host, _, _ in seen}) == 1
        if usable and len({visible for _, visible, _ in seen}) == 1:  # one numbering: ask for every peer's GPU
            usable = all(torch.cuda.can_device_access_peer(gpu, d) for _, _, d in seen if d != gpu)
        verdicts: list[Any] = [None] * n
        torch.distributed.all_gather_object(verdicts, usable, group=axis.group)
        _one_host[name] = all(verdicts)
    settings: list[Any] = [None] * n
    torch.distributed.all_gather_object(settings, os.environ.get("SPMDMOE_EP_SYMMETRIC", "1") != "0", group=axis.group)
    if len(set(settings)) > 1:
        off = [axis.ranks[r] for r, on in enumerate(settings) if not on]
        raise MoEConfigError(f"SPMDMOE_EP_SYMMETRIC=0 on ranks {off} of the EP group {list(axis.ranks)} only: the "
                             "ranks would take different sync-free transports (symmetric memory, the padded "
                             "all-to-all) and hang; set it alike on every rank")
    return settings[0] and _one_host[name]


def _nccl(axis: MeshAxis) -> bool:
    return "nccl" in str(torch.distributed.get_backend(axis.group))


@dataclass
class _Staging:
    buf: torch.Tensor  # uint8, this rank's symmetric buffer
    hdl: Any  # its _SymmetricMemory handle
    offset: int  # bytes from the start of the handle's buffer to ``buf`` (a pooled allocation may not start it)
    ptrs: torch.Tensor  # int64 (n,): every rank's address of its ``buf``, on the device
    views: dict[torch.dtype, PeerRows]
    captured: bool = False  # a CUDA graph captured a move on it


_staging: dict[tuple[str, int], _Staging] = {}
_retired: list[_Staging] = []  # grown out of after a CUDA graph captured them: kept alive for its replays


def _allocate(group: str, device: torch.device, nbytes: int) -> tuple[torch.Tensor, Any]:
    """A symmetric ``uint8`` buffer of ``nbytes`` on every rank of ``group`` and its handle (a collective)."""
    from torch.distributed import _symmetric_memory as symm_mem

    buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    return buf, symm_mem.rendezvous(buf, group)


def _buffer(group: str, device: torch.device, nbytes: int) -> _Staging:
    """The group's staging buffer, at least ``nbytes``: allocated or grown (a collective rendezvous: every rank
    asks for the same sizes in the same order) when too small."""
    key = (group, device.index or 0)
    st = _staging.get(key)
    if st is None or st.buf.numel() < nbytes:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("spmdmoe's symmetric EP buffer must grow during CUDA graph capture: run one eager "
                               "forward and backward at the captured sizes before capturing")
        size = max(nbytes, 2 * st.buf.numel() if st is not None else 1 << 20)  # (a 0-byte rendezvous: no handle)
        if st is not None and st.captured:
            _retired.append(st)
        buf, hdl = _allocate(group, device, size)
        # the handle's buffers may start before ``buf`` (torch's symmetric memory can carve ``buf`` out of a pooled
        # block; the same offset on every rank): address every rank's copy of ``buf`` itself, never the block's start
        offset = buf.data_ptr() - hdl.get_buffer(hdl.rank, (1,), torch.uint8).data_ptr()
        own = hdl.get_buffer(hdl.rank, (size,), torch.uint8, offset)
        if offset < 0 or own.data_ptr() != buf.data_ptr():
            raise RuntimeError(f"spmdmoe's symmetric EP buffer: the handle's view of this rank's buffer starts at "
                               f"{own.data_ptr():#x}, the buffer at {buf.data_ptr():#x}; set SPMDMOE_EP_SYMMETRIC=0 "
                               "(the padded all-to-all transport) and report the torch version")
        ptrs = torch.tensor([hdl.get_buffer(r, (size,), torch.uint8, offset).data_ptr()
                             for r in range(hdl.world_size)], dtype=torch.int64)
        if device.type == "cuda":  # from pinned memory: no host sync
            ptrs = ptrs.pin_memory().to(device, non_blocking=True)
        st = _staging[key] = _Staging(buf, hdl, offset, ptrs, {})
    return st


def _peers(st: _Staging, dtype: torch.dtype) -> PeerRows:
    """Every rank's staging buffer (its copy of ``buf``) as flat ``dtype`` elements."""
    if dtype not in st.views:
        n, numel, first = st.hdl.world_size, st.buf.numel() // dtype.itemsize, st.offset // dtype.itemsize
        views = tuple(st.hdl.get_buffer(r, (numel,), dtype, first) for r in range(n))
        st.views[dtype] = PeerRows(views, st.ptrs, st.hdl.rank)
    return st.views[dtype]


def _regions(parts: list[tuple[int, torch.dtype]]) -> tuple[list[int], int]:
    """The byte offset of each ``(numel, dtype)`` region laid one after another, 16-byte aligned, and the total."""
    starts, nbytes = [], 0
    for numel, dtype in parts:
        starts.append(nbytes)
        nbytes += -(-numel * dtype.itemsize // 16) * 16
    return starts, nbytes


def _staged(group: str, *parts: tuple[torch.Tensor, int]) -> tuple[list[tuple[PeerRows, int]], Any]:
    """Each ``(src, numel)`` region, in order (16-byte aligned), of this rank's staging buffer: ``src`` copied to
    its start, then a barrier, after which every rank's regions are readable. Returns each region's
    ``(peers, element offset)`` and the handle (whose ``barrier`` the caller makes once it has read)."""
    starts, nbytes = _regions([(numel, src.dtype) for src, numel in parts])
    st = _buffer(group, parts[0][0].device, nbytes)
    st.captured = st.captured or (st.buf.is_cuda and torch.cuda.is_current_stream_capturing())
    regions = []
    for (src, _), start in zip(parts, starts):
        peers = _peers(st, src.dtype)
        offset = start // src.dtype.itemsize
        peers.views[peers.rank][offset: offset + src.numel()].view_as(src).copy_(src)
        regions.append((peers, offset))
    st.hdl.barrier(channel=0, timeout_ms=TIMEOUT_MS)
    return regions, st.hdl


# The moves, each a collective custom op over ``group`` (stage, barrier, read, barrier). Under torch.compile the
# compiler orders the ops it cannot tell apart by data however it likes, and may order them differently on
# different ranks (their sizes differ); so every op that a forward or a backward can reach independently of
# the others is ONE op: the dispatch moves its ids and its rows together, and its backward their gradients.

def _peer_dispatch(x_TD: torch.Tensor, meta_TW: torch.Tensor, need_Tn: torch.Tensor, group: str, t_max: int,
                   first: int, last: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The dispatch's reads: ``(x_QD, meta_QW, mask_Q)``. ``meta_QW`` row ``s * t_max + t`` is rank ``s``'s
    ``meta_TW[t]`` (``(t_max, W)`` on every rank: ``W/2`` weights then ``W/2`` expert ids, ``-1`` on rows past
    its tokens); ``mask_Q``: whether any of the row's ids is in ``[first, last)`` (this rank's experts); ``x_QD``
    row ``s * t_max + t`` rank ``s``'s ``x_TD[t]`` (``(T <= t_max, D)``) where ``mask_Q`` is set, zero
    elsewhere. ``need_Tn`` (bool ``(T, n)``: the ranks each of this rank's tokens visits) is for the backward,
    :func:`peer_dispatch_backward`."""
    D, W, n = x_TD.shape[1], meta_TW.shape[1], need_Tn.shape[1]
    # sized once for the step's largest move (the dispatch's backward: every received row and its ids-and-weights)
    _buffer(group, x_TD.device, _regions([(n * t_max * D, x_TD.dtype), (n * t_max * W, meta_TW.dtype)])[1])
    ((meta, m_off), (rows, x_off)), hdl = _staged(group, (meta_TW.contiguous(), t_max * W),
                                                  (x_TD.contiguous(), t_max * D))
    meta_QW = pull_rows(meta, torch.ones(n * t_max, dtype=torch.bool, device=x_TD.device), t_max, W, m_off)
    ids_QK = meta_QW[:, W // 2:]
    mask_Q = ((ids_QK >= first) & (ids_QK < last)).any(1)
    x_QD = pull_rows(rows, mask_Q, t_max, D, x_off)
    hdl.barrier(channel=0, timeout_ms=TIMEOUT_MS)
    return x_QD, meta_QW, mask_Q


def _peer_dispatch_backward(grad_x_QD: torch.Tensor, grad_meta_QW: torch.Tensor, need_Tn: torch.Tensor, group: str,
                            t_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`peer_dispatch`'s backward: ``grad_x_QD`` ``(Q, D)`` and ``grad_meta_QW`` ``(Q, W)`` (fp32 / fp64), the
    gradients of its received rows and ids-and-weights on this rank, staged for their sources; returns
    ``(grad_x_TD, grad_meta_TW)``: each of this rank's tokens' row gradient summed (fp32, rank order, rounded
    once) over the ranks ``need_Tn`` (bool ``(T, n)``) names, and its ids-and-weights gradient summed over every
    rank, ``(t_max, W)``. ``group``: the EP group's name; ``t_max``: its ``T_max``."""
    Q, D = grad_x_QD.shape
    W = grad_meta_QW.shape[1]
    ((rows, x_off), (meta, m_off)), hdl = _staged(group, (grad_x_QD.contiguous(), Q * D),
                                                  (grad_meta_QW.contiguous(), Q * W))
    grad_x_TD = pull_sum(rows, need_Tn, t_max, D, x_off)
    every_Tn = torch.ones((t_max, need_Tn.shape[1]), dtype=torch.bool, device=need_Tn.device)
    grad_meta_TW = pull_sum(meta, every_Tn, t_max, W, m_off)
    hdl.barrier(channel=0, timeout_ms=TIMEOUT_MS)
    return grad_x_TD, grad_meta_TW


def _peer_pull_rows(src_TD: torch.Tensor, mask_Q: torch.Tensor, group: str, t_max: int) -> torch.Tensor:
    """``(Q, D)``: row ``s * t_max + t`` is rank ``s``'s ``src_TD[t]`` (``(T <= t_max, D)``) where ``mask_Q``
    (bool ``(Q,)``) is set, zero elsewhere (the combine's backward)."""
    D = src_TD.shape[1]
    ((rows, off),), hdl = _staged(group, (src_TD.contiguous(), t_max * D))
    out_QD = pull_rows(rows, mask_Q, t_max, D, off)
    hdl.barrier(channel=0, timeout_ms=TIMEOUT_MS)
    return out_QD


def _peer_pull_sum(src_QD: torch.Tensor, need_Tn: torch.Tensor, mask_Q: torch.Tensor, group: str, t_max: int
                   ) -> torch.Tensor:
    """``(T, D)``: row ``t`` the fp32 sum, in rank order, of rank ``d``'s ``src_QD[me * t_max + t]`` over the
    ranks ``need_Tn[t]`` marks, rounded once (the combine). Backward: :func:`peer_pull_rows` with
    ``mask_Q`` (this rank's: which received rows it read)."""
    Q, D = src_QD.shape
    ((rows, off),), hdl = _staged(group, (src_QD.contiguous(), Q * D))
    out_TD = pull_sum(rows, need_Tn, t_max, D, off)
    hdl.barrier(channel=0, timeout_ms=TIMEOUT_MS)
    return out_TD


def _keep_dispatch(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    _, _, need_Tn, ctx.group, ctx.t_max, _, _ = inputs
    ctx.save_for_backward(need_Tn)


def _dispatch_backward(ctx: Any, grad_x_QD: torch.Tensor, grad_meta_QW: torch.Tensor, _mask: Any
                       ) -> tuple[Optional[torch.Tensor], ...]:
    (need_Tn,) = ctx.saved_tensors
    grad_x_TD, grad_meta_TW = peer_dispatch_backward(grad_x_QD, grad_meta_QW, need_Tn, ctx.group, ctx.t_max)
    return grad_x_TD, grad_meta_TW, None, None, None, None, None


def _keep_sum(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    _, _, mask_Q, ctx.group, ctx.t_max = inputs
    ctx.save_for_backward(mask_Q)


def _sum_backward(ctx: Any, grad_TD: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
    (mask_Q,) = ctx.saved_tensors
    return peer_pull_rows(grad_TD, mask_Q, ctx.group, ctx.t_max), None, None, None, None


class _PeerOp:
    """A move: ``spmdmoe::<name>``, a custom op with ordered side effects, where torch must see one (under
    ``torch.compile``; under a dispatch mode: fake tensors, selective checkpointing's policy); elsewhere ``fn``
    itself, through :class:`_Eager` (the op's ``backward``) when grad mode is on: the custom op's dispatch and
    generated autograd cost 0.2-0.5 ms of host time a call inside a step (2x H200, issue 61), four calls a
    step. A move without a backward takes the custom op when an input needs grad (a second-order backward),
    which raises on every rank alike."""

    def __init__(self, name: str, fn: Callable[..., Any], backward: Optional[Callable[..., Any]] = None,
                 setup: Optional[Callable[..., None]] = None):
        self.fn, self.backward, self.setup = fn, backward, setup
        self.op = torch.library.custom_op(f"spmdmoe::{name}", mutates_args=())(fn)
        # Collectives, not functions: under torch.compile an op whose result is unused or empty (a rank with no
        # tokens, a rank that stood in zero rows) would be dropped, or a backward op moved into the forward, on
        # that rank only, and its peers' barriers would pair with the wrong op. Ordered side effects: every call
        # stays, in program order.
        _register_effectful_op(self.op, EffectType.ORDERED)
        if backward is not None:
            self.op.register_autograd(backward, setup_context=setup)

    def __call__(self, *args: Any) -> Any:
        if self.backward is None:  # the launchers' rule (kernels/backend.py)
            return self.op(*args) if torch.compiler.is_compiling() or op_required(*args) else self.fn(*args)
        if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
            return self.op(*args)
        return _Eager.apply(self, *args) if torch.is_grad_enabled() else self.fn(*args)


class _Eager(torch.autograd.Function):
    """A move with a backward, eagerly: its function, context and backward as the custom op registers them."""

    @staticmethod
    def forward(ctx: Any, move: _PeerOp, *inputs: Any) -> Any:  # type: ignore[override]
        out = move.fn(*inputs)
        move.setup(ctx, inputs, out)  # type: ignore[misc]
        ctx.move = move
        return out

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override]
        return None, *ctx.move.backward(ctx, *grads)


peer_dispatch = _PeerOp("peer_dispatch", _peer_dispatch, _dispatch_backward, _keep_dispatch)
peer_dispatch_backward = _PeerOp("peer_dispatch_backward", _peer_dispatch_backward)
peer_pull_rows = _PeerOp("peer_pull_rows", _peer_pull_rows)
peer_pull_sum = _PeerOp("peer_pull_sum", _peer_pull_sum, _sum_backward, _keep_sum)
PEER_OPS = tuple(p.op for p in (peer_dispatch, peer_dispatch_backward, peer_pull_rows, peer_pull_sum))
_OVERLOADS = frozenset(op._opoverload for op in PEER_OPS)


@peer_dispatch.op.register_fake
def _(x_TD, meta_TW, need_Tn, group, t_max, first, last):  # type: ignore[no-untyped-def]
    Q = t_max * need_Tn.shape[1]
    return x_TD.new_empty((Q, x_TD.shape[1])), meta_TW.new_empty((Q, meta_TW.shape[1])), \
        x_TD.new_empty((Q,), dtype=torch.bool)


@peer_dispatch_backward.op.register_fake
def _(grad_x_QD, grad_meta_QW, need_Tn, group, t_max):  # type: ignore[no-untyped-def]
    return grad_x_QD.new_empty((need_Tn.shape[0], grad_x_QD.shape[1])), \
        grad_meta_QW.new_empty((t_max, grad_meta_QW.shape[1]))


@peer_pull_rows.op.register_fake
def _(src_TD, mask_Q, group, t_max):  # type: ignore[no-untyped-def]
    return src_TD.new_empty((mask_Q.shape[0], src_TD.shape[1]))


@peer_pull_sum.op.register_fake
def _(src_QD, need_Tn, mask_Q, group, t_max):  # type: ignore[no-untyped-def]
    return src_QD.new_empty((need_Tn.shape[0], src_QD.shape[1]))


def checkpoint_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """A selective activation checkpointing policy (``torch.utils.checkpoint.create_selective_checkpoint_contexts``)
    that saves the transport's moves and recomputes the rest. Under ``torch.compile`` a checkpointed layer over
    this transport needs it (or another policy that saves :data:`PEER_OPS`): plain checkpointing would rerun the
    dispatch in the backward, which torch 2.13's compiler refuses for an op with ordered effects
    (``AssertionError: backward num_erased_inputs``), and which, unordered, could pair with the wrong barrier.
    Eager checkpointing needs nothing (the recomputation reruns the moves on every rank alike)."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _OVERLOADS else CheckpointPolicy.PREFER_RECOMPUTE


@dataclass(frozen=True)
class _Handle:
    need_Tn: torch.Tensor  # bool (T, n): whether token t visited rank d
    mask_Q: torch.Tensor  # bool (Q,): whether this rank read received row q
    t_max: int
    rows: int  # the rows routed (more than t_max: those past it got no expert and return zero)


class SymmetricTransport(SyncFreeTransport):
    """Sync-free EP over CUDA symmetric memory (the module docstring); ``SyncFreeTransport``'s arguments."""

    backward_in_flight = False  # its moves run on the compute stream, one op each

    def sizes(self, t_max: int) -> tuple[int, int]:
        """``(T_max, R)``: no slots here (a source's every token can cross), ``R`` as ``SyncFreeTransport``'s."""
        return t_max, super().sizes(t_max)[1]

    def launch_dispatch(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, *, t_max: int,
                        problem: Optional[Problem] = None, fp8_rows: bool = False) -> Callable[[], RoutedTokens]:
        """:meth:`SyncFreeTransport.launch_dispatch`'s contract and result (bit for bit), the rows read from the
        peers now (on the compute stream: nothing runs under them). Rows past ``T_max`` (a problem the layer
        recorded, raised at the step boundary) are not sent and return zero. Collectives: one read of peer
        memory over EP (every rank's ids and weights, then the rows with an expert here) between barriers; its
        reverse in the backward. Recorded for the backward whenever grad mode is on, whatever ``x_TD`` needs
        (``spmdmoe.autograd``: a rank that stood in zero rows runs the backward's reads too)."""
        rows, K = x_TD.shape[0], ids_TK.shape[1]
        if problem is not None:
            problem.record(problem.bits, x_TD.device)
        if rows > t_max:  # the admission recorded the problem (``T_max``): the rows past T_max are not sent
            x_TD, ids_TK, weights_TK = x_TD[:t_max], ids_TK[:t_max], weights_TK[:t_max]
        n, e, me, E = self.axis.size, self.local_experts, self.axis.rank, self.num_experts
        _, R = self.sizes(t_max)
        # rows past this rank's tokens: no expert (a pad, not a cat: under compile a cat guards on an empty part)
        meta_TW = torch.nn.functional.pad(pack_meta(ids_TK, weights_TK), (0, 0, 0, t_max - x_TD.shape[0]), value=-1.0)
        need_Tn = destinations(ids_TK, e, n)
        x_QD, meta_QW, mask_Q = peer_dispatch(always_recorded(x_TD), meta_TW, need_Tn, self.axis.group.group_name,
                                              t_max, me * e, me * e + e)
        # every rank read every rank's ids: the same demand and verdict everywhere, with no other collective
        order = received_order(meta_QW[:, K:], me, e, R, total=E)  # its counts: every rank's demand
        self._record((meta_QW[:, K] >= 0).view(n, t_max).sum(1).max(),
                     order[2].view(n, e).sum(1).max(), t_max, R, t_max)
        routed = routed_copies(x_QD, order, meta_QW[:, :K], R, fp8_rows=fp8_rows,
                               handle=_Handle(need_Tn, mask_Q, t_max, rows))
        return lambda: routed

    def combine(self, y_QD: torch.Tensor, routed: RoutedTokens) -> torch.Tensor:
        """:meth:`SyncFreeTransport.combine`'s result: each token's rows read from the ranks it visited and
        summed (on the compute stream)."""
        h: _Handle = routed.handle
        y_TD = peer_pull_sum(always_recorded(y_QD), h.need_Tn, h.mask_Q, self.axis.group.group_name, h.t_max)
        return torch.cat([y_TD, y_TD.new_zeros(h.rows - h.t_max, y_TD.shape[1])]) if h.rows > h.t_max else y_TD

    def launch_combine(self, y_QD: torch.Tensor, routed: RoutedTokens) -> Callable[[], torch.Tensor]:
        """:meth:`combine`, done now: nothing runs under its reads."""
        y_TD = self.combine(y_QD, routed)
        return lambda: y_TD
