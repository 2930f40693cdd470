"""What the FP8 quantizers share: the e4m3 format, the scale rule, and the rounding.

A row (or a group's column) of values ``v`` with ``amax = max(|v|, EPS)`` is
stored as ``q = e4m3(clamp(v * (448 / amax), -448, 448))`` with the fp32
dequantization factor ``s = amax / 448`` (``v ≈ q * s``, what
``torch._scaled_grouped_mm`` takes). ``EPS`` keeps an all-zero row finite
(``q = 0``, ``s = EPS / 448``): no inf, no NaN. Both divisions are IEEE
(``div_rn`` in Triton), the product one fp32 rounding, and the cast to e4m3
round-to-nearest-even, so a kernel and its reference agree bit for bit.

The kernels round to e4m3 in fp32 arithmetic themselves (:func:`round_e4m3`)
and then cast an exactly representable value: Triton's interpreter
(``TRITON_INTERPRET=1``, 3.9) rounds a carry into the next binade wrongly
(125.6 -> 64 instead of 128), hardware does not; rounding first makes both exact.
A zero is stored as +0 (the GPU's conversion and torch's disagree on -0 otherwise).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["FP8", "FP8_MAX", "EPS", "FP8_MAX_C", "EPS_C", "dequant_scale", "e4m3_inverse", "e4m3_scale", "quantize_reference",
           "round_e4m3", "to_e4m3", "write_where"]

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
EPS = 1e-12
FP8_MAX_C = tl.constexpr(FP8_MAX)  # the same, readable inside @triton.jit
EPS_C = tl.constexpr(EPS)


@triton.jit
def round_e4m3(v):
    """fp32 ``v`` (``|v| <= 448``) rounded to the nearest e4m3 value, ties to even, still fp32."""
    bits = v.to(tl.int32, bitcast=True)
    # normal e4m3 (|v| >= 2^-6): keep 3 of fp32's 23 mantissa bits, round to nearest even
    kept = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # -1048576 = ~0xFFFFF
    normal = kept.to(tl.float32, bitcast=True)
    # subnormal e4m3 (|v| < 2^-6): multiples of 2^-9; adding 1.5 * 2^14 rounds there, ties to even (on
    # |v|, the sign put back after)
    magic = 24576.0
    a = tl.abs(v)
    sub = (a + magic) - magic
    q = tl.where(a < 0.015625, tl.where(bits < 0, -sub, sub), normal)
    return tl.where(q == 0.0, 0.0, q)  # -0 -> +0


@triton.jit
def e4m3_inverse(amax):
    """``448 / amax`` of fp32 ``amax`` (any shape), an IEEE division: the quantizing factor."""
    return tl.math.div_rn(tl.zeros_like(amax) + FP8_MAX_C, amax)


@triton.jit
def e4m3_scale(amax):
    """``amax / 448``, an IEEE division: the dequantization scale a kernel stores."""
    return tl.math.div_rn(amax, tl.zeros_like(amax) + FP8_MAX_C)


@triton.jit
def to_e4m3(v, inv):
    """fp32 ``v`` times ``inv`` (broadcast by the caller), clamped to +-448 and rounded to e4m3, still fp32."""
    return round_e4m3(tl.clamp(v * inv, -FP8_MAX_C, FP8_MAX_C))


def dequant_scale(amax: torch.Tensor) -> torch.Tensor:
    """``s = max(amax, EPS) / 448``, fp32, a true division (torch's CUDA ``tensor / 448`` multiplies by
    ``1 / 448`` instead, 1 ulp off at times)."""
    amax = amax.clamp(min=EPS)
    return amax / torch.full_like(amax, FP8_MAX)


def quantize_reference(v: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, s)`` of fp32 values ``v`` for an ``amax`` that broadcasts against them (already reduced)."""
    amax = amax.clamp(min=EPS)
    # a true division, tensor by tensor: torch computes ``448 / tensor`` as ``reciprocal(tensor) * 448``
    q = (v * (torch.full_like(amax, FP8_MAX) / amax)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    q = torch.where(q.view(torch.uint8) == 0x80, 0, q.view(torch.uint8)).view(FP8)  # -0 -> +0, as the kernels
    return q, dequant_scale(amax)


def write_where(gate: torch.Tensor, outs: tuple[torch.Tensor, ...], new: tuple[torch.Tensor, ...]) -> None:
    """Each ``out.copy_(new)`` where the one-element device tensor ``gate`` is nonzero, else unchanged (device
    ops only): how the references of the gated kernels write. Like the kernels (raw stores), it leaves each
    ``out``'s version counter as it was (it writes through ``out.data``, a counter of its own): the weight
    cache's tensors are saved by pending backwards, and a closed gate writes back the same bytes
    (``tests/test_fp8_two_forwards.py``)."""
    take = gate.reshape(()) != 0
    for out, value in zip(outs, new):
        bits = (lambda t: t.view(torch.uint8)) if out.dtype == FP8 else (lambda t: t)
        bits(out.data).copy_(torch.where(take, bits(value.reshape(out.shape)), bits(out)))
