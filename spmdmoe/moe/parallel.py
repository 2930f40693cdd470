"""``parallelize_moe``: the same layer over an SP axis, an EP axis, or both.

Legend: ``T`` local valid tokens, ``D`` model dim, ``F`` expert hidden dim,
``E`` experts, ``e = E / ep`` local experts, ``K`` top-k, ``R`` rows received
by the local experts.

=====================  =========================================  ============================
plan                   forward                                    parameters
=====================  =========================================  ============================
``sp`` local           each SP rank routes its own rows           experts whole (or EP block)
``sp`` gather          all_gather over SP, TP experts, combine    experts: F split over SP
                       into ``padded_global_tokens`` rows,
                       reduce_scatter, + shared on local rows
``ep``                 all-to-all dispatch / combine over EP      experts: block of ``e``
=====================  =========================================  ============================

Gradient contract: after ``backward`` of a loss summed over the SP group's
tokens, every parameter's ``.grad`` is the single-device gradient of that loss
(experts: this rank's slice, including the tokens other EP ranks routed to
it). A parameter replicated along the SP axis (router, shared experts;
experts unless split along SP) has its fresh gradient summed over SP by
:func:`spmdmoe.moe.sync_grads` at its use. What is left is the reduction
across *batches* (``dp_mesh``, and the EP axis when it is not the SP axis):
:meth:`ParallelMoE.grad_reductions` says, per parameter, over which group and
divided by what; ``spmdmoe.moe.ddp`` and ``fully_shard_moe`` set DDP / FSDP2 up with it.
"""

from __future__ import annotations

import copy
from typing import Any, Literal, Optional, Union

import torch
import torch.distributed as dist

from ..collectives import all_gather, reduce_scatter
from ..types import layout
from ..types.construct import padded_empty
from ..types.errors import MoEConfigError, SPMDLayoutError, SPMDMeshError
from ..types.mesh import MeshAxis, MeshLike, mesh_axis
from ..types.placement import Partial, Shard, Varying
from ..types.product import product_axis
from ..types.tensor import SPMDTensor
from .checkpoint import ExpertLayout, grid_mesh, install_hooks
from .dispatch import BAD_DIM, AllToAllTransport, LocalTransport
from .experts import GroupedExperts
from .grads import sync_grads
from .grads import GradReduction
from .layer import MoE, _Layer, check_dim

__all__ = ["parallelize_moe", "ParallelMoE"]

Input = Union[SPMDTensor, torch.Tensor]


def parallelize_moe(
    moe: MoE,
    *,
    sp_mesh: Optional[MeshLike] = None,
    ep_mesh: Optional[MeshLike] = None,
    dp_mesh: Optional[MeshLike] = None,
    sp_mode: Literal["local", "gather"] = "local",
) -> "ParallelMoE":
    """This rank's part of ``moe`` over the given axes (same parameter names, sliced experts).

    ``forward`` takes an ``SPMDTensor`` sharded (``Shard(0)``) on ``sp_mesh`` and
    returns one with the same layout; with ``sp_mesh=None`` it takes and
    returns a plain ``(T_rank, D)`` tensor or a ``Varying`` ``SPMDTensor``
    (each rank its own batch; ``T_rank`` may differ and be 0). ``moe``'s router,
    shared experts and ``expert_bias`` are copied, its experts sliced; build
    ``moe`` identically on every rank (same seed) and do not use it afterwards
    for training the same weights.

    ``dp_mesh``: the data-parallel axis (replicas of the layer that see other
    batches; orthogonal to the SP and EP axes). The forward does not use it;
    it joins the load-count reductions (``update_expert_bias`` and
    ``expert_load`` see the whole step's tokens, as one device would) and
    :meth:`ParallelMoE.grad_reductions`. The aux loss is per batch: its counts
    are summed over the SP axis only (the ranks one batch spans), and each
    rank's ``aux_loss`` is its share of its batch's aux loss.

    Raises ``MoEConfigError``: ``E % ep != 0``, an unknown ``sp_mode``, gather mode
    without ``sp_mesh``, with ``ep_mesh`` equal to ``sp_mesh``, or with fewer
    hidden units than SP ranks. ``SPMDMeshError``: SP and EP axes that are
    neither the same group nor orthogonal, a DP axis not orthogonal to both.
    """
    sp, ep, dp = (None if m is None else mesh_axis(m) for m in (sp_mesh, ep_mesh, dp_mesh))
    _check_plan(moe, sp, ep, dp, sp_mode)
    return ParallelMoE(moe, sp, ep, sp_mode, dp)


def _check_plan(moe: MoE, sp: Optional[MeshAxis], ep: Optional[MeshAxis], dp: Optional[MeshAxis],
                sp_mode: str) -> None:
    cfg = moe.config
    if sp_mode not in ("local", "gather"):
        raise MoEConfigError(f"sp_mode must be 'local' or 'gather', found {sp_mode!r}")
    if ep is not None and cfg.num_experts % ep.size:
        raise MoEConfigError(
            f"rank {ep.rank}: num_experts={cfg.num_experts} does not divide by the EP size {ep.size} "
            f"({cfg.num_experts} % {ep.size} = {cfg.num_experts % ep.size}); use an EP size that divides E"
        )
    if sp_mode == "gather":
        if sp is None:
            raise MoEConfigError("sp_mode='gather' needs sp_mesh (the axis tokens are gathered over)")
        if ep is not None and ep == sp:
            raise MoEConfigError(
                f"rank {sp.rank}: sp_mode='gather' splits the experts' hidden dim over sp_mesh, so EP "
                "must be another axis (or None); for EP on the SP group use sp_mode='local'"
            )
        if cfg.hidden_dim < sp.size:
            raise MoEConfigError(
                f"rank {sp.rank}: gather mode splits hidden_dim={cfg.hidden_dim} over {sp.size} SP ranks; "
                "each rank needs at least one hidden unit"
            )
    pairs = [("sp_mesh", sp, "ep_mesh", ep)] if sp != ep else []
    pairs += [("dp_mesh", dp, name, a) for name, a in (("sp_mesh", sp), ("ep_mesh", ep))]
    for name_a, a, name_b, b in pairs:
        if a is None or b is None:
            continue
        shared = set(dist.get_process_group_ranks(a.group)) & set(dist.get_process_group_ranks(b.group))
        if shared != {dist.get_rank()}:
            same = "the same group or " if name_a == "sp_mesh" else ""
            raise SPMDMeshError(
                f"rank {dist.get_rank()}: {name_a} and {name_b} must be {same}orthogonal axes "
                f"(e.g. two dims of one mesh); they share ranks {sorted(shared)}"
            )


def _expert_layout(cfg: Any, sp: Optional[MeshAxis], ep: Optional[MeshAxis], sp_mode: str,
                   experts: slice, hidden: slice) -> ExpertLayout:
    """The DTensor layout that ``state_dict()`` gives the expert weights (see ``checkpoint.py``)."""
    split_ep = ep is not None and ep.size > 1
    split_tp = sp is not None and sp_mode == "gather" and sp.size > 1
    if split_ep and split_tp:
        assert ep is not None and sp is not None
        mesh, ep_dim, tp_dim = grid_mesh(ep, sp), 0, 1
    elif split_ep:
        assert ep is not None
        mesh, ep_dim, tp_dim = ep.device_mesh(), 0, None
    elif split_tp:
        assert sp is not None
        mesh, ep_dim, tp_dim = sp.device_mesh(), None, 0
    else:
        mesh, ep_dim, tp_dim = None, None, None
    return ExpertLayout(cfg.num_experts, experts, hidden, cfg.hidden_dim, mesh, ep_dim, tp_dim)


class ParallelMoE(_Layer):
    """A :class:`MoE` over SP and/or EP axes; see :func:`parallelize_moe` and the module docstring."""

    def __init__(self, moe: MoE, sp: Optional[MeshAxis], ep: Optional[MeshAxis], sp_mode: str,
                 dp: Optional[MeshAxis] = None):
        super().__init__()
        cfg = moe.config
        self.sp, self.ep, self.dp, self.sp_mode = sp, ep, dp, sp_mode
        n_ep, r_ep = (1, 0) if ep is None else (ep.size, ep.rank)
        e = cfg.num_experts // n_ep
        experts_slice = slice(r_ep * e, (r_ep + 1) * e)
        if sp_mode == "gather":
            assert sp is not None
            f0 = layout.chunk_offset(cfg.hidden_dim, sp.size, sp.rank)
            hidden = slice(f0, f0 + layout.local_tokens(cfg.hidden_dim, sp.size, sp.rank))
        else:
            hidden = slice(0, cfg.hidden_dim)
        src = moe.experts
        experts = GroupedExperts(e, cfg.dim, hidden.stop - hidden.start).to(device=src.w1.device, dtype=src.w1.dtype)
        with torch.no_grad():
            experts.w1.copy_(src.w1[experts_slice, hidden])
            experts.w2.copy_(src.w2[experts_slice, :, hidden])
            experts.w3.copy_(src.w3[experts_slice, hidden])
        self._build(cfg, copy.deepcopy(moe.router), experts, copy.deepcopy(moe.shared_experts), moe.expert_bias.clone())
        self.transport = AllToAllTransport(ep, cfg.num_experts) if ep is not None and ep.size > 1 else LocalTransport(e)
        self.load_axes = tuple(a for i, a in enumerate((sp, ep, dp)) if a is not None and a not in (sp, ep)[:i])
        self.aux_axes = () if sp is None else (sp,)
        install_hooks(self, _expert_layout(cfg, sp, ep, sp_mode, experts_slice, hidden))
        if sp is not None and sp.size > 1:
            self.sp_synced = tuple(_Layer.weights(self))  # dense weights; the experts sync their own
            if sp_mode == "local" and sp != ep:
                self.experts.grad_axis = sp
        else:
            self.sp_synced = ()
        self._reductions: Optional[tuple[GradReduction, GradReduction]] = None

    @property
    def batch_axes(self) -> tuple[MeshAxis, ...]:
        """Axes whose ranks hold different batches: ``dp_mesh``, and EP when it is not the SP axis."""
        axes = (self.dp, None if self.ep == self.sp else self.ep)
        return tuple(a for a in axes if a is not None and a.size > 1)

    def grad_reductions(self) -> dict[str, GradReduction]:
        """Per parameter name: the group its gradient must still be summed over, and the divide factor.

        See :meth:`batch_reductions`; a collective over the world on the first call.
        """
        dense, experts = self.batch_reductions()
        return {name: experts if name.startswith("experts.") else dense
                for name, p in self.named_parameters() if p.requires_grad}

    def batch_reductions(self) -> tuple[GradReduction, GradReduction]:
        """``(dense, experts)``: what a dense parameter's and an expert's gradient still need.

        Dense parameters are replicated over every batch axis; the experts
        already hold every EP batch's contribution, so they need only the
        batch axes other than EP. Both divide by the number of batches one step
        sees (the product of the batch axes' sizes), which turns the summed
        gradient into that of the mean of the per-batch losses. A collective
        over the world on the first call (it may create the product group,
        see :func:`spmdmoe.product_axis`); cached.
        """
        if self._reductions is None:
            batches = self.batch_axes
            factor = 1
            for a in batches:
                factor *= a.size
            expert_batches = tuple(a for a in batches if a != self.ep)
            dense = GradReduction(product_axis(*batches), factor, batches)
            experts = GradReduction(product_axis(*expert_batches), factor, expert_batches)
            self._reductions = (dense, experts)
        return self._reductions

    def weights(self) -> dict[str, torch.Tensor]:
        w = super().weights()
        if self.sp is not None and self.sp_synced:
            views = sync_grads([w[n] for n in self.sp_synced], self.sp)
            w.update(zip(self.sp_synced, views))
        return w

    def forward(self, x: Input) -> Input:
        if self.sp is None:
            return self._forward_batches(x)
        x_TD = self._sp_rows(x)
        assert isinstance(x, SPMDTensor)
        w = self.weights()
        if self.sp_mode == "local":
            out_TD = self._rows(x_TD, w, self.transport)
        else:
            out_TD = self._gathered(x, w)
        return x.with_local(self._plus_shared(out_TD, x_TD, w))

    def _gathered(self, x: SPMDTensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        """Gather mode: route all SP rows, TP experts, combine into the padded buffer, reduce-scatter."""
        sp, T = x.axis, x.global_tokens
        start = layout.chunk_offset(T, sp.size, sp.rank)
        h_TD = all_gather(x).local
        partial_TD = self._rows(h_TD, w, self.transport, own=slice(start, start + x.local_tokens))
        buf = padded_empty(sp, Partial(), T, (self.config.dim,), dtype=partial_TD.dtype, device=partial_TD.device)
        buf.local.copy_(partial_TD)
        return reduce_scatter(buf).local

    def _sp_rows(self, x: Input) -> torch.Tensor:
        assert self.sp is not None
        if not isinstance(x, SPMDTensor) or not isinstance(x.placement, Shard):
            found = x.placement if isinstance(x, SPMDTensor) else type(x).__name__
            raise SPMDLayoutError(
                f"rank {self.sp.rank}: this MoE layer takes an SPMDTensor sharded with Shard(0) on its "
                f"sp_mesh, found {found}; wrap the local rows with spmdmoe.shard(...) or spmdmoe.from_local(...)"
            )
        if x.axis != self.sp:
            raise SPMDMeshError(
                f"rank {self.sp.rank}: the input is sharded on {x.axis}, but the layer's sp_mesh is {self.sp}"
            )
        if x.token_dim != 0:
            raise SPMDLayoutError(
                f"rank {self.sp.rank}: expected tokens on dim 0, found Shard({x.token_dim}); flatten to (tokens, dim)"
            )
        check_dim(x.local, self.config.dim, self.sp.rank)
        return x.local

    def _forward_batches(self, x: Input) -> Input:
        """EP only (or nothing): each rank routes its own batch."""
        rank = self.ep.rank if self.ep is not None else 0
        if isinstance(x, SPMDTensor) and not isinstance(x.placement, Varying):
            raise SPMDLayoutError(
                f"rank {rank}: without sp_mesh this MoE layer takes a plain (tokens, dim) tensor or a "
                f"Varying SPMDTensor, found {x.placement}; pass sp_mesh to parallelize_moe for SP inputs"
            )
        x_TD = x.local if isinstance(x, SPMDTensor) else x
        problem = 0
        try:
            check_dim(x_TD, self.config.dim, rank)
        except SPMDLayoutError:
            if isinstance(self.transport, LocalTransport):
                raise
            # take part in the count exchange with the problem flagged: every EP rank raises together
            x_TD, problem = x_TD.new_zeros((0, self.config.dim)), BAD_DIM
        w = self.weights()
        out_TD = self._plus_shared(self._rows(x_TD, w, self.transport, problem=problem), x_TD, w)
        return x.with_local(out_TD) if isinstance(x, SPMDTensor) else out_TD
