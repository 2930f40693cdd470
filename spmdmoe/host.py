"""Device-to-host transfers that spmdmoe makes on purpose, and their count.

Every documented sync goes through :func:`to_host` (the EP split sizes in sync
mode, the agreement exchanges of ``spmdmoe.agreement``, the sticky-flag read of
:func:`spmdmoe.check_errors` and of the bias update). :func:`host_sync_count`
counts them, which is a bookkeeping aid, not proof: tests that claim "no other
sync" on CUDA also run under ``torch.cuda.set_sync_debug_mode``.
"""

from __future__ import annotations

import torch

__all__ = ["to_host", "host_sync_count"]

_host_syncs = [0]


def host_sync_count() -> int:
    """How many explicit device-to-host transfers spmdmoe made so far (see the module docstring)."""
    return _host_syncs[0]


def to_host(t: torch.Tensor) -> list:
    """The explicit device-to-host transfer of a small int tensor, as (nested) Python lists (counted).

    Allowed under ``torch.cuda.set_sync_debug_mode("error")``: the mode is lifted
    for this one transfer (so a test in that mode fails on any *other* sync).
    Under ``torch.compile`` it is traced (``capture_scalar_outputs``) and not counted.
    """
    if torch.compiler.is_compiling():
        return t.tolist()
    _host_syncs[0] += 1
    if not t.is_cuda:
        return t.tolist()
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        return t.tolist()
    finally:
        torch.cuda.set_sync_debug_mode(mode)
