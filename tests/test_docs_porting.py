"""``docs/porting.md`` runs as written: its transformers block swaps, trains three steps with the model's own loss
(falling) and saves a checkpoint the unswapped model loads (in a fresh interpreter: the swap's optimizer hook is
process-wide). Its full port, ``examples/port_moe.py``, is run by ``tests/test_example.py``."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

from spmdmoe.testing import markdown_python_blocks

pytest.importorskip("transformers", reason="transformers is an optional extra: pip install '.[transformers]'")

GUIDE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "porting.md"


@pytest.mark.training_run  # (25 s on 2 cores: CI's torch-2.11 leg runs this file, OLD_SINGLE)
@pytest.mark.timeout(200)
def test_transformers_block_trains_and_saves(tmp_path):
    blocks = [code for _, code in markdown_python_blocks(GUIDE)]
    assert len(blocks) == 1, f"docs/porting.md: expected 1 python block, found {len(blocks)}"
    out = subprocess.run([sys.executable, "-c", blocks[0]], cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "swapped: ['model.layers.0.mlp', 'model.layers.1.mlp']" in out.stdout, out.stdout
    losses = [float(v) for v in re.findall(r"step \d: loss ([\d.]+)", out.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0], out.stdout
    assert "reloaded unswapped: Qwen3MoeSparseMoeBlock" in out.stdout, out.stdout
