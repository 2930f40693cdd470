"""Every ``python`` block of README.md and of docs/guide.md runs as written, each as its own program on 4 gloo
processes.

The blocks are read from the two files when the tests are collected, so an edit is what gets tested.
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

ROOT = Path(__file__).resolve().parents[1]
PRINTS = re.compile(r"#\s*prints:\s*(.+?)\s*$", flags=re.M)
BLOCKS = [(f"{name}:{line}", code) for name in ("README.md", "docs/guide.md")
          for line, code in markdown_python_blocks(ROOT / name)]


def test_readme_blocks_are_whole_scripts():
    assert sum(where.startswith("README.md") for where, _ in BLOCKS) >= 1, "the README lost its quick start"
    assert len(BLOCKS) >= 6, "the README and the guide lost their examples"
    for where, code in BLOCKS:
        assert PRINTS.search(code), f"{where}: no '# prints: ...' comment saying what rank 0 prints"
        last = [s for s in code.splitlines() if s.strip() and not s.lstrip().startswith("#")][-1]
        assert "spmdmoe.shutdown(" in last, f"{where}: a script ends with spmdmoe.shutdown(...), found {last!r}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("where,code", BLOCKS, ids=[where for where, _ in BLOCKS])
def test_readme_block_runs(where, code, tmp_path, torchrun_job):
    gpus = '"nccl"' in code
    if gpus and torch.cuda.device_count() < 2:
        pytest.skip("a block for CUDA GPUs (NCCL): needs 2 or more, run by benchmarks/gpu_session.sh tests")
    script = tmp_path / f"{where.replace('/', '_').replace('.', '_').replace(':', '_line_')}.py"
    script.write_text(code)
    returncode, out, err = torchrun_job(str(script), timeout=200, nproc=min(4, torch.cuda.device_count()) if gpus else 4)
    assert returncode == 0, f"{where} failed (exit {returncode}):\n{out[-3000:]}\n{err[-5000:]}"
    lines = [s.strip() for s in out.splitlines()]
    for expected in PRINTS.findall(code):
        pattern = ".*".join(map(re.escape, expected.split("...")))
        assert any(re.fullmatch(pattern, s) for s in lines), \
            f"{where}: no output line matches {expected!r}; stdout:\n{out[-3000:]}"


def _sentences(markdown: str) -> list[str]:
    """The prose of a Markdown page, sentence by sentence: code fences dropped, each table cell, heading-free
    paragraph and list item a unit of its own, units split after ``.``, ``!`` or ``?``."""
    text = re.sub(r"^```.*?^```\n", "", markdown, flags=re.S | re.M)
    units: list[str] = []
    para: list[str] = []
    for line in text.splitlines():
        if (not line.strip() or line.startswith(("#", "|")) or line.lstrip().startswith("- ")) and para:
            units.append(" ".join(para))
            para = []
        if line.startswith("|"):
            units += line.strip("|").split("|")
        elif line.lstrip().startswith("- "):
            para = [line.lstrip()[2:]]
        elif line.strip() and not line.startswith("#"):
            para.append(line.strip())
    units += [" ".join(para)] if para else []
    return [s for u in units for s in re.split(r"(?<=[.!?])\s+(?=[A-Z`*\[(])", u.strip()) if s.strip()]


def test_readme_is_short_and_plain():
    """The front door: about 200 lines, no sentence over 40 words (table cells and list items included)."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 220, len(text.splitlines())
    long = [s for s in _sentences(text) if len(s.split()) > 40]
    assert not long, long
    assert _sentences("One two. Three four!\n\n| a b. C d |\n- e f") == ["One two.", "Three four!", "a b.", "C d", "e f"]


def test_readme_results_are_the_results_pages():
    """Every row of the README's results table is a row of benchmarks/README.md's, verbatim."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Results"):readme.index("## Quick start")]
    rows = [line for line in section.splitlines() if line.startswith("|") and not line.startswith("|---")]
    page = (ROOT / "benchmarks" / "README.md").read_text().splitlines()
    assert len(rows) >= 4, section
    missing = [row for row in rows if row not in page]
    assert not missing, f"README rows not on benchmarks/README.md: {missing}"
