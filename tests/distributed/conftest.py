"""Multi-process test set-up: one process group per pytest process, every test under a timeout.

Run with ``torchrun --nproc-per-node 4 -m pytest tests/distributed``: gloo on
CPU, NCCL when CUDA is present (each rank on ``cuda:LOCAL_RANK``). Tests that
need exactly four ranks are marked ``world4``. Every test gets a 120 s
timeout unless it sets its own, so a hang fails fast instead of blocking CI.
"""

from __future__ import annotations

import datetime
import os
import sys

import pytest
import torch
import torch.distributed as dist

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


def pytest_unconfigure(config):
    if dist.is_initialized():
        dist.destroy_process_group()


def pytest_collection_modifyitems(config, items):
    world = dist.get_world_size()
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(DEFAULT_TIMEOUT_S))
        if item.get_closest_marker("world4") is not None and world != 4:
            item.add_marker(pytest.mark.skip(reason=f"needs exactly 4 processes, found {world}"))


@pytest.fixture(autouse=True)
def _no_recorded_problems():
    """Every test starts with no recorded problems (spmdmoe.agreement's sticky flags are per process)."""
    from spmdmoe.agreement import clear_all

    clear_all()


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where this rank's tensors live: its GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@pytest.fixture(scope="session")
def world():
    """The 1-D mesh over every rank."""
    return init_mesh("cuda" if dist.get_backend() == "nccl" else "cpu", (dist.get_world_size(),),
                     mesh_dim_names=("world",))


@pytest.fixture(scope="session")
def mesh2x2():
    """A 2x2 mesh with dims ("dp", "sp"); only for world4 tests."""
    if dist.get_world_size() != 4:
        pytest.skip("needs 4 ranks")
    return init_mesh("cuda" if dist.get_backend() == "nccl" else "cpu", (2, 2), mesh_dim_names=("dp", "sp"))


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
