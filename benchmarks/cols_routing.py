"""The wgrad column quantizer (`quantize_cols_pair`) under four routings, against another copy of spmdmoe.

    bash benchmarks/base_copy.sh BASE.tar /tmp/base_copy
    python3 benchmarks/cols_routing.py --base /tmp/base_copy

Group sizes are drawn from a multinomial over the experts: balanced, Zipf 0.5, Zipf 1, and every row on one
expert. Each case is first checked bit-equal to the base's output, then both candidates and the cast-pass
configurations in CANDIDATES are timed interleaved (`timing.timed`, median). Counted TB/s = bf16 read once
plus e4m3 written (3 bytes per element).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import timed  # noqa: E402

import spmdmoe.kernels.fp8_cols as fc  # noqa: E402

# name: the cast pass's configuration (the amax pass keeps fp8_cols.CONFIG)
CANDIDATES = {
    "ours": {},
    "2 splits": {"splits": 2},
    "4 splits, 32 columns, column-major": {"block_c": 32, "group_major": False},
}
SHAPES = (("16B 16k: N x (2048 + 1408), e 64", 98304, 2048, 1408, 64),
          ("V3 16k: N x (7168 + 2048), e 32", 131072, 7168, 2048, 32))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _offsets(N: int, E: int, zipf: float | None) -> torch.Tensor:
    if zipf is None:  # every row on one expert
        offs = torch.zeros(E, dtype=torch.int32)
        offs[E // 2:] = N
        return offs.cuda()
    probs = (1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** zipf)[torch.randperm(E)]
    return torch.distributions.Multinomial(N, probs).sample().to(torch.int64).cumsum(0).to("cuda", torch.int32)


def _with(config: dict, a, b, offs):
    def run():
        saved = dict(fc.CAST_CONFIG)
        fc.CAST_CONFIG.update(config)
        try:
            return fc.quantize_cols_pair_triton(a, b, offs)
        finally:
            fc.CAST_CONFIG.clear()
            fc.CAST_CONFIG.update(saved)
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="a folder holding `spmdmoe_base` (benchmarks/base_copy.sh)")
    args = ap.parse_args()
    sys.path.insert(0, args.base)
    from spmdmoe_base.kernels.fp8_cols import quantize_cols_pair_triton as base_cols
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; cast config {fc.CAST_CONFIG}\n")
    print("| operands | routing (largest group) | " + " | ".join(f"{n} ms" for n in CANDIDATES)
          + " | base ms | base / ours | ours counted TB/s |")
    print("|---|---|" + "---|" * (len(CANDIDATES) + 3))
    for name, N, A, B, E in SHAPES:
        a = torch.randn(N, A, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(N, B, device="cuda", dtype=torch.bfloat16)
        for kind, zipf in (("balanced", 0.0), ("Zipf 0.5", 0.5), ("Zipf 1", 1.0), ("one expert", None)):
            offs = _offsets(N, E, zipf)
            want = base_cols(a, b, offs)
            fns = {n: _with(c, a, b, offs) for n, c in CANDIDATES.items()}
            for n, fn in fns.items():
                assert all(torch.equal(_bits(x), _bits(y)) for x, y in zip(fn(), want)), (name, kind, n)
            t = timed({**fns, "base": lambda: base_cols(a, b, offs)}, 10, 7)
            largest = int(torch.diff(offs, prepend=offs.new_zeros(1)).max())
            print(f"| {name} | {kind} ({largest:,}) | " + " | ".join(f"{t[n]:.3f}" for n in CANDIDATES)
                  + f" | {t['base']:.3f} | {t['base'] / t['ours']:.2f}x | {N * (A + B) * 3 / t['ours'] / 1e9:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
