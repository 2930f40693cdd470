"""The FP8 weight cache: the experts' quantized weights, never stale, refreshed on the device.

Legend: ``e`` local experts, ``D`` model dim, ``F`` expert hidden dim.

The FP8 experts (:mod:`spmdmoe.moe.experts.fp8`) need each weight in two e4m3 layouts (:class:`Fp8Weights`).
Quantizing them costs two reads of the bf16 weights (1.3 ms for DeepSeek-MoE-16B's experts on an H200), so they
are kept between forwards: micro-batches under gradient accumulation, activation-checkpoint recomputes and
evaluation reuse them. Version counters and data pointers miss ``p.data`` writes, FSDP2 all-gathers into the same
storage and CUDA-graph replays, so the cache compares the bytes: before every use one custom op
(``spmdmoe::fp8_refresh_weights``, opaque to ``torch.compile``) fingerprints the master weights on the device
(:mod:`spmdmoe.kernels.fingerprint`), compares with the fingerprint of what the cache holds, and runs the quantizers
gated by that verdict (:func:`spmdmoe.kernels.quantize_weight_pair_into`), with no host read: the same code runs
eagerly, compiled and in a captured CUDA graph, and the weights are quantized at most once per change. The op
declares no writes (it returns an empty ``ready`` tensor the experts' forward takes, which orders them), so a
pending backward's saved tensors keep their versions: two forwards in flight back-propagate bit for bit
(``tests/test_fp8_two_forwards.py``). Its cost (0.35 ms a forward at 16B), ``fp8_cache = None`` (quantize every
call, no fingerprint; ``fully_shard_moe`` sets it) and what a backward sees when weights change in place:
``docs/design.md`` §7.1, "The weight cache". Memory: two e4m3 layouts of every weight (as many bytes as the bf16
weights), fp32 scales and 64 bytes of state.

One forward at a time per cache (the fingerprint's accumulators are shared): two layers, two caches. The weights
must not change between a forward and its backward (no optimizer step in between; ordinary training never does).
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
