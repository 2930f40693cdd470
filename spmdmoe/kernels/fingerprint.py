"""A content fingerprint of tensors, computed and compared on the device: "did these bytes change?" without a host sync.

The FP8 weight cache (:mod:`spmdmoe.moe.experts.fp8_cache`) asks it before every use: the quantized copy is stale
exactly when the master weights' bytes differ from the ones it was made from, however they were written
(an optimizer step through ``p.data``, ``load_state_dict``, an FSDP2 all-gather into the same storage, an
in-place edit, a CUDA-graph replay after ``optimizer.step()``). Version counters and data pointers miss
several of these; the bytes do not.

The fingerprint of tensors ``x_0, x_1, ...`` (each read as its 32-bit words, or 16-bit ones zero-extended
where its size or alignment needs that) is two 64-bit sums, one per lane ``L``, over every word ``w`` at
word index ``i`` of tensor ``t``::

    h_L(w, i, t) = mix_L(w ^ (lo(i) * A_L) ^ ((hi(i) + t * G) * B))        (uint32 arithmetic)
    mix_L(x) = x * C_L; x ^= x >> 16; x *= M; x ^= x >> 13

For a fixed position ``h_L`` is a bijection of ``w`` (xor with a constant, odd multipliers, xorshifts), so
a change of one word always changes both sums; a change of many words leaves both sums unchanged with
probability about 2^-64. Integer sums are exact modulo 2^64, so the result does not depend on the order
the programs add in (deterministic, atomics included).

``state`` (int64, :data:`STATE_SLOTS` entries, zeros to start) holds the stored fingerprint, the two
accumulators and the ticket of the running launch (zero between calls), the verdict and a count:

* ``state[CHANGED]``: 1 when the fingerprint differs from the stored one, or nothing was stored yet
  (``state[COUNT] == 0``), else 0; the stored fingerprint is then replaced;
* ``state[COUNT]``: how many calls found a change (the cache's refresh count).

The kernel makes the verdict itself: every program adds its partial sums to the accumulators, then takes a
ticket; the program that takes the last ticket of the last launch reads and clears the accumulators,
compares and writes the verdict. One launch per tensor, stream-ordered; no host read anywhere, so it
runs inside CUDA-graph capture and inside a compiled graph (through the cache's custom op).

A persistent grid of a few programs per SM walks the words in ``BLOCK``-word strides.

Measured (H200, torch 2.11, Triton 3.6; ``benchmarks/kernels.py``, swept; bytes = the bf16 weights read once):
DeepSeek-MoE-16B's expert weights (1.1 GB, ``[w1 | w3]`` and ``w2`` of 64 experts) in 0.346 ms, 3.20 TB/s
(76 % of the 4.2 TB/s copy ceiling; what holds it there is not yet established).
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from .backend import use_triton

__all__ = ["STATE_SLOTS", "CHANGED", "COUNT", "fingerprint_", "fingerprint_reference", "fingerprint_triton",
           "new_state"]

STORED_A, STORED_B, ACC_A, ACC_B, TICKET, CHANGED, COUNT = range(7)
STATE_SLOTS = 8
# launch configuration (benchmarks/kernels.py sweeps it on the GPU)
CONFIG = {"block": 2048, "programs_per_sm": 8, "num_warps": 16}

_M32 = 0xFFFFFFFF
_A = (0x9E3779B1, 0x85EBCA77)  # per lane: the position's low word
_C = (0xCC9E2D51, 0x1B873593)  # per lane: the first multiply
_B, _M, _G = 0xC2B2AE3D, 0x85EBCA6B, 0x27D4EB2F


# The kernel spells the constants out (a jit function reads no Python globals); the test against the reference,
# bit for bit, pins them to _A, _B, _C, _M, _G above. State slots as named above: 2, 3 the accumulators, 4 the
# ticket, 0, 1 the stored fingerprint, 5 the verdict, 6 the count.
@triton.jit
def _mix(w, lo, hi, a, c):
    x = w ^ (lo * a) ^ (hi * 0xC2B2AE3D)
    x = x * c
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    return x ^ (x >> 13)


@triton.jit
def _fingerprint_kernel(x_ptr, state_ptr, n, SEED: tl.constexpr, WIDE: tl.constexpr, FINAL: tl.constexpr,
                        BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK).to(tl.int64)
    seed = tl.full([], SEED, tl.uint32)  # the tensor's index, mixed (a host int below 2^32)
    acc_a = tl.zeros([BLOCK], tl.int64)
    acc_b = tl.zeros([BLOCK], tl.int64)
    for start in range(pid * BLOCK, n, step):
        idx = start + offs
        m = idx < n
        raw = tl.load(x_ptr + idx, mask=m, other=0)
        if WIDE:
            w = raw.to(tl.uint32, bitcast=True)
        else:
            w = raw.to(tl.uint16, bitcast=True).to(tl.uint32)
        lo = idx.to(tl.uint32)
        hi = (idx >> 32).to(tl.uint32) + seed
        acc_a += tl.where(m, _mix(w, lo, hi, 0x9E3779B1, 0xCC9E2D51).to(tl.int64), 0)
        acc_b += tl.where(m, _mix(w, lo, hi, 0x85EBCA77, 0x1B873593).to(tl.int64), 0)
    tl.atomic_add(state_ptr + 2, tl.sum(acc_a, axis=0))
    tl.atomic_add(state_ptr + 3, tl.sum(acc_b, axis=0))
    if FINAL:
        ticket = tl.atomic_add(state_ptr + 4, 1)
        if ticket == tl.num_programs(0) - 1:  # every other program of this launch has added its sums
            a = tl.atomic_xchg(state_ptr + 2, 0)
            b = tl.atomic_xchg(state_ptr + 3, 0)
            tl.atomic_xchg(state_ptr + 4, 0)
            count = tl.load(state_ptr + 6)
            changed = ((a != tl.load(state_ptr + 0)) | (b != tl.load(state_ptr + 1)) | (count == 0)).to(tl.int64)
            tl.store(state_ptr + 0, a)
            tl.store(state_ptr + 1, b)
            tl.store(state_ptr + 5, changed)
            tl.store(state_ptr + 6, count + changed)


def new_state(device: torch.device | str) -> torch.Tensor:
    """A fresh ``state``: nothing stored (the first call reports a change)."""
    return torch.zeros(STATE_SLOTS, dtype=torch.int64, device=device)


def _words(x: torch.Tensor) -> torch.Tensor:
    """``x``'s bytes as a flat int32 (wide) or int16 tensor, without a copy when ``x`` is contiguous."""
    flat = x.detach().contiguous().view(-1).view(torch.uint8)
    if flat.numel() % 4 == 0 and flat.data_ptr() % 4 == 0:
        return flat.view(torch.int32)
    if flat.numel() % 2 == 0 and flat.data_ptr() % 2 == 0:
        return flat.view(torch.int16)
    raise TypeError(f"fingerprint: a tensor of {flat.numel()} bytes ({x.dtype}) is not made of 16-bit words")


def fingerprint_triton(tensors: Sequence[torch.Tensor], state: torch.Tensor) -> None:
    """The Triton launcher: one launch per tensor (the last one makes the verdict)."""
    if not tensors:
        raise ValueError("fingerprint: no tensors")
    dev = state.device
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
    for t, x in enumerate(tensors):
        words = _words(x)
        n = words.numel()
        grid = (max(1, min(triton.cdiv(n, CONFIG["block"]), sms * CONFIG["programs_per_sm"])),)
        _fingerprint_kernel[grid](words, state, n, SEED=t * _G & _M32, WIDE=words.element_size() == 4,
                                  FINAL=t == len(tensors) - 1, BLOCK=CONFIG["block"], num_warps=CONFIG["num_warps"])


def _lane_sums(words: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two lane sums of one tensor's words (int64 tensors emulating uint32 arithmetic)."""
    sums = [words.new_zeros((), dtype=torch.int64) for _ in _A]
    chunk = 1 << 22
    for s in range(0, words.numel(), chunk):  # bounded int64 temporaries
        w = words[s:s + chunk].to(torch.int64) & (_M32 if words.element_size() == 4 else 0xFFFF)
        idx = torch.arange(s, s + w.numel(), device=words.device, dtype=torch.int64)
        lo, hi = idx & _M32, ((idx >> 32) + (t * _G & _M32)) & _M32
        for lane, (a, c) in enumerate(zip(_A, _C)):
            x = w ^ ((lo * a) & _M32) ^ ((hi * _B) & _M32)
            x = (x * c) & _M32
            x = x ^ (x >> 16)
            x = (x * _M) & _M32
            x = x ^ (x >> 13)
            sums[lane] = sums[lane] + x.sum()
    return sums[0], sums[1]


def fingerprint_reference(tensors: Sequence[torch.Tensor], state: torch.Tensor) -> None:
    """Plain torch, same signature and ``state`` updates (device ops only: no host read either)."""
    if not tensors:
        raise ValueError("fingerprint: no tensors")
    a = b = state.new_zeros(())
    for t, x in enumerate(tensors):
        sa, sb = _lane_sums(_words(x), t)
        a, b = a + sa, b + sb
    changed = ((a != state[STORED_A]) | (b != state[STORED_B]) | (state[COUNT] == 0)).to(torch.int64)
    state[STORED_A:STORED_B + 1].copy_(torch.stack([a, b]))
    state[CHANGED].copy_(changed)
    state[COUNT].add_(changed)


def fingerprint_(tensors: Sequence[torch.Tensor], state: torch.Tensor) -> None:
    """Fingerprint ``tensors`` into ``state`` (module docstring): the Triton kernel on CUDA, the reference
    elsewhere (``spmdmoe.kernels.backend``)."""
    impl = fingerprint_triton if tensors and use_triton("fingerprint", tensors[0]) else fingerprint_reference
    impl(tensors, state)
