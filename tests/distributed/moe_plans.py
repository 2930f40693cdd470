"""Parallel plans for the MoE parity tests, each with its single-device bookkeeping.

A plan says, for this rank: which rows of the global input ``X`` it holds,
how to wrap them, which axis (if any) acts as data parallel for the dense
parameters (their gradients cover one batch; the test sums them over that
axis), and which slice of the reference experts it holds.

=============  ========================  =====================================================
plan           axes                      batches
=============  ========================  =====================================================
``sp_ep``      SP = EP = world           one batch, sharded over SP
``sp``         SP = world, no EP         one batch, sharded over SP
``ep``         EP = world, no SP         one batch per rank, uneven sizes, zeros included
``sp_x_ep``    2x2: EP "dp" dim, SP "sp"  two batches (one per EP index), each sharded over SP
``gather``     SP = world, gather mode   one batch; experts' hidden dim split over SP
``gather_ep``  2x2 gather on "sp", EP    two batches, gathered over SP, dispatched over EP
=============  ========================  =====================================================

The 2-D plans run on 2 x (world / 2) meshes (``mesh2d_wide``): 2x2 on 4 ranks, 2x4 on 8; not on 2 (2x1 has no SP).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

import spmdmoe
from spmdmoe.moe import MoE, MoEConfig, parallelize_moe
from spmdmoe.testing import reference_tensor
from spmdmoe.types import layout

PLANS = ["sp_ep", "sp", "ep", "sp_x_ep", "gather", "gather_ep"]
FOUR_RANK_PLANS = {"sp_x_ep", "gather_ep"}


@dataclass
class Plan:
    name: str
    layer: Any
    rows: slice  # this rank's rows of the global input
    wrap: Any  # local rows -> the layer's input
    dp_group: Optional[Any]  # process group over which dense grads are summed by the test
    experts: slice  # this rank's experts
    hidden: slice  # this rank's hidden units
    sp_group: Optional[Any]
    routers_per_token: int  # how many ranks route each token (gather mode: the SP size)
    batches: list  # the rows of each batch (the aux loss is per batch)


def compile_backend(device: torch.device) -> str:
    """``torch.compile``'s backend for the compiled-vs-eager tests: inductor on NCCL (the GPU run); ``aot_eager``
    on CPU, where inductor on 2 cores is too slow for CI."""
    return "inductor" if device.type == "cuda" else "aot_eager"


def reference_moe(cfg: MoEConfig, seed: int, device, dtype=torch.float32) -> MoE:
    """The same weights on every rank: N(0, 1/fan_in) from a fixed seed."""
    moe = MoE(cfg)
    with torch.no_grad():
        for i, (name, p) in enumerate(sorted(moe.named_parameters())):
            fan_in = p.shape[-1]
            p.copy_(reference_tensor(p.shape, seed * 100 + i) / fan_in**0.5)
    return moe.to(device=device, dtype=dtype)


def _batches(total: int, n: int) -> list[tuple[int, int]]:
    """(offset, size) of ``n`` uneven per-rank batches of ``total`` rows: empty ranks first."""
    sizes = [layout.local_tokens(total, n, n - 1 - r) for r in range(n)]
    offsets = [sum(sizes[:r]) for r in range(n)]
    return list(zip(offsets, sizes))


def build_plan(name: str, moe: MoE, total: int, world, request, layer: Any = None, **ep_options: Any) -> Plan:
    """The plan ``name`` for ``total`` tokens; ``layer``: reuse this parallel layer (built by the same plan);
    ``ep_options``: ``ep_mode``, ``capacity_factor``, ``max_tokens`` for the plans with EP."""
    n, rank, E, F = world.size(), world.get_local_rank(), moe.config.num_experts, moe.config.hidden_dim
    if name in FOUR_RANK_PLANS:
        mesh = request.getfixturevalue("mesh2d_wide")  # 2 x (n / 2): the EP "dp" dim of 2, SP over the rest
        ep, sp = mesh["dp"], mesh["sp"]
        m, b, s = sp.size(), ep.get_local_rank(), sp.get_local_rank()
        b_off, b_rows = layout.chunk_offset(total, 2, b), layout.local_tokens(total, 2, b)
        start = b_off + layout.chunk_offset(b_rows, m, s)
        rows = slice(start, start + layout.local_tokens(b_rows, m, s))
        gather = name == "gather_ep"
        layer = layer or parallelize_moe(moe, sp_mesh=sp, ep_mesh=ep, sp_mode="gather" if gather else "local",
                                         **ep_options)
        wrap = lambda t: spmdmoe.from_local(t, sp, global_tokens=b_rows)  # noqa: E731
        f0 = layout.chunk_offset(F, m, s) if gather else 0
        hidden = slice(f0, f0 + (layout.local_tokens(F, m, s) if gather else F))
        e = E // 2
        halves = [slice(layout.chunk_offset(total, 2, i), layout.chunk_offset(total, 2, i) + layout.local_tokens(total, 2, i)) for i in range(2)]
        return Plan(name, layer, rows, wrap, ep.get_group(), slice(b * e, (b + 1) * e), hidden, sp.get_group(), m if gather else 1, halves)
    if name == "ep":
        off, size = _batches(total, n)[rank]
        layer = layer or parallelize_moe(moe, ep_mesh=world, **ep_options)
        e = E // n
        batches = [slice(o, o + c) for o, c in _batches(total, n)]
        return Plan(name, layer, slice(off, off + size), lambda t: t, world.get_group(), slice(rank * e, (rank + 1) * e), slice(0, F), None, 1, batches)
    start = layout.chunk_offset(total, n, rank)
    rows = slice(start, start + layout.local_tokens(total, n, rank))
    wrap = lambda t: spmdmoe.from_local(t, world, global_tokens=total)  # noqa: E731
    if name == "gather":
        layer = layer or parallelize_moe(moe, sp_mesh=world, sp_mode="gather")
        f0 = layout.chunk_offset(F, n, rank)
        return Plan(name, layer, rows, wrap, None, slice(0, E), slice(f0, f0 + layout.local_tokens(F, n, rank)), world.get_group(), n, [slice(0, total)])
    if name == "sp":
        return Plan(name, layer or parallelize_moe(moe, sp_mesh=world), rows, wrap, None, slice(0, E), slice(0, F), world.get_group(), 1, [slice(0, total)])
    assert name == "sp_ep"
    e = E // n
    layer = layer or parallelize_moe(moe, sp_mesh=world, ep_mesh=world, **ep_options)
    return Plan(name, layer, rows, wrap, None, slice(rank * e, (rank + 1) * e), slice(0, F), world.get_group(), 1, [slice(0, total)])


def expert_grad_slice(name: str, grad: torch.Tensor, plan: Plan) -> torch.Tensor:
    """This rank's part of a reference expert gradient (w1/w3: (E, F, D); w2: (E, D, F))."""
    g = grad[plan.experts]
    return g[:, :, plan.hidden] if name.endswith("w2") else g[:, plan.hidden]


def summed_over(t: torch.Tensor, group) -> torch.Tensor:
    out = t.detach().clone()
    if group is not None:
        dist.all_reduce(out, group=group)
    return out


def kept_copies(ids_by_rank, n, e, S, R):
    """The documented capacity rule, in plain Python over every rank's expert ids: rank ``d`` gets the first
    ``S`` tokens of each source that need it (in token order), and keeps the first ``R`` of its copies in
    expert-major order (local expert, then source rank, then token). Returns, per source rank, a list of
    ``(t, k)`` copies kept."""
    kept = [set() for _ in range(n)]
    for d in range(n):
        arrived = []  # (local expert, source, token, k)
        for i, ids in enumerate(ids_by_rank):
            visits = [t for t in range(len(ids)) if any(x // e == d for x in ids[t])][:S]
            arrived += [(ids[t][k] - d * e, i, t, k) for t in visits for k in range(len(ids[t])) if ids[t][k] // e == d]
        for _, i, t, k in sorted(arrived)[:R]:
            kept[i].add((t, k))
    return kept


def kept_reference(moe: MoE, leaf: torch.Tensor, kept: set) -> torch.Tensor:
    """The layer's output with only the ``kept`` ``(t, k)`` copies (``kept_copies``), differentiable in ``leaf``
    (the router's weights included): fp32, one masked pass per expert."""
    r = moe.router(leaf, moe.expert_bias, moe.router.gate.weight)
    keep_TK = torch.zeros(r.ids_TK.shape, dtype=torch.bool, device=leaf.device)
    if kept:
        t, k = zip(*kept)
        keep_TK[list(t), list(k)] = True
    xf, out = leaf.float(), leaf.new_zeros(leaf.shape, dtype=torch.float32)
    w1, w2, w3 = (w.float() for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3))
    for e_ in range(moe.config.num_experts):
        t, k = torch.nonzero((r.ids_TK == e_) & keep_TK, as_tuple=True)
        h = torch.nn.functional.silu(xf[t] @ w1[e_].T) * (xf[t] @ w3[e_].T)
        out = out.index_add(0, t, r.weights_TK[t, k, None].float() * (h @ w2[e_].T))
    return out
