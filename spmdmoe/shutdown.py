"""Ending a distributed job without the gloo exit abort: :func:`shutdown`.

With torch's gloo backend a process that used a ``DeviceMesh`` (or plain process groups) can abort
after its last line of Python, while the interpreter and C++ static objects are torn down:
``terminate called without an active exception``, exit code -6, and ``torchrun`` reports the whole
job failed even though every rank finished and printed its results. Measured on torch 2.13, 4 gloo
processes on CPU, a minimal script (``init_mesh``, one ``all_gather``, ``destroy_process_group()``):
8 of 15 runs aborted; ``examples/shard_gather.py`` ending with a plain return: 1 of 10. The cause is
torch's teardown, not the job (the control reported with issue 24, a 1-D ``init_device_mesh`` and
``destroy_process_group()`` without spmdmoe, aborted in 5 of 10), so the reliable cure is not to run
that teardown. With :func:`shutdown`: 0 of 50 runs of the minimal script, 0 of 10 of each example.

:func:`shutdown` ends the process the safe way, losing nothing: it flushes ``sys.stdout`` and
``sys.stderr``, drops unreachable Python objects (a mesh, a group) while the interpreter is whole,
destroys the default process group and every group made from it, runs the ``atexit`` handlers
(``logging.shutdown`` among them: buffered log records are written), flushes again, and leaves with
``os._exit(code)``, skipping only the C++ static destructors where the abort happens. Call it last,
on every rank, as a script's final statement::

    if __name__ == "__main__":
        spmdmoe.shutdown(main())

On NCCL, a CUDA graph that captured collectives must be gone before the groups are torn down, or
``ncclCommDestroy`` waits forever (pytorch/pytorch#115388; ``benchmarks/sync_free.py`` held two GPUs after
printing its table while its graphs were still locals of the function that destroyed the groups). Graphs
held by ``main()``'s locals are gone once it returns, as in the form above.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
from typing import NoReturn, Optional

import torch.distributed as dist

__all__ = ["shutdown"]


def shutdown(code: Optional[int] = 0) -> NoReturn:
    """End this process with exit status ``code`` (``None``: 0), after flushing its output, tearing the
    process groups down and running its ``atexit`` handlers; never returns (module docstring). A rank
    that calls it does not wait for its peers: call it once the job's last collective is done."""
    for stream in (sys.stdout, sys.stderr):
        _flush(stream)
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        _flush(stream)
    os._exit(0 if code is None else int(code))


def _flush(stream: object) -> None:
    try:
        stream.flush()  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):  # closed or replaced by something without flush
        pass
