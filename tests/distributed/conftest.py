"""Multi-process test set-up: one process group per pytest process, every test under a timeout.

Run with ``torchrun --nproc-per-node 4 -m pytest tests/distributed``: gloo on
CPU, NCCL when CUDA is present (each rank on ``cuda:LOCAL_RANK``). Tests that
need exactly four ranks are marked ``world4``. Every test gets a 120 s
timeout unless it sets its own, so a hang fails fast instead of blocking CI.
Tests marked ``one_rank_bad`` (an input wrong on one rank) get process groups
of their own with a 30 s timeout in the ``world``, ``mesh2x2`` and ``mesh2d`` fixtures,
made afresh after any failure, so reverting a fix fails that test instead of
hanging the suite (``fresh_mesh``). On NCCL a collective timeout kills the
process: ``benchmarks/gpu_session.sh`` runs each file in its own ``torchrun``.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import os
import sys

import pytest
import torch
import torch.distributed as dist

from torch.distributed.device_mesh import DeviceMesh

from spmdmoe import init_mesh

DEFAULT_TIMEOUT_S = 120


@pytest.hookimpl(trylast=True)  # after the terminal reporter exists
def pytest_configure(config):
    if "RANK" not in os.environ:
        raise pytest.UsageError(
            "tests/distributed needs several processes: run "
            "`torchrun --nproc-per-node 4 -m pytest tests/distributed`"
        )
    _quiet_non_zero_ranks(config)
    if dist.is_initialized():
        return
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT_S),
                                device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT_S))


def _quiet_non_zero_ranks(config):
    """Rank 0 prints the normal report; other ranks print only their failures.

    Four interleaved progress bars are unreadable, and every verdict in these
    tests is collective, so rank 0's report is the run's report. A failure that
    is local to another rank still reaches the console (below) and its exit code.
    """
    if int(os.environ.get("RANK", "0")) == 0:
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        config.pluginmanager.unregister(reporter)
    config.pluginmanager.register(_FailureEcho(int(os.environ["RANK"])), "spmdmoe-failure-echo")


class _FailureEcho:
    def __init__(self, rank: int):
        self.rank = rank

    def pytest_runtest_logreport(self, report):
        if report.failed:
            sys.stderr.write(f"\n[rank {self.rank}] FAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n")

    def pytest_sessionfinish(self, session, exitstatus):
        if exitstatus:
            sys.stderr.write(f"[rank {self.rank}] pytest exit status {int(exitstatus)}\n")


# ``SPMDMOE_FILE_TABLE=path``: rank 0 appends one markdown row per test file to ``path`` at the session's end
# (passed / failed / errors / skipped, seconds), so a run of several files still reports file by file
# (``benchmarks/gpu_session.sh``). Every rank also keeps ``path.rank<N>.now``: the test it is in and the counts so
# far, rewritten at each test's start and end, so a run killed by a hang still says where each rank was.
_per_file: dict[str, dict[str, float]] = {}


def _progress(line: str) -> None:
    path = os.environ.get("SPMDMOE_FILE_TABLE")
    if path:
        with open(f"{path}.rank{os.environ.get('RANK', '0')}.now", "w") as now:
            now.write(line + "\n")


def pytest_runtest_logstart(nodeid, location):
    done = {k: int(sum(r[k] for r in _per_file.values())) for k in ("passed", "failed", "errors", "skipped")}
    _progress(f"in {nodeid} after {done}")


def pytest_runtest_logreport(report):
    if report.failed:
        _failed_since_fresh[0] = True
    if not os.environ.get("SPMDMOE_FILE_TABLE"):
        return
    row = _per_file.setdefault(report.nodeid.split("::")[0], dict.fromkeys(("passed", "failed", "errors",
                                                                            "skipped", "s"), 0))
    row["s"] += report.duration
    if report.when == "call":
        row[report.outcome] += 1
    elif report.skipped:
        row["skipped"] += 1
    elif report.failed:
        row["errors"] += 1


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("SPMDMOE_FILE_TABLE")
    _progress(f"finished, exit status {int(exitstatus)}")
    if path and int(os.environ.get("RANK", "0")) == 0:
        with open(path, "a") as table:
            for name, row in _per_file.items():
                cells = [row[k] for k in ("passed", "failed", "errors", "skipped")]
                table.write(f"| {os.path.basename(name)} | {' | '.join(map(str, cells))} | {row['s']:.0f} |\n")


def pytest_unconfigure(config):
    """Tear the groups down. A CUDA graph that captured NCCL work and is still alive makes ``ncclCommDestroy``
    wait forever (pytorch/pytorch#115388): drop unreachable graphs first; and should the teardown hang anyway,
    print every thread's stack and leave after 60 s rather than hold the GPUs."""
    if dist.is_initialized():
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        faulthandler.dump_traceback_later(60, exit=True)
        dist.destroy_process_group()
        faulthandler.cancel_dump_traceback_later()


def pytest_collection_modifyitems(config, items):
    world = dist.get_world_size()
    for item in items:
        if item.get_closest_marker("timeout") is None:  # one-rank-bad: the group's timeout, + set-up slack
            bad = item.get_closest_marker("one_rank_bad") is not None
            item.add_marker(pytest.mark.timeout(2 * ONE_RANK_BAD_TIMEOUT_S if bad else DEFAULT_TIMEOUT_S))
        if item.get_closest_marker("world4") is not None and world != 4:
            item.add_marker(pytest.mark.skip(reason=f"needs exactly 4 processes, found {world}"))


@pytest.fixture(autouse=True)
def _no_recorded_problems():
    """Every test starts with no recorded problems (spmdmoe.sticky's flags are per process)."""
    from spmdmoe.sticky import clear_all

    clear_all()


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where this rank's tensors live: its GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


ONE_RANK_BAD_TIMEOUT_S = 30


def _device_type() -> str:
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


_fresh: dict[tuple, DeviceMesh] = {}
_failed_since_fresh = [False]  # a test failed on this rank since the fresh meshes were made


def fresh_mesh(shape: tuple, names: tuple) -> DeviceMesh:
    """A mesh of new process groups (the world's too) whose collectives time out after ``ONE_RANK_BAD_TIMEOUT_S``:
    a scenario that leaves ranks out of step fails itself, not the next test, which gets groups of its own.

    Kept for the next test of the same shape while no test has failed on any rank since (one all-reduce of a
    flag decides, so every rank decides alike): on NCCL each new group is a communicator to set up (about
    2 s a test at 4 ranks, and they add up), and a test that passed left its ranks in step."""
    flag = torch.tensor([int(_failed_since_fresh[0])], device=_device_type())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        _fresh.clear()
        _failed_since_fresh[0] = False
    key = (tuple(shape), tuple(names))
    if key not in _fresh:
        _fresh[key] = init_mesh(_device_type(), shape, mesh_dim_names=names,
                                timeout=datetime.timedelta(seconds=ONE_RANK_BAD_TIMEOUT_S))
    return _fresh[key]


def _one_rank_bad(request) -> bool:
    return request.node.get_closest_marker("one_rank_bad") is not None


@pytest.fixture(scope="session")
def _world_once():
    return init_mesh(_device_type(), (dist.get_world_size(),), mesh_dim_names=("world",))


@pytest.fixture
def world(request, _world_once):
    """The 1-D mesh over every rank; a fresh one (new groups, 30 s timeout) for ``one_rank_bad`` tests."""
    return fresh_mesh((dist.get_world_size(),), ("world",)) if _one_rank_bad(request) else _world_once


@pytest.fixture(scope="session")
def _mesh2x2_once():
    if dist.get_world_size() != 4:
        pytest.skip("needs 4 ranks")
    return _mesh2d_once(4)


@pytest.fixture
def mesh2x2(request, _mesh2x2_once):
    """A 2x2 mesh with dims ("dp", "sp"); only for world4 tests; fresh for ``one_rank_bad`` tests."""
    return fresh_mesh((2, 2), ("dp", "sp")) if _one_rank_bad(request) else _mesh2x2_once


@pytest.fixture
def mesh2d(request):
    """A ``(2, world / 2)`` mesh with dims ("dp", "sp"), for a 2-D mesh at any even world size (2x2 on 4
    ranks, 2x1 on 2); fresh for ``one_rank_bad`` tests."""
    n = dist.get_world_size()
    if n % 2:
        pytest.skip(f"a (2, world / 2) mesh needs an even number of ranks, found {n}")
    if _one_rank_bad(request):
        return fresh_mesh((2, n // 2), ("dp", "sp"))
    return _mesh2d_once(n)


@pytest.fixture
def mesh2d_wide(request):
    """``mesh2d`` with both dims above 1: 2x2 on 4 ranks, 2x4 on 8 (the 2-D plans: EP over "dp", SP over "sp")."""
    n = dist.get_world_size()
    if n < 4:
        pytest.skip(f"a (2, world / 2) mesh with both dims above 1 needs 4 ranks or more, found {n}")
    return request.getfixturevalue("mesh2d")


_MESH2D: dict[int, DeviceMesh] = {}


def _mesh2d_once(n: int) -> DeviceMesh:
    if n not in _MESH2D:
        _MESH2D[n] = init_mesh(_device_type(), (2, n // 2), mesh_dim_names=("dp", "sp"))
    return _MESH2D[n]


@pytest.fixture
def shared_tmp(tmp_path):
    """A directory every rank sees (rank 0's tmp_path; the path travels as a byte tensor)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    raw = torch.zeros(512, dtype=torch.uint8, device=device)
    if dist.get_rank() == 0:
        encoded = str(tmp_path).encode()
        raw[: len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    dist.broadcast(raw, src=0)
    return bytes(raw.cpu().tolist()).rstrip(b"\0").decode()
