"""State dicts of MoE layers: global expert tensors for DCP, torchtitan names, any EP size.

Legend: ``E`` experts, ``e`` local experts, ``F`` expert hidden dim (``f``: this
rank's slice under tensor-parallel experts), ``D`` model dim.

A parallel layer's ``state_dict()`` presents each expert weight as a DTensor of its global shape, so DCP writes
every expert once; ``load_state_dict`` takes spmdmoe's and torchtitan's names, values of any layout, at any EP
size; the oldest torchtitan orientation loads only through :func:`from_torchtitan` with ``orientation="EDF"``.
Saving, loading, orientation and the load's agreement: ``docs/design.md`` §5 ("Checkpoints") and §6.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..._dist import is_dtensor
from ...agreement import Field, Problem, agree, exchange_rows, raise_if, verdict, world_axis
from ...types import layout
from ...types.errors import SPMDLayoutError
from ...types.layout import contiguous_strides
from ...types.mesh import MeshAxis, mesh_axis
from ..config import MoEConfig

__all__ = ["to_torchtitan", "from_torchtitan", "install_hooks", "ExpertLayout", "expert_layout", "grid_mesh"]

# torchtitan's names -> ours, newest first (0.3.0, then the earlier _EFD names)
TORCHTITAN_NAMES = {
    "routed_experts.inner_experts.w1_EFD": "experts.w1",
    "routed_experts.inner_experts.w2_EDF": "experts.w2",
    "routed_experts.inner_experts.w3_EFD": "experts.w3",
    "expert_bias_E": "expert_bias",
    "experts.w1_EFD": "experts.w1",
    "experts.w2_EDF": "experts.w2",
    "experts.w3_EFD": "experts.w3",
}
NEWEST = dict(list(TORCHTITAN_NAMES.items())[:4])
COUNTERS = ("tokens_per_expert", "tokens_per_expert_E")
HIDDEN_DIM = {"experts.w1": 1, "experts.w2": 2, "experts.w3": 1}


class ExpertLayout:
    """Where this rank's expert slices sit in the global expert tensors, and their DTensor mesh."""

    def __init__(self, experts: slice, hidden: slice, mesh: Optional[DeviceMesh], ep_dim: Optional[int],
                 tp_dim: Optional[int]):
        self.experts, self.hidden, self.mesh, self.ep_dim, self.tp_dim = experts, hidden, mesh, ep_dim, tp_dim

    def placements(self, name: str) -> list[Any]:
        from torch.distributed.tensor import Shard  # not at import: DTensor costs every process about 1 s

        assert self.mesh is not None
        out: list[Any] = [None] * self.mesh.ndim
        if self.ep_dim is not None:
            out[self.ep_dim] = Shard(0)
        if self.tp_dim is not None:
            out[self.tp_dim] = Shard(HIDDEN_DIM[name])
        return out

    def local_slice(self, name: str, full: torch.Tensor) -> torch.Tensor:
        index: list[Any] = [self.experts, slice(None), slice(None)]
        index[HIDDEN_DIM[name]] = self.hidden
        return full[tuple(index)]


# (ep group, sp group) -> their grid mesh; weak keys: a destroyed group's entry goes with it
_GRIDS: "weakref.WeakKeyDictionary[Any, weakref.WeakKeyDictionary[Any, DeviceMesh]]" = weakref.WeakKeyDictionary()


def grid_mesh(ep: MeshAxis, sp: MeshAxis) -> DeviceMesh:
    """The 2-D ``(ep, sp)`` mesh of this rank's block: row ``e`` is the SP group of the EP peer of EP rank ``e``.

    A collective over ``ep`` only (one check exchange of each EP peer's SP group), made once per pair of groups:
    every EP peer calls it with the same groups in the same order (``parallelize_moe`` does, after its
    agreement over ``agree_over``), so a pipeline stage's layers never wait on another stage's, and a
    model's second layer on the same axes reuses the first one's mesh without a collective.
    """
    cached = _GRIDS.get(ep.group, {}).get(sp.group)
    if cached is not None:
        return cached
    sp_ranks = sorted(dist.get_process_group_ranks(sp.group), key=lambda r: dist.get_group_rank(sp.group, r))
    grid = torch.tensor(exchange_rows(ep, sp_ranks, "expert layout"), dtype=torch.int64)  # (ep.size, sp.size)
    mesh = DeviceMesh.from_group([ep.group, sp.group], ep.device_type, mesh=grid, mesh_dim_names=("ep", "sp"))
    _GRIDS.setdefault(ep.group, weakref.WeakKeyDictionary())[sp.group] = mesh
    return mesh


def expert_shard(cfg: MoEConfig, sp: Optional[MeshAxis], ep: Optional[MeshAxis], sp_mode: str) -> tuple[slice, slice]:
    """``(experts, hidden)``: the global experts this rank holds (its EP block of ``E / ep``) and the hidden
    units of each (gather mode: its chunk of ``F`` over SP by the chunk rule, possibly empty; else all)."""
    n_ep, r_ep = (1, 0) if ep is None else (ep.size, ep.rank)
    e = cfg.num_experts // n_ep
    hidden = slice(0, cfg.hidden_dim)
    if sp_mode == "gather":
        assert sp is not None
        f0 = layout.chunk_offset(cfg.hidden_dim, sp.size, sp.rank)
        hidden = slice(f0, f0 + layout.local_tokens(cfg.hidden_dim, sp.size, sp.rank))
    return slice(r_ep * e, (r_ep + 1) * e), hidden


def expert_layout(cfg: MoEConfig, sp: Optional[MeshAxis], ep: Optional[MeshAxis], sp_mode: str,
                  experts: slice, hidden: slice) -> ExpertLayout:
    """The DTensor layout that ``state_dict()`` gives the expert weights (see ``checkpoint.py``)."""
    ep = ep if ep is not None and ep.size > 1 else None
    tp = sp if sp is not None and sp_mode == "gather" and sp.size > 1 else None
    if ep is not None and tp is not None:
        mesh = grid_mesh(ep, tp)
    else:
        mesh = ep.device_mesh() if ep is not None else tp.device_mesh() if tp is not None else None
    return ExpertLayout(experts, hidden, mesh, None if ep is None else 0, None if tp is None else int(ep is not None))


def to_torchtitan(state_dict: dict[str, Any], *, names: str = "new") -> dict[str, Any]:
    """Our state dict with torchtitan's names: ``"new"`` (0.3.0: ``routed_experts.inner_experts.w1_EFD``
    ..., ``expert_bias_E``) or ``"old"`` (``experts.w1`` ..., which are ours).

    Orientation is torchtitan's current one (ours): ``w1``/``w3`` ``(E, F, D)``,
    ``w2`` ``(E, D, F)``. Values (plain tensors or DTensors) are passed through.
    The router (``router.gate.weight``) and shared experts
    (``shared_experts.w1.weight`` ...) have the same names in both.
    """
    if names not in ("new", "old"):
        raise ValueError(f"names must be 'new' or 'old', found {names!r}")
    if names == "old":
        return dict(state_dict)
    ours_to_theirs = {v: k for k, v in NEWEST.items()}
    return {_renamed(key, ours_to_theirs): value for key, value in state_dict.items()}


def from_torchtitan(state_dict: dict[str, Any], *, orientation: str = "EFD") -> dict[str, Any]:
    """A torchtitan state dict in our names, the experts in our orientation.

    ``orientation="EFD"``: torchtitan's current layout (``w1``/``w3`` ``(E, F, D)``),
    names only (``load_state_dict`` does this by itself). ``"EDF"``: the oldest
    layout (``w1``/``w3`` ``(E, D, F)``, ``w2`` ``(E, F, D)``): the last two dims of
    every expert weight are swapped, also when ``D == F`` (where no shape can
    tell the layouts apart, which is why this is never guessed). Plain tensors
    and DTensors (a transpose of the last two dims keeps a ``Shard(0)``).
    """
    if orientation not in ("EFD", "EDF"):
        raise ValueError(f"orientation must be 'EFD' or 'EDF', found {orientation!r}")
    out = {_renamed(key, TORCHTITAN_NAMES): value for key, value in state_dict.items()}
    if orientation == "EDF":
        for key in [k for k in out if any(k.endswith(n) for n in HIDDEN_DIM)]:
            out[key] = out[key].transpose(1, 2).contiguous()
    return out


def _renamed(key: str, table: dict[str, str]) -> str:
    for theirs, ours in table.items():
        if key == theirs or key.endswith("." + theirs):
            return key[: -len(theirs)] + ours
    return key


Checkpointed = Any  # what the state-dict hooks use of a layer (MoE, ParallelMoE): its config, bias and parameters


def install_hooks(module: Checkpointed, layout: Optional[ExpertLayout], agree_over: Optional[MeshAxis] = None) -> None:
    """Register the save hook (parallel layers) and the load hook (every layer) on ``module``.

    ``agree_over``: the group a parallel layer's load agrees over (``None``: the world)."""
    if layout is not None and layout.mesh is not None:
        module.register_state_dict_post_hook(_save_hook(layout))
    module.register_load_state_dict_pre_hook(_load_hook(module, layout, agree_over))


def _save_hook(layout: ExpertLayout) -> Any:
    def hook(module: Any, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        from torch.distributed.tensor import DTensor

        for name in HIDDEN_DIM:
            key = prefix + name
            if key in state_dict:
                local = state_dict[key]
                if is_dtensor(local):  # FSDP2 shards this rank's experts over its DP group
                    local = local.full_tensor()
                shape = torch.Size(_global_shape(name, module.config))
                state_dict[key] = DTensor.from_local(
                    local, layout.mesh, layout.placements(name), run_check=False, shape=shape,
                    stride=contiguous_strides(shape),
                )

    return hook


def _load_hook(module: Checkpointed, layout: Optional[ExpertLayout], agree_over: Optional[MeshAxis]) -> Any:
    def hook(mod: Any, state_dict: dict[str, Any], prefix: str, local_metadata: Any, strict: bool, *args: Any) -> None:
        for key in [k for k in state_dict if k.startswith(prefix)]:
            ours = prefix + _renamed(key[len(prefix):], TORCHTITAN_NAMES)
            if ours != key:
                state_dict[ours] = state_dict.pop(key)
        for counter in COUNTERS:
            state_dict.pop(prefix + counter, None)
        if prefix + "expert_bias" not in state_dict:
            state_dict[prefix + "expert_bias"] = module.expert_bias.detach().clone()
        if layout is not None:  # in every checking mode: the setting never decides whether a collective runs
            _agree_on_entries(module, state_dict, prefix, layout, strict, agree_over)
        elif (axis := _dtensor_axis(state_dict, prefix)) is not None:  # a single-device layer gathering DTensors
            _agree_on_entries(module, state_dict, prefix, None, strict, axis)
        for name in HIDDEN_DIM:
            key = prefix + name
            if key in state_dict:
                local = _local_value(name, state_dict[key], layout, module.config)
                param = module.get_parameter(name)
                if is_dtensor(param):  # FSDP2: hand it this rank's shard of the slice
                    from torch.distributed.tensor import distribute_tensor

                    local = distribute_tensor(local, param.device_mesh, param.placements, src_data_rank=None)
                elif _same_elements(local, param):  # the layer's own state dict (or DCP loaded in place): with one
                    local = param.detach()  # expert a rank its view has other strides, a "partial overlap" to copy_
                state_dict[key] = local

    return hook


def _same_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same elements of one storage (strides of size-1 dims aside)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and all(
        s == t for n, s, t in zip(a.shape, a.stride(), b.stride()) if n > 1)


_KIND = {0: "missing", 1: "a plain tensor", 2: "a DTensor in this layer's layout", 3: "a DTensor in another layout"}


def _dtensor_axis(state_dict: dict[str, Any], prefix: str) -> Optional[MeshAxis]:
    """A single-device layer: the axis to agree over before gathering the expert DTensors of ``state_dict`` whose
    mesh holds other ranks (``None``: no such DTensor, nothing to agree on): the mesh of the first one when it
    is 1-D and holds the others' ranks, else the world."""
    meshes = [v.device_mesh for n in HIDDEN_DIM if is_dtensor(v := state_dict.get(prefix + n))]
    ranks = {r for m in meshes for r in m.mesh.flatten().tolist()}
    if not dist.is_initialized() or not ranks - {dist.get_rank()}:
        return None
    first = meshes[0]
    if first.ndim == 1 and ranks <= set(first.mesh.flatten().tolist()):
        return mesh_axis(first)
    return world_axis()


def _agree_on_entries(module: Checkpointed, state_dict: dict[str, Any], prefix: str, layout: Optional[ExpertLayout],
                      strict: bool, agree_over: Optional[MeshAxis]) -> None:
    """One agreement exchange over ``agree_over`` (the world by default) before any gather: every rank
    raises if one rank's entries are missing (strict), misshapen, or of another kind than its peers'.

    A DTensor's gathers span its own mesh, not the layer's group: when some rank of ``agree_over`` holds an
    expert DTensor whose load talks to ranks outside it (a mesh wider than the group), the verdict is not
    raised there (the other groups would go on into those gathers and wait) but agreed again over the world,
    which every rank that such a gather involves takes part in. ``layout`` ``None``: a single-device layer,
    agreeing over the mesh of its DTensors (``_dtensor_axis``)."""
    found, kinds = Problem(), []
    rank = dist.get_rank()
    reach: set[int] = set()  # the global ranks this rank's expert DTensors will gather or redistribute over
    expected = [*module.named_parameters(), ("expert_bias", module.expert_bias)]
    for name, param in expected:
        value = state_dict.get(prefix + name)
        if name in HIDDEN_DIM:
            own = _in_layout(name, value, layout)
            if is_dtensor(value) and not own:  # loading it gathers or redistributes over its mesh
                reach |= set(value.device_mesh.mesh.flatten().tolist())
            kinds.append((Field(f"kind of entry {prefix + name}", show=lambda v: _KIND[v]),
                          0 if value is None else 2 if own else 3 if is_dtensor(value) else 1))
            want: Any = _global_shape(name, module.config)
        else:
            want = tuple(param.shape)
        if value is None:
            if strict:
                found.add("state_dict", f"rank {rank}: {prefix + name} is missing from the state dict")
        elif not isinstance(value, torch.Tensor):
            found.add("state_dict", f"rank {rank}: {prefix + name} is a {type(value).__name__}, not a tensor")
        elif tuple(value.shape) != want:
            found.add("state_dict", f"rank {rank}: {prefix + name}: {_shape_problem(name, tuple(value.shape), want)}")
    if agree_over is None or agree_over.size == dist.get_world_size():
        agree("load_state_dict", agree_over, found, kinds, global_ranks=True)
        return
    wider = bool(reach - set(agree_over.ranks))
    table = exchange_rows(agree_over, [found.bits, *(v for _, v in kinds), int(wider)], "load_state_dict", found.bits)
    if any(row[-1] for row in table):  # some rank's gathers reach past the group: every rank of theirs agrees
        agree("load_state_dict", None, found, kinds, global_ranks=True)
        return
    raise_if(verdict("load_state_dict", agree_over, table, found, [f for f, _ in kinds], global_ranks=True))


def _in_layout(name: str, value: Any, layout: Optional[ExpertLayout]) -> bool:
    """Whether ``value`` is a DTensor in this layer's own layout (loading it is a local copy, no collective)."""
    return is_dtensor(value) and layout is not None and layout.mesh is not None \
        and value.device_mesh == layout.mesh and list(value.placements) == layout.placements(name)


def _global_shape(name: str, config: MoEConfig) -> tuple[int, int, int]:
    E, F, D = config.num_experts, config.hidden_dim, config.dim
    return (E, D, F) if name == "experts.w2" else (E, F, D)


def _shape_problem(name: str, found: tuple[int, ...], want: Any) -> str:
    text = f"expected shape {tuple(want)}, found {found}"
    if name in HIDDEN_DIM and len(found) == 3 and found == (want[0], want[2], want[1]):
        text += ("; this looks like torchtitan's oldest (E, D, F) orientation: convert it with "
                 "spmdmoe.moe.checkpoint.from_torchtitan(state_dict, orientation='EDF') (never guessed: it is "
                 "ambiguous when dim == hidden_dim)")
    elif name in HIDDEN_DIM and len(found) == 3 and found[0] < want[0] and found[1:] == tuple(want[1:]):
        text += ("; a plain tensor must hold every expert (save with the layer's state_dict(), which presents "
                 "global DTensors)")
    elif name in HIDDEN_DIM:
        text += ("; the checkpoint's layer has another num_experts, dim or hidden_dim than this layer's MoEConfig: "
                 "build the layer with the checkpoint's")
    return text


def _local_value(name: str, value: Any, layout: Optional[ExpertLayout], config: MoEConfig) -> torch.Tensor:
    """This rank's slice of a saved expert weight (DTensor of any layout, or a full tensor)."""
    if is_dtensor(value):
        from torch.distributed.tensor import Replicate

        if layout is not None and layout.mesh is not None and value.device_mesh == layout.mesh:
            # the same mesh: this layout's shards by redistribution (all-to-alls, no full tensor anywhere)
            want = [p if p is not None else Replicate() for p in layout.placements(name)]
            return (value if list(value.placements) == want else value.redistribute(layout.mesh, want)).to_local()
        value = value.full_tensor()  # another mesh: gathered whole (DCP, loading into state_dict(), never does)
    want = _global_shape(name, config)
    if tuple(value.shape) != want:
        raise SPMDLayoutError(f"{name}: {_shape_problem(name, tuple(value.shape), want)}")
    return value if layout is None else layout.local_slice(name, value)
