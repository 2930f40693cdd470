"""The ``python`` code blocks of ``docs/migrating_from_dtensor.md`` run, in order, on 4 processes.

They share one namespace (as a reader running the guide top to bottom would), and every assertion
in them is a check of this test. A failure names the block (its first line in the file).
"""

import re
from pathlib import Path

import pytest

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "migrating_from_dtensor.md"


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, code) of each fenced ``python`` block."""
    return [
        (text[: m.start()].count("\n") + 2, m.group(1))
        for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    ]


def test_guide_has_blocks():
    blocks = python_blocks(GUIDE.read_text())
    assert len(blocks) >= 10, "the guide lost its examples"


@pytest.mark.world4
@pytest.mark.timeout(240)
def test_migration_guide_runs():
    namespace: dict = {"__name__": "migrating_from_dtensor"}
    for line, code in python_blocks(GUIDE.read_text()):
        try:
            exec(compile(code, f"{GUIDE.name}:{line}", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"the block at {GUIDE.name} line {line} failed: {e!r}") from e
