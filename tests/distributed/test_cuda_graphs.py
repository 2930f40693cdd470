"""Sync-free EP captured in ONE CUDA graph (forward and backward) and replayed with new routing (NCCL).

The layer (``ep_mode="sync_free"``; ``max_tokens`` set where EP is not the SP axis) is captured once
and replayed 5 times with new inputs and biases: balanced, skewed, an expert with no rows, every token
on two experts (one rank's), and a rank that sends nothing (all its tokens routed to its own
experts: its peers receive no rows from it). Each replay is compared with the same step run eagerly
by the sync transport (outputs, input and every parameter gradient: bitwise, as the experts see the
same rows in the same order), on uneven per-rank token counts under the same ``T_max``. With a
capacity factor, an overflowing replay raises ``SPMDCapacityError`` on every rank from the check after
it. Skipped on gloo (CPU), where no CUDA graph exists; the same logic runs eagerly there
(``test_sync_free.py``).
"""

import copy

import pytest
import torch

from moe_plans import build_plan, reference_moe
from spmdmoe import SPMDCapacityError, SPMDTensor
from spmdmoe.moe import MoEConfig
from spmdmoe.testing import assert_raises_everywhere, capture_training_step, reference_tensor

D, F, E, TOTAL = 64, 32, 8, 301


def _biases(n: int, rank: int) -> list[torch.Tensor]:
    e = E // n
    skew, idle, two, own = torch.zeros(E), torch.zeros(E), torch.full((E,), -1e4), torch.full((E,), -1e4)
    skew[:2] = 0.5
    idle[3] = -1e4
    two[:2] = 1e4
    own[rank * e:(rank + 1) * e] = 1e4  # each rank's tokens stay home: no rows to its peers
    return [torch.zeros(E), skew, idle, two, own]


def _capture(layer, x_in, leaf, g):
    def step():
        y = layer(x_in)
        y = y.local if isinstance(y, SPMDTensor) else y
        (y.float() * g).sum().backward()
        return y

    return capture_training_step(step, layer, leaf)


@pytest.mark.parametrize("rows", ["symmetric", "all_to_all"])
@pytest.mark.parametrize("plan_name", ["sp_ep", "ep"])
def test_graphed_sync_free_layer_matches_the_sync_transport(world, device, request, monkeypatch, plan_name, rows):
    """Both sync-free transports: the symmetric-memory one (one host) and the padded all-to-all
    (``SPMDMOE_EP_SYMMETRIC=0``, the transport of several hosts)."""
    if device.type != "cuda":
        pytest.skip("CUDA graphs need NCCL on GPUs")
    if rows == "all_to_all":
        monkeypatch.setenv("SPMDMOE_EP_SYMMETRIC", "0")
    cfg = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=2, num_shared_experts=1)
    dtype = torch.bfloat16  # fp32 on CUDA syncs in torch's grouped GEMM (tests/test_cuda_graphs.py)
    moe = reference_moe(cfg, 0, device, dtype)
    options = {"ep_mode": "sync_free"} | ({"max_tokens": TOTAL} if plan_name == "ep" else {})
    plan = build_plan(plan_name, moe, TOTAL, world, request, **options)
    synced = copy.deepcopy(plan.layer)
    synced.set_ep_mode("sync")
    leaf = torch.zeros(plan.rows.stop - plan.rows.start, D, device=device, dtype=dtype, requires_grad=True)
    x_in = plan.wrap(leaf)  # from_local's agreement (a host read) stays outside the graph
    g = reference_tensor((TOTAL, D), 3, device=device)[plan.rows]
    graph, static_y = _capture(plan.layer, x_in, leaf, g)
    for i, bias in enumerate(_biases(world.size(), world.get_local_rank())):
        X = reference_tensor((TOTAL, D), 10 + i, device=device, dtype=dtype)
        with torch.no_grad():
            leaf.copy_(X[plan.rows])
            plan.layer.expert_bias.copy_(bias)
            synced.expert_bias.copy_(bias)
        graph.replay()
        synced.zero_grad(set_to_none=True)
        ref_leaf = X[plan.rows].clone().requires_grad_()
        y = synced(plan.wrap(ref_leaf))
        y = y.local if isinstance(y, SPMDTensor) else y
        (y.float() * g).sum().backward()
        got = [static_y, leaf.grad] + [p.grad for _, p in sorted(plan.layer.named_parameters())]
        want = [y.detach(), ref_leaf.grad] + [p.grad for _, p in sorted(synced.named_parameters())]
        for k, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), (i, k, (a.float() - b.float()).abs().max())
    plan.layer.check_capacity()  # lossless: never overflows


def test_graphed_overflow_raises_on_every_rank(world, device, request):
    if device.type != "cuda":
        pytest.skip("CUDA graphs need NCCL on GPUs")
    cfg = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=2)
    plan = build_plan("sp_ep", reference_moe(cfg, 1, device, torch.bfloat16), TOTAL, world, request, ep_mode="sync_free",
                      capacity_factor=1.0)
    leaf = torch.zeros(plan.rows.stop - plan.rows.start, D, device=device, dtype=torch.bfloat16, requires_grad=True)
    graph, _ = _capture(plan.layer, plan.wrap(leaf), leaf, reference_tensor((TOTAL, D), 4, device=device)[plan.rows])
    plan.layer.transport.overflow.zero_()  # whatever the warm-up's random routing did: start afresh
    with torch.no_grad():
        leaf.copy_(reference_tensor((TOTAL, D), 5, device=device, dtype=torch.bfloat16)[plan.rows])
        plan.layer.expert_bias.zero_()
        plan.layer.expert_bias[:2] = 1e4  # every token to rank 0's experts
    graph.replay()
    assert_raises_everywhere(SPMDCapacityError, plan.layer.check_capacity, match="EP capacity exceeded")
