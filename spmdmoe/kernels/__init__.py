"""Triton kernels, each beside a plain-torch reference with the same signature (docs/design.md §7).

One module per kernel: the ``@triton.jit`` kernel, its launcher (a
``torch.library.triton_op``, so ``torch.compile(fullgraph=True)`` traces it),
the reference, and a dispatching function (Triton on CUDA, the reference
elsewhere; :mod:`spmdmoe.kernels.backend`).

* :func:`fan_out`: rows into ``J`` copies each (dispatch permute; combine backward);
* :func:`gather_sum`: the fp32 sum of ``J`` rows each, optionally weighted (combine; permute backward);
* :func:`expert_order`: each routed copy's row in a stable expert-major buffer, the groups' ends, the counts;
* :func:`topk_route` / :func:`topk_route_backward`: top-k routing from the gate logits (scores, choice, weights,
  counts, the non-finite flag) in one launch, and its backward in one;
* :func:`overflow_record`: the sync-free EP transports' worst demand since the last check, kept on the device;
* :func:`swiglu_forward` / :func:`swiglu_backward`: offset-aware SwiGLU over the valid rows only;
* :func:`swiglu_quant_forward` / :func:`swiglu_quant_backward`: SwiGLU (backward) fused with the rowwise FP8 of its result;
* :func:`quantize_rows`: rowwise FP8 scale+cast in one pass, valid rows only;
* :func:`quantize_cols_pair`: the two wgrad operands' per-group columnwise FP8, 16-row aligned, a hot expert split across programs;
* :func:`quantize_weight_pair`: both FP8 layouts of a 3-D weight (rowwise, and its transpose without a
  transposing copy) from two reads;
* :func:`quantize_weight_pair_into`: the same into given tensors, gated by a device flag (the FP8 weight cache);
* :func:`fingerprint_`: a content fingerprint of tensors compared on the device (the FP8 weight cache's check).
* ``peer_rows.pull_rows`` / ``pull_sum``: rows read from the peers' mapped buffers (the symmetric-memory EP
  transport, ``spmdmoe.moe.transports.symmetric``). The exception to the rule above: one module for the two reads, each the
  other's backward, with plain launchers (no ``triton_op``), called only inside that module's custom ops.
"""

from .backend import COMPILED, kernel_backend, set_kernel_backend, use_triton
from .expert_order import expert_order, expert_order_reference, expert_order_triton
from .fan_out import fan_out, fan_out_fp8, fan_out_fp8_reference, fan_out_fp8_triton, fan_out_reference, fan_out_triton
from .fingerprint import fingerprint_, fingerprint_reference, fingerprint_triton
from .fp8_cols import quantize_cols_pair, quantize_cols_pair_reference, quantize_cols_pair_triton
from .fp8_rows import quantize_rows, quantize_rows_reference, quantize_rows_triton
from .fp8_weights import (
    quantize_weight_pair,
    quantize_weight_pair_into,
    quantize_weight_pair_reference,
    quantize_weight_pair_triton,
)
from .gather_sum import gather_sum, gather_sum_reference, gather_sum_triton
from .overflow_record import overflow_record, overflow_record_reference, overflow_record_triton
from .topk_route import (
    topk_route,
    topk_route_backward,
    topk_route_backward_reference,
    topk_route_backward_triton,
    topk_route_reference,
    topk_route_triton,
)
from .swiglu_fp8 import (
    swiglu_quant_backward_,
    swiglu_quant_backward_inplace_reference,
    swiglu_quant_backward_inplace_triton,
    swiglu_quant_backward,
    swiglu_quant_backward_reference,
    swiglu_quant_backward_triton,
    swiglu_quant_forward,
    swiglu_quant_forward_reference,
    swiglu_quant_forward_triton,
)
from .swiglu import (
    swiglu_backward,
    swiglu_backward_reference,
    swiglu_backward_triton,
    swiglu_forward,
    swiglu_forward_reference,
    swiglu_forward_triton,
)

__all__ = [
    "COMPILED", "kernel_backend", "set_kernel_backend", "use_triton",
    "fan_out", "fan_out_fp8", "fan_out_fp8_reference", "fan_out_fp8_triton", "fan_out_reference", "fan_out_triton",
    "gather_sum", "gather_sum_reference", "gather_sum_triton",
    "expert_order", "expert_order_reference", "expert_order_triton",
    "overflow_record", "overflow_record_reference", "overflow_record_triton",
    "topk_route", "topk_route_reference", "topk_route_triton",
    "topk_route_backward", "topk_route_backward_reference", "topk_route_backward_triton",
    "swiglu_forward", "swiglu_forward_reference", "swiglu_forward_triton",
    "swiglu_backward", "swiglu_backward_reference", "swiglu_backward_triton",
    "swiglu_quant_forward", "swiglu_quant_forward_reference", "swiglu_quant_forward_triton",
    "swiglu_quant_backward", "swiglu_quant_backward_reference", "swiglu_quant_backward_triton",
    "swiglu_quant_backward_", "swiglu_quant_backward_inplace_reference", "swiglu_quant_backward_inplace_triton",

    "quantize_rows", "quantize_rows_reference", "quantize_rows_triton",
    "quantize_cols_pair", "quantize_cols_pair_reference", "quantize_cols_pair_triton",
    "quantize_weight_pair", "quantize_weight_pair_into", "quantize_weight_pair_reference",
    "quantize_weight_pair_triton",
    "fingerprint_", "fingerprint_reference", "fingerprint_triton",
]
