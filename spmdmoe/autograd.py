"""When an op records its backward: by rank-local facts for local ops, by shared facts for collectives.

A local op (a row gather, a permutation) may skip autograd when its input needs no gradient: nothing on another rank
depends on it. A collective may not: its backward is a collective too, and a rank that skipped recording it would skip
the backward collective its peers run, and they would wait forever. Whether a collective records its backward therefore
depends only on facts every rank shares: grad mode and the dtype (floating point). A rank whose input does not require
grad still records the node, through :data:`GRAD_LEAF`, a zero-size leaf that requires grad and is passed as an extra
input, so its backward runs whenever the peers' does. Its gradient is never computed (the backward returns ``None`` for
it), so the leaf costs nothing.

One consequence, by design: with grad mode on, a collective's floating-point
result requires grad on every rank, even where the input did not.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["GRAD_LEAF", "differentiable", "collective_op", "always_recorded", "written"]

GRAD_LEAF = torch.zeros(0, requires_grad=True)


def differentiable(function: type[torch.autograd.Function], plain: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """For LOCAL ops: ``function.apply`` when autograd must record the op, else ``plain`` (same math).

    ``autograd.Function.apply`` costs ~10-20 us of host time per call; skipping it under ``no_grad`` or for inputs that
    need no gradient keeps inference-style calls cheap. Never use this for an op whose backward communicates: see
    :func:`collective_op`.
    """

    def op(local: torch.Tensor, *args: Any) -> torch.Tensor:
        if local.requires_grad and torch.is_grad_enabled():
            return function.apply(local, *args)
        return plain(local, *args)

    return op


def collective_op(function: type[torch.autograd.Function], plain: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """For COLLECTIVES: record the backward whenever grad mode is on and the data is floating point.

    ``function.forward`` takes ``(local, *args, grad_leaf)`` and its backward returns one more ``None`` for the leaf.
    The decision never looks at ``local.requires_grad``, which can differ between ranks.
    """

    def op(local: torch.Tensor, *args: Any) -> torch.Tensor:
        if torch.is_grad_enabled() and (local.is_floating_point() or local.is_complex()):
            return function.apply(local, *args, GRAD_LEAF)
        return plain(local, *args)

    return op


class _AlwaysRecorded(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, grad_leaf: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return local.view_as(local)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        return grad, None


def always_recorded(local: torch.Tensor) -> torch.Tensor:
    """``local`` unchanged, but requiring grad whenever grad mode is on (through :data:`GRAD_LEAF`).

    For collectives whose backward is recorded by torch itself (the functional collectives that ``torch.compile``
    traces): feeding them such an input records their backward on every rank alike, as :func:`collective_op` does.
    """
    if torch.is_grad_enabled() and (local.is_floating_point() or local.is_complex()):
        return _AlwaysRecorded.apply(local, GRAD_LEAF)
    return local


def written(t: torch.Tensor) -> torch.Tensor:
    """``t``, a tensor an op allocated and then wrote in place (a collective's output), as the op returns it:
    itself eagerly, a view of it while tracing: an ``autograd.Function`` forward returning a tensor it wrote in
    place meets torch 2.11's hazard that :func:`spmdmoe.kernels.backend.cast` describes (pytorch/pytorch#180642),
    and a view is a tensor of its own. ``tests/distributed/test_compile_moe.py`` checks every plan's gradients."""
    return t.view_as(t) if torch.compiler.is_compiling() else t
