"""FP8 rowwise routed experts (``MoEConfig(expert_precision="fp8_rowwise")``).

Legend: ``T`` tokens, ``K`` top-k, ``R`` routed rows in the buffer, ``D`` model dim, ``F`` expert hidden
dim (this rank's slice), ``e`` local experts, ``P`` rows of the 16-aligned
wgrad layout (:func:`spmdmoe.kernels.fp8_cols.padded_rows`), ``M`` rows of a GEMM, ``I`` / ``O`` a
projection's input (reduced) and output width (as in ``gemm.py``), ``A`` / ``B`` the widths of a weight
gradient's two operands.

The experts' forward and input-gradient GEMMs run in e4m3 with fp32 scales (``torch._scaled_grouped_mm``, fast
accumulation: :data:`FAST_ACCUM`, bf16 out), their weight-gradient GEMMs in FP8 or unquantized (:func:`fp8_wgrad`);
everything else (router, shared experts, combine, master weights and their gradients) stays in the activations'
precision. One autograd node whose backward frees each activation as soon as it has read it, so none lives longer
than in the bf16 layer (H200, the five shape presets: the eager step peak 3-13 % below the bf16 layer's; compiled, at
or below it at three, 2.4 % above at Qwen3-30B-A3B and 64k tokens). The activations are kept in a box on the node, not
saved: a second backward through one forward (``retain_graph=True``) raises and says so. The weights enter in two
layouts (per output column, per input column), kept by the weight cache (:mod:`spmdmoe.moe.experts.fp8_cache`).
On CPU, on GPUs without sm90 and for dims that are not multiples of 16 the same path runs emulated: the same
quantizers and alignment, then dequantize and an ordinary GEMM (a CUDA device takes that route with a one-time
warning). The order of the backward, the weight-gradient rule and the fast-accumulation measurements:
``docs/design.md`` §7.1.

This module holds the GEMMs (native or emulated) and the weights' layouts; the autograd node, the
custom ops around them and their fake implementations, with the entry :func:`fp8_swiglu`, are in
``fp8_ops.py``: ``torch.compile(fullgraph=True)`` sees opaque calls (their fakes give the shapes), and
compiled runs execute the very code eager runs do.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple, Optional

import torch

from ...host import to_host
from ...kernels import quantize_weight_pair
from .gemm import grouped_mm, up_weights

__all__ = ["FAST_ACCUM", "WGRAD_FP8_MIN", "Fp8Weights", "fp8_native", "fp8_wgrad", "quantize_weights"]

_scaled = getattr(torch, "_scaled_grouped_mm", None)
# ``use_fast_accum`` of the scaled GEMMs, per kind: Hopper's FP8 tensor cores accumulate in reduced precision unless
# the GEMM promotes partial sums to fp32 (``False``: slower). Chosen by measurement (``docs/design.md`` §7.1;
# ``benchmarks/fp8_numerics.py``, figures in ``benchmarks/ARCHIVE.md``).
FAST_ACCUM: dict[str, bool] = {"forward": True, "dgrad": True, "wgrad": True}
# ``fp8_wgrad="auto"``: the weight gradients run in FP8 where ``D F / (2 D + 3 F)`` (GEMM work per byte the
# wgrad quantizers move) reaches this; below it the unquantized wgrad GEMMs are faster than FP8 GEMMs plus the
# per-(group, column) quantizers (measured at every shape preset: ``docs/design.md`` §7.1, ``benchmarks/ARCHIVE.md``).
WGRAD_FP8_MIN = 600.0
_grouped = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_warned: list[bool] = [False]


def fp8_native(x: torch.Tensor, *dims: int) -> bool:
    """Whether ``torch._scaled_grouped_mm`` runs here: a CUDA device of sm90 or later, every GEMM dim a
    multiple of 16 (and some rows). Warns once when a CUDA device must emulate. Asked inside the experts'
    custom ops, so on real tensors, also under ``torch.compile``."""
    if not x.is_cuda or _scaled is None or x.shape[0] == 0:
        return False
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    ok = torch.cuda.get_device_capability(index) >= (9, 0) and all(d % 16 == 0 and d > 0 for d in dims)
    if not ok and not _warned[0]:
        _warned[0] = True
        warnings.warn(f"fp8_rowwise experts need sm90+ and dims that are multiples of 16 (found {dims}); "
                      "emulating them (quantize, dequantize, an ordinary GEMM): FP8 numerics, no FP8 speed", stacklevel=3)
    return ok


class Fp8Weights(NamedTuple):
    """The quantized weights, in the GEMMs' column-major layouts (``(q, s)`` pairs, ``s`` fp32 per column).

    ``up`` = ``[w1 | w3]`` as ``(e, 2F, D)`` (forward: per (expert, hidden unit) over D); ``up_t`` its
    transpose ``(e, D, 2F)`` (dgrad: per (expert, model unit) over 2F); ``down`` = ``w2`` ``(e, D, F)``
    (forward, per (expert, model unit)); ``down_t`` its transpose ``(e, F, D)`` (dgrad)."""

    up: torch.Tensor
    up_s: torch.Tensor
    up_t: torch.Tensor
    up_t_s: torch.Tensor
    down: torch.Tensor
    down_s: torch.Tensor
    down_t: torch.Tensor
    down_t_s: torch.Tensor
    ready: Optional[torch.Tensor] = None  # the cache's refresh token (spmdmoe.moe.experts.fp8_cache); None: fresh values


def quantize_weights(w1_eFD: torch.Tensor, w2_eDF: torch.Tensor, w3_eFD: torch.Tensor) -> Fp8Weights:
    """Both layouts of both weights (the transposed ones quantized per column, no transposing copy; two reads
    of each weight, :func:`spmdmoe.kernels.quantize_weight_pair`)."""
    with torch.no_grad():
        up = up_weights(w1_eFD, w3_eFD)
        return Fp8Weights(*quantize_weight_pair(up), *quantize_weight_pair(w2_eDF))


def _mm_rows(q_MI: torch.Tensor, s_M: torch.Tensor, w_eOI: torch.Tensor, s_eO: torch.Tensor,
             offsets_e: torch.Tensor, out_dtype: torch.dtype, native: bool, kind: str) -> torch.Tensor:
    """``y[rows of g] = (q * s)[rows] @ (w[g] * s[g])^T`` (2-D x 3-D, any group sizes); ``kind``: "forward" or
    "dgrad" (:data:`FAST_ACCUM`)."""
    if native:
        y = _scaled(q_MI, w_eOI.transpose(1, 2), s_M, s_eO, offs=offsets_e, out_dtype=torch.bfloat16,
                    use_fast_accum=FAST_ACCUM[kind])
        return y.to(out_dtype)
    dt = _emulation_dtype(q_MI, out_dtype)
    x = (q_MI.to(torch.float32) * s_M[:, None]).to(dt)
    w = (w_eOI.to(torch.float32) * s_eO[:, :, None]).to(dt)
    return grouped_mm(x, w, offsets_e).to(out_dtype)


def _mm_groups(qa_AP: torch.Tensor, qb_BP: torch.Tensor, sa_eA: torch.Tensor, sb_eB: torch.Tensor,
               padded_e: torch.Tensor, out_dtype: torch.dtype, native: bool) -> torch.Tensor:
    """``out[g] = (a[g] * sa[g])^T-ish``: per group ``g``, ``qa[:, rows of g] @ qb[:, rows of g]^T`` scaled,
    ``(e, A, B)`` (2-D x 2-D, groups 16-aligned, pad rows zero)."""
    if native:
        out = _scaled(qa_AP, qb_BP.t(), sa_eA.reshape(-1), sb_eB.reshape(-1), offs=padded_e,
                      out_dtype=torch.bfloat16, use_fast_accum=FAST_ACCUM["wgrad"])
        return out.to(out_dtype)
    if _emulation_dtype(qa_AP, out_dtype) == torch.bfloat16:  # e4m3 values are exact in bf16
        out = _grouped(qa_AP.to(torch.bfloat16), qb_BP.to(torch.bfloat16).t(), offs=padded_e)
        return (out.float() * sa_eA[:, :, None] * sb_eB[:, None, :]).to(out_dtype)
    out = _per_group(qa_AP.to(torch.float32), qb_BP.to(torch.float32), padded_e)
    return (out * sa_eA[:, :, None] * sb_eB[:, None, :]).to(out_dtype)


def _per_group(a_AP: torch.Tensor, b_BP: torch.Tensor, ends_e: torch.Tensor) -> torch.Tensor:
    """``out[g] = a[:, cols of g] @ b[:, cols of g]^T`` by one GEMM per group on the host's group ends
    (emulation only: CPU, or fp32 on CUDA; the op runs eagerly, also when compiled)."""
    ends = to_host(ends_e)
    starts = [0, *ends[:-1]]
    if not ends:
        return a_AP.new_zeros((0, a_AP.shape[0], b_BP.shape[0]))
    return torch.stack([a_AP[:, s:t] @ b_BP[:, s:t].t() for s, t in zip(starts, ends)])


def _emulation_dtype(q: torch.Tensor, out_dtype: torch.dtype) -> torch.dtype:
    """bf16 GEMMs for a bf16 layer on CUDA (torch's grouped GEMM, also under compile), fp32 elsewhere."""
    return torch.bfloat16 if q.is_cuda and out_dtype == torch.bfloat16 and _grouped is not None else torch.float32


def _wgrad_plain(a_RA: torch.Tensor, b_RB: torch.Tensor, offsets_e: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Unquantized weight gradient ``out[g] = a[rows of g]^T @ b[rows of g]``, ``(e, A, B)``: torch's grouped
    GEMM (2-D x 2-D, any group sizes, rows past ``offsets[-1]`` never read) where it runs, else per-group
    GEMMs in fp32 on the host's group ends (emulation only)."""
    e = offsets_e.shape[0]
    if a_RA.shape[0] == 0:  # no rows at all (torch's kernel refuses a zero-length contraction)
        return a_RA.new_zeros((e, a_RA.shape[1], b_RB.shape[1]), dtype=out_dtype)
    if _grouped is not None and a_RA.is_cuda and a_RA.dtype == torch.bfloat16 == b_RB.dtype and \
            (a_RA.shape[1] * 2) % 16 == 0 and (b_RB.shape[1] * 2) % 16 == 0:
        return _grouped(a_RA.t(), b_RB, offs=offsets_e).to(out_dtype)
    return _per_group(a_RA.to(torch.float32).t(), b_RB.to(torch.float32).t(), offsets_e).to(out_dtype)


def fp8_wgrad(D: int, F: int, e: int, dtype: torch.dtype, setting: str = "auto") -> bool:
    """Whether the weight-gradient GEMMs run in FP8 (``setting`` ``"auto"``: by :data:`WGRAD_FP8_MIN`; else
    ``"fp8"`` / ``"bf16"``). A function of the layer's shape only, never of the token count: one graph,
    no host sync, for every T. ``e`` and ``dtype`` are part of the rule's signature (measured at the
    shapes of ``benchmarks/shapes.py``; the rule found no use for them so far)."""
    if setting != "auto":
        return setting == "fp8"
    return D * F / (2 * D + 3 * F) >= WGRAD_FP8_MIN


def _parts(A: int, split: int) -> list[tuple[int, int]]:
    """The column ranges of the weight gradients in one ``A``-wide operand: all, or ``[0, split)`` and ``[split, A)``."""
    return [(0, A)] if not split else [(0, split), (split, A)]
