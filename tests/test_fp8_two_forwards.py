"""Two forwards in flight before a backward (pipeline 1F1B, a layer reused in a step, a no-grad forward in
between), for the bf16 and the FP8 experts (both weight-gradient precisions), on CPU and on CUDA.

The FP8 weight cache's refresh runs in every forward and writes the cached tensors that a pending backward
saved. With the weights unchanged it rewrites nothing (the Triton kernels: a closed gate stores nothing; the
CPU reference: the same bytes), and neither writer bumps a version counter, so the first forward's backward
equals, bit for bit, the same computation without the second forward. (Before, the CPU reference's
``copy_`` bumped the counters and that backward raised "modified by an inplace operation".) With the
weights changed in place in between (an optimizer step), the next forward re-quantizes them into the same
tensors; the FP8 node saves the weights for their version counters, so that backward raises, as the bf16
layer's does, eagerly and compiled, instead of using the newer weights.
"""

from __future__ import annotations

import copy

import pytest
import torch

from spmdmoe.moe import MoE, MoEConfig

CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                       reason="needs a CUDA GPU")])
DEVICES = ["cpu", CUDA]
# (expert_precision, fp8_wgrad): the bf16 experts and the FP8 ones with both weight-gradient precisions
PRECISIONS = [("bf16", "auto"), ("fp8_rowwise", "bf16"), ("fp8_rowwise", "fp8")]
D = 64


def _layer(device: str, precision: str, wgrad: str) -> MoE:
    torch.manual_seed(0)
    cfg = MoEConfig(dim=D, hidden_dim=32, num_experts=8, top_k=2, expert_precision=precision, fp8_wgrad=wgrad)
    return MoE(cfg).to(device, torch.bfloat16 if device == "cuda" else torch.float32)


def _inputs(moe: MoE, seed: int, T: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    p = next(moe.parameters())
    gen = torch.Generator().manual_seed(seed)
    x, g = (torch.randn(T, D, generator=gen).to(p.device, p.dtype) for _ in range(2))
    return x.requires_grad_(), g


def _grads(moe: MoE, x: torch.Tensor) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in moe.named_parameters() if p.grad is not None}
    assert {"experts.w1", "experts.w2", "experts.w3"} <= grads.keys()
    return {"x": x.grad.clone(), **grads}


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys(), what
    for name in want:
        diff = (got[name] - want[name]).abs().max()
        assert torch.equal(got[name], want[name]), f"{what}: {name} differs (max {float(diff):.3g})"


@pytest.mark.parametrize("second", ["no_grad", "grad"])
@pytest.mark.parametrize("precision,wgrad", PRECISIONS)
@pytest.mark.parametrize("device", DEVICES)
def test_two_forwards_then_one_backward(device, precision, wgrad, second):
    """``y1 = moe(x1); moe(x2); y1.backward(g1)``: ``y1`` and every gradient as without ``moe(x2)``, bitwise.
    With ``second="grad"`` the second forward keeps its graph and its backward runs last (F1 F2 B1 B2): its
    gradients equal those of ``x2`` alone on a fresh copy, bitwise, too."""
    moe = _layer(device, precision, wgrad)
    ref = copy.deepcopy(moe)  # the same weights, a cache of its own
    (x1, g1), (x2, g2) = _inputs(moe, 1), _inputs(moe, 2)
    r1 = x1.detach().clone().requires_grad_()
    y_ref = ref(r1)
    (y_ref * g1).sum().backward()
    want = _grads(ref, r1)

    y1 = moe(x1)
    if second == "no_grad":
        with torch.no_grad():
            moe(x2)
    else:
        y2 = moe(x2)
    (y1 * g1).sum().backward()
    assert torch.equal(y1, y_ref), "the first output"
    _assert_equal(_grads(moe, x1), want, "the first forward's backward")
    if second == "grad":
        moe.zero_grad(set_to_none=True)
        alone = copy.deepcopy(ref)
        alone.zero_grad(set_to_none=True)
        r2 = x2.detach().clone().requires_grad_()
        (alone(r2) * g2).sum().backward()
        (y2 * g2).sum().backward()
        _assert_equal(_grads(moe, x2), _grads(alone, r2), "the second forward's backward")


@pytest.mark.parametrize("precision,wgrad,compiled", [(*pw, False) for pw in PRECISIONS] + [
    ("bf16", "auto", True), ("fp8_rowwise", "bf16", True)])  # compiled: what is saved is wgrad's either way
@pytest.mark.parametrize("device", DEVICES)
def test_weights_changed_before_the_backward_raise(device, precision, wgrad, compiled):
    """An optimizer step on the experts' weights between a forward and its backward, then a second forward
    (which re-quantizes the FP8 weights into the cache the first one saved): the first backward raises, as in
    the bf16 layer; compiled too (``aot_eager``; the FP8 backward's GEMM takes the weights as an unread input
    so that the compiled backward saves them). Only the experts change: the router's own saved weight would
    raise for it otherwise."""
    torch._dynamo.reset()
    moe = _layer(device, precision, wgrad)
    run = torch.compile(moe, backend="aot_eager", fullgraph=True) if compiled else moe
    opt = torch.optim.SGD(moe.experts.parameters(), lr=0.1)
    (x1, g1), (x2, _) = _inputs(moe, 1), _inputs(moe, 2)
    (run(x1) * g1).sum().backward()  # gradients for the step
    y1 = run(x1)
    opt.step()
    with torch.no_grad():
        run(x2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (y1 * g1).sum().backward()
