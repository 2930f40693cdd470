"""Overlapped SP gradient sums: launched at the use, waited for at the join (docs/design.md §5.2).

``sync_grads`` (``grads.py``) sums the fresh gradients of replicated parameters over an SP axis at their use.
Alone, it waits for that all-reduce right there, and the rest of backward waits with it. Inside a *joined* call (a
:class:`ParallelMoE` forward, a ``replicate_grads`` module call, or a module wrapped by :func:`overlap_grads`, e.g.
a transformer block) it only launches it (``async_op=True``, one bucket per call and dtype), and the call's *join*
node (``_JoinNode``, made at the call's start; every ``sync_grads`` inside takes its token) waits for it when the
gradient of the call's input is complete. Only then do the parameters receive their sums, through autograd, so
DDP's and FSDP2's hooks see final values, in order, in the same backward. A backward that will not run the join
sums at the use instead. Not joined: under ``torch.compile`` (inductor places the waits), with grad off, or when
the call's input is not floating point; an input that needs no gradient is joined anyway (whether a call joins
must not differ between ranks). Why buckets are per call, exactness, FSDP2 units inside a call: §5.2.
"""

from __future__ import annotations

import sys
import threading
import types
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn

from ..._dist import all_reduce
from ...types.tensor import SPMDTensor
from .flat import by_dtype, split_as

__all__ = ["overlap_grads", "Join", "active_join", "call_joined", "sync_params"]

_local = threading.local()


class Join:
    """One joined call's launched SP sums and the parameters they belong to (the join's inputs)."""

    def __init__(self, params: Sequence[torch.Tensor]):
        self.params = list(params)
        self.slots = {id(p): i for i, p in enumerate(self.params)}
        self.token: Optional[torch.Tensor] = None
        self.node: Any = None  # the join's autograd node
        self.launched: list[tuple[torch.Tensor, Any, list[tuple[int, torch.Size]]]] = []
        self.task = -1  # the backward (autograd graph task) the launched sums belong to

    def covers(self, tensors: Sequence[torch.Tensor]) -> bool:
        return all(id(t) in self.slots for t in tensors)

    def joins_this_backward(self) -> bool:
        """Whether the running backward will run this call's join node (not so in a second-order
        backward that reaches a use but not the call's input, or one that stops short of it)."""
        return self.node is not None and torch._C._will_engine_execute_node(self.node)

    def launch(self, group: Any, slots: Sequence[int], grads: Sequence[torch.Tensor]) -> None:
        """All-reduce the fresh gradients of parameters ``slots`` (indices into ``params``) over
        ``group`` asynchronously: one buffer per dtype (:func:`by_dtype`). Sums left by an earlier
        backward of the same graph that stopped before the join (an exception, then a retry with
        ``retain_graph``) are dropped, not added in."""
        task = torch._C._current_graph_task_id()
        if task != self.task:
            self.launched, self.task = [], task
        for idx, flat in by_dtype(grads):
            work = all_reduce(flat, group=group, async_op=True) if flat.numel() else None
            self.launched.append((flat, work, [(slots[i], grads[i].shape) for i in idx]))  # grads freed

    def wait(self) -> list[Optional[torch.Tensor]]:
        """Wait for every launched sum; each parameter's summed gradient over its uses (or None)."""
        out: list[Optional[torch.Tensor]] = [None] * len(self.params)
        launched, self.launched = self.launched, []
        for flat, work, items in launched:
            if work is not None:
                work.wait()
            for (slot, _), part in zip(items, split_as(flat, [shape for _, shape in items])):
                out[slot] = part if out[slot] is None else out[slot] + part
        return [None if g is None else g.to(p.dtype) for g, p in zip(out, self.params)]


class _JoinNode(torch.autograd.Function):
    """Identity on ``x`` plus a 0-d ``token``; backward: ``dx`` as it came (so a second-order backward
    through the call still works) and the join's summed parameter gradients."""

    @staticmethod
    def forward(ctx: Any, join: Join, x: torch.Tensor, *params: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.join = join
        return x.view_as(x), x.new_zeros(())

    @staticmethod
    def backward(ctx: Any, dx: torch.Tensor, _dtoken: Any) -> Any:  # type: ignore[override]
        with torch.no_grad():
            sums = ctx.join.wait()
        return (None, dx, *sums)


def active_join() -> Optional[Join]:
    """The innermost joined call running on this thread (``None`` outside one)."""
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


def sync_params(module: nn.Module) -> list[torch.Tensor]:
    """The parameters whose SP reductions a joined call on ``module`` defers: those of every
    module inside it that says (``_spmdmoe_sync_params()``: ``ParallelMoE``, ``replicate_grads`` modules), read at call
    time (so FSDP2's unsharded parameters are the ones listed). FSDP2 units nested inside ``module`` are left out: their
    sums must be done before their own reduce-scatter, so they
    join themselves."""
    seen: dict[int, torch.Tensor] = {}
    todo = [module]
    while todo:
        m = todo.pop()
        provider = getattr(m, "_spmdmoe_sync_params", None)
        for p in provider() if provider is not None else ():
            seen.setdefault(id(p), p)
        todo += [c for c in m.children() if not is_fsdp_unit(c)]
    return list(seen.values())


def is_fsdp_unit(module: nn.Module) -> bool:
    """Whether ``fully_shard`` made ``module`` an FSDP2 unit (no FSDP2 unit exists before FSDP2 is imported: this
    imports nothing)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


def inside_fsdp_unit(root: nn.Module, name: str) -> bool:
    """Whether parameter ``name`` of ``root`` lives in an FSDP2 unit below ``root``."""
    m = root
    for part in name.split(".")[:-1]:
        m = getattr(m, part)
        if is_fsdp_unit(m):
            return True
    return False


def call_joined(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                params: Callable[[], Sequence[torch.Tensor]]) -> Any:
    """``fn(*args, **kwargs)`` as a joined call on its first tensor (or ``SPMDTensor``) argument ``x``, deferring the
    reductions of ``params()`` (not called under ``torch.compile``). It calls ``fn`` unjoined when an enclosing
    joined call already covers the parameters, when there are none, under ``torch.compile``, with grad off, or when
    ``x`` is not floating point. The decision must be the same on every rank (their collectives differ otherwise),
    so it does not depend on ``x.requires_grad``: an ``x`` that needs no gradient is joined too, and backward then
    computes its gradient (to reach the join)."""
    i = next((i for i, a in enumerate(args) if isinstance(a, (torch.Tensor, SPMDTensor))), None)
    if i is None or torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    x, ps = args[i], params()
    local = x.local if isinstance(x, SPMDTensor) else x
    outer = active_join()  # an enclosing joined call that covers the parameters joins them
    if not ps or not local.is_floating_point() or (outer is not None and outer.covers(ps)):
        return fn(*args, **kwargs)
    join = Join(ps)
    local, join.token = _JoinNode.apply(join, local, *ps)
    join.node = join.token.grad_fn
    stack = _local.__dict__.setdefault("stack", [])
    stack.append(join)
    try:
        return fn(*args[:i], x.with_local(local) if isinstance(x, SPMDTensor) else local, *args[i + 1:], **kwargs)
    finally:
        stack.pop()


def overlap_grads(module: nn.Module) -> nn.Module:
    """Join the SP gradient sums inside ``module`` at its input; returns ``module``.

    Wraps ``module.forward`` in place (names, ``state_dict`` unchanged; a ``deepcopy`` wraps the copy). The all-reduces
    of the replicated parameters of the ``ParallelMoE`` layers and ``replicate_grads`` modules inside it are launched
    asynchronously as their gradients are ready and waited for when the gradient of ``module``'s first tensor argument
    is complete (module docstring). Give it the transformer blocks: the MoE layer's expert gradients then reduce behind
    the block's attention backward. Works with DDP and FSDP2 in either order of wrapping; FSDP2 units inside ``module``
    keep their own joins. Without it each ``ParallelMoE`` and ``replicate_grads`` module joins at its own input.
    Applying it twice changes nothing.

    >>> import torch, spmdmoe
    >>> pg = spmdmoe.testing.single_process_group()
    >>> block = spmdmoe.moe.overlap_grads(spmdmoe.moe.replicate_grads(torch.nn.Linear(2, 2), pg))
    >>> block(torch.ones(1, 2, requires_grad=True)).shape
    torch.Size([1, 2])
    """
    if getattr(module, "_spmdmoe_overlap_inner", None) is not None:  # already joined
        return module
    object.__setattr__(module, "_spmdmoe_overlap_inner", module.forward)
    object.__setattr__(module, "forward", types.MethodType(_joined_forward, module))
    return module


def _joined_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``overlap_grads``' forward: a method bound to the module, so ``deepcopy`` rebinds it to the copy."""
    return call_joined(self._spmdmoe_overlap_inner, args, kwargs, lambda: sync_params(self))
