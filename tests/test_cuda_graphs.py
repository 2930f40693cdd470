"""The MoE layer's forward and backward captured in ONE CUDA graph and replayed with new routing.

A layer that syncs the host cannot be captured (capture fails on any synchronizing call), and one
that sizes a buffer from the data would replay stale shapes: every replay here is compared with the
same layer run eagerly on the same input and bias (outputs, input gradient, every parameter
gradient; bitwise, as the same kernels run). Replays: balanced routing, a skewed bias, an expert with
no rows, all tokens on two experts, then balanced again. The sync-free EP transport is captured the
same way in ``tests/distributed/test_cuda_graphs.py`` (2+ GPUs, NCCL).

bf16 (and FP8 experts) only: torch 2.11's grouped GEMM copies its offsets to the host for fp32 on
CUDA (measured: capture fails with "Cannot copy between CPU and CUDA tensors during CUDA graph
capture" inside ``torch._grouped_mm``), so an fp32 layer on CUDA syncs there and cannot be captured.
"""

from __future__ import annotations

import copy

import pytest
import torch

from spmdmoe.moe import MoE, MoEConfig
from spmdmoe.testing import capture_training_step

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

D, F, E, K, T = 256, 128, 8, 2, 301


def _biases() -> list[torch.Tensor]:
    skew, idle, two = torch.zeros(E), torch.zeros(E), torch.full((E,), -1e4)
    skew[:2] = 0.5
    idle[3] = -1e4
    two[5:7] = 1e4
    return [torch.zeros(E), skew, idle, two, torch.zeros(E)]


def _grads(layer: MoE, x: torch.Tensor) -> list[torch.Tensor]:
    return [x.grad] + [p.grad for _, p in sorted(layer.named_parameters())]


@pytest.mark.parametrize("precision", ["bf16", "fp8_rowwise"])
def test_layer_forward_and_backward_replay_with_new_routing(precision):
    if precision == "fp8_rowwise" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("FP8 experts: sm90+")
    dtype = torch.bfloat16
    torch.manual_seed(0)
    cfg = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=K, num_shared_experts=1, aux_loss_coeff=0.01,
                    expert_precision=precision)
    layer = MoE(cfg).cuda().to(dtype)
    eager = copy.deepcopy(layer)
    static_x = torch.randn(T, D, device="cuda", dtype=dtype, requires_grad=True)
    static_g = torch.randn(T, D, device="cuda", dtype=dtype)

    def step(m: MoE, x: torch.Tensor) -> torch.Tensor:
        y = m(x)
        ((y * static_g).sum() + m.aux_loss).backward()
        return y

    graph, static_y = capture_training_step(lambda: step(layer, static_x), layer, static_x)
    for i, bias in enumerate(_biases()):
        x = torch.randn(T, D, device="cuda", dtype=dtype, generator=torch.Generator("cuda").manual_seed(i))
        with torch.no_grad():
            static_x.copy_(x)
            layer.expert_bias.copy_(bias)
            eager.expert_bias.copy_(bias)
        graph.replay()
        eager.zero_grad(set_to_none=True)
        xe = x.clone().requires_grad_()
        want = [step(eager, xe).detach()] + _grads(eager, xe)
        got = [static_y] + _grads(layer, static_x)
        for k, (a, b) in enumerate(zip(got, want)):
            assert a is not None and torch.equal(a, b), (i, k, (a.float() - b.float()).abs().max())
