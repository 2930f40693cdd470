"""``torch.compile`` of the EP layer, beyond the plan-by-plan comparison of ``test_compile_moe.py``: torch's
default compile (static sizes first), and what the compiled sync transport allocates. A file of its own, so
the NCCL run (``benchmarks/gpu_session.sh``) gives it a ``torchrun`` beside the plans' (inductor compiles
dominate both files' time)."""

import pytest
import torch

from moe_plans import build_plan, reference_moe
from spmdmoe.moe import MoEConfig
from spmdmoe.testing import reference_tensor
from test_compile_moe import D, STEPS, SYNC_FREE, _compare, _step


@pytest.mark.compile_matrix
@pytest.mark.parametrize("options", [{}, SYNC_FREE], ids=["sync", "sync_free"])
def test_compiled_ep_with_torchs_default_shapes(world, device, request, options):
    """``torch.compile``'s default (``dynamic=None``): the first graph has static sizes (inductor on CUDA
    could not generate code for the EP positions' scan at static sizes, torch 2.11: issue 41), a second
    one dynamic sizes, at most one more when a rank first sees its rows and ``T`` change."""
    _compare("ep", options, None, world, device, request, max_graphs=3)


@pytest.mark.compile_matrix
@torch._dynamo.config.patch(capture_scalar_outputs=True)  # restored after the test
def test_compiled_sync_ep_zero_fills_no_row_buffer(world, device, request):
    """The sync EP transport's buffers are sized by the exchanged counts (data-dependent under compile) and
    every row of them is written: the dedup send buffer (a token to a rank once) and the experts' copies (at
    most ``K`` per received row). The transport states both bounds (``torch._check``), so no traced op
    zero-fills a 2-D buffer (any width) with that many rows, forward or backward (the fan-outs' fills took
    2.5 ms of GPU time per EP 4 step at 16k tokens on H100s before: issue 41). bf16, so the grouped GEMM is
    torch's (fp32 under compile takes a masked loop that zero-fills its output)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    fills = {torch.ops.aten.zeros.default, torch.ops.aten.new_zeros.default, torch.ops.aten.full.default,
             torch.ops.aten.zeros_like.default, torch.ops.aten.zero_.default, torch.ops.aten.fill_.Scalar,
             torch.ops.aten.new_full.default}
    found = []

    def keep(gm, example_inputs):
        for node in gm.graph.nodes:
            val = node.meta.get("val")
            if (node.target in fills and isinstance(val, torch.Tensor) and val.dim() == 2
                    and free_unbacked_symbols(val.shape[0])):
                found.append(f"{node.format_node()} (rows {val.shape[0]})")
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    cfg = MoEConfig(dim=D, hidden_dim=16, num_experts=8, top_k=2)
    moe = reference_moe(cfg, 9, device, dtype=torch.bfloat16)
    layer = build_plan("ep", moe, STEPS[0], world, request).layer
    run = torch.compile(layer, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep), fullgraph=True,
                        dynamic=True)
    X = reference_tensor((STEPS[0], D), 11, device=device).to(torch.bfloat16)
    G = reference_tensor((STEPS[0], D), 12, device=device).to(torch.bfloat16)
    _step(build_plan("ep", moe, STEPS[0], world, request, layer=layer), run, X, G)
    torch._dynamo.reset()
    assert not found, "zero-filled buffers with a data-dependent row count:\n" + "\n".join(found)
