"""What ``parallelize_moe`` agrees on before it builds anything: the plan, the config, the weights.

Legend: ``E`` experts, ``F`` expert hidden dim, ``D`` model dim, ``K`` top-k.

Every rank fingerprints what it was given (the checks setting, the config, the plan, the parameters' dtype and
device type, an exact fingerprint of the weights) and one agreement exchange (``spmdmoe.agreement.agree``: one
check exchange, an ``all_to_all_single`` of 19 int64 a rank, once per layer) compares them over ``agree_over``:
the world by default, a pipeline stage's group when stages build different layers. Problems a rank finds on its own (``E % ep``, gather
mode without SP, ...) travel as problem bits in the same exchange, so every rank raises the same error, and
``parallelize_moe`` is a collective over ``agree_over``: every rank of it calls it for the same layers in the same
order. The fields and their errors: ``docs/design.md`` §6 (the table's ``parallelize_moe`` row).
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Optional

import torch
import torch.nn as nn

from ..._dist import is_dtensor
from ...agreement import Field, Problem, agree, dtype_code, dtype_name, global_rank
from ...host import to_host
from ...types.checks import checks_enabled
from ...types.errors import MoEConfigError, SPMDMeshError
from ...types.mesh import MeshAxis, MeshLike, mesh_axis
from ..config import MoEConfig
from ..layer import MoE

__all__ = ["agree_plan", "weights_fingerprint"]

_MODES = {"local": 0, "gather": 1}
_EP_MODES = {"sync": 0, "sync_free": 1}
_DEVICES = {"cpu": 0, "cuda": 1, "meta": 2}
_SAME_CONFIG = "build the layer from the same MoEConfig on every rank"


def _plan_field(name: str, show: Any = str) -> Field:
    return Field(f"plan's {name}", MoEConfigError, show, "call parallelize_moe with the same meshes and sp_mode on every rank")


# first: a rank with checks off sends zeros for every field below, so a mixed setting is named as such
_CHECKS = Field("checks setting (spmdmoe.set_checks)", MoEConfigError, lambda v: "on" if v else "off",
                "use the same spmdmoe.set_checks setting on every rank")
_FIELDS = (
    *(Field(f"MoEConfig.{n}", MoEConfigError, fix=_SAME_CONFIG)
      for n in ("dim", "hidden_dim", "num_experts", "top_k", "num_shared_experts")),
    Field("MoEConfig (hash of every option)", MoEConfigError, fix=_SAME_CONFIG),
    *(_plan_field(f"{n}_mesh size") for n in ("sp", "ep", "dp")),
    _plan_field("sp_mode", lambda v: {c: m for m, c in _MODES.items()}.get(v, "other")),
    _plan_field("EP-on-the-SP-axis", lambda v: str(bool(v))),
    _plan_field("ep_mode", lambda v: {c: m for m, c in _EP_MODES.items()}.get(v, "other")),
    _plan_field("capacity_factor", lambda v: "None" if v < 0 else f"{v / 1e6:g}"),
    _plan_field("max_tokens", lambda v: "None" if v < 0 else str(v)),
    Field("parameter dtype", MoEConfigError, dtype_name, "convert the layer with .to(dtype) on every rank"),
    Field("parameter device type", MoEConfigError, lambda v: {c: d for d, c in _DEVICES.items()}.get(v, "other"),
          "build or move the layer to the same kind of device on every rank"),
    Field("weights (fingerprint of every parameter and expert_bias)", MoEConfigError, lambda v: f"#{v % 99991}",
          "build and initialise the layer identically on every rank (same seed, same checkpoint) before "
          "parallelize_moe"),
)

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def weights_fingerprint(module: nn.Module) -> int:
    """An exact integer fingerprint of ``module``'s parameters and ``expert_bias``.

    The bit patterns of every element, in the order of a flat concatenation of
    the (name-sorted) tensors, summed twice in wrapping int64: plainly, and
    weighted by a hash of the element's position, so a permutation (a
    transposed ``w1`` with ``D == F``, swapped tensors) changes it. Integer
    sums do not depend on summation order, so every rank and device type gets
    the same value for the same bits. -1 when a tensor has no data here (meta)
    or is a DTensor (its shards differ by rank).
    """
    tensors = [p for _, p in sorted(module.named_parameters())] + [b for n, b in module.named_buffers() if n == "expert_bias"]
    if not tensors or any(t.is_meta or is_dtensor(t) for t in tensors):
        return -1
    device = tensors[0].device
    acc = torch.zeros(2, dtype=torch.int64, device=device)
    at = 0
    for t in tensors:
        bits = t.detach().contiguous().view(-1).view(_INT_VIEW[t.element_size()]).to(device)
        for chunk in bits.split(1 << 22):
            c = chunk.to(torch.int64)
            where = torch.arange(at, at + c.numel(), dtype=torch.int64, device=device)
            weight = (where * 2654435761 + 97531) & 0xFFFFFFFF
            acc += torch.stack([c.sum(), (c * weight).sum()])
            at += c.numel()
    a, b = to_host(acc)
    return (a * 1000003 + b + 2**63) % 2**64 - 2**63


def _axis(name: str, mesh: Optional[MeshLike], found: Problem) -> Optional[MeshAxis]:
    try:
        return None if mesh is None else mesh_axis(mesh)
    except SPMDMeshError as e:
        found.add("mesh", f"{name}: {e}")
        return None


def _plan_problems(cfg: MoEConfig, sp: Optional[MeshAxis], ep: Optional[MeshAxis], dp: Optional[MeshAxis],
                   sp_mode: Any, found: Problem) -> None:
    rank = global_rank()
    if sp_mode not in _MODES:
        found.add("config", f"rank {rank}: sp_mode must be 'local' or 'gather', found {sp_mode!r}")
    if ep is not None and cfg.num_experts % ep.size:
        found.add("config", f"rank {rank}: num_experts={cfg.num_experts} does not divide by the EP size {ep.size} "
                            f"({cfg.num_experts} % {ep.size} = {cfg.num_experts % ep.size}); use an EP size that divides E")
    if sp_mode == "gather" and sp is None:
        found.add("config", f"rank {rank}: sp_mode='gather' needs sp_mesh (the axis tokens are gathered over)")
    if sp_mode == "gather" and ep is not None and ep == sp:
        found.add("config", f"rank {rank}: sp_mode='gather' splits the experts' hidden dim over sp_mesh, so EP must be "
                            "another axis (or None); for EP on the SP group use sp_mode='local'")
    pairs = [("sp_mesh", sp, "ep_mesh", ep)] if sp != ep else []
    pairs += [("dp_mesh", dp, name, a) for name, a in (("sp_mesh", sp), ("ep_mesh", ep))]
    for name_a, a, name_b, b in pairs:
        if a is not None and b is not None:
            shared = set(a.ranks) & set(b.ranks)
            if shared != {rank}:
                same = "the same group or " if name_a == "sp_mesh" else ""
                found.add("mesh", f"rank {rank}: {name_a} and {name_b} must be {same}orthogonal axes (e.g. two dims "
                                  f"of one mesh); they share ranks {sorted(shared)}")


def agree_plan(moe: Any, sp_mesh: Optional[MeshLike], ep_mesh: Optional[MeshLike], dp_mesh: Optional[MeshLike],
               sp_mode: Any, agree_over: Optional[MeshLike] = None,
               transport: tuple[Any, Any, Any] = ("sync", None, None),
               ) -> tuple[Optional[MeshAxis], Optional[MeshAxis], Optional[MeshAxis], Optional[MeshAxis]]:
    """The normalised ``(sp, ep, dp, agree_over)`` axes, once every rank agrees on the layer (see the
    module docstring); ``agree_over`` ``None`` means the world. ``transport``: ``(ep_mode,
    capacity_factor, max_tokens)``; ``moe``: what the caller passed (a single-device ``MoE``, or a problem)."""
    found = Problem()
    checking = checks_enabled()
    over = None if agree_over is None else mesh_axis(agree_over)
    sp, ep, dp = (_axis(n, m, found) for n, m in (("sp_mesh", sp_mesh), ("ep_mesh", ep_mesh), ("dp_mesh", dp_mesh)))
    if not isinstance(moe, MoE):
        found.add("config", f"parallelize_moe takes a single-device MoE, found "
                            f"{type(moe).__name__}" + (" (it is already parallel: apply parallelize_moe once, to "
                                                       "the single-device layer)" if isinstance(moe, nn.Module) else ""))
        values = [-1] * len(_FIELDS)
    else:
        _plan_problems(moe.config, sp, ep, dp, sp_mode, found)
        _transport_problems(*transport, found)
        values = _values(moe, sp, ep, dp, sp_mode, transport) if checking else [0] * len(_FIELDS)
    # the same exchange in every mode (checks off: the fields zero, not compared with anything but zeros), so a
    # rank's local setting never decides whether a collective runs
    agree("parallelize_moe", over, found, [(_CHECKS, int(checking)), *zip(_FIELDS, values)], global_ranks=True)
    return sp, ep, dp, over


def _values(moe: Any, sp: Optional[MeshAxis], ep: Optional[MeshAxis], dp: Optional[MeshAxis], sp_mode: Any,
            transport: tuple[Any, Any, Any]) -> list[int]:
    cfg = moe.config
    ep_mode, factor, max_tokens = transport
    weight = moe.router.gate.weight
    return [
        cfg.dim, cfg.hidden_dim, cfg.num_experts, cfg.top_k, cfg.num_shared_experts,
        zlib.crc32(repr(cfg).encode()),
        *(0 if a is None else a.size for a in (sp, ep, dp)),
        _MODES.get(sp_mode, -1),
        int(sp is not None and sp == ep),
        _EP_MODES.get(ep_mode, -1),
        _factor_code(factor),
        max_tokens if isinstance(max_tokens, int) else -1,
        dtype_code(weight.dtype),
        _DEVICES.get(weight.device.type, 3),
        weights_fingerprint(moe),
    ]


def _factor_code(factor: Any) -> int:
    """``capacity_factor`` as an agreement field: micro-units, or -1 for ``None`` and anything unusable."""
    ok = isinstance(factor, (int, float)) and not isinstance(factor, bool) and math.isfinite(factor) and 0 < factor < 1e9
    return round(factor * 1e6) if ok else -1


def _transport_problems(ep_mode: Any, factor: Any, max_tokens: Any, found: Problem) -> None:
    rank = global_rank()
    if ep_mode not in _EP_MODES:
        found.add("config", f"rank {rank}: ep_mode must be 'sync' or 'sync_free', found {ep_mode!r}")
    if factor is not None and _factor_code(factor) < 0:
        found.add("config", f"rank {rank}: capacity_factor must be None (lossless) or a finite number > 0, found "
                            f"{factor!r}")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0):
        found.add("config", f"rank {rank}: max_tokens must be None or an int >= 0, found {max_tokens!r}")
    if ep_mode == "sync" and (factor is not None or max_tokens is not None):
        found.add("config", f"rank {rank}: capacity_factor and max_tokens size the static buffers of "
                            f"ep_mode='sync_free'; the sync transport sizes its buffers per forward (found "
                            f"capacity_factor={factor!r}, max_tokens={max_tokens!r}); pass ep_mode='sync_free' or drop them")
