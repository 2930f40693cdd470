"""State dicts of MoE layers: global expert tensors for DCP, torchtitan names, any EP size.

Legend: ``E`` experts, ``e`` local experts, ``F`` expert hidden dim (``f``: this
rank's slice under tensor-parallel experts), ``D`` model dim.

Saving. A parallel layer's ``state_dict()`` presents each expert weight as a
DTensor over the axes it is split on, with its global shape (``w1``/``w3``
``(E, F, D)``, ``w2`` ``(E, D, F)``): ``Shard(0)`` over EP, ``Shard(1)``
(``w1``/``w3``) or ``Shard(2)`` (``w2``) over SP for tensor-parallel experts,
both on a 2-D mesh for both. ``torch.distributed.checkpoint`` then writes every
expert once (plain local tensors under global names would be deduplicated to
one rank's copy). Dense weights are replicated and stay plain tensors. Under
FSDP2 (``data_parallel.fully_shard_moe``) the experts' DP shards are gathered
first (one all-gather over the DP group per weight: the checkpoint is the same
as without FSDP); dense weights stay FSDP's DTensors, which DCP reads natively.

Loading. ``load_state_dict`` on ``MoE`` or a parallel layer accepts our names
and torchtitan's (``experts.w1_EFD`` / ``w2_EDF`` / ``w3_EFD`` or the older
``experts.w1`` / ``w2`` / ``w3``, also the older ``(E, D, F)`` orientation of
``w1``/``w3``, told apart by shape when ``D != F``), plain full tensors or
DTensors of any layout (this layer's own layout is taken locally, any other is
gathered once and sliced), with or without ``expert_bias`` (kept as is when
absent) and ``tokens_per_expert`` (a per-step counter here, dropped). So a
checkpoint saved at one EP size loads at another. Under FSDP2 each rank keeps
its DP shard of its slice (no communication).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor import Shard as DShard

from ..types.errors import SPMDLayoutError
from ..types.layout import contiguous_strides
from ..types.mesh import MeshAxis
from ..agreement import exchange_rows

__all__ = ["to_torchtitan", "install_hooks", "ExpertLayout", "grid_mesh"]

TORCHTITAN_NAMES = {"experts.w1_EFD": "experts.w1", "experts.w2_EDF": "experts.w2", "experts.w3_EFD": "experts.w3"}
COUNTERS = ("tokens_per_expert", "tokens_per_expert_E")
HIDDEN_DIM = {"experts.w1": 1, "experts.w2": 2, "experts.w3": 1}


class ExpertLayout:
    """Where this rank's expert slices sit in the global expert tensors, and their DTensor mesh."""

    def __init__(self, num_experts: int, experts: slice, hidden: slice, hidden_dim: int,
                 mesh: Optional[DeviceMesh], ep_dim: Optional[int], tp_dim: Optional[int]):
        self.num_experts, self.experts, self.hidden, self.hidden_dim = num_experts, experts, hidden, hidden_dim
        self.mesh, self.ep_dim, self.tp_dim = mesh, ep_dim, tp_dim

    def placements(self, name: str) -> list[Any]:
        assert self.mesh is not None
        out: list[Any] = [None] * self.mesh.ndim
        if self.ep_dim is not None:
            out[self.ep_dim] = DShard(0)
        if self.tp_dim is not None:
            out[self.tp_dim] = DShard(HIDDEN_DIM[name])
        return out

    def global_shape(self, name: str, local: torch.Tensor) -> torch.Size:
        shape = list(local.shape)
        shape[0], shape[HIDDEN_DIM[name]] = self.num_experts, self.hidden_dim
        return torch.Size(shape)

    def local_slice(self, name: str, full: torch.Tensor) -> torch.Tensor:
        index: list[Any] = [self.experts, slice(None), slice(None)]
        index[HIDDEN_DIM[name]] = self.hidden
        return full[tuple(index)]


def grid_mesh(ep: MeshAxis, sp: MeshAxis) -> DeviceMesh:
    """The 2-D ``(ep, sp)`` mesh of this rank's block (one all-gather over the world; all ranks call it)."""
    row = [dist.get_rank(), ep.rank, sp.rank, min(dist.get_process_group_ranks(sp.group))]
    rows = exchange_rows(None, row)
    my_ep = set(dist.get_process_group_ranks(ep.group))
    sp_ids = {r[3] for r in rows if r[0] in my_ep}
    grid = torch.empty(ep.size, sp.size, dtype=torch.int64)
    for rank, e, s, sp_id in rows:
        if sp_id in sp_ids:
            grid[e, s] = rank
    return DeviceMesh.from_group([ep.group, sp.group], ep.device_type, mesh=grid, mesh_dim_names=("ep", "sp"))


def to_torchtitan(state_dict: dict[str, Any], *, names: str = "new") -> dict[str, Any]:
    """Our state dict with torchtitan's expert names: ``"new"`` (``w1_EFD``...) or ``"old"`` (``w1``...).

    Orientation is torchtitan's current one (ours): ``w1``/``w3`` ``(E, F, D)``,
    ``w2`` ``(E, D, F)``. Values (plain tensors or DTensors) are passed through.
    """
    if names not in ("new", "old"):
        raise ValueError(f"names must be 'new' or 'old', found {names!r}")
    ours_to_theirs = {v: k for k, v in TORCHTITAN_NAMES.items()}
    out = {}
    for key, value in state_dict.items():
        for ours, theirs in ours_to_theirs.items():
            if names == "new" and key.endswith(ours):
                key = key[: -len(ours)] + theirs
                break
        out[key] = value
    return out


def install_hooks(module: torch.nn.Module, layout: Optional[ExpertLayout]) -> None:
    """Register the save hook (parallel layers) and the load hook (every layer) on ``module``."""
    if layout is not None and layout.mesh is not None:
        module.register_state_dict_post_hook(_save_hook(layout))
    module.register_load_state_dict_pre_hook(_load_hook(module, layout))


def _save_hook(layout: ExpertLayout) -> Any:
    def hook(module: Any, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        for name in HIDDEN_DIM:
            key = prefix + name
            if key in state_dict:
                local = state_dict[key]
                if isinstance(local, DTensor):  # FSDP2 shards this rank's experts over its DP group
                    local = local.full_tensor()
                shape = layout.global_shape(name, local)
                state_dict[key] = DTensor.from_local(
                    local, layout.mesh, layout.placements(name), run_check=False, shape=shape,
                    stride=contiguous_strides(shape),
                )

    return hook


def _load_hook(module: torch.nn.Module, layout: Optional[ExpertLayout]) -> Any:
    def hook(mod: Any, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        for theirs, ours in TORCHTITAN_NAMES.items():
            if prefix + theirs in state_dict:
                state_dict[prefix + ours] = state_dict.pop(prefix + theirs)
        for counter in COUNTERS:
            state_dict.pop(prefix + counter, None)
        if prefix + "expert_bias" not in state_dict:
            state_dict[prefix + "expert_bias"] = module.expert_bias.detach().clone()
        for name in HIDDEN_DIM:
            key = prefix + name
            if key in state_dict:
                local = _local_value(name, state_dict[key], layout, module.config)
                param = module.get_parameter(name)
                if isinstance(param, DTensor):  # FSDP2: hand it this rank's shard of the slice
                    local = distribute_tensor(local, param.device_mesh, param.placements, src_data_rank=None)
                state_dict[key] = local

    return hook


def _local_value(name: str, value: Any, layout: Optional[ExpertLayout], config: Any) -> torch.Tensor:
    """This rank's slice of a saved expert weight (DTensor of any layout, or a full tensor)."""
    if isinstance(value, DTensor):
        if layout is not None and layout.mesh is not None and value.device_mesh == layout.mesh \
                and list(value.placements) == layout.placements(name):
            return value.to_local()
        value = value.full_tensor()
    full = _oriented(name, value, config)
    return full if layout is None else layout.local_slice(name, full)


def _oriented(name: str, full: torch.Tensor, config: Any) -> torch.Tensor:
    E, F, dim = config.num_experts, config.hidden_dim, config.dim
    want = (E, dim, F) if name == "experts.w2" else (E, F, dim)
    if tuple(full.shape) == want:
        return full
    if tuple(full.shape) == (want[0], want[2], want[1]):  # torchtitan's older (E, D, F) w1/w3
        return full.transpose(1, 2)
    raise SPMDLayoutError(
        f"{name}: expected the global expert tensor of shape {want} (or its transpose in the last two "
        f"dims), found {tuple(full.shape)}; a plain tensor must hold every expert (save with the layer's "
        "state_dict(), which presents global DTensors)"
    )
