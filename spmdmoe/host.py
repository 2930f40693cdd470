"""Device-to-host transfers that spmdmoe makes on purpose, and their count.

Every documented sync goes through :func:`to_host` (the EP split sizes in sync
mode, the agreement exchanges of ``spmdmoe.agreement``, the sticky-flag read of
:func:`spmdmoe.check_errors` and of the bias update) or :class:`DelayedRead`
(a riding SP layer's problem exchange, ``spmdmoe.moe.parallel.ride``, read once in that
forward's backward or at the next forward). :func:`host_sync_count`
counts them, which is a bookkeeping aid, not proof: tests that claim "no other
sync" on CUDA also run under ``torch.cuda.set_sync_debug_mode``.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["to_host", "host_sync_count", "DelayedRead", "tracing"]

_host_syncs = [0]


def host_sync_count() -> int:
    """How many explicit device-to-host transfers spmdmoe made so far (see the module docstring)."""
    return _host_syncs[0]


def tracing() -> bool:
    """Under ``torch.compile`` or CUDA graph capture, where no host read may happen."""
    return torch.compiler.is_compiling() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def to_host(t: torch.Tensor) -> list:
    """The explicit device-to-host transfer of a small int tensor, as (nested) Python lists (counted).

    Allowed under ``torch.cuda.set_sync_debug_mode("error")``: the mode is lifted
    for this one transfer (so a test in that mode fails on any *other* sync).
    Under ``torch.compile`` it is traced (``capture_scalar_outputs``) and not counted.
    """
    if torch.compiler.is_compiling():
        return t.tolist()
    return _counted(t.is_cuda, t.tolist)


def _counted(cuda: bool, read: Callable[[], list]) -> list:
    """``read()``, counted as one transfer; on CUDA with the sync debug mode lifted for it alone."""
    _host_syncs[0] += 1
    if not cuda:
        return read()
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        return read()
    finally:
        torch.cuda.set_sync_debug_mode(mode)


class DelayedRead:
    """A small int tensor's device-to-host copy, started now and read later (counted as a transfer at the read).

    On CUDA: a non-blocking copy into pinned memory and an event; :meth:`get` waits for that event only, so
    it blocks only while the GPU has not yet reached the point where the copy was started (for a copy
    started one step earlier, only a host running more than a step ahead waits). On the CPU the values are
    read at once. Not under ``torch.compile`` or CUDA graph capture (callers skip it there).
    """

    __slots__ = ("_host", "_event", "_values")

    def __init__(self, t: torch.Tensor) -> None:
        self._event: "torch.cuda.Event | None" = None
        self._values: "list | None" = None
        if t.is_cuda:
            self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._host.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = t.detach().clone()

    def get(self) -> list:
        """The values, as (nested) Python lists (a documented transfer: allowed in the sync debug mode, counted
        once: a second ``get`` returns the same lists)."""
        if self._values is None:
            self._values = _counted(self._event is not None, self._wait_and_read)
        return self._values

    def _wait_and_read(self) -> list:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()
