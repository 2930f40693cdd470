"""``docs/torchtitan.md`` runs as written: its "own loop" block trains (in a fresh interpreter: the swap's
optimizer hook is process-wide; on torch 2.11 too, where it must import spmdmoe's integration before
torchtitan), and its Trainer block gives the spec that ``tests/torchtitan_parallelize.py`` runs through
torchtitan's own ``parallelize`` with EP 4 on 4 processes (``test_torchtitan.py``)."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

from spmdmoe.testing import markdown_python_blocks

pytest.importorskip("torchtitan", reason="torchtitan is an optional extra: pip install '.[torchtitan]'")

GUIDE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "torchtitan.md"


def guide_blocks() -> list[str]:
    """The guide's Python blocks, in order: the Trainer block, the own-loop block."""
    blocks = [code for _, code in markdown_python_blocks(GUIDE)]
    assert len(blocks) == 2, f"docs/torchtitan.md: expected 2 python blocks, found {len(blocks)}"
    return blocks


@pytest.mark.timeout(200)
def test_own_loop_block_trains(tmp_path):
    out = subprocess.run([sys.executable, "-c", guide_blocks()[1]], cwd=tmp_path, capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "swapped: ['layers.1.moe', 'layers.2.moe']" in out.stdout, out.stdout
    losses = [float(v) for v in re.findall(r"step \d: loss ([\d.]+)", out.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0], out.stdout


def test_trainer_block_wraps_torchtitans_parallelize():
    namespace: dict = {}
    exec(guide_blocks()[0], namespace)  # first: it imports spmdmoe's integration before torchtitan (torch 2.11)
    from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3

    spec = namespace["model_spec"]
    assert spec.parallelize_fn is not parallelize_deepseekv3
    assert (spec.name, spec.flavor) == ("deepseek_v3", "debugmodel")
