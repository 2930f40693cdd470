"""A pytest plugin for ``benchmarks/gpu_session.sh``: a markdown row per test file, rewritten after every test.

    FILE_TABLE=rows.md python3 -m pytest -p benchmarks.file_table ...
    FILE_TABLE=rows.md torchrun --nproc-per-node 4 -m pytest -p benchmarks.file_table ... tests/distributed

``rows.md`` holds ``| file | passed | failed | errors | skipped | s |`` for every file seen so far (seconds: the
sum of its tests' set-up, call and tear-down), the package's doctests one row; rewritten (atomically) after each test's report and each failed
collection, so a run killed at its time limit still leaves the rows of what ran; ``rows.md.now`` names the test
in progress (or ``finished, exit status N``). Under ``torchrun`` rank 0 writes them, under pytest-xdist the controller (the distributed tests'
verdicts are collective; ``tests/distributed/conftest.py`` echoes another rank's own failures). Without
``FILE_TABLE`` it does nothing. ``tests/distributed/conftest.py``'s ``SPMDMOE_FILE_TABLE`` writes its rows at
the session's end only: this one is for runs of many files under one time limit.
"""

from __future__ import annotations

import os
from typing import Any

_rows: dict[str, dict[str, float]] = {}
KEYS = ("passed", "failed", "errors", "skipped")


def _path() -> str:
    # under torchrun rank 0 writes; under pytest-xdist the controller (it sees every worker's reports), no worker
    if os.environ.get("RANK", "0") != "0" or "PYTEST_XDIST_WORKER" in os.environ:
        return ""
    return os.environ.get("FILE_TABLE", "")


def _write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _row(nodeid: str) -> dict[str, float]:
    name = nodeid.split("::")[0]
    if not name.startswith("tests"):  # the package's doctests (``--doctest-modules``): one row
        name = name.split("/")[0] + "/ (doctests)"
    return _rows.setdefault(name, dict.fromkeys((*KEYS, "s"), 0))


def _flush() -> None:
    if path := _path():
        _write(path, "".join(f"| {name} | {' | '.join(str(int(r[k])) for k in KEYS)} | {r['s']:.0f} |\n"
                             for name, r in _rows.items()))


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    if path := _path():
        _write(path + ".now", f"in {nodeid}\n")


def pytest_runtest_logreport(report: Any) -> None:
    if not _path():
        return
    row = _row(report.nodeid)
    row["s"] += report.duration
    if report.when == "call":
        row["passed" if report.passed else "failed" if report.failed else "skipped"] += 1
    elif report.skipped:  # skipped in set-up (a skip mark, a fixture's skip)
        row["skipped"] += 1
    elif report.failed:  # an error in set-up or tear-down
        row["errors"] += 1
    if report.when == "teardown":
        _flush()


def pytest_collectreport(report: Any) -> None:
    if _path() and report.failed:  # a file that does not import: one error, no tests
        _row(report.nodeid or "(collection)")["errors"] += 1
        _flush()


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    if path := _path():
        _flush()
        _write(path + ".now", f"finished, exit status {int(exitstatus)}\n")
