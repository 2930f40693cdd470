"""Load statistics, the aux-loss-free bias update and the auxiliary loss.

Legend: ``T`` tokens this rank holds, ``E`` experts, ``K`` top-k.

Every rank counts only the valid tokens it *holds*, so the sum over the layer's load axes (SP, EP once when it is
the SP group, DP) counts every token once; the counts reach ``tokens_per_expert`` in the backward of the forward
that routed them (:func:`count_on_backward`), with no host sync. :func:`update_expert_bias` sums them over the load
axes (every rank of them must call it) and makes the DeepSeek-V3 sign update
``bias += coeff * sign(mean(load) - load)`` in fp32, bitwise identical everywhere, after raising on every rank what
any rank recorded. The aux loss is ``coeff * E * sum_e f_e * P_e`` per batch (the SP axis), each rank's share from
its own tokens' scores. The counting rule, the update and the aux loss: ``docs/design.md`` §5 (data flow, step 2).
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol, Sequence

import torch

from ..._dist import all_reduce
from ...agreement import alone
from ...sticky import ProblemFlag, raise_and_clear
from ...autograd import GRAD_LEAF
from ...host import to_host
from ...types.checks import checks_enabled
from ...types.mesh import MeshAxis

__all__ = ["LoadCounter", "count_on_backward", "reduce_counts", "aux_loss", "update_expert_bias"]


class LoadCounter(Protocol):
    """What :func:`count_on_backward` adds to: a layer's ``tokens_per_expert`` buffer (read when the backward
    runs, so a layer moved by ``.to()`` since the forward still gets the counts)."""

    tokens_per_expert: torch.Tensor


class _CountOnBackward(torch.autograd.Function):
    """Identity on the routing weights; the backward adds this forward's counts to the layer's counter."""

    @staticmethod
    def forward(ctx: Any, weights_TK: torch.Tensor, counts_E: torch.Tensor, layer: LoadCounter,  # type: ignore[override]
                grad_leaf: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(counts_E)
        ctx.layer = weakref.ref(layer)  # no cycle layer -> aux_loss -> graph -> layer
        return weights_TK.view_as(weights_TK)

    @staticmethod
    def backward(ctx: Any, grad_TK: torch.Tensor) -> Any:  # type: ignore[override]
        (counts_E,) = ctx.saved_tensors
        layer = ctx.layer()
        if layer is not None:
            layer.tokens_per_expert.add_(counts_E)
        return grad_TK, None, None, None


def count_on_backward(weights_TK: torch.Tensor, counts_E: torch.Tensor, layer: LoadCounter) -> torch.Tensor:
    """``weights_TK`` unchanged; once its backward runs, ``counts_E`` is added to ``layer.tokens_per_expert``.

    Recorded whenever grad mode is on (``spmdmoe.autograd.GRAD_LEAF``), also for a
    frozen router; the caller decides on training mode.
    """
    return _CountOnBackward.apply(weights_TK, counts_E, layer, GRAD_LEAF)


def reduce_counts(counts_E: torch.Tensor, axes: Sequence[MeshAxis]) -> torch.Tensor:
    """The sum of ``counts_E`` over the load axes (a new tensor; one all_reduce per axis)."""
    total = counts_E.clone()
    for axis in axes:
        all_reduce(total, group=axis.group)
    return total


def aux_loss(scores_TE: torch.Tensor, total_counts_E: torch.Tensor, top_k: int, coeff: float) -> torch.Tensor:
    """This rank's share of ``coeff * E * sum_e f_e * P_e`` (see the module docstring)."""
    copies = total_counts_E.sum().clamp(min=1).to(torch.float32)
    f_E = total_counts_E.to(torch.float32) / copies
    P_E = scores_TE.sum(dim=0) / (copies / top_k)
    # the tensor first: compiled with dynamic=True ``coeff`` is a symbolic float, and float arithmetic on it
    # outside a tensor op made torch 2.11's Dynamo specialise it and trace the layer a second time
    return (f_E * P_E).sum() * total_counts_E.numel() * coeff


@torch.no_grad()
def update_expert_bias(
    expert_bias: torch.Tensor, tokens_per_expert: torch.Tensor, coeff: float, axes: Sequence[MeshAxis],
    problems: ProblemFlag,
) -> torch.Tensor:
    """Apply the sign update from the counts summed over ``axes``; reset the counts; return the sums.

    One all-reduce per axis of ``E + world_size`` int64 (the counts and every
    rank's sticky ``problems`` flag of this layer) and one host read of the
    flags: if any rank of the axes recorded a problem, the counts are dropped
    and every rank raises. With checks off the payload is the same (the flag
    slots zero: a rank with checks off and one with checks on still exchange
    the same size), and the flags are not read.

    A layer with no peers (every axis of one rank) in a job of several
    processes (a plain ``MoE`` under torch DDP) cannot tell whether its peers
    would raise too: it drops a failed step's counts and leaves the bias, but
    does not raise; :func:`spmdmoe.check_errors` raises on every rank.
    """
    problems.before_exchange()
    E = tokens_per_expert.numel()
    checking = checks_enabled()
    slots = problems.slots(tokens_per_expert.device)
    payload = torch.cat([tokens_per_expert.to(torch.int64), slots if checking else torch.zeros_like(slots)])
    for axis in axes:
        all_reduce(payload, group=axis.group)
    if checking:
        verdict = to_host(payload[E:])
        if any(verdict):
            if alone() or any(axis.size > 1 for axis in axes):
                raise_and_clear("update_expert_bias (problems recorded during the step)", verdict, [problems])
            tokens_per_expert.zero_()  # no peers here, but peers elsewhere: check_errors raises everywhere
            return payload[:E].to(torch.float32)
    load = payload[:E].to(torch.float32)
    delta = coeff * torch.sign(load.mean() - load)
    expert_bias.add_((delta - delta.mean()).to(expert_bias.dtype))
    tokens_per_expert.zero_()
    return load
