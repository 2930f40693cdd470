"""Issue 24: no rank-local value decides whether a collective runs or how large its payload is.

The checking switch (``spmdmoe.set_checks``), which parameters are frozen, and grad mode are per process. Each
test sets one of them differently on ONE rank (the last) and asserts what every rank sees: the same result as
with the setting alike everywhere, or the same specific error. Before these fixes each scenario hung or aborted
inside gloo. Every test runs on fresh process groups with a 30 s timeout (``one_rank_bad``, conftest.py).
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist

import spmdmoe
from moe_plans import build_plan, reference_moe
from spmdmoe import SPMDCollectiveError, SPMDLayoutError
from spmdmoe.moe import MoEConfig, replicate_grads, sync_grads
from spmdmoe.testing import assert_close_everywhere, assert_raises_everywhere, reference_tensor
from spmdmoe.types import layout

pytestmark = pytest.mark.one_rank_bad

D, F, E = 16, 16, 8
CFG = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=2)


def _last(world) -> bool:
    return world.get_local_rank() == world.size() - 1


def _checks_off_here(world):
    """Checks off on the last rank only."""
    return spmdmoe.checks(not _last(world))


def test_from_local_with_checks_off_on_one_rank_still_rejects_a_bad_split(world, device):
    """Before: the rank with checks off skipped the exchange (trusting T); its peers waited in it."""
    rows = layout.local_tokens(10, world.size(), world.get_local_rank()) + (1 if world.get_local_rank() == 0 else 0)
    with _checks_off_here(world):
        assert_raises_everywhere(SPMDLayoutError, lambda: spmdmoe.from_local(torch.zeros(rows, 2, device=device),
                                                                            world, global_tokens=10),
                                 match=r"bad Shard\(dim=0\) split on ranks \[0\]")
        good = layout.local_tokens(10, world.size(), world.get_local_rank())
        assert spmdmoe.from_local(torch.zeros(good, 2, device=device), world).global_tokens == 10


def test_exchange_counts_with_checks_off_on_one_rank(world, device):
    """Before: the width agreement ran on the ranks with checks on only."""
    n = world.size()
    with _checks_off_here(world):
        send, recv = spmdmoe.exchange_counts(torch.ones(n, 2, dtype=torch.int64, device=device), world)
        assert send == [1] * (2 * n) and recv == [1] * (2 * n)
        width = 3 if world.get_local_rank() == 0 else 2
        assert_raises_everywhere(SPMDLayoutError, lambda: spmdmoe.exchange_counts(
            torch.ones(n, width, dtype=torch.int64, device=device), world), match="disagree on the")


def test_all_to_all_host_counts_with_checks_off_on_one_rank(world, device):
    """Before: the count check ran on the ranks with checks on only; the one with checks off went on to the data
    exchange. Now a receive count that contradicts the sender is caught whatever the setting."""
    n, rank = world.size(), world.get_local_rank()
    x = spmdmoe.SPMDTensor(torch.ones(n, 2, device=device), world, spmdmoe.Varying())
    with _checks_off_here(world):
        assert spmdmoe.all_to_all(x, [1] * n, [1] * n).local_tokens == n
        recv = [2 if (rank == 0 and src == 1 % n) else 1 for src in range(n)]
        assert_raises_everywhere(SPMDLayoutError, lambda: spmdmoe.all_to_all(x, [1] * n, recv),
                                 match=r"\(rank 0: bad counts\)")


@pytest.mark.parametrize("plan_name", ["gather", "sp_ep", "gather_ep"])
def test_moe_layer_with_checks_off_on_one_rank_matches_checks_on(world, device, request, plan_name):
    """Before: gather mode (and EP on the SP axis with the sync-free transport) agreed on T with checks on only."""
    moe = reference_moe(CFG, 0, device)
    total = 11
    full = reference_tensor((total, D), 3, device=device)
    results = []
    for off_here in (False, True):
        plan = build_plan(plan_name, moe, total, world, request)
        x = full[plan.rows].clone().requires_grad_()
        with spmdmoe.checks(not (off_here and _last(world))):
            y = plan.layer(plan.wrap(x))
            (y.local ** 2).sum().backward()
        results.append((y.local.detach(), x.grad, plan.layer.router.gate.weight.grad))
    for a, b in zip(*results):
        assert_close_everywhere(b, a, rtol=0, atol=0)


def test_load_state_dict_with_checks_off_on_one_rank(world, device, request):
    """Before: the agreement on the entries ran with checks on only (the others waited in it)."""
    from torch.distributed.tensor import Shard as DShard, distribute_tensor

    ref = reference_moe(CFG, 9, device)
    sd = {k: (distribute_tensor(v.detach(), world, [DShard(0)]) if k.startswith("experts.") else v.detach().clone())
          for k, v in ref.state_dict().items()}
    layer = build_plan("gather", reference_moe(CFG, 10, device), 8, world, request).layer
    with _checks_off_here(world):
        layer.load_state_dict(sd)
    assert torch.equal(layer.router.gate.weight, ref.router.gate.weight)


def _replicated(device):
    lin = torch.nn.Linear(3, 2).to(device)
    with torch.no_grad():
        lin.weight.copy_(reference_tensor((2, 3), 1, device=device))
        lin.bias.copy_(reference_tensor((2,), 2, device=device))
    return lin


def test_sync_grads_when_one_rank_freezes_everything_after_the_first_step(world, device):
    """The set agreed at the first forward holds: the rank that froze the weight and the bias afterwards still
    records the all-reduce (before: it skipped it and its peers waited in backward), so the peers' sums are
    exact; ``check_errors`` then raises the same SPMDLayoutError on every rank, naming it."""
    lin = replicate_grads(_replicated(device), world)
    x = reference_tensor((4, 3), 10 + world.get_local_rank(), device=device)
    lin(x).sum().backward()  # the first forward: the set is agreed (both need a gradient)
    want = lin.weight.grad.clone()
    lin.zero_grad()
    if _last(world):
        lin.requires_grad_(False)
    lin(x).sum().backward()  # the last rank's output needs a gradient through the stand-in alone
    if not _last(world):
        assert torch.equal(lin.weight.grad, want)
    assert_raises_everywhere(SPMDLayoutError, spmdmoe.check_errors,
                             match=rf"rank {world.size() - 1}: it trains another set of parameters")
    spmdmoe.check_errors()  # cleared


def test_parameter_frozen_on_one_rank_before_wrapping_raises_everywhere(world, device, request):
    """The trained set is agreed when replicate_grads / parallelize_moe wrap (before: the reductions' sizes
    differed, or a rank skipped them, and every rank hung in backward)."""
    lin = _replicated(device)
    if _last(world):
        lin.bias.requires_grad_(False)
    assert_raises_everywhere(SPMDLayoutError, lambda: replicate_grads(lin, world),
                             match="disagree on the set of tensors that need a gradient")
    moe = reference_moe(CFG, 0, device)
    if _last(world):
        moe.router.gate.weight.requires_grad_(False)
    assert_raises_everywhere(SPMDLayoutError, lambda: build_plan("sp", moe, 9, world, request),
                             match="disagree on the set of tensors that need a gradient")


def test_sync_grads_sets_that_differ_at_the_first_call_raise_everywhere(world, device):
    tensors = [torch.nn.Parameter(torch.ones(2, device=device)) for _ in range(2)]
    if _last(world):
        tensors[1].requires_grad_(False)
    assert_raises_everywhere(SPMDLayoutError, lambda: sync_grads(tensors, world),
                             match="disagree on the set of tensors that need a gradient")


def test_sync_grads_frozen_everywhere(world, device, monkeypatch):
    """Frozen on every rank before the set is agreed: no reduction at all. Frozen everywhere after it (the set
    is fixed once, as DDP fixes its parameters at construction): the reductions still run on every rank and
    check_errors names the change on every rank."""
    calls = []
    import spmdmoe.moe.params.grads as grads
    import spmdmoe.moe.params.overlap as overlap

    for module in (grads, overlap):
        real = module.all_reduce
        monkeypatch.setattr(module, "all_reduce", lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    tensors = [torch.nn.Parameter(torch.ones(2, device=device), requires_grad=False) for _ in range(2)]
    x = reference_tensor((2,), 10, device=device).requires_grad_()
    a, b = sync_grads(tensors, world)
    (a * b * x).sum().backward()
    assert calls == [] and x.grad is not None
    spmdmoe.check_errors()

    lin = replicate_grads(_replicated(device), world).requires_grad_(False)
    lin(reference_tensor((4, 3), 10, device=device)).sum().backward()
    assert calls and lin.weight.grad is None
    assert_raises_everywhere(SPMDLayoutError, spmdmoe.check_errors, match="it trains another set of parameters")


def test_grad_mode_off_on_one_rank_caught_in_the_collective_checking_mode(world, device, monkeypatch):
    """Default mode: a documented contract (grad mode is not exchanged; it would cost a host read per call).
    The collective-checking mode compares it at every sync_grads and every collective."""
    monkeypatch.setenv("SPMDMOE_CHECK_TIMEOUT", "10")
    lin = replicate_grads(_replicated(device), world)
    x = reference_tensor((4, 3), 10, device=device)
    with spmdmoe.checks("collectives"), torch.set_grad_enabled(not _last(world)):
        assert_raises_everywhere(SPMDCollectiveError, lambda: lin(x), match="grad_enabled is")


def test_frozen_parameter_on_one_rank_caught_in_the_collective_checking_mode(world, device, monkeypatch):
    monkeypatch.setenv("SPMDMOE_CHECK_TIMEOUT", "10")
    tensors = [torch.nn.Parameter(torch.ones(2, device=device)) for _ in range(2)]
    if _last(world):
        tensors[1].requires_grad_(False)
    with spmdmoe.checks("collectives"):
        assert_raises_everywhere(SPMDLayoutError, lambda: sync_grads(tensors, world), match="needs_grad is")


def test_aux_loss_all_reduce_runs_whatever_the_grad_mode(world, device, request):
    """Before: the aux-loss count all-reduce ran only with grad on; a rank under no_grad left its peers in it.
    Now the peers' aux losses are those they get with grad on everywhere; the no_grad rank sets none."""
    cfg = dataclasses.replace(CFG, aux_loss_coeff=1e-2)
    plan = build_plan("sp", reference_moe(cfg, 0, device), 9, world, request)
    x = reference_tensor((9, D), 4, device=device)[plan.rows]
    losses = []
    for off_here in (False, True):
        with torch.set_grad_enabled(not (off_here and _last(world))):
            y = plan.layer(plan.wrap(x))
        losses.append(plan.layer.aux_loss)
    assert y.local.shape == x.shape
    assert (losses[1] is None) == _last(world)
    if not _last(world):
        assert torch.equal(losses[1], losses[0])


def test_eval_mode_on_one_rank_caught_in_the_collective_checking_mode(world, device, request, monkeypatch):
    """Default mode: a documented contract (train / eval decides whether the aux-loss all-reduce runs). The
    collective-checking mode compares it at every MoE layer forward."""
    monkeypatch.setenv("SPMDMOE_CHECK_TIMEOUT", "10")
    cfg = dataclasses.replace(CFG, aux_loss_coeff=1e-2)
    plan = build_plan("sp", reference_moe(cfg, 0, device), 9, world, request)
    plan.layer.train(not _last(world))
    x = reference_tensor((9, D), 4, device=device)[plan.rows]
    with spmdmoe.checks("collectives"):
        assert_raises_everywhere(SPMDCollectiveError, lambda: plan.layer(plan.wrap(x)), match="training is")


@pytest.mark.parametrize("plan_name", ["sp", "gather"])
def test_grad_off_on_one_rank_sp_layer_raises_everywhere(world, device, request, plan_name):
    """An SP layer without EP, the last rank under no_grad (before: its peers waited in backward for sums it
    never sent). Its T exchange carries the grad mode: the peers raise in the backward of that forward, before
    any of the layer's backward collectives; the next forward raises on every rank. Then the layer runs on."""
    plan = build_plan(plan_name, reference_moe(CFG, 0, device), 9, world, request)
    x = reference_tensor((9, D), 4, device=device)[plan.rows]
    with torch.set_grad_enabled(not _last(world)):
        y = plan.layer(plan.wrap(x.clone().requires_grad_()))
    message = rf"rank {world.size() - 1}: it ran the forward with grad off"
    if not _last(world):  # the peers, in the backward the last rank will never run
        with pytest.raises(SPMDCollectiveError, match=message):
            y.local.sum().backward()
    # the next forward: every rank (the last one too, which ran no backward)
    assert_raises_everywhere(SPMDCollectiveError, lambda: plan.layer(plan.wrap(x)), match=message)
    y = plan.layer(plan.wrap(x.clone().requires_grad_()))
    y.local.mul_(2)  # the output is an ordinary tensor (a gradient hook, no view node): in place is fine
    y.local.sum().backward()
    spmdmoe.check_errors()


@pytest.mark.parametrize("plan_name,ep_mode", [("sp", "sync"), ("gather", "sync"), ("sp_ep", "sync_free")])
def test_grad_off_on_one_rank_in_a_training_loop_with_step_boundaries(world, device, request, plan_name, ep_mode):
    """The guide's loop (forward, backward where there is a graph, ``update_expert_bias``, ``check_errors``; an
    spmdmoe error skips the step), the last rank under no_grad in step 0, on the layers whose T exchange carries
    the grad mode. Before: the peers raised in their backward and skipped the boundary, while the last rank, which
    ran no backward, waited in ``update_expert_bias``'s all-reduce for them (a hang). Now it raises there, before
    the exchange: every rank raises in step 0 and at step 1's forward, and step 2 trains."""
    plan = build_plan(plan_name, reference_moe(CFG, 0, device), 9, world, request, ep_mode=ep_mode)
    x = reference_tensor((9, D), 4, device=device)[plan.rows]
    outcomes = []
    for step in range(3):
        try:
            with torch.set_grad_enabled(not (step == 0 and _last(world))):
                y = plan.layer(plan.wrap(x.clone().requires_grad_()))
            if y.local.requires_grad:
                y.local.sum().backward()
            plan.layer.update_expert_bias()
            spmdmoe.check_errors()
            outcomes.append("ok")
        except SPMDCollectiveError as e:
            assert f"rank {world.size() - 1}: it ran the forward with grad off" in str(e), str(e)
            outcomes.append("raised")
    assert outcomes == ["raised", "raised", "ok"], outcomes


@pytest.mark.parametrize("plan_name", ["sp", "gather", "ep", "sp_ep", "sp_x_ep"])
def test_experts_frozen_before_wrapping_stay_frozen(plan_name, world, device, request):
    """An expert weight frozen (on every rank) before ``parallelize_moe``, as the guide says to freeze: the
    parallel layer's copy is frozen too, gets no gradient, and the step boundary finds nothing. Before, the
    experts' block was built as new parameters that all needed a gradient: frozen experts trained, and where the
    experts are replicated over SP they could not be frozen at all (frozen after wrapping, ``check_errors``
    raised: the SP sums' agreed set had changed)."""
    moe = reference_moe(CFG, 0, device)
    moe.experts.w3.requires_grad_(False)
    plan = build_plan(plan_name, moe, 9, world, request)
    trains = {n: p.requires_grad for n, p in plan.layer.named_parameters() if n.startswith("experts.")}
    assert trains == {"experts.w1": True, "experts.w2": True, "experts.w3": False}, trains
    y = plan.layer(plan.wrap(reference_tensor((9, D), 4, device=device)[plan.rows]))
    (y.local if isinstance(y, spmdmoe.SPMDTensor) else y).sum().backward()
    spmdmoe.check_errors()
    assert plan.layer.experts.w3.grad is None and plan.layer.experts.w1.grad is not None


def test_grad_off_on_one_rank_ep_layer_raises_at_the_exchange(world, device, request):
    """With EP spanning the layer, the grad mode rides the count exchange: the forward raises on every rank."""
    plan = build_plan("sp_ep", reference_moe(CFG, 0, device), 9, world, request)
    x = reference_tensor((9, D), 4, device=device)[plan.rows]
    with torch.set_grad_enabled(not _last(world)):
        assert_raises_everywhere(SPMDCollectiveError, lambda: plan.layer(plan.wrap(x)),
                                 match=rf"rank {world.size() - 1}: it ran the forward with grad off")
    with torch.no_grad():  # off everywhere: nothing to raise
        plan.layer(plan.wrap(x))


def test_grad_off_on_one_rank_sync_free_ep_on_the_sp_axis(world, device, request):
    """Sync-free EP on the SP axis has no host read in its forward; its T exchange (which sizes the buffers)
    carries the grad mode as in an SP layer without EP."""
    plan = build_plan("sp_ep", reference_moe(CFG, 0, device), 9, world, request, ep_mode="sync_free")
    x = reference_tensor((9, D), 4, device=device)[plan.rows]
    with torch.set_grad_enabled(not _last(world)):
        y = plan.layer(plan.wrap(x.clone().requires_grad_()))
    message = rf"rank {world.size() - 1}: it ran the forward with grad off"
    if not _last(world):
        with pytest.raises(SPMDCollectiveError, match=message):
            y.local.sum().backward()
    assert_raises_everywhere(SPMDCollectiveError, lambda: plan.layer(plan.wrap(x)), match=message)
    plan.layer(plan.wrap(x.clone().requires_grad_())).local.sum().backward()
    spmdmoe.check_errors()
