"""``torch.compile(fullgraph=True)`` of a block holding the MoE layer (one process), against eager.

A residual block (``x + moe(proj(x))``) is built twice with the same
weights; one copy runs eager, the other compiled (inductor, and ``aot_eager``).
Over token counts that change from step to step the compiled block must give
the eager outputs and gradients (fp32: ``rtol = atol = 1e-5``, the compiled
fp32 grouped GEMM is a masked loop and inductor fuses differently), compile
one graph (``dynamic=True``; torch's default automatic dynamic shapes compile
at most one more, at the first change), count the load once per step, and
count it once under activation checkpointing too (the recompute runs the
forward again; the counts are added by the backward), and trace the block once (no second attempt: under
``dynamic=True`` a Python test of a config float made Dynamo specialise it and trace everything again).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch.utils.checkpoint import checkpoint

from spmdmoe.moe import MoE, MoEConfig

STEPS = [13, 9, 2, 17, 5]
D = 16


class Block(nn.Module):
    def __init__(self, checkpointed: bool = False, route_scale: float = 1.0):
        super().__init__()
        self.norm = nn.Linear(D, D, bias=False)  # a dense op before the layer (its gradient crosses it)
        self.moe = MoE(MoEConfig(dim=D, hidden_dim=8, num_experts=4, top_k=2, num_shared_experts=1,
                                 aux_loss_coeff=0.01, load_balance_coeff=1e-3, route_scale=route_scale))
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            return x + checkpoint(self.moe, self.norm(x), use_reentrant=False)
        return x + self.moe(self.norm(x))


def _graphs() -> int:
    return len(_debug_get_cache_entry_list(Block.forward.__code__))


def _run(block: nn.Module, fn, total: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    p = next(block.parameters())
    x = torch.randn(total, D, generator=gen).to(p.device, p.dtype).requires_grad_()
    g = torch.randn(total, D, generator=gen).to(p.device, p.dtype)
    block.zero_grad(set_to_none=True)
    y = fn(x)
    ((y * g).sum() + block.moe.aux_loss).backward()
    return [y.detach(), x.grad, block.moe.aux_loss.detach()] + [p.grad for p in block.parameters()]


# dynamic=True (one graph for every T) is taken with checkpointing; the plain block with torch's default shapes
@pytest.mark.parametrize("backend,dynamic,checkpointed,route_scale", [
    ("aot_eager", None, False, 1.0), ("aot_eager", True, True, 2.5),
    # inductor on CPU (its C++ build: 40 s on 2 cores) with the compile matrix; on CUDA the test below
    pytest.param("inductor", True, False, 2.5, marks=pytest.mark.compile_matrix),
])
def test_compiled_block_matches_eager(backend, dynamic, checkpointed, route_scale):
    torch._dynamo.reset()
    # the layer sets aux_loss and records problem bits in its forward: under compile, checkpointing needs
    # leave not to replay those side effects in the recompute (replaying them changes nothing: the
    # recompute's aux_loss is unused, the bits are OR-ed, the counts are added by the backward)
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=checkpointed):
        _compare(backend, dynamic, checkpointed, route_scale=route_scale)


def _retraces() -> int:
    """How many times Dynamo has restarted a frame's analysis so far (a second, third ... attempt)."""
    return sum(len(v) for k, v in torch._dynamo.utils.compilation_time_metrics.items()
               if k.startswith("compile_attempt_") and k != "compile_attempt_0")


def _compare(backend, dynamic, checkpointed, device="cpu", dtype=torch.float32, tol=1e-5, route_scale=1.0):
    torch.manual_seed(0)
    retraces = _retraces()
    eager = Block(checkpointed, route_scale).to(device=device, dtype=dtype)
    compiled = copy.deepcopy(eager)
    run = torch.compile(compiled, backend=backend, fullgraph=True, dynamic=dynamic)
    for i, total in enumerate(STEPS):
        want = _run(eager, eager, total, i)
        got = _run(compiled, run, total, i)
        for k, (a, b) in enumerate(zip(got, want)):
            atol = tol * max(float(b.abs().max()), 1.0)
            torch.testing.assert_close(a, b, rtol=tol, atol=atol, msg=lambda m: f"step {i} (T={total}) item {k}: {m}")
        assert torch.equal(compiled.moe.tokens_per_expert, eager.moe.tokens_per_expert)
        # counted once per step: T tokens x top-k copies each
        assert int(compiled.moe.tokens_per_expert.sum()) == 2 * sum(STEPS[: i + 1])
        # T = 2 may specialise (0 and 1 do), so the default mode may compile for it too
        limit = 1 if dynamic else 3
        assert _graphs() <= limit, f"step {i} (T={total}): {_graphs()} graphs"
    assert _retraces() == retraces, "Dynamo traced the block twice (a restarted analysis: TORCH_LOGS=dynamo says why)"
    eager.moe.update_expert_bias()
    compiled.moe.update_expert_bias()
    assert torch.equal(compiled.moe.expert_bias, eager.moe.expert_bias)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_block_on_cuda_with_inductor():
    """bf16 on the GPU, inductor with the Triton kernels: one graph for every T, eager's values within bf16
    rounding (``2e-2`` of the largest magnitude), the same load counts."""
    torch._dynamo.reset()
    _compare("inductor", True, False, device="cuda", dtype=torch.bfloat16, tol=2e-2)


def test_compiled_up_projection_reads_packed_weights_without_copy():
    """Under compile (bf16: torch's grouped GEMM) the up-projection reads ``[w1 | w3]`` as a view of their
    shared storage, as eager does: no ``cat`` of the weights in the forward graph (it cost a 0.7 GB copy per
    step at E=64). ``unpack()`` changes the parameters' strides, so Dynamo recompiles and the new graph
    concatenates; the outputs and gradients equal eager's before and after, within bf16 rounding (``2e-2`` of
    the largest magnitude: ``aot_eager`` decomposes some of the router's ops)."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    torch._dynamo.reset()
    torch.manual_seed(0)
    moe = MoE(MoEConfig(dim=D, hidden_dim=8, num_experts=4, top_k=2)).to(torch.bfloat16)
    eager = copy.deepcopy(moe)
    backend = AotEagerAndRecordGraphs()
    run = torch.compile(moe, backend=backend, fullgraph=True, dynamic=True)

    def weight_cats(graph: torch.fx.GraphModule) -> int:
        return sum(1 for n in graph.graph.nodes if n.target is torch.ops.aten.cat.default
                   and any(getattr(a, "op", None) == "placeholder" for a in n.args[0]))

    for step in range(3):
        if step == 2:
            moe.experts.unpack()
            eager.experts.unpack()
        x = torch.randn(11 + step, D).bfloat16()
        outs = []
        for module, fn in ((moe, run), (eager, eager)):
            module.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_()
            y = fn(xi)
            y.float().square().sum().backward()
            outs.append([y, xi.grad, *(p.grad for p in module.parameters())])
        for k, (a, b) in enumerate(zip(*outs)):
            atol = 2e-2 * max(float(b.abs().max()), 1.0)
            torch.testing.assert_close(a, b, rtol=2e-2, atol=atol, msg=lambda m: f"step {step} item {k}: {m}")
    first, last = backend.fw_graphs[0], backend.fw_graphs[-1]
    assert len(backend.fw_graphs) == 2
    assert weight_cats(first) == 0 and any(n.target is torch.ops.aten.as_strided.default for n in first.graph.nodes)
    assert weight_cats(last) == 1
