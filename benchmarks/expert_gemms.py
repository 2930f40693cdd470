"""The experts' six GEMMs of one step, in bf16 and in FP8, on operands made as the layer makes them.

Legend: ``R`` routed rows, ``D`` model dim, ``F`` expert hidden dim, ``e`` experts (groups).

:func:`operands` builds, for given group sizes: routed rows ``x`` ~ N(0, 1), weights with the layer's
init scale, ``h13`` from the real up-projection, ``h`` its SwiGLU, an output gradient ``dy``, ``dh`` and
``dh13`` through the real SwiGLU backward, and every FP8 form the FP8 experts feed their GEMMs (spmdmoe's
quantizers). :func:`gemms` returns, per GEMM, the bf16 call as the bf16 layer makes it (torch's grouped
GEMM; the up-projection as one GEMM on ``[w1 | w3]``, its weight gradient as two) and the FP8 call as the
FP8 layer makes it (``torch._scaled_grouped_mm``, ``spmdmoe.moe.experts.fp8.FAST_ACCUM``). Shared by
``fp8_numerics.py`` (quality) and ``vs_torchtitan.py`` (the ceiling table).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from spmdmoe.kernels import quantize_cols_pair, quantize_rows, swiglu_backward, swiglu_forward
from spmdmoe.moe.experts.fp8 import FAST_ACCUM, Fp8Weights, quantize_weights

__all__ = ["Operands", "operands", "gemms"]

_grouped = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm")


@dataclass
class Operands:
    offs: torch.Tensor  # (e,) int32 group ends
    w1: torch.Tensor  # (e, F, D)
    w2: torch.Tensor  # (e, D, F)
    w3: torch.Tensor  # (e, F, D)
    w13: torch.Tensor  # (e, 2F, D)
    x: torch.Tensor  # (R, D)
    h13: torch.Tensor  # (R, 2F)
    h: torch.Tensor  # (R, F)
    dy: torch.Tensor  # (R, D)
    dh13: torch.Tensor  # (R, 2F)
    q: Fp8Weights  # the weights' two FP8 layouts
    rows: dict[str, tuple[torch.Tensor, torch.Tensor]]  # rowwise FP8 (q, s) of x, h, dy, dh13
    cols: dict[str, tuple]  # per-group colwise FP8 of (dy, h) and (dh13, x): (qa, qb, sa, sb, padded ends)


def operands(D: int, F: int, sizes: list[int], device: str, seed: int = 0) -> Operands:
    gen = torch.Generator(device=device).manual_seed(seed)
    bf = torch.bfloat16
    e, R = len(sizes), sum(sizes)
    offs = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
    w1, w3 = ((torch.randn(e, F, D, device=device, generator=gen) * 0.02).to(bf) for _ in range(2))
    w2 = (torch.randn(e, D, F, device=device, generator=gen) * 0.01).to(bf)
    w13 = torch.cat([w1, w3], dim=1)
    x = torch.randn(R, D, device=device, generator=gen).to(bf)
    valid = offs[-1:]
    h13 = _grouped(x, w13.transpose(1, 2), offs=offs)
    h = swiglu_forward(h13, valid)
    dy = (torch.randn(R, D, device=device, generator=gen) * 1e-3).to(bf)
    dh13 = swiglu_backward(_grouped(dy, w2, offs=offs), h13, valid)[0]
    rows = {name: quantize_rows(t) for name, t in (("x", x), ("h", h), ("dy", dy), ("dh13", dh13))}
    cols = {"dy, h": quantize_cols_pair(dy, h, offs), "dh13, x": quantize_cols_pair(dh13, x, offs)}
    return Operands(offs, w1, w2, w3, w13, x, h13, h, dy, dh13, quantize_weights(w1, w2, w3), rows, cols)


def gemms(o: Operands) -> dict[str, tuple[str, Callable[[], object], Callable[[], object]]]:
    """GEMM name -> (kind: forward / dgrad / wgrad, bf16 call, FP8 call)."""
    bf, q, offs = torch.bfloat16, o.q, o.offs
    F = o.w1.shape[1]

    def rows(a: str, w: torch.Tensor, s: torch.Tensor, kind: str) -> Callable[[], object]:
        qa, sa = o.rows[a]
        return lambda: torch._scaled_grouped_mm(qa, w.transpose(1, 2), sa, s, offs=offs, out_dtype=bf,
                                                use_fast_accum=FAST_ACCUM[kind])

    def groups(pair: str, part: slice = slice(None)) -> Callable[[], object]:
        qa, qb, sa, sb, padded = o.cols[pair]
        qa, sa = qa[part], sa[:, part].contiguous()
        return lambda: torch._scaled_grouped_mm(qa, qb.t(), sa.reshape(-1), sb.reshape(-1), offs=padded,
                                                out_dtype=bf, use_fast_accum=FAST_ACCUM["wgrad"])

    dw1, dw3 = groups("dh13, x", slice(0, F)), groups("dh13, x", slice(F, 2 * F))
    return {
        "forward up  x @ [w1|w3]^T": ("forward", lambda: _grouped(o.x, o.w13.transpose(1, 2), offs=offs),
                                      rows("x", q.up, q.up_s, "forward")),
        "forward down  h @ w2^T": ("forward", lambda: _grouped(o.h, o.w2.transpose(1, 2), offs=offs),
                                   rows("h", q.down, q.down_s, "forward")),
        "dgrad down  dy @ w2": ("dgrad", lambda: _grouped(o.dy, o.w2, offs=offs), rows("dy", q.down_t, q.down_t_s, "dgrad")),
        "dgrad up  dh13 @ [w1|w3]": ("dgrad", lambda: _grouped(o.dh13, o.w13, offs=offs),
                                     rows("dh13", q.up_t, q.up_t_s, "dgrad")),
        "wgrad down  dy^T h": ("wgrad", lambda: _grouped(o.dy.t(), o.h, offs=offs), groups("dy, h")),
        "wgrad up  dh13^T x (w1, w3)": (
            "wgrad", lambda: (_grouped(o.dh13[:, :F].t(), o.x, offs=offs), _grouped(o.dh13[:, F:].t(), o.x, offs=offs)),
            lambda: (dw1(), dw3())),
    }
