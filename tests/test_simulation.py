"""The 1024-rank planning simulation (``benchmarks/simulate.py --quick``) runs in CI.

One process plays a rank of 1024-rank ``dp x sp x ep`` meshes on torch's fake process group: a
DeepSeek-V3-sized layer built on meta, parallelized (plan validation and agreement with synthetic
tables) and forwarded through the sync-free EP transport (shapes only). A subprocess, so its fake
process groups never meet this process' own.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_simulated_1024_ranks():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "simulate.py"), "--quick"], cwd=ROOT,
                         capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    table = out.stdout[out.stdout.index("| dp x sp x ep"):]  # the final table (rows also print as they come)
    rows = [line for line in table.splitlines() if line.startswith("| ") and "| 1024 |" in line]
    assert len(rows) == 4, out.stdout
    for row in rows:  # this rank's parameters: its 256/ep experts of 3 x 2048 x 7168 bf16, never the layer's 10.5 GiB
        assert float(row.split("|")[5]) < 0.4, row
