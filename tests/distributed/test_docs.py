"""The ``python`` code blocks of ``docs/migrating_from_dtensor.md`` run, in order, on 4 processes.

They share one namespace (as a reader running the guide top to bottom would), and every assertion
in them is a check of this test. A failure names the block (its first line in the file).
"""

import shutil
from pathlib import Path

import pytest
import torch.distributed as dist

from spmdmoe.testing import markdown_python_blocks

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "migrating_from_dtensor.md"


def test_guide_has_blocks():
    blocks = markdown_python_blocks(GUIDE)
    assert len(blocks) >= 10, "the guide lost its examples"


@pytest.mark.world4
@pytest.mark.timeout(240)
def test_migration_guide_runs():
    namespace: dict = {"__name__": "migrating_from_dtensor"}
    for line, code in markdown_python_blocks(GUIDE):
        try:
            exec(compile(code, f"{GUIDE.name}:{line}", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"the block at {GUIDE.name} line {line} failed: {e!r}") from e
    # the checkpoint blocks' directories, removed once: every rank passed the later blocks' collectives, so none
    # still reads them
    if dist.get_rank() == 0:
        for suffix in ("", "-plain"):
            shutil.rmtree(namespace["path"] + suffix, ignore_errors=True)
