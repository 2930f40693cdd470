"""A CPU proxy for "no host sync": every read of a tensor's values on the host, seen at the torch level.

CUDA's sync debug mode (``tests/distributed/test_syncs.py``) needs GPUs, and ``spmdmoe.host.host_sync_count``
counts only the reads the library makes on purpose. :class:`HostReads` sees the others too, on any device:

* the Python conversions, patched on ``torch.Tensor`` while it is active (a ``__torch_function__`` mode would
  miss the autograd engine's callbacks: gradient hooks and custom ``Function.backward`` run without it):
  ``tolist``, ``numpy``, ``item``, ``bool`` / ``int`` / ``float`` / ``index`` / ``complex`` of a tensor, and
  its formatting;
* the ATen ops that read values on the host or size their output from them, so sync on CUDA (a
  ``__torch_dispatch__`` mode, below autograd, which the backward runs under too): ``_local_scalar_dense``
  (what ``item`` and the conversions end in), ``nonzero``, ``equal``, ``masked_select``, indexing by a boolean
  mask, ``repeat_interleave`` without ``output_size``, ``bincount``, ``unique``.

Each read is named by its call site: the innermost frame in ``spmdmoe`` outside ``spmdmoe/host.py``, as
``path:function``, plus `` via host`` when it went through ``spmdmoe.host`` (``to_host`` / ``DelayedRead``,
the documented transfers). ``where`` keeps each one's ``path:line`` and what read, for messages. A site
outside ``spmdmoe`` is named by its innermost frames outside ``torch``. Not seen: device-to-host copies (none on
the CPU; CUDA's mode covers them) and calls that bypass ``torch.Tensor`` (``torch._C.TensorBase.tolist(t)``).
"""

from __future__ import annotations

import collections
import os
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import spmdmoe

_PACKAGE = os.path.dirname(os.path.abspath(spmdmoe.__file__)) + os.sep
_HOST = _PACKAGE + "host.py"
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_CONVERSIONS = ["tolist", "numpy", "item", "__bool__", "__int__", "__float__", "__index__", "__complex__",
                "__format__", "__repr__"]
_aten = torch.ops.aten
_OPS = {_aten._local_scalar_dense, _aten.nonzero, _aten.equal, _aten.masked_select, _aten.bincount, _aten._unique,
        _aten._unique2, _aten.unique_dim, _aten.unique_consecutive, _aten.unique_dim_consecutive}
_INDEXING = {_aten.index, _aten.index_put, _aten.index_put_, _aten._index_put_impl_}


def _syncs(func, args, kwargs) -> bool:
    packet = func.overloadpacket
    if packet in _OPS:
        return True
    if packet in _INDEXING:  # a boolean mask: its nonzero sizes the result
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    if packet is _aten.repeat_interleave and isinstance(args[0], torch.Tensor):
        return kwargs.get("output_size") is None
    return False


def _site() -> tuple[str, str]:
    """``(path:function[ via host], path:line)`` of the innermost spmdmoe frame (module docstring)."""
    frames = traceback.extract_stack()[:-3]
    via = " via host" if any(f.filename == _HOST for f in frames) else ""
    for f in reversed(frames):
        if f.filename.startswith(_PACKAGE) and f.filename != _HOST:
            path = "spmdmoe/" + os.path.relpath(f.filename, _PACKAGE).replace(os.sep, "/")
            return f"{path}:{f.name}{via}", f"{path}:{f.lineno}"
    outside = [f for f in frames if not f.filename.startswith(_TORCH)][-3:]
    here = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(outside))
    return f"outside spmdmoe: {here}", here


class HostReads(TorchDispatchMode):
    """``with HostReads() as r: ...``: ``r.reads`` counts the host reads per call site (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: collections.Counter = collections.Counter()
        self.where: dict[str, set] = collections.defaultdict(set)
        self._inside = 0  # in a conversion already counted: its own reads are not reads of their own
        self._saved: dict = {}

    def _record(self, what: str) -> None:
        key, line = _site()
        self.reads[key] += 1
        self.where[key].add(f"{line} {what}")

    def _conversion(self, original):
        def read(tensor, *args, **kwargs):
            if not self._inside:
                self._record(original.__name__)
            self._inside += 1
            try:
                return original(tensor, *args, **kwargs)
            finally:
                self._inside -= 1
        return read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._inside and _syncs(func, args, kwargs):
            self._record(str(func))
        return func(*args, **kwargs)

    def __enter__(self):
        for name in _CONVERSIONS:
            self._saved[name] = torch.Tensor.__dict__.get(name)
            setattr(torch.Tensor, name, self._conversion(getattr(torch.Tensor, name)))
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        for name, saved in self._saved.items():
            if saved is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, saved)

    def report(self, allowed: dict) -> str:
        """The difference from ``allowed`` (site -> count), one site a line with its lines; empty if none."""
        sites = sorted(set(self.reads) | set(allowed))
        return "\n".join(f"  {k}: {self.reads.get(k, 0)} read(s), allowed {allowed.get(k, 0)}"
                         f"  [{', '.join(sorted(self.where.get(k, ())))}]"
                         for k in sites if self.reads.get(k, 0) != allowed.get(k, 0))
