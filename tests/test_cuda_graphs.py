"""The MoE layer's forward and backward captured in ONE CUDA graph and replayed with new routing.

A layer that syncs the host cannot be captured (capture fails on any synchronizing call), and one
that sizes a buffer from the data would replay stale shapes: every replay here is compared with the
same layer run eagerly on the same input and bias (outputs, input gradient, every parameter
gradient; bitwise, as the same kernels run). Replays: balanced routing, a skewed bias, an expert with
no rows, all tokens on two experts, then balanced again. The sync-free EP transport is captured the
same way in ``tests/distributed/test_cuda_graphs.py`` (2+ GPUs, NCCL).

A captured step must also follow the weights: after ``optimizer.step()`` (eager, between replays) the
next replay computes with the new weights, bitwise equal to eager; with FP8 experts that needs the weight
cache to decide on the device whether to re-quantize (``spmdmoe.moe.experts.fp8_cache``): before it, a replay kept
the weights quantized at capture (0.67 max abs off on an H200).

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


def _setup(precision: str, seed: int, **options):
    """The layer to capture, an eager twin with the same weights, the static input and output gradient."""
    if precision == "fp8_rowwise" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("FP8 experts: sm90+")
    torch.manual_seed(seed)
    cfg = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=K, expert_precision=precision, **options)
    layer = MoE(cfg).cuda().to(torch.bfloat16)
    static_x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    static_g = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    return layer, copy.deepcopy(layer), static_x, static_g


def _assert_replay_is_eager(i: int, layer: MoE, static_x, static_y, eager: MoE, step) -> None:
    """The replayed output and gradients equal eager's on the same input, bit for bit."""
    eager.zero_grad(set_to_none=True)
    xe = static_x.detach().clone().requires_grad_()
    want = [step(eager, xe).detach()] + _grads(eager, xe)
    got = [static_y] + _grads(layer, static_x)
    for k, (a, b) in enumerate(zip(got, want)):
        assert a is not None and torch.equal(a, b), (i, k, (a.float() - b.float()).abs().max())


@pytest.mark.parametrize("precision", ["bf16", "fp8_rowwise"])
def test_layer_forward_and_backward_replay_with_new_routing(precision):
    layer, eager, static_x, static_g = _setup(precision, 0, num_shared_experts=1, aux_loss_coeff=0.01)

    def step(m: MoE, x: torch.Tensor) -> torch.Tensor:
        y = m(x)
        ((y * static_g).sum() + m.aux_loss).backward()
        return y

    graph, static_y = capture_training_step(lambda: step(layer, static_x), layer, static_x)
    for i, bias in enumerate(_biases()):
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(i))
        with torch.no_grad():
            static_x.copy_(x)
            layer.expert_bias.copy_(bias)
            eager.expert_bias.copy_(bias)
        graph.replay()
        _assert_replay_is_eager(i, layer, static_x, static_y, eager, step)


@pytest.mark.parametrize("precision", ["bf16", "fp8_rowwise"])
def test_replays_after_optimizer_steps_use_the_new_weights(precision):
    layer, eager, static_x, static_g = _setup(precision, 1)
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)  # in place on the parameters the graph reads

    def step(m: MoE, x: torch.Tensor) -> torch.Tensor:
        y = m(x)
        (y * static_g).sum().backward()
        return y

    graph, static_y = capture_training_step(lambda: step(layer, static_x), layer, static_x)
    for i in range(4):
        if i:
            opt.step()  # eager, outside the graph: the next replay must see the new weights
        graph.replay()
        eager.load_state_dict(layer.state_dict())
        _assert_replay_is_eager(i, layer, static_x, static_y, eager, step)


def test_reduce_overhead_compile_of_the_layer_replays_with_new_routing():
    """The one flag: ``torch.compile(layer, mode="reduce-overhead", fullgraph=True)`` runs the forward and backward
    as CUDA graphs (inductor skips none: no host read, no CPU tensor, static shapes) and follows new routing and
    new inputs from replay to replay, eager's values within bf16 rounding (inductor fuses the reference ops
    differently: ``2e-2`` of the largest magnitude, as the other compiled tests)."""
    from torch._dynamo.utils import counters

    layer, eager, _, static_g = _setup("bf16", 2, num_shared_experts=1)
    torch._dynamo.reset()
    counters.clear()
    run = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
    for i, bias in enumerate(_biases()):
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(i))
        with torch.no_grad():
            layer.expert_bias.copy_(bias)
            eager.expert_bias.copy_(bias)
        got, want = [], []
        for m, f, out in ((layer, run, got), (eager, eager, want)):
            m.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_()
            y = f(xi)
            (y * static_g).sum().backward()
            out += [y.detach().clone(), xi.grad.clone()] + [p.grad.clone() for _, p in sorted(m.named_parameters())]
        for k, (a, b) in enumerate(zip(got, want)):
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2 * max(float(b.abs().max()), 1e-6),
                                       msg=lambda m: f"replay {i}, item {k}: {m}")
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
