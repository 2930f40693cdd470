"""Parallel MoE vs the single-device ``MoE`` with the same weights and the full input.

Every rank builds the reference from the same seeds and runs it on all
tokens. Loss: ``sum(y * G)`` over each rank's own rows (+ its aux loss), so
the per-rank losses sum to the single-device loss (run once per batch of the
plan, since the aux loss is per batch). Compared: outputs (each
rank's rows, and the all-gathered SP output), input gradients, every
parameter's gradient (dense ones summed over the data-parallel axis where
the plan has one; experts: this rank's slice), the aux loss (summed over
ranks) and the load counts. Tolerance (fp32): ``rtol = 1e-5`` and ``atol =
1e-5 * max|reference|``, and the routed-row counts prove that no padding row
reached the router or the experts.
"""

import pytest
import torch
import torch.distributed as dist

import spmdmoe
from moe_plans import PLANS, build_plan, expert_grad_slice, reference_moe, summed_over
from spmdmoe import SPMDTensor
from spmdmoe.moe import MoEConfig
from spmdmoe.testing import assert_close_everywhere, reference_tensor
from spmdmoe.types import layout

TOKENS = [1, 3, 5, 17, 64, 1023]
D, F, E = 16, 16, 8
VARIANTS = [
    dict(top_k=2),
    dict(top_k=1, score_func="sigmoid", num_shared_experts=1, load_balance_coeff=1e-3),
    dict(top_k=4, num_shared_experts=1, aux_loss_coeff=0.1),
    dict(top_k=2, score_func="sigmoid", route_norm=True, route_scale=2.5, num_expert_groups=4,
         num_limited_groups=2, aux_loss_coeff=0.01),
    dict(top_k=1, num_shared_experts=2, aux_loss_coeff=0.05),
    dict(top_k=4, score_func="sigmoid", num_expert_groups=2, num_limited_groups=1),
]


def close(actual, expected, name, rtol=1e-5):
    atol = rtol * max(float(expected.detach().abs().max()) if expected.numel() else 0.0, 1e-30)
    assert_close_everywhere(actual.detach(), expected.detach().to(actual.dtype), rtol=rtol, atol=atol, name=name)


def run_parity(plan_name, total, cfg, world, device, request, *, dtype=torch.float32, rtol=1e-5, seed=0, bias=None,
               **ep_options):
    moe = reference_moe(cfg, seed, device, dtype)
    if bias is not None:
        moe.expert_bias.copy_(bias)
    X = reference_tensor((total, D), 1000 + seed, dtype=dtype, device=device)
    G = reference_tensor((total, D), 2000 + seed, dtype=dtype, device=device)

    # the plan is built first only to learn its batches; its layer copies the untouched weights
    plan = build_plan(plan_name, moe, total, world, request, **ep_options)
    ref_x = X.clone().requires_grad_()
    ref_loss, ref_aux, ys = 0.0, 0.0, []
    for rows in plan.batches:  # one forward per batch: the aux loss is per batch
        ys.append(moe(ref_x[rows]))
        ref_loss = ref_loss + (ys[-1].float() * G[rows].float()).sum()
        if moe.aux_loss is not None:
            ref_loss, ref_aux = ref_loss + moe.aux_loss, ref_aux + moe.aux_loss
    ref_y = torch.cat(ys)
    ref_loss.backward()

    seen = {"router": 0, "experts": 0}
    plan.layer.router.register_forward_hook(lambda m, a, out: seen.__setitem__("router", seen["router"] + a[0].shape[0]))
    plan.layer.experts.register_forward_hook(
        lambda m, a, out: seen.__setitem__("experts", seen["experts"] + int(a[0].valid_rows.sum()))
    )  # the valid rows: a sync-free buffer holds more (capacity), never read
    leaf = X[plan.rows].clone().requires_grad_()
    x = plan.wrap(leaf)
    y = plan.layer(x)
    y_local = y.local if isinstance(y, SPMDTensor) else y
    loss = (y_local.float() * G[plan.rows].float()).sum()
    if plan.layer.aux_loss is not None:
        loss = loss + plan.layer.aux_loss
    loss.backward()

    close(y_local, ref_y[plan.rows], "output rows", rtol)
    if isinstance(y, SPMDTensor):
        gathered = spmdmoe.all_gather(y).local
        batch = slice(plan.rows.start - layout_offset(y), plan.rows.start - layout_offset(y) + y.global_tokens)
        close(gathered, ref_y[batch], "all-gathered output", rtol)
    close(leaf.grad, ref_x.grad[plan.rows], "input gradient", rtol)
    ref_params = dict(moe.named_parameters())
    for name, p in plan.layer.named_parameters():
        assert p.grad is not None, f"{name}.grad is None"
        if name.startswith("experts."):
            close(p.grad, expert_grad_slice(name, ref_params[name].grad, plan), f"{name} gradient", rtol)
        else:
            close(summed_over(p.grad, plan.dp_group), ref_params[name].grad, f"{name} gradient", rtol)
    if cfg.aux_loss_coeff is not None:
        # each batch's ranks' shares sum to its aux loss, so the world sum is the sum over batches
        close(summed_over(plan.layer.aux_loss.reshape(1), dist.group.WORLD), ref_aux.reshape(1),
              "aux loss summed over ranks", rtol)
    close(plan.layer.expert_load(), moe.tokens_per_expert, "load counts summed over the load axes", 0)

    # no padding row reached the router or the experts
    routed = torch.tensor([seen["router"], seen["experts"]], device=device)
    dist.all_reduce(routed)
    own_rows = plan.rows.stop - plan.rows.start
    routed_here = own_rows if plan.routers_per_token == 1 else y.global_tokens
    ok = seen["router"] == routed_here
    want = torch.tensor([total * plan.routers_per_token, total * plan.routers_per_token * cfg.top_k], device=device)
    assert ok and torch.equal(routed, want), (seen, routed.tolist(), want.tolist())
    return plan


def layout_offset(y: SPMDTensor) -> int:
    return layout.chunk_offset(y.global_tokens, y.axis.size, y.axis.rank)


@pytest.mark.parametrize("total", TOKENS)
@pytest.mark.parametrize("plan_name", PLANS)
def test_parity(world, device, request, plan_name, total):
    variant = VARIANTS[(TOKENS.index(total) + PLANS.index(plan_name)) % len(VARIANTS)]
    cfg = MoEConfig(dim=D, hidden_dim=F, num_experts=E, **variant)
    run_parity(plan_name, total, cfg, world, device, request, seed=TOKENS.index(total))


@pytest.mark.parametrize("plan_name", PLANS)
def test_all_tokens_on_one_expert(world, device, request, plan_name):
    """A huge bias on expert 5 sends every token there: the other experts get none (zero grads)."""
    cfg = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=1, num_shared_experts=1)
    bias = torch.zeros(E)
    bias[5] = 1e3
    plan = run_parity(plan_name, 37, cfg, world, device, request, bias=bias)
    local = [i for i in range(plan.experts.start, plan.experts.stop) if i != 5]
    for p in (plan.layer.experts.w1, plan.layer.experts.w2, plan.layer.experts.w3):
        idle = p.grad[[i - plan.experts.start for i in local]]
        assert idle.numel() == 0 or torch.count_nonzero(idle) == 0


@pytest.mark.parametrize("plan_name", PLANS)
def test_no_tokens_at_all(world, device, request, plan_name):
    cfg = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=2, num_shared_experts=1)
    run_parity(plan_name, 0, cfg, world, device, request)


@pytest.mark.parametrize("plan_name", ["sp_ep", "gather", "sp_x_ep"])
def test_bf16(world, device, request, plan_name):
    """bf16 end to end (router in fp32) against the bf16 single-device layer, rtol 2e-2."""
    cfg = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=2, num_shared_experts=1)
    run_parity(plan_name, 64, cfg, world, device, request, dtype=torch.bfloat16, rtol=2e-2)


@pytest.mark.parametrize("plan_name", ["gather", "gather_ep"])
@pytest.mark.parametrize("hidden", [5, 3, 1])
def test_gather_with_ranks_holding_no_hidden_unit(world, device, request, plan_name, hidden):
    """Issue 11: the chunk rule splits F=5 over 4 ranks as 2,2,1,0 (F=3: 1,1,1,0; F=1: 1,0,0,0); a
    rank with no hidden unit used to crash in the grouped GEMM and hang the others. It contributes
    zeros, and outputs and gradients match the single-device layer."""
    cfg = MoEConfig(dim=D, hidden_dim=hidden, num_experts=E, top_k=2, num_shared_experts=1, aux_loss_coeff=0.01)
    plan = run_parity(plan_name, 17, cfg, world, device, request)
    assert plan.layer.experts.w1.shape[1] == plan.hidden.stop - plan.hidden.start


@pytest.mark.parametrize("plan_name", PLANS)
def test_eval_forward_counts_nothing_and_skips_the_aux_loss(world, device, request, plan_name, monkeypatch):
    """Issue 6: eval and no_grad forwards leave tokens_per_expert alone and set no aux loss; an eval forward
    issues no aux all-reduce. Issue 24: a no_grad forward in training mode issues it (grad mode is rank-local
    and must not decide whether a collective runs: a peer with grad on is in it)."""
    import spmdmoe.moe.routing.balance as balance

    cfg = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=2, aux_loss_coeff=0.1)
    plan = build_plan(plan_name, reference_moe(cfg, 0, device), 29, world, request)
    x = plan.wrap(reference_tensor((29, D), 5, device=device)[plan.rows].clone())
    calls = []
    real = balance.reduce_counts
    monkeypatch.setattr(balance, "reduce_counts", lambda *a: (calls.append(1), real(*a))[1])
    plan.layer.eval()
    plan.layer(x)
    assert plan.layer.aux_loss is None
    plan.layer.train()
    with torch.no_grad():
        plan.layer(x)
    assert plan.layer.aux_loss is None
    assert calls == [1] and int(plan.layer.tokens_per_expert.sum()) == 0
    y = plan.layer(x)  # a training forward with grad: the aux all-reduce, and counts at its backward
    assert calls == [1, 1] and plan.layer.aux_loss is not None
    (y.local if isinstance(y, SPMDTensor) else y).sum().backward()
    assert int(plan.layer.expert_load().sum()) == 29 * 2
