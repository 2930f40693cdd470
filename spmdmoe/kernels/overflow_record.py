"""The sync-free EP overflow record: this forward's demand kept in the transport's state when it is the worst since
the last check (``moe/transports/sync_free.py``, ``SizedTransport.overflow``), in one launch.

``state``, int64 ``(4,)``: ``[excess, slot rows needed, experts' rows needed, T_max]`` of the worst forward; ``excess``
the larger demand's excess over its buffer in thousandths of balanced traffic, ``ceil(1000 * max(n * (slot - S),
rows - R) / balanced)`` (``> 0``: overflowed). A forward replaces the state when its excess is larger.

Measured (H200, torch 2.11, Triton 3.6; ``benchmarks/kernels.py --only "overflow record"``): 0.047 ms a call against
the reference's 0.107 eager (twelve launches) and 0.051 compiled; latency-bound (80 bytes). Eagerly it saves twelve
scalar torch ops of host time in every sync-free forward (issue 61).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from .backend import kernel_op, use_triton

__all__ = ["overflow_record", "overflow_record_reference", "overflow_record_triton"]


@triton.jit
def _record_kernel(slot_ptr, rows_ptr, state_ptr, S, R, n, balanced, t_max):
    slot, rows = tl.load(slot_ptr).to(tl.int64), tl.load(rows_ptr).to(tl.int64)
    num = tl.maximum((slot - S) * n, rows - R) * 1000 + (balanced - 1)
    excess = num // balanced
    excess = tl.where((num < 0) & (excess * balanced != num), excess - 1, excess)  # floor, as torch's //
    i = tl.arange(0, 4)
    old = tl.load(state_ptr + i)
    now = tl.where(i == 0, excess, tl.where(i == 1, slot, tl.where(i == 2, rows, t_max)))
    tl.store(state_ptr + i, tl.where(excess > tl.load(state_ptr), now, old))


@kernel_op("spmdmoe::overflow_record", mutates_args=("state",))
def overflow_record_triton(slot_needed: torch.Tensor, rows_needed: torch.Tensor, state: torch.Tensor, S: int, R: int,
                           n: int, balanced: int, t_max: int) -> None:
    """The Triton launcher (see the module docstring)."""
    wrap_triton(_record_kernel)[(1,)](slot_needed, rows_needed, state, S, R, n, balanced, t_max, num_warps=1)


def overflow_record_reference(slot_needed: torch.Tensor, rows_needed: torch.Tensor, state: torch.Tensor, S: int,
                              R: int, n: int, balanced: int, t_max: int) -> None:
    """Plain torch, same signature and result as :func:`overflow_record_triton`."""
    # ceil(1000 * max(n * slot excess, rows excess) / balanced): the max of the two ratios, ceil being monotone
    excess = (torch.maximum((slot_needed - S) * n, rows_needed - R) * 1000 + (balanced - 1)) // balanced
    now = torch.stack([excess, slot_needed, rows_needed, torch.full_like(excess, t_max)])
    state.copy_(torch.where(excess > state[0], now, state))


def overflow_record(slot_needed: torch.Tensor, rows_needed: torch.Tensor, state: torch.Tensor, S: int, R: int,
                    n: int, balanced: int, t_max: int) -> None:
    """Keep this forward's demand in ``state`` if it is the worst (the module docstring): ``slot_needed`` and
    ``rows_needed`` int64 0-d (the most rows a (source, destination) slot and a rank's experts needed), the buffers'
    ``S`` and ``R`` rows, ``n`` EP ranks, ``balanced`` an experts' buffer's balanced rows, ``T_max``. In place on
    ``state`` (int64 ``(4,)``). The Triton kernel on CUDA, the reference elsewhere."""
    impl = overflow_record_triton if use_triton("overflow_record", state) else overflow_record_reference
    impl(slot_needed, rows_needed, state, S, R, n, balanced, t_max)
