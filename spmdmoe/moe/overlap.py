"""Overlapped SP gradient reduction: launch at the use, wait at the anchor (docs/design.md §5.2).

``sync_grads`` (``grads.py``) sums the fresh gradients of replicated
parameters over an SP axis at their use. Alone, it waits for that all-reduce
right there, and the rest of backward waits with it. Inside an *anchored*
call (a :class:`ParallelMoE` forward, or a module wrapped by
:func:`overlap_grads`, e.g. a transformer block) it only launches it: the
fresh gradients go into buckets of about ``bucket_mb`` per (group, dtype), a
full bucket is all-reduced asynchronously at once, and the call's *join* node
waits for all of them when the gradient of the call's input is complete, i.e.
when backward leaves the call. Only then do the parameters receive their
gradients, through autograd (``AccumulateGrad``), so DDP's and FSDP2's hooks
see final values, in order, in the same backward:

====================  ===============================================================
forward               ``x' , token = Join(x, *params)`` at the call's start; every
                      ``sync_grads`` inside takes ``token`` as an input
backward, at a use    ``sync_grads`` node: fresh gradients into the open bucket;
                      launch it when full; return nothing to the parameters
backward, at ``x``    ``Join`` (runs after every use: each depends on ``token``):
                      launch the open buckets, wait, return ``dx`` and each
                      parameter's summed gradient, cast to its dtype
====================  ===============================================================

Exact as before: only fresh gradients are reduced (micro-batch accumulation),
recomputation under activation checkpointing builds its own join, and every
rank launches the same buckets in the same order (the backward order and the
parameters' shapes are the same on every rank of the axis). Not anchored:
under ``torch.compile`` (the collectives are functional there and inductor
places their waits), with grad off, or when the call's input is not floating
point. An input that needs no gradient is anchored anyway (backward then
computes one): whether a call anchors must not differ between ranks.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.nn as nn

from .._dist import all_reduce
from ..types.tensor import SPMDTensor

__all__ = ["overlap_grads", "Anchor", "anchored", "active_anchor", "call_anchored", "sync_params"]

DEFAULT_BUCKET_MB = 25.0
_local = threading.local()


class Anchor:
    """One anchored call's pending SP reductions: open buckets, launched ones, and the parameters
    they belong to (the join's inputs, in order)."""

    def __init__(self, params: Sequence[torch.Tensor], bucket_mb: float):
        self.params = list(params)
        self.slots = {id(p): i for i, p in enumerate(self.params)}
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.token: Optional[torch.Tensor] = None
        self.open: dict[tuple[Any, torch.dtype], list[tuple[int, torch.Tensor]]] = {}
        self.launched: list[tuple[torch.Tensor, Any, list[tuple[int, torch.Size]]]] = []

    def covers(self, tensors: Sequence[torch.Tensor]) -> bool:
        return all(id(t) in self.slots for t in tensors)

    def submit(self, group: Any, slots: Sequence[int], grads: Sequence[torch.Tensor]) -> None:
        """Add the fresh gradients of parameters ``slots`` (indices into ``params``) to their buckets."""
        for slot, g in zip(slots, grads):
            bucket = self.open.setdefault((group, g.dtype), [])
            bucket.append((slot, g))
            if sum(x.numel() * x.element_size() for _, x in bucket) >= self.bucket_bytes:
                self._launch((group, g.dtype))

    def _launch(self, key: tuple[Any, torch.dtype]) -> None:
        items = self.open.pop(key)
        flat = torch.cat([g.reshape(-1) for _, g in items])
        work = all_reduce(flat, group=key[0], async_op=True) if flat.numel() else None
        self.launched.append((flat, work, [(slot, g.shape) for slot, g in items]))  # fresh grads freed

    def finish(self) -> list[Optional[torch.Tensor]]:
        """Launch what is still open, wait for everything; each parameter's summed gradient (or None)."""
        for key in list(self.open):  # insertion order: the same on every rank
            self._launch(key)
        out: list[Optional[torch.Tensor]] = [None] * len(self.params)
        for flat, work, items in self.launched:
            if work is not None:
                work.wait()
            for (slot, shape), part in zip(items, flat.split([shape.numel() for _, shape in items])):
                part = part.view(shape)
                out[slot] = part if out[slot] is None else out[slot] + part
        self.launched = []
        return [None if g is None else g.to(p.dtype) for g, p in zip(out, self.params)]


class _Join(torch.autograd.Function):
    """Identity on ``x`` plus a 0-d ``token``; backward: the anchor's summed parameter gradients."""

    @staticmethod
    def forward(ctx: Any, anchor: Anchor, x: torch.Tensor, *params: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.anchor = anchor
        return x.view_as(x), x.new_zeros(())

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dx: torch.Tensor, _dtoken: Any) -> Any:  # type: ignore[override]
        return (None, dx, *ctx.anchor.finish())


def active_anchor() -> Optional[Anchor]:
    """The innermost anchored call running on this thread (``None`` outside one)."""
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


def _covered(params: Sequence[torch.Tensor]) -> bool:
    outer = active_anchor()
    return outer is not None and outer.covers(params)


@contextlib.contextmanager
def anchored(x: Any, params: Sequence[torch.Tensor], bucket_mb: float = DEFAULT_BUCKET_MB) -> Iterator[Any]:
    """Run the body as an anchored call on input ``x`` (a tensor or an ``SPMDTensor``); yields the
    ``x`` to use instead. Yields ``x`` unchanged, anchoring nothing, when an enclosing anchored call
    already covers ``params``, when there are none, under ``torch.compile``, with grad off, or when
    ``x`` is not floating point. The decision must be the same on every rank (their collectives
    differ otherwise), so it does not depend on ``x.requires_grad``: an ``x`` that needs no
    gradient is anchored too, and backward then computes its gradient (to reach the join)."""
    local = x.local if isinstance(x, SPMDTensor) else x
    if (torch.compiler.is_compiling() or not torch.is_grad_enabled() or not params
            or not isinstance(local, torch.Tensor) or not local.is_floating_point() or _covered(params)):
        yield x
        return
    anchor = Anchor(params, bucket_mb)
    local, anchor.token = _Join.apply(anchor, local, *params)
    stack = _local.__dict__.setdefault("stack", [])
    stack.append(anchor)
    try:
        yield x.with_local(local) if isinstance(x, SPMDTensor) else local
    finally:
        stack.pop()


def sync_params(module: nn.Module) -> list[torch.Tensor]:
    """The parameters whose SP reductions an anchored call on ``module`` defers: those of every
    ``ParallelMoE`` (``sp_sync_params()``) and ``replicate_grads`` module inside it, read at call
    time (so FSDP2's unsharded parameters are the ones listed). FSDP2 units nested inside
    ``module`` are left out: their sums must be done before their own reduce-scatter, so they
    anchor themselves."""
    seen: dict[int, torch.Tensor] = {}
    todo = [module]
    while todo:
        m = todo.pop()
        replicated = getattr(m, "_spmdmoe_replicated", None)
        if replicated is not None:
            axis, names = replicated
            params = [m.get_parameter(n) for n in names] if axis.size > 1 else []
        else:
            provider = getattr(m, "sp_sync_params", None)
            params = provider() if callable(provider) else []
        for p in params:
            seen.setdefault(id(p), p)
        todo += [c for c in m.children() if not is_fsdp_unit(c)]
    return list(seen.values())


def is_fsdp_unit(module: nn.Module) -> bool:
    """Whether ``fully_shard`` made ``module`` an FSDP2 unit."""
    return any(c.__name__ == "FSDPModule" for c in type(module).__mro__)


def call_anchored(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                  params: Callable[[], Sequence[torch.Tensor]], bucket_mb: float = DEFAULT_BUCKET_MB) -> Any:
    """``fn(*args, **kwargs)`` as an anchored call on its first tensor (or ``SPMDTensor``) argument,
    deferring the reductions of ``params()`` (not called under ``torch.compile``)."""
    i = next((i for i, a in enumerate(args) if isinstance(a, (torch.Tensor, SPMDTensor))), None)
    if i is None or torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    with anchored(args[i], params(), bucket_mb) as x:
        return fn(*args[:i], x, *args[i + 1:], **kwargs)


def overlap_grads(module: nn.Module, *, bucket_mb: float = DEFAULT_BUCKET_MB) -> nn.Module:
    """Anchor the SP gradient reductions inside ``module`` at its input; returns ``module``.

    Wraps ``module.forward`` in place (names, ``state_dict`` unchanged). The
    all-reduces of the replicated parameters of the ``ParallelMoE`` layers and
    ``replicate_grads`` modules inside it are launched as their gradients are
    ready, in buckets of about ``bucket_mb``, and waited for when the gradient
    of ``module``'s first tensor argument is complete (module docstring). Give
    it the transformer blocks: the MoE layer's expert gradients then reduce
    behind the block's attention backward. With FSDP2, wrap the modules you
    make units (the wait then comes before the unit's reduce-scatter). Without
    it each ``ParallelMoE`` and ``replicate_grads`` module anchors at its own input.

    >>> import torch, spmdmoe
    >>> pg = spmdmoe.testing.single_process_group()
    >>> block = spmdmoe.moe.overlap_grads(spmdmoe.moe.replicate_grads(torch.nn.Linear(2, 2), pg))
    >>> block(torch.ones(1, 2, requires_grad=True)).shape
    torch.Size([1, 2])
    """
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return call_anchored(inner, args, kwargs, lambda: sync_params(module), bucket_mb)

    module.forward = forward  # type: ignore[method-assign]
    return module
