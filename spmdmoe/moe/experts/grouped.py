"""Routed experts (grouped SwiGLU over expert-major rows) and shared experts (dense SwiGLU).

Legend: ``R`` routed rows received by this rank's experts, ``T`` local tokens, ``D`` model dim, ``F`` expert hidden dim
(this rank's slice of it under tensor-parallel experts), ``E`` experts, ``e`` local experts, ``K`` top-k, ``H`` the
shared experts' hidden dim (``num_shared_experts * F``).

Expert math (torchtitan's): ``y = w2 @ (silu(w1 @ x) * (w3 @ x))``. The routed experts read their own parameters inside
``forward`` (so FSDP2 can shard them as a unit of their own, torchtitan-style) and, when replicated along an SP axis,
sum their gradients over it there (``grad_axis``, see ``grads.py``). The shared experts take their weights from the
caller, which syncs them with the layer's other dense weights.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...kernels import swiglu_backward, swiglu_forward
from ...types.mesh import MeshAxis
from ..transports.routed import RoutedTokens
from .fp8 import quantize_weights
from .fp8_ops import fp8_swiglu
from .fp8_cache import Fp8WeightCache, fresh_cache
from .gemm import plain_tensor, grouped_mm, grouped_mm_pair, joined
from ..params.grads import sync_grads
from ..params.overlap import is_fsdp_unit
from ..routing.permute import weighted_combine
from .wgrad_later import LaterWgrad

__all__ = ["GroupedExperts", "SharedExperts", "grouped_swiglu", "swiglu", "swiglu_rows"]


class GroupedExperts(nn.Module):
    """Parameters ``w1`` (E, F, D), ``w2`` (E, D, F), ``w3`` (E, F, D).

    ``grad_axis``: an SP axis the parameters are replicated along (set by ``parallelize_moe``, with ``grad_set``, which
    of them need a gradient as the ranks agreed then); their fresh gradients are summed over it.
    ``precision``: ``"bf16"`` (the activations' dtype) or ``"fp8_rowwise"`` (``spmdmoe.moe.experts.fp8``; its weight
    gradients in FP8 or not by ``fp8_wgrad``, ``fp8.fp8_wgrad``; the quantized weights are kept in ``fp8_cache`` until
    the weights' bytes change, checked on the device before every use (``fp8_cache.py``); ``fp8_cache = None``, as
    ``fully_shard_moe`` sets it, quantizes them every call).
    """

    grad_axis: Optional[MeshAxis] = None
    grad_set: Optional[tuple[bool, ...]] = None  # which of w1, w2, w3 need a gradient, as agreed over grad_axis
    packing: bool = True  # keep w1 and w3 packed side by side (see pack)

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, precision: str = "bf16", fp8_wgrad: str = "auto"):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.set_precision(precision, fp8_wgrad)

    def set_precision(self, precision: str, fp8_wgrad: str) -> None:
        """Set the precision, pack ``w1 | w3`` and make the FP8 weight cache (``None`` in bf16), once the
        weights are in place (a subclass holding other parameters calls it from its constructor too)."""
        self.precision = precision
        self.fp8_wgrad = fp8_wgrad
        self.pack()
        self.fp8_cache: Optional[Fp8WeightCache] = (
            Fp8WeightCache(*self.read_weights()) if precision == "fp8_rowwise" else None)

    def pack(self) -> None:
        """Put ``w1`` and ``w3`` side by side in one storage (``w3`` right after ``w1`` for each expert), so the
        up-projection reads ``[w1 | w3]`` as a view: one grouped GEMM instead of two (``gemm.grouped_mm_pair``). Runs at
        construction and after every ``.to()`` / ``.cuda()`` / ``to_empty``; the parameters keep their identity
        (``.data`` is re-pointed), values, names and shapes. ``w1`` and ``w3`` are then non-contiguous views, which
        FSDP2 refuses: shard with ``spmdmoe.moe.fully_shard_moe`` (or call :meth:`unpack` before ``fully_shard``); the
        GEMM then joins the two with a copy per step."""
        w1, w3 = self.w1.data, self.w3.data
        if not (plain_tensor(w1) and plain_tensor(w3)) or w1.shape != w3.shape:
            return
        if w1.dtype != w3.dtype or w1.device != w3.device or joined(w1, w3) is not None:
            return
        e, F, D = w1.shape
        both = torch.empty((e, 2 * F, D), dtype=w1.dtype, device=w1.device)
        if w1.device.type != "meta":
            both[:, :F].copy_(w1)
            both[:, F:].copy_(w3)
        self.w1.data, self.w3.data = both[:, :F], both[:, F:]

    def unpack(self) -> None:
        """Give ``w1`` and ``w3`` storages of their own (contiguous), and stop packing them: FSDP2's
        ``fully_shard`` takes contiguous parameters only (``fully_shard_moe`` calls this first)."""
        self.packing = False
        self.w1.data, self.w3.data = self.w1.data.contiguous(), self.w3.data.contiguous()

    def __setstate__(self, state: dict) -> None:
        """``copy.deepcopy`` / unpickling copy ``w1`` and ``w3`` one by one: packed again here (the copy's
        up-projection stays one grouped GEMM on a view, not a join per step)."""
        super().__setstate__(state)
        if self.packing:
            self.pack()

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        out = super()._apply(fn, recurse)
        if self.packing:
            self.pack()
        self.fp8_cache = fresh_cache(*self.read_weights(), self.fp8_cache)  # on the weights' new device
        return out

    @property
    def num_experts(self) -> int:
        """``w1``'s experts, or an integration's ``_num_experts`` (the global ``E`` over this rank's block)."""
        return self.__dict__["_num_experts"] if "_num_experts" in self.__dict__ else self.w1.shape[0]

    def read_weights(self) -> list[torch.Tensor]:
        """``[w1, w2, w3]`` as the forward reads them (a subclass holding them elsewhere, e.g. as DTensors,
        returns this rank's local tensors)."""
        return [self.w1, self.w2, self.w3]

    def later_wgrad(self) -> Optional[LaterWgrad]:
        """An anchor for the up-projection's weight gradients (``spmdmoe.moe.experts.wgrad_later``), made by the layer
        between its dispatch's launch and wait, where that split is exact: experts not in FP8 (``precision``
        ``"bf16"``), ``w1`` and ``w3`` plain packed parameters both needing a gradient, read as they are (this class's
        ``read_weights``, not a subclass's views or casts), not an FSDP2 unit of their own, no SP sum of them here, grad
        mode on, not under ``torch.compile``. ``None`` elsewhere (one node makes the input and weight gradients)."""
        if (self.precision != "bf16" or self.grad_axis is not None or not torch.is_grad_enabled()
                or torch.compiler.is_compiling() or type(self).read_weights is not GroupedExperts.read_weights):
            return None  # (a subclass reading views or casts, as the integrations do: not read here for nothing)
        w1, w3 = self.w1, self.w3
        # the module's own parameters (not FSDP2's sharded ones, which its pre-forward hook swaps later, nor a
        # unit FSDP2 reduce-scatters at its input)
        if not (w1.requires_grad and w3.requires_grad) or joined(w1, w3) is None or is_fsdp_unit(self):
            return None
        return LaterWgrad(w1, w3)

    def forward(self, routed: RoutedTokens, later: Optional[LaterWgrad] = None) -> torch.Tensor:
        """``y_RD`` for ``routed.x_RD``; ``y_TD``, the sum of each token's copies, when the transport asks for
        it (``routed.copies_TK``: the FP8 experts fuse that sum into their down-projection's node). ``later``:
        :meth:`later_wgrad`'s anchor, made earlier in this forward."""
        weights = self.read_weights()
        if self.grad_axis is not None:
            weights = sync_grads(weights, self.grad_axis, agreed=self.grad_set)
        if self.precision == "fp8_rowwise" and weights[0].shape[1] > 0:
            quantized = (self.fp8_cache.get(*weights) if self.fp8_cache is not None
                         else quantize_weights(*weights))
            assert routed.valid_rows is not None
            return fp8_swiglu(routed.x_RD, routed.group_offsets, routed.valid_rows, *weights, quantized,
                              self.fp8_wgrad, routed.fp8_rows, routed.weights_R, routed.copies_TK)
        y_RD = grouped_swiglu(routed, *weights, later=later)
        return y_RD if routed.copies_TK is None else weighted_combine(y_RD, routed.copies_TK, None)


def experts_block(src: GroupedExperts, experts: slice, hidden: slice, precision: str, fp8_wgrad: str
                  ) -> GroupedExperts:
    """A copy of ``src``'s block: experts ``experts``, hidden units ``hidden`` of each, on ``src``'s device and
    dtype, in ``precision``, each weight frozen where ``src``'s is (a meta ``src`` gives meta shards, uninitialised:
    nothing is allocated here)."""
    with torch.device("meta" if src.w1.is_meta else "cpu"):
        block = GroupedExperts(experts.stop - experts.start, src.w1.shape[2], hidden.stop - hidden.start,
                               precision, fp8_wgrad)
    block = block.to(device=src.w1.device, dtype=src.w1.dtype)
    if not src.w1.is_meta:
        with torch.no_grad():
            block.w1.copy_(src.w1[experts, hidden])
            block.w2.copy_(src.w2[experts, :, hidden])
            block.w3.copy_(src.w3[experts, hidden])
    for name in ("w1", "w2", "w3"):
        getattr(block, name).requires_grad_(getattr(src, name).requires_grad)
    return block


class SharedExperts(nn.Module):
    """A dense SwiGLU FFN: ``w1.weight`` (H, D), ``w2.weight`` (D, H), ``w3.weight`` (H, D)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x_TD: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        """The FFN of ``x_TD``; ``weights`` (w1, w2, w3) override the parameters."""
        return swiglu(x_TD, *(weights or (self.w1.weight, self.w2.weight, self.w3.weight)))


def grouped_swiglu(
    routed: RoutedTokens, w1_eFD: torch.Tensor, w2_eDF: torch.Tensor, w3_eFD: torch.Tensor,
    later: Optional[LaterWgrad] = None,
) -> torch.Tensor:
    """``y_RD`` for the routed rows: three grouped GEMMs with the device offsets (``later``: the up-projection's
    weight gradients come from that anchor, ``GroupedExperts.later_wgrad``).

    A rank whose slice of the hidden dim is empty (tensor-parallel experts with ``F < n`` or ``F % n`` leaving the last
    ranks none, by the chunk rule) contributes zeros, through GEMMs with an empty inner dim, so its weights and rows
    still get (zero) gradients and every backward collective runs.
    """
    x_RD, offs, sizes = routed.x_RD, routed.group_offsets, routed.group_sizes
    if w1_eFD.shape[1] == 0:
        D = x_RD.shape[1]
        h_R0 = F.silu(x_RD @ w1_eFD.reshape(0, D).T) * (x_RD @ w3_eFD.reshape(0, D).T)
        if routed.weights_R is not None:  # folded weights: in the graph too (zero gradient, but a backward runs)
            h_R0 = h_R0 * routed.weights_R.to(h_R0.dtype).unsqueeze(1)
        return h_R0 @ w2_eDF.transpose(1, 2).reshape(0, D)
    h13_R2F = grouped_mm_pair(x_RD, w1_eFD, w3_eFD, offs, sizes, later)
    valid = routed.valid_rows
    assert valid is not None
    # copies_TK: GroupedExperts.forward sums each token's copies next, whose backward gives a fresh gradient
    return grouped_mm(swiglu_rows(h13_R2F, valid, routed.weights_R), w2_eDF, offs, sizes,
                      dense_grad=routed.copies_TK is not None)


class _SwiGLURows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h13_R2F: torch.Tensor, valid: torch.Tensor,  # type: ignore[override]
                w_R: Optional[torch.Tensor]) -> torch.Tensor:
        ctx.save_for_backward(h13_R2F, valid, w_R)
        return swiglu_forward(h13_R2F, valid, w_R)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, g_RF: torch.Tensor) -> Any:  # type: ignore[override]
        h13_R2F, valid, w_R = ctx.saved_tensors
        d13, dw = swiglu_backward(g_RF.contiguous(), h13_R2F, valid, w_R)
        return d13, None, (dw.to(w_R.dtype) if w_R is not None and ctx.needs_input_grad[2] else None)


def swiglu_rows(h13_R2F: torch.Tensor, valid: torch.Tensor, w_R: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``w * silu(h1) * h3`` from ``h13 = [h1 | h3]`` on rows ``[0, valid)`` (a device count;
    :mod:`spmdmoe.kernels.swiglu`), fp32 math rounded once; ``w_R``: each row's routing weight (the
    combine's, folded in; ``None``: 1). The weight's gradient is the row dot of the output gradient with the
    unweighted SwiGLU, recomputed in the backward (no division by a weight, which can be 0). Rows past
    ``valid`` are unspecified and get unspecified gradients nobody reads."""
    if torch.is_grad_enabled() and (h13_R2F.requires_grad or (w_R is not None and w_R.requires_grad)):
        return _SwiGLURows.apply(h13_R2F, valid, w_R)
    return swiglu_forward(h13_R2F, valid, w_R)


def swiglu(x_TD: torch.Tensor, w1_FD: torch.Tensor, w2_DF: torch.Tensor, w3_FD: torch.Tensor) -> torch.Tensor:
    """The dense SwiGLU FFN of the shared experts."""
    return F.linear(F.silu(F.linear(x_TD, w1_FD)) * F.linear(x_TD, w3_FD), w2_DF)
