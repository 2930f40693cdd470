"""``spmdmoe.clip_grad_norm_``: the single-device norm of the whole model's gradient, the same clip everywhere.

Every rank builds the single-device reference from the same seeds and runs it on all tokens, one forward per
batch of the plan; the loss is the mean over batches of ``sum(y * G)`` over each batch's rows. The parallel
layer runs each rank's rows, then ``reduce_grads`` (the batch axes: EP beside SP, EP alone; a no-op for the
others), then the clip. Checked, for every plan of ``moe_plans.PLANS``:

* the norm (2 and inf) equals ``torch.nn.utils.get_total_norm`` of the reference gradients, fp32,
  ``rtol = 1e-5``, and is the same bits on every rank; also for the experts alone (``model=``). Where a
  rank holds part of the experts (every plan but ``sp``), torch's own per-rank norm differs from it on
  some rank (what this function exists for; checked so that the comparison can fail);
* three SGD steps (``lr = 0.5``) clipped to ``max_norm = 0.05`` (every step's norm is above it, so the
  clip is active) against the same steps on one device with ``torch.nn.utils.clip_grad_norm_``: each
  step's norm and the final weights within ``rtol = 1e-5``, ``atol = 1e-5 * max|reference|``, and every
  replicated weight (dense ones everywhere; experts across the ranks holding the same slice) the same
  bits on every rank that holds it;
* dp: the dp x ep and dp x sp nets of ``test_data_parallel.py`` under DDP, FSDP2 (DTensor gradients, a
  ``dp x ep`` mesh taken as its two axes) and ``reduce_grads``, clipped the same way, against one device;
* a ``None`` gradient on one rank counts as zeros (as in torch), with no hang; parameters without their
  model raise ``TypeError`` on every rank.
"""

import math

import pytest
import torch
import torch.distributed as dist

import spmdmoe
from moe_plans import PLANS, build_plan, expert_grad_slice, reference_moe
from spmdmoe import SPMDTensor
from spmdmoe.moe import MoEConfig, reduce_grads
from spmdmoe.testing import all_ranks_agree, assert_close_everywhere, assert_raises_everywhere, reference_tensor
from test_data_parallel import CFG as DP_CFG, Net, WRAPPERS, _aux, _batches, _data, _full, _plan

D, F, E = 16, 16, 8
CFG = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=2, num_shared_experts=1)
TOTAL = 37
STEPS, LR, MAX_NORM = 3, 0.5, 0.05
RTOL = 1e-5


def _close(actual, expected, name, rtol=RTOL):
    atol = rtol * max(float(expected.detach().abs().max()) if expected.numel() else 0.0, 1e-30)
    assert_close_everywhere(actual.detach(), expected.detach().to(actual.dtype), rtol=rtol, atol=atol, name=name)


def _same_bits(t, name, group=None):
    """``t`` is bitwise the same on every rank of ``group`` (default: the world)."""
    first = t.detach().clone()
    dist.broadcast(first, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    differ = all_ranks_agree(torch.equal(first, t.detach()))
    assert not differ, f"{name}: not the same bits as on the group's first rank, on ranks {differ}"


def _backward(moe, plan, step, device):
    """One step's gradients, on the reference (one forward per batch) and on the plan (its own rows,
    then reduce_grads): both the gradient of the mean over batches of sum(y * G)."""
    X = reference_tensor((TOTAL, D), 1000 + step, device=device)
    G = reference_tensor((TOTAL, D), 2000 + step, device=device)
    n = len(plan.batches)
    sum(((moe(X[rows]) * G[rows]).sum() for rows in plan.batches)).div(n).backward()
    y = plan.layer(plan.wrap(X[plan.rows].clone()))
    ((y.local if isinstance(y, SPMDTensor) else y) * G[plan.rows]).sum().backward()
    reduce_grads(plan.layer)


def _grads(module):
    return [p.grad for p in module.parameters() if p.grad is not None]


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("plan_name", PLANS)
def test_norm_is_the_single_device_norm(world, device, request, plan_name, norm_type):
    moe = reference_moe(CFG, 0, device)
    plan = build_plan(plan_name, moe, TOTAL, world, request)
    _backward(moe, plan, 0, device)
    torch_own = torch.nn.utils.get_total_norm(_grads(plan.layer), norm_type)  # what each rank alone sees
    experts = spmdmoe.clip_grad_norm_(plan.layer.experts.parameters(), 1e9, norm_type, model=plan.layer)
    total = spmdmoe.clip_grad_norm_(plan.layer, 1e9, norm_type)  # far above the norm: nothing changes
    _close(total, torch.nn.utils.get_total_norm(_grads(moe), norm_type), "global norm")
    _close(experts, torch.nn.utils.get_total_norm(_grads(moe.experts), norm_type), "experts' norm")
    _same_bits(total, "global norm")
    if plan_name != "sp" and norm_type == 2.0:  # a rank holding part of the experts: torch's norm is its part's
        want = float(torch.nn.utils.get_total_norm(_grads(moe), norm_type))
        table = [torch.zeros_like(torch_own) for _ in range(dist.get_world_size())]
        dist.all_gather(table, torch_own)
        assert any(not math.isclose(float(t), want, rel_tol=1e-3) for t in table), (table, want)


@pytest.mark.parametrize("plan_name", PLANS)
def test_clipped_training_matches_single_device(world, device, request, plan_name):
    moe = reference_moe(CFG, 0, device)
    plan = build_plan(plan_name, moe, TOTAL, world, request)
    ref_opt = torch.optim.SGD(moe.parameters(), lr=LR)
    opt = torch.optim.SGD(plan.layer.parameters(), lr=LR)
    for step in range(STEPS):
        ref_opt.zero_grad()
        opt.zero_grad()
        _backward(moe, plan, step, device)
        want = torch.nn.utils.clip_grad_norm_(moe.parameters(), MAX_NORM)
        total = spmdmoe.clip_grad_norm_(plan.layer, MAX_NORM)
        assert float(want) > 2 * MAX_NORM, f"step {step}: the norm {float(want)} would not be clipped"
        _close(total, want, f"step {step} norm")
        ref_opt.step()
        opt.step()
    ref = dict(moe.named_parameters())
    experts_group = plan.sp_group if plan.layer.experts.grad_axis is not None else "alone"
    for name, p in plan.layer.named_parameters():
        if name.startswith("experts."):
            _close(p, expert_grad_slice(name, ref[name], plan), f"{name} after {STEPS} clipped steps")
            if experts_group != "alone":  # replicated along SP (local mode): the same bits on each SP rank
                _same_bits(p, name, experts_group)
        else:
            _close(p, ref[name], f"{name} after {STEPS} clipped steps")
            _same_bits(p, name)


def _clipped_reference(device, batches, max_norm):
    """test_data_parallel's single-device run, clipped by torch: (norm per step, parameters, expert_bias)."""
    net = Net(reference_moe(DP_CFG, 3, device), 50).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        for rows, shift in batches:
            X, Y = _data(step, rows, device)
            ((((net(X + shift) - Y) ** 2).sum() / max(rows, 1) + _aux(net.moe)) / len(batches)).backward()
        net.moe.update_expert_bias()
        norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm))
        opt.step()
    return norms, {n: p.detach() for n, p in net.named_parameters()}


@pytest.mark.parametrize("plan, wrapper", [("dp_ep", "ddp"), ("dp_ep", "fsdp2"), ("dp_sp", "ddp"),
                                           ("dp_sp", "fsdp2"), ("dp_sp", "reduce_grads")])
def test_data_parallel_clipped_training(device, plan, wrapper):
    """dp replicas (DDP, reduce_grads) counted once; FSDP2's DTensor shards by their placements."""
    ref_norms, ref_params = _clipped_reference(device, _batches(plan), MAX_NORM)
    net, batch, experts, _ = _plan(plan, device)
    model = WRAPPERS[wrapper](net)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        X, Y, count = batch(step)
        (((model(X) - Y) ** 2).sum() / count + net.moe.aux_loss).backward()
        if wrapper == "reduce_grads":
            reduce_grads(net)
        net.moe.update_expert_bias()
        total = spmdmoe.clip_grad_norm_(model, MAX_NORM)
        assert float(ref_norms[step]) > 2 * MAX_NORM
        _close(total, ref_norms[step], f"step {step} norm")
        _same_bits(total, f"step {step} norm")
        opt.step()
    layer = net.moe
    experts_group = layer.dp.group if layer.ep is not None else None  # the ranks holding the same experts
    for name, p in net.named_parameters():
        full = _full(p)
        expert = name.startswith("moe.experts.")
        _close(full, ref_params[name][experts] if expert else ref_params[name], f"{name} after {STEPS} clipped steps")
        _same_bits(full, name, experts_group if expert else None)


@pytest.mark.one_rank_bad
def test_a_none_gradient_on_one_rank_counts_as_zeros(world, device, request):
    """Rank 0 (the first replica of the dense weights) has no router gradient, rank 2 none for its block of
    ``w2``: they count as zeros, as torch counts a ``None``; the collectives match (no hang)."""
    moe = reference_moe(CFG, 0, device)
    plan = build_plan("sp_ep", moe, TOTAL, world, request)
    _backward(moe, plan, 0, device)
    if dist.get_rank() == 0:
        plan.layer.router.gate.weight.grad = None
    if dist.get_rank() == 2:
        plan.layer.experts.w2.grad = None
    moe.router.gate.weight.grad = None
    e = E // dist.get_world_size()
    if dist.get_world_size() > 2:
        moe.experts.w2.grad[2 * e: 3 * e] = 0
    total = spmdmoe.clip_grad_norm_(plan.layer, 1e9)
    _close(total, torch.nn.utils.get_total_norm(_grads(moe)), "norm with the missing gradients as zeros")
    _same_bits(total, "norm")


def test_parameters_without_their_model_are_refused(world, device, request):
    plan = build_plan("sp_ep", reference_moe(CFG, 0, device), TOTAL, world, request)
    assert_raises_everywhere(TypeError, lambda: spmdmoe.clip_grad_norm_(list(plan.layer.parameters()), 1.0),
                             match="without the model that holds them")
