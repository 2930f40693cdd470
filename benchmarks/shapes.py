"""The model shapes the benchmarks measure: one name per shape (``--shape NAME``).

Legend: ``D`` model dim, ``F`` expert hidden dim, ``E`` experts, ``K`` top-k, ``T`` tokens per step.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Shape", "SHAPES"]


class Shape(NamedTuple):
    D: int
    F: int
    E: int
    K: int
    T: int
    model: str

    def label(self) -> str:
        return f"{self.D} / {self.F} / {self.E} / {self.K}, {self.T // 1024}k tokens ({self.model})"


SHAPES: dict[str, Shape] = {
    "dsv3-debug": Shape(256, 256, 8, 3, 4096, "torchtitan's DeepSeek-V3 debug model"),
    "dsmoe16b": Shape(2048, 1408, 64, 6, 16384, "DeepSeek-MoE-16B"),
    "dsmoe16b-64k": Shape(2048, 1408, 64, 6, 65536, "DeepSeek-MoE-16B"),
    "qwen3-30b": Shape(2048, 768, 128, 8, 16384, "Qwen3-30B-A3B"),
    "qwen3-235b": Shape(4096, 1536, 128, 8, 16384, "Qwen3-235B-A22B"),
    "dsv3-ep8": Shape(7168, 2048, 32, 8, 16384, "DeepSeek-V3, one EP-8 rank's 32 experts"),
}
