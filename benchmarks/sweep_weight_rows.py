"""Sweep the launch configuration of the FP8 weight quantizer's rows pass, per row width (1 GPU).

    python benchmarks/sweep_weight_rows.py [--out FILE]

``spmdmoe.kernels.fp8_weights`` picks the rows pass's ``(block_r, sub_r, num_warps)`` by the row's width
rounded up to a power of two (``ROWS_CONFIG``), because single configurations measured up to 4x slower at
one width and fine at another. For each width this times ``quantize_weight_pair`` (both passes) on an
expert weight of the model shapes with rows that wide, over every configuration (one tile) and the tiled
path (``TILED_CONFIG`` candidates), interleaved per shape, and prints the fastest few beside the current
entry. Copy the winners into ``ROWS_CONFIG`` / ``TILED_CONFIG``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from timing import report, timed  # noqa: E402

from spmdmoe.kernels import fp8_weights as fw  # noqa: E402

# (e, A, C): the weights whose rows are C wide (w2 of Qwen3-30B / DeepSeek-MoE-16B / V3; [w1|w3] of 16B, 235B, V3)
SHAPES = [(128, 2048, 768), (128, 2048, 1024), (64, 2048, 1408), (128, 1536, 2048), (32, 7168, 2048),
          (128, 3072, 4096), (32, 4096, 7168)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows_before, tiled_before = dict(fw.ROWS_CONFIG), fw.TILED_CONFIG
    lines = [f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; current ROWS_CONFIG {rows_before}, "
             f"TILED_CONFIG {tiled_before}", "", "| (e, A, C) | current ms | fastest (config: ms) |", "|---|---|---|"]
    for e, A, C in SHAPES:
        w = torch.randn(e, A, C, device="cuda", dtype=torch.bfloat16)
        width = max(triton_pow2(C), min(rows_before))
        configs = [("tile", c) for c in itertools.product([16, 32], [1, 2], [4, 8, 16])]
        configs += [("tiled", c) for c in itertools.product([32], [256, 512], [4, 8])]
        res = {}
        for kind, c in configs:
            fw.ROWS_CONFIG = {**rows_before, width: c}
            if kind == "tiled":
                fw.ROWS_CONFIG = {k: v for k, v in rows_before.items() if k < width} or {1: (1, 1, 4)}
                fw.TILED_CONFIG = c
            res[(kind, c)] = timed({"k": lambda: fw.quantize_weight_pair_triton(w)}, 10, 5)["k"]
            fw.ROWS_CONFIG, fw.TILED_CONFIG = dict(rows_before), tiled_before
        current = timed({"k": lambda: fw.quantize_weight_pair_triton(w)}, 10, 5)["k"]
        best = sorted(res.items(), key=lambda kv: kv[1])[:5]
        lines.append(f"| {(e, A, C)} | {current:.3f} | " + ", ".join(f"{k} {c}: {v:.3f}" for (k, c), v in best) + " |")
        print(lines[-1], flush=True)
        del w
    report("\n".join(lines), args.out)


def triton_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


if __name__ == "__main__":
    main()
