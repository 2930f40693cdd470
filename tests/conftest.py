"""Shared pytest set-up.

``tests/distributed`` needs several processes, so plain ``pytest`` (no
``torchrun``) leaves it out; ``torchrun --nproc-per-node 4 -m pytest
tests/distributed`` runs it.

Without a GPU the Triton kernels of ``spmdmoe.kernels`` run under Triton's
interpreter (``TRITON_INTERPRET=1``, read when a kernel is defined, so it is
set here, before any test module imports spmdmoe): ``tests/test_kernels.py``
compares them with their references on CPU tensors.
"""

import getpass
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

collect_ignore = [] if "WORLD_SIZE" in os.environ else ["distributed"]

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# under pytest-xdist (``make test`` runs ``-n``), the cores shared among the workers: torch's default (a thread a
# core in every worker) oversubscribes them, and OpenMP's spinning threads made some tests 10x slower on 2 cores
if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


# the slowest single-process tests (a program on 4 processes, a compile, a model trained: 15-45 s each on 2 cores)
# first, so that pytest-xdist's workers take them early and end together rather than one finishing a long test alone
SLOW_FIRST = ("compile", "test_docs_", "test_simulation", "load_balancing", "activation_checkpointing")


def pytest_collection_modifyitems(config, items):
    if "WORLD_SIZE" not in os.environ:
        items.sort(key=lambda item: not ("torchrun_job" in getattr(item, "fixturenames", ())
                                         or any(s in item.nodeid for s in SLOW_FIRST)))


@pytest.fixture
def torchrun_job():
    """``run(script, *args, timeout=..., nproc=4) -> (returncode, stdout, stderr)``: ``script`` (a path under the
    repo) on ``nproc`` local processes through ``torchrun --standalone``, outside this process's own launch variables; on
    timeout, torchrun and its workers are killed (the whole session), nothing left behind: the job's temporary files
    (torchrun's own, a script's checkpoints) go to a directory of its own, removed after it (the compile cache stays
    where it was, shared between jobs)."""
    root = Path(__file__).resolve().parents[1]
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"))

    def run(script: str, *args: str, timeout: float, nproc: int = 4) -> tuple[int, str, str]:
        with tempfile.TemporaryDirectory(prefix="spmdmoe-job-") as tmp:
            proc = subprocess.Popen([str(torchrun), "--standalone", "--nproc-per-node", str(nproc), str(root / script),
                                     *args], cwd=root, env={**env, "TMPDIR": tmp}, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, start_new_session=True)
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
        return proc.returncode, out, err
    return run


@pytest.fixture
def nan_empty():
    """For the test's duration ``torch.empty`` hands out NaN (integers: their largest value; torch's
    ``fill_uninitialized_memory`` under deterministic algorithms, warnings only), so a kernel or transport
    that reads a row it never wrote (a dead sync-free slot, a buffer's tail) shows up."""
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(was, warn_only=warn_only)


@pytest.fixture
def three_programs(monkeypatch):
    """The row kernels' bounded grid at 3 programs (``kernels.backend.row_programs``; the CPU interpreter's own
    number) on every device, so that their loop over the valid rows turns at a test's few rows on a GPU too."""
    from spmdmoe.kernels import fp8_rows, swiglu, swiglu_fp8
    for module in (fp8_rows, swiglu, swiglu_fp8):
        monkeypatch.setattr(module, "row_programs", lambda blocks, device: torch.sym_min(blocks, 3))
