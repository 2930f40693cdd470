"""The FP8 weight cache: the experts' quantized weights, never stale, refreshed on the device.

Legend: ``e`` local experts, ``D`` model dim, ``F`` expert hidden dim.

The FP8 experts (:mod:`spmdmoe.moe.experts.fp8`) need each weight in two e4m3 layouts (:class:`Fp8Weights`).
Quantizing them costs two reads of the bf16 weights (1.3 ms for DeepSeek-MoE-16B's experts on an
H200), so they are kept between forwards: micro-batches under gradient accumulation, activation-checkpoint
recomputes and evaluation reuse them. The hard part is knowing when they are stale. A parameter's version
counter and data pointer miss an optimizer that writes through ``p.data``, a user's ``w.data.mul_(2)``, an
FSDP2 all-gather into the same storage, and every CUDA-graph replay (no Python runs there); ``torch.compile``
runs no Python cache logic at all. So the cache compares the bytes:

* before every use, one launch per weight fingerprints the master weights on the device
  (:mod:`spmdmoe.kernels.fingerprint`: two 64-bit sums of mixed 32-bit words; one changed word always
  changes them) and compares the result with the fingerprint of the weights the cache holds, all on the
  device, with no host read;
* the quantizers run gated by that verdict (:func:`spmdmoe.kernels.quantize_weight_pair_into`, both layouts
  of a weight from two reads): they write only when the weights changed.

The same code runs eagerly, inside a compiled graph and inside a captured CUDA graph: the check and the
gated writes are one custom op (``spmdmoe::fp8_refresh_weights``), opaque to ``torch.compile``. So the cache
follows every way weights change, and the weights are quantized at most once per change, in every mode.

Cost (measured on an H200, ``benchmarks/ARCHIVE.md``, issue 22): the fingerprint reads the bf16 weights once
per forward, 0.35 ms for DeepSeek-MoE-16B's 1.1 GB of expert weights (3.2 TB/s; a whole use with unchanged
weights 0.42 ms), about 1.5 ms for Qwen3-235B's 4.8 GB; the quantization when they changed, 1.3 ms at 16B
(5.4 ms at 235B; issue 23). Where the weights change before every forward anyway (no gradient accumulation,
no recompute), ``GroupedExperts.fp8_cache = None`` quantizes every call and skips the
fingerprint; ``fully_shard_moe`` does that (its units re-gather the weights each forward, and a cache would
keep a full-size FP8 copy of each layer's experts beside FSDP2's shards). Memory: two e4m3 layouts of every
weight (as many bytes as the bf16 weights), fp32 scales and 64 bytes of state.

How the op stays in order without declaring its writes: it takes the weights and the cache's tensors and
returns a fresh empty tensor, ``ready``, that the experts' forward op takes as an input, so the refresh runs
before every read of the cache in the same forward. Declaring the writes (``mutates_args``) would bump the
version counters of the cached tensors, which a pending backward saved: a micro-batch's forward, or an
activation-checkpoint recompute, would then fail another micro-batch's backward ("modified by an inplace
operation") although the bytes did not change. Neither writer bumps them: the Triton kernels store through
pointers, the CPU reference (:func:`spmdmoe.kernels.fp8_common.write_where`) through ``.data``. So two forwards
in flight (pipeline 1F1B, a layer used twice in a step, a no-grad forward before a backward) back-propagate
bit for bit as without the second forward, on CPU and CUDA (``tests/test_fp8_two_forwards.py``). The cached
tensors are marked static addresses, so inductor's CUDA graphs (``mode="reduce-overhead"``) use them in place
rather than copying them in.

One forward at a time per cache (the fingerprint's accumulators are shared): two layers, two caches.
A backward reads the cached weights as the last forward's refresh left them, so the weights must not change
between a forward and its backward (no optimizer step in between; ordinary training never does). Where they
are changed in place and the layer reads the parameters or views of them, that backward raises ("modified by
an inplace operation"), as the bf16 layer's does, eagerly and compiled: the experts' node saves the bf16
weights for their version counters (``fp8_ops._setup``; same test file). Not seen: writes through ``p.data``
and weights an integration's ``read_weights`` casts each forward; the backward then uses the newer weights.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...kernels import quantize_weight_pair_into
from ...kernels.fingerprint import CHANGED, COUNT, fingerprint_, new_state
from ...kernels.fp8_common import FP8
from .fp8 import Fp8Weights, quantize_weights
from .gemm import up_weights

__all__ = ["Fp8WeightCache"]


def _layouts(w1_eFD: torch.Tensor, w2_eDF: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of each field of :class:`Fp8Weights` for these weights."""
    e, F, D = w1_eFD.shape
    f32 = torch.float32
    return [((e, 2 * F, D), FP8), ((e, 2 * F), f32), ((e, D, 2 * F), FP8), ((e, D), f32),
            ((e, D, F), FP8), ((e, D), f32), ((e, F, D), FP8), ((e, F), f32)]


class Fp8WeightCache:
    """The quantized weights of one ``GroupedExperts`` (module docstring), allocated for ``(w1, w2, w3)``'s
    shapes on their device (a meta device allocates nothing). ``GroupedExperts`` makes one at construction
    and again when ``.to()`` moves its weights; :meth:`get` also makes room eagerly if the weights' shapes
    or device changed under it."""

    def __init__(self, w1_eFD: torch.Tensor, w2_eDF: torch.Tensor, w3_eFD: torch.Tensor) -> None:
        self._allocate(w1_eFD, w2_eDF)

    def _allocate(self, w1_eFD: torch.Tensor, w2_eDF: torch.Tensor) -> None:
        dev = w1_eFD.device
        self.tensors = tuple(torch.empty(shape, dtype=dtype, device=dev) for shape, dtype in _layouts(w1_eFD, w2_eDF))
        self.weights = Fp8Weights(*self.tensors)
        self.state = new_state(dev)  # nothing stored: the first use quantizes
        if dev.type == "cuda":
            for t in (*self.tensors, self.state):
                torch._dynamo.mark_static_address(t)

    def matches(self, w1_eFD: torch.Tensor, w2_eDF: torch.Tensor, w3_eFD: torch.Tensor) -> bool:
        """Whether the cache has room for these weights (shapes and device)."""
        return (w3_eFD.shape == w1_eFD.shape and w1_eFD.device == self.state.device
                and all(t.shape == shape for t, (shape, _) in zip(self.weights, _layouts(w1_eFD, w2_eDF))))

    def get(self, w1_eFD: torch.Tensor, w2_eDF: torch.Tensor, w3_eFD: torch.Tensor) -> Fp8Weights:
        """The quantized ``(w1, w2, w3)``, refreshed first if their bytes changed (on the device)."""
        if not self.matches(w1_eFD, w2_eDF, w3_eFD):
            if torch.compiler.is_compiling():  # no allocation inside a graph: quantize in it (each call)
                return quantize_weights(w1_eFD, w2_eDF, w3_eFD)
            self._allocate(w1_eFD, w2_eDF)
        ready = _refresh(w1_eFD.detach(), w2_eDF.detach(), w3_eFD.detach(), *self.tensors, self.state)
        return self.weights._replace(ready=ready)

    def invalidate(self) -> None:
        """Forget what is cached: the next use quantizes (never needed for correctness; a device op)."""
        self.state.zero_()

    def refreshes(self) -> int:
        """How many uses found changed weights and quantized them (a host read: tests and benchmarks)."""
        return int(self.state[COUNT])

    def nbytes(self) -> int:
        """Persistent bytes: the two e4m3 layouts, their scales and the state."""
        return sum(t.numel() * t.element_size() for t in (*self.tensors, self.state))


@torch.library.custom_op("spmdmoe::fp8_refresh_weights", mutates_args=())
def _refresh(w1_eFD: torch.Tensor, w2_eDF: torch.Tensor, w3_eFD: torch.Tensor, up: torch.Tensor, up_s: torch.Tensor,
             up_t: torch.Tensor, up_t_s: torch.Tensor, down: torch.Tensor, down_s: torch.Tensor, down_t: torch.Tensor,
             down_t_s: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """Fingerprint the weights, then re-quantize into the cache's tensors if they changed; returns ``ready``
    (an empty tensor the experts' op takes, module docstring). Writes the cache's tensors and ``state``
    in place without declaring it, on purpose (module docstring)."""
    up_eGD = up_weights(w1_eFD, w3_eFD)  # [w1 | w3]: a view when packed, else a copy
    fingerprint_([up_eGD, w2_eDF], state)
    gate = state[CHANGED:CHANGED + 1]
    quantize_weight_pair_into(up_eGD, up, up_s, up_t, up_t_s, gate)
    quantize_weight_pair_into(w2_eDF, down, down_s, down_t, down_t_s, gate)
    return state.new_empty(0)


@_refresh.register_fake
def _(w1_eFD, w2_eDF, w3_eFD, up, up_s, up_t, up_t_s, down, down_s, down_t, down_t_s, state):  # type: ignore[no-untyped-def]
    return state.new_empty(0)


def fresh_cache(w1_eFD: torch.Tensor, w2_eDF: torch.Tensor, w3_eFD: torch.Tensor,
                old: Optional[Fp8WeightCache]) -> Optional[Fp8WeightCache]:
    """``old`` if it still fits the weights (shapes, device), else a new cache; ``None`` stays ``None``."""
    if old is None or old.matches(w1_eFD, w2_eDF, w3_eFD):
        return old
    return Fp8WeightCache(w1_eFD, w2_eDF, w3_eFD)
