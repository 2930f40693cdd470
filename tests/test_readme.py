"""Every ``python`` block of README.md runs as written, each as its own program on 4 gloo processes.

The blocks are read from README.md when the tests are collected, so a README edit is what gets tested.
Each block is a complete script (it makes its own process group and mesh and ends with
``spmdmoe.shutdown(...)``, as the README asks of every script) and states what rank 0 prints in
``# prints: ...`` comments (``...`` matches anything). A block passes when ``torchrun --nproc-per-node 4``
exits 0 on every rank (its asserts hold) and every ``# prints:`` line appears as a line of its output.
A block that is not meant to run uses another fence (```text, ```bash). A block that uses ``"nccl"`` runs on
CUDA GPUs only (one process per GPU, at most 4; skipped without CUDA): the GPU run executes it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from spmdmoe.testing import markdown_python_blocks

README = Path(__file__).resolve().parents[1] / "README.md"
PRINTS = re.compile(r"#\s*prints:\s*(.+?)\s*$", flags=re.M)
BLOCKS = markdown_python_blocks(README)


def test_readme_blocks_are_whole_scripts():
    assert len(BLOCKS) >= 5, "the README lost its examples"
    for line, code in BLOCKS:
        assert PRINTS.search(code), f"README.md line {line}: no '# prints: ...' comment saying what rank 0 prints"
        last = [s for s in code.splitlines() if s.strip() and not s.lstrip().startswith("#")][-1]
        assert "spmdmoe.shutdown(" in last, f"README.md line {line}: a script ends with spmdmoe.shutdown(...), found {last!r}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("line,code", BLOCKS, ids=[f"README.md:{line}" for line, _ in BLOCKS])
def test_readme_block_runs(line, code, tmp_path, torchrun_job):
    gpus = '"nccl"' in code
    if gpus and torch.cuda.device_count() < 2:
        pytest.skip("a block for CUDA GPUs (NCCL): needs 2 or more, run by benchmarks/gpu_session.sh tests")
    script = tmp_path / f"readme_line_{line}.py"
    script.write_text(code)
    returncode, out, err = torchrun_job(str(script), timeout=200, nproc=min(4, torch.cuda.device_count()) if gpus else 4)
    assert returncode == 0, f"README.md line {line} failed (exit {returncode}):\n{out[-3000:]}\n{err[-5000:]}"
    lines = [s.strip() for s in out.splitlines()]
    for expected in PRINTS.findall(code):
        pattern = ".*".join(map(re.escape, expected.split("...")))
        assert any(re.fullmatch(pattern, s) for s in lines), \
            f"README.md line {line}: no output line matches {expected!r}; stdout:\n{out[-3000:]}"
