"""``parallelize_moe``: the same layer over an SP axis, an EP axis, or both.

Legend: ``T`` local valid tokens, ``D`` model dim, ``F`` expert hidden dim, ``E`` experts, ``e = E / ep`` local experts,
``K`` top-k, ``R`` rows received by the local experts, ``n`` EP ranks, ``S`` rows of one sync-free slot.

Plans: SP ``local`` (each SP rank routes its own rows), SP ``gather`` (all_gather over SP, the experts' ``F``
split over SP, reduce_scatter) and EP (all-to-all dispatch and combine, a block of ``e`` experts a rank). After
``backward`` of a loss summed over the SP group's tokens every ``.grad`` is the single-device gradient (experts:
this rank's slice); the reduction across batches is :meth:`ParallelMoE.batch_reductions`'. Plans, gradient sums and
admission: ``docs/design.md`` §5 ("Plans"); the agreement and the stand-in of a rank whose input fails: §6.
"""

from __future__ import annotations

import copy
from typing import Literal, Optional, Union

import torch

from ...sticky import check_errors
from ...types.errors import MoEConfigError
from ...types.mesh import MeshAxis, MeshLike
from ..experts.grouped import experts_block
from ..layer import MoE, OwnRows, _Layer
from ..params.checkpoint import expert_layout, expert_shard, install_hooks
from ..params.grads import GradReduction, agree_grad_set, batch_reductions, sync_grads
from ..params.overlap import inside_fsdp_unit
from ..transports.dispatch import transport_for
from ..transports.sync_free import SyncFreeTransport
from .admission import Admission
from .gather_mode import GatheredRows
from .plan import agree_plan
from .ride import Ride

__all__ = ["parallelize_moe", "ParallelMoE"]


def parallelize_moe(
    moe: MoE,
    *,
    sp_mesh: Optional[MeshLike] = None,
    ep_mesh: Optional[MeshLike] = None,
    dp_mesh: Optional[MeshLike] = None,
    sp_mode: Literal["local", "gather"] = "local",
    agree_over: Optional[MeshLike] = None,
    ep_mode: Literal["sync", "sync_free"] = "sync",
    capacity_factor: Optional[float] = None,
    max_tokens: Optional[int] = None,
    device: Optional[Union[str, torch.device]] = None,
) -> "ParallelMoE":
    """This rank's part of ``moe`` over the given axes (same parameter names, sliced experts).

    ``forward`` takes an ``SPMDTensor`` sharded (``Shard(0)``) on ``sp_mesh`` and returns one with the same layout; with
    ``sp_mesh=None`` it takes and returns a plain ``(T_rank, D)`` tensor or a ``Varying`` ``SPMDTensor`` (each rank its
    own batch; ``T_rank`` may differ and be 0). ``moe``'s router, shared experts and ``expert_bias`` are copied, its
    experts sliced; build ``moe`` identically on every rank (same seed) and do not use it afterwards for training the
    same weights.

    ``dp_mesh``: the data-parallel axis (replicas of the layer that see other batches; orthogonal to the SP and EP
    axes). The forward does not use it; it joins the load-count reductions (``update_expert_bias`` and ``expert_load``
    see the whole step's tokens, as one device would) and :meth:`ParallelMoE.batch_reductions`. The aux loss is per
    batch: its counts are summed over the SP axis only (the ranks one batch spans), and each rank's ``aux_loss`` is its
    share of it.

    A collective over ``agree_over`` (default: the world; a pipeline stage passes its own group, e.g.
    ``mesh["dp", "sp", "ep"]._flatten()`` or a ``ProcessGroup``): every rank of it calls this for the same layers in the
    same order, the config, plan and weights are compared across them (``spmdmoe.moe.parallel.plan``), and every rank
    raises the same error if any rank's differ. ``load_state_dict`` agrees over the same group.

    ``ep_mode``: how EP moves rows. ``"sync"`` (default) reads the split sizes on the host once per forward and sends
    exactly the routed rows. ``"sync_free"`` (``spmdmoe.moe.transports.sync_free``) never syncs: static buffers of ``S``
    rows per rank pair, sized from ``T_max``, the most tokens any rank of the EP group routes: with EP on the SP axis
    the SP input's padded local count; otherwise (EP across batches, gather mode) ``max_tokens``, or, when that is
    ``None``, the most tokens a rank routed in the first forward (agreed once host to host, through the c10d store: no
    device sync). More rows on a rank than that bound raise ``SPMDCapacityError`` on every rank at the step boundary;
    pass ``max_tokens`` where the token count grows after the first step. ``capacity_factor=None`` is lossless
    (``S = T_max``: a token crosses to a rank once); a factor ``c`` sizes the buffers to ``c`` times balanced traffic
    (``sync_free.capacity_rows``), and an overflow is raised by :meth:`ParallelMoE.check_capacity` and
    ``update_expert_bias`` as ``SPMDCapacityError`` on every rank of the layer. Without EP both modes are the local,
    sync-free transport.

    A ``moe`` on the meta device (``with torch.device("meta"): moe = MoE(cfg)``) is never materialised: the layer
    allocates only this rank's shards, uninitialised, on ``device`` (default: the meshes' device; ``"meta"`` keeps them
    on meta, e.g. to plan without memory), zeroes its buffers, and ``layer.init_weights(generator=g)`` then gives
    exactly the weights ``MoE(cfg).init_weights(generator=g)`` gives on one device (every rank passing the same
    generator state; ``spmdmoe.moe.params.init``); the weights agreement skips meta layers (no values to compare).

    Raises ``MoEConfigError``: configs, plans or weights that differ between ranks, ``E % ep != 0``, an unknown
    ``sp_mode``, gather mode without ``sp_mesh`` or with ``ep_mesh`` equal to ``sp_mesh``, a layer that is already
    parallel. ``SPMDMeshError``: a mesh that is not one axis, SP and EP axes that are neither the same group nor
    orthogonal, a DP axis not orthogonal to both.
    """
    transport = (ep_mode, capacity_factor, max_tokens)
    sp, ep, dp, over = agree_plan(moe, sp_mesh, ep_mesh, dp_mesh, sp_mode, agree_over, transport)
    layer = ParallelMoE(moe, sp, ep, sp_mode, dp, over, transport)
    if moe.router.gate.weight.is_meta:
        axis = next(a for a in (sp, ep, dp) if a is not None) if (sp or ep or dp) else None
        target = torch.device(device) if device is not None else (
            axis.metadata_device() if axis is not None else torch.device("meta"))
        if target.type != "meta":
            layer.to_empty(device=target)
            layer.reset_buffers()
    return layer


class ParallelMoE(_Layer):
    """A :class:`MoE` over SP and/or EP axes; see :func:`parallelize_moe` and the module docstring."""

    def __init__(self, moe: MoE, sp: Optional[MeshAxis], ep: Optional[MeshAxis], sp_mode: str,
                 dp: Optional[MeshAxis] = None, agree_over: Optional[MeshAxis] = None,
                 transport: tuple[str, Optional[float], Optional[int]] = ("sync", None, None)):
        super().__init__()
        cfg = moe.config
        self.sp, self.ep, self.dp, self.sp_mode = sp, ep, dp, sp_mode
        self.agree_over = agree_over  # the group the layer's one-off agreements run over (None: the world)
        experts_slice, hidden = expert_shard(cfg, sp, ep, sp_mode)
        experts = experts_block(moe.experts, experts_slice, hidden, cfg.expert_precision, cfg.fp8_wgrad)
        self._build(cfg, copy.deepcopy(moe.router), experts, copy.deepcopy(moe.shared_experts), moe.expert_bias.clone())
        self.expert_slice, self.hidden_slice = experts_slice, hidden
        self.load_axes = tuple(dict.fromkeys(a for a in (sp, ep, dp) if a is not None))  # SP and EP may be one group
        ep_mode, self.capacity_factor, max_tokens = transport
        # SP over the whole job, without EP or with EP on the SP axis: the T exchange (made for gather mode, the
        # sync-free capacity, or for the ride alone without EP) carries the deferred problems and the grad mode
        rides = sp is not None and ep in (None, sp) and dp is None and 1 < sp.size == torch.distributed.get_world_size()
        gather = sp is not None and sp_mode == "gather"
        self.admission = Admission(sp, ep, gather, cfg.dim, self.problems, Ride(sp, self.problems) if rides else None,
                                   max_tokens)
        self.rows = GatheredRows(sp) if sp is not None and gather else OwnRows()
        self.set_ep_mode(ep_mode)
        self.aux_axes = () if sp is None else (sp,)
        install_hooks(self, expert_layout(cfg, sp, ep, sp_mode, experts_slice, hidden), agree_over)
        if sp is not None and sp.size > 1:
            self.sp_synced = tuple(_Layer.weights(self))  # dense weights; the experts sync their own
            # agreed now, eagerly (grads.py); the forward reads these plain attributes
            self.sp_grad_set = agree_grad_set([self.get_parameter(n) for n in self.sp_synced], sp)
            if sp_mode == "local" and sp != ep:
                self.experts.grad_axis = sp
                self.experts.grad_set = agree_grad_set(self.experts.read_weights(), sp)
        else:
            self.sp_synced, self.sp_grad_set = (), ()
        self._reductions: Optional[tuple[GradReduction, GradReduction]] = None
        self.grad_overlap = True  # False: each SP gradient sum waits at its use (sp_sync_params)

    def set_ep_mode(self, ep_mode: Literal["sync", "sync_free"]) -> None:
        """Switch the EP transport (e.g. ``"sync"`` to rerun a step that overflowed a sync-free capacity, then
        back). Call it on every rank of the layer alike: the two transports issue different collectives."""
        if ep_mode not in ("sync", "sync_free"):
            raise MoEConfigError(f"ep_mode must be 'sync' or 'sync_free', found {ep_mode!r}")
        self.ep_mode = ep_mode
        # problems raise at the count exchange only when it reaches every rank the layer talks to
        spans = all(a == self.ep or a.size == 1 for a in self.load_axes)
        old = self._modules.get("transport")
        if isinstance(old, SyncFreeTransport):
            # leaving a sync-free transport: an overflow not yet checked is recorded for the step boundary (never
            # silent; one host read), and its buffer is kept for the next one: a CUDA graph captured on it goes
            # on writing to that address
            if not old.overflow.is_meta:
                self._record_overflow()
            self._overflow = old.overflow
        kept: Optional[torch.Tensor] = self.__dict__.get("_overflow")
        device = self.expert_bias.device
        if kept is None or kept.device != device:  # (moved by .to() since: a graph captured before is void anyway)
            kept = torch.zeros(4, dtype=torch.int64, device=device)
        self.transport = transport_for(self.ep, ep_mode, self.config.num_experts, self.config.top_k,
                                       self.capacity_factor, raises=spans, overflow=kept)

    @property
    def max_tokens(self) -> Optional[int]:
        """``parallelize_moe``'s ``max_tokens``: what sizes sync-free EP off the SP axis (the admission's)."""
        return self.admission.max_tokens

    def _record_overflow(self) -> None:
        """A sync-free transport: its overflow since the last check recorded in the layer's sticky flag (one host
        read; ``SyncFreeTransport.record_overflow``); otherwise nothing."""
        if isinstance(self.transport, SyncFreeTransport):
            self.transport.record_overflow(self.problems, f"MoE layer (sync-free EP over {self.ep})")

    def check_capacity(self) -> None:
        """Raise ``SPMDCapacityError`` on every rank of the layer if a sync-free EP slot overflowed anywhere
        since the last check (and whatever else a rank recorded: it is :func:`spmdmoe.check_errors` over the
        layer's ``agree_over`` group, the world by default); a no-op in sync mode. A collective: call it on
        every rank, e.g. once per step (``update_expert_bias`` makes the same check)."""
        self._record_overflow()
        check_errors(self.agree_over)

    def update_expert_bias(self) -> torch.Tensor:
        """:meth:`MoE.update_expert_bias`; in sync-free mode it first records an overflow of the capacity since
        the last step (one more host read), which its collective then raises on every rank as
        ``SPMDCapacityError`` (dropping the step's load counts, as for any problem)."""
        self._record_overflow()
        return super().update_expert_bias()

    @property
    def batch_axes(self) -> tuple[MeshAxis, ...]:
        """Axes whose ranks hold different batches: ``dp_mesh``, and EP when it is not the SP axis."""
        axes = (self.dp, None if self.ep == self.sp else self.ep)
        return tuple(a for a in axes if a is not None and a.size > 1)

    def batch_reductions(self) -> tuple[GradReduction, GradReduction]:
        """``(dense, experts)``: what a dense parameter's and an expert's gradient still need
        (:func:`spmdmoe.moe.params.grads.batch_reductions`; a collective on the first call, then cached)."""
        if self._reductions is None:
            self._reductions = batch_reductions(self.batch_axes, self.ep)
        return self._reductions

    def weights(self) -> dict[str, torch.Tensor]:
        if self.sp is None or not self.sp_synced:
            return super().weights()
        w = self.dense_params()
        synced = [w[n] for n in self.sp_synced]
        views = sync_grads(synced, self.sp, [self.read_dtype(n, p) for n, p in zip(self.sp_synced, synced)],
                           agreed=self.sp_grad_set)
        w.update(zip(self.sp_synced, views))
        return w

    def leave_sp_sums_to_fsdp(self) -> None:
        """Make no SP gradient sums from now on: FSDP2 on a group that spans the SP axis sums the SP shares in
        its reduce-scatter (``fully_shard_moe`` calls it; the sums of both would count every share twice)."""
        self.sp_synced, self.sp_grad_set = (), ()
        self.experts.grad_axis, self.experts.grad_set = None, None

    def sp_sync_params(self) -> list[torch.Tensor]:
        """The parameters whose gradients this layer sums over SP (``grads.py``): the dense ones, and the experts when
        they are replicated along SP; not those inside an FSDP2 unit of their own (e.g. the experts under
        ``fully_shard_moe``: their sum must be done inside that unit, before its reduce-scatter). Empty with
        ``grad_overlap = False``: each sum then waits at its use (``overlap.py``)."""
        if not self.grad_overlap or not self.sp_synced:
            return []
        names = list(self.sp_synced)
        if self.experts.grad_axis is not None:
            names += [f"experts.{n}" for n, _ in self.experts.named_parameters()]  # a drop-in's names too
        return [self.get_parameter(n) for n in names if not inside_fsdp_unit(self, n)]

    _spmdmoe_sync_params = sp_sync_params  # what overlap.sync_params asks
