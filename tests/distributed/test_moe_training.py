"""Training semantics of the parallel MoE: micro-batch accumulation, activation checkpointing,
the aux-loss-free bias update, host syncs, and the public gradient helpers.

References are single-device runs on every rank from the same seeds; fp32
tolerance ``rtol = 1e-5, atol = 1e-5 * max|reference|`` (see test_moe_parity).
"""

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

import spmdmoe
from moe_plans import PLANS, build_plan, expert_grad_slice, reference_moe, summed_over
from spmdmoe import SPMDTensor
from spmdmoe.collectives import host_sync_count
from spmdmoe.moe import MoEConfig, replicate_grads, sync_grads
from spmdmoe.testing import assert_close_everywhere, reference_tensor
from spmdmoe.types import layout

D, F, E = 16, 16, 8
CFG = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=2, num_shared_experts=1, load_balance_coeff=1e-2)


def close(actual, expected, name, rtol=1e-5):
    atol = rtol * max(float(expected.detach().abs().max()) if expected.numel() else 0.0, 1e-30)
    assert_close_everywhere(actual.detach(), expected.detach(), rtol=rtol, atol=atol, name=name)


def _local(y):
    return y.local if isinstance(y, SPMDTensor) else y


def _check_grads(plan, moe, name=""):
    ref = dict(moe.named_parameters())
    for n, p in plan.layer.named_parameters():
        want = expert_grad_slice(n, ref[n].grad, plan) if n.startswith("experts.") else ref[n].grad
        got = p.grad if n.startswith("experts.") else summed_over(p.grad, plan.dp_group)
        close(got, want, f"{name}{n} gradient")


@pytest.mark.parametrize("plan_name", PLANS)
def test_gradient_accumulation_over_micro_batches(world, device, request, plan_name):
    """Two backward passes accumulate exactly: only the fresh gradient is reduced each time."""
    moe = reference_moe(CFG, 1, device)
    batches = [(reference_tensor((13, D), 10 + i, device=device), reference_tensor((13, D), 20 + i, device=device)) for i in range(2)]
    for X, G in batches:
        (moe(X) * G).sum().backward()
    plan = build_plan(plan_name, moe, 13, world, request)
    for X, G in batches:
        (_local(plan.layer(plan.wrap(X[plan.rows].clone()))) * G[plan.rows]).sum().backward()
    _check_grads(plan, moe, "accumulated ")


SYNC_FREE = {"ep_mode": "sync_free", "max_tokens": 23}
CHECKPOINTED = [("sp_ep", {}), ("gather", {}), ("ep", {}), ("sp_ep", {"ep_mode": "sync_free"}), ("ep", SYNC_FREE)]


@pytest.mark.parametrize("plan_name,options", CHECKPOINTED,
                         ids=[p + ("-sync_free" if o else "") for p, o in CHECKPOINTED])
@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpoint(world, device, request, plan_name, options, reentrant):
    """Recompute does not count the tokens twice, and the gradients stay exact (both EP transports: the
    recompute runs the dispatch and its exchanges again)."""
    moe = reference_moe(CFG, 2, device)
    X, G = reference_tensor((23, D), 30, device=device), reference_tensor((23, D), 31, device=device)
    leaf_ref = X.clone().requires_grad_()
    (moe(leaf_ref) * G).sum().backward()
    plan = build_plan(plan_name, moe, 23, world, request, **options)
    leaf = X[plan.rows].clone().requires_grad_()
    run = lambda t: _local(plan.layer(plan.wrap(t)))  # noqa: E731
    (checkpoint(run, leaf, use_reentrant=reentrant) * G[plan.rows]).sum().backward()
    close(leaf.grad, leaf_ref.grad[plan.rows], "input gradient under checkpoint")
    _check_grads(plan, moe, "checkpointed ")
    close(plan.layer.expert_load(), moe.tokens_per_expert, "load counted once", 0)


@pytest.mark.parametrize("plan_name", PLANS)
def test_expert_bias_update_is_bitwise_identical(world, device, request, plan_name):
    moe = reference_moe(CFG, 3, device)
    X = reference_tensor((41, D), 40, device=device)
    plan = build_plan(plan_name, moe, 41, world, request)
    for _ in range(3):  # counts are taken by the backward of a training forward
        moe(X).sum().backward()
        _local(plan.layer(plan.wrap(X[plan.rows]))).sum().backward()
        load_ref, load = moe.update_expert_bias(), plan.layer.update_expert_bias()
        close(load, load_ref, "summed load", 0)
        assert int(plan.layer.tokens_per_expert.sum()) == 0
    bias = plan.layer.expert_bias
    everyone = [torch.empty_like(bias) for _ in range(world.size())]
    dist.all_gather(everyone, bias)
    same = all(torch.equal(b, bias) for b in everyone) and torch.equal(bias, moe.expert_bias)
    flags = torch.tensor([0 if same else 1], device=device)
    dist.all_reduce(flags)
    assert flags.item() == 0 and bias.abs().sum() > 0, "expert_bias differs between ranks or from the single-device update"


def test_ep_dispatch_makes_exactly_one_host_sync(world, device, request):
    moe = reference_moe(CFG, 4, device)
    plan = build_plan("sp_ep", moe, 50, world, request)
    x = plan.wrap(reference_tensor((50, D), 50, device=device)[plan.rows].clone().requires_grad_())
    before = host_sync_count()
    y = plan.layer(x)
    middle = host_sync_count()
    y.local.sum().backward()
    assert (middle - before, host_sync_count() - middle) == (1, 0)


def test_sync_grads_and_replicate_grads_match_single_device(world, device):
    """The public helpers: an SP-replicated Linear used on each rank's rows gets the full gradient."""
    torch.manual_seed(0)
    ref = torch.nn.Linear(D, 3).to(device)
    X = reference_tensor((11, D), 60, device=device)
    (ref(X) ** 2).sum().backward()
    n, r = world.size(), world.get_local_rank()
    rows = slice(layout.chunk_offset(11, n, r), layout.chunk_offset(11, n, r) + layout.local_tokens(11, n, r))
    lin = replicate_grads(torch.nn.Linear(D, 3).to(device), world)
    lin.load_state_dict(ref.state_dict())
    for _ in range(2):  # accumulation stays exact
        (lin(X[rows]) ** 2).sum().backward()
    close(lin.weight.grad, 2 * ref.weight.grad, "replicate_grads weight")
    close(lin.bias.grad, 2 * ref.bias.grad, "replicate_grads bias")
    assert [name for name, _ in lin.named_parameters()] == ["weight", "bias"]
    w0 = ref.weight.detach().clone().requires_grad_()
    (want,) = torch.autograd.grad((torch.nn.functional.linear(X, w0) ** 2).sum(), w0)
    w = torch.nn.Parameter(ref.weight.detach().clone())
    (v,) = sync_grads([w], world)
    (torch.nn.functional.linear(X[rows], v) ** 2).sum().backward()
    close(w.grad, want, "sync_grads")
