"""Bad MoE inputs raise their specific error on EVERY rank (never a hang), each under the timeout."""

import pytest
import torch

import spmdmoe
from moe_plans import reference_moe
from spmdmoe import MoEConfigError, Replicate, SPMDLayoutError, SPMDRoutingError, SPMDShapeError
from spmdmoe.moe import MoEConfig, parallelize_moe
from spmdmoe.testing import assert_raises_everywhere, reference_tensor
from spmdmoe.types import layout

pytestmark = pytest.mark.one_rank_bad  # fresh process groups, 30 s timeout (conftest.py)

D, F, E = 16, 16, 8
CFG = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=2)


def _rows(world, total, device, features=D):
    rank = world.get_local_rank()
    return torch.randn(layout.local_tokens(total, world.size(), rank), features, device=device)


def test_top_k_larger_than_experts(world, device):
    assert_raises_everywhere(MoEConfigError, lambda: MoEConfig(dim=D, hidden_dim=F, num_experts=4, top_k=5), match="top_k")


def test_experts_not_divisible_by_ep(world, device):
    moe = reference_moe(MoEConfig(dim=D, hidden_dim=F, num_experts=world.size() + 1, top_k=1), 0, device)
    assert_raises_everywhere(MoEConfigError, lambda: parallelize_moe(moe, ep_mesh=world), match="does not divide")


def test_bad_plans(world, device):
    moe = reference_moe(CFG, 0, device)
    assert_raises_everywhere(MoEConfigError, lambda: parallelize_moe(moe, sp_mesh=world, sp_mode="scatter"))
    assert_raises_everywhere(MoEConfigError, lambda: parallelize_moe(moe, ep_mesh=world, sp_mode="gather"))
    assert_raises_everywhere(
        MoEConfigError, lambda: parallelize_moe(moe, sp_mesh=world, ep_mesh=world, sp_mode="gather"), match="EP"
    )


@pytest.mark.parametrize("bad", ["plain", "replicate", "other_mesh"])
def test_wrong_input_layout(world, device, bad):
    layer = parallelize_moe(reference_moe(CFG, 0, device), sp_mesh=world, ep_mesh=world)
    full = reference_tensor((9, D), 1, device=device)
    x = {
        "plain": lambda: full,
        "replicate": lambda: spmdmoe.from_local(full, world, placement=Replicate()),
        "other_mesh": lambda: spmdmoe.shard(full, spmdmoe.testing.single_process_group() if world.size() == 1 else _self_group()),
    }[bad]()
    assert_raises_everywhere(SPMDLayoutError, lambda: layer(x))


def _self_group():
    import torch.distributed as dist

    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank creates every group
    return groups[dist.get_rank()]


def test_model_dim_mismatch_sp(world, device):
    layer = parallelize_moe(reference_moe(CFG, 0, device), sp_mesh=world, ep_mesh=world)
    x = spmdmoe.from_local(_rows(world, 10, device, features=D + 1), world, global_tokens=10)
    assert_raises_everywhere(SPMDShapeError, lambda: layer(x), match="dim=16")


def test_model_dim_mismatch_on_one_ep_rank(world, device):
    """Each rank has its own batch; only the last one has the wrong width: all raise together."""
    layer = parallelize_moe(reference_moe(CFG, 0, device), ep_mesh=world)
    bad = world.get_local_rank() == world.size() - 1
    x = torch.randn(5, D + 3 if bad else D, device=device)
    assert_raises_everywhere(SPMDShapeError, lambda: layer(x),
                             match=rf"rank {world.size() - 1}: input width is not the model dim")


def test_nan_router_logits_with_ep_raise_everywhere(world, device):
    layer = parallelize_moe(reference_moe(CFG, 0, device), sp_mesh=world, ep_mesh=world)
    local = _rows(world, 4 * world.size(), device)
    if world.get_local_rank() == 0:
        local[1, 3] = float("nan")
    x = spmdmoe.from_local(local, world)
    assert_raises_everywhere(SPMDRoutingError, lambda: layer(x), match=r"\(rank 0: non-finite router logits")


def test_nan_router_logits_without_ep_raise_at_check_errors(world, device):
    """One rule with and without EP: non-finite router logits are SPMDRoutingError on every rank.
    Without an exchange to carry the flag, the forward goes on (no rank blocks) and the step
    boundary (check_errors / update_expert_bias) raises everywhere."""
    layer = parallelize_moe(reference_moe(CFG, 0, device), sp_mesh=world)
    local = _rows(world, 4 * world.size(), device)
    if world.get_local_rank() == 0:
        local[1, 3] = float("inf")
    layer(spmdmoe.from_local(local, world))
    assert_raises_everywhere(SPMDRoutingError, spmdmoe.check_errors, match=r"\(rank 0: non-finite router logits")
    spmdmoe.check_errors()  # raised once, then cleared


@pytest.mark.parametrize("sp_mode", ["local", "gather"])
@pytest.mark.parametrize("bad", ["width", "inf"])
def test_deferred_problem_surfaces_at_a_later_forward_without_check_errors(world, device, sp_mode, bad):
    """Issue 24: an SP layer without EP defers a one-rank problem to the step boundary; a job that never calls
    check_errors / update_expert_bias must not lose it. Each forward's T exchange carries the problems (this
    forward's input problems, and the bits recorded before it), read at the next forward: a bad input surfaces
    one forward late, non-finite logits (found during the forward) two, on every rank; then the layer runs
    on. A step boundary in between raises them once, and the later forward does not raise them again."""
    layer = parallelize_moe(reference_moe(CFG, 0, device), sp_mesh=world, sp_mode=sp_mode)
    last = world.size() - 1
    total = 4 * world.size()
    good = lambda: spmdmoe.from_local(_rows(world, total, device), world)  # noqa: E731

    def bad_input():  # built locally on the bad rank (no cross-rank check there)
        x = good()
        if world.get_local_rank() != last:
            return x
        local = _rows(world, total, device, features=D + 1 if bad == "width" else D)
        local[0, 3] = float("inf")
        return x.with_local(local)

    error, match = (SPMDShapeError, rf"\(rank {last}: input width") if bad == "width" else \
        (SPMDRoutingError, rf"\(rank {last}: non-finite router logits")
    layer(bad_input())  # the bad rank stands in; nobody raises yet
    late = 1 if bad == "width" else 2
    for _ in range(late - 1):
        layer(good())
    assert_raises_everywhere(error, lambda: layer(good()), match=match)
    layer(good())  # raised once, then cleared: the layer runs on
    layer(good())
    spmdmoe.check_errors()
    layer(bad_input())  # a step boundary in between raises it, and no later forward raises it again
    for _ in range(late - 1):
        layer(good())
    assert_raises_everywhere(error, spmdmoe.check_errors, match=match)
    layer(good())
    layer(good())


def test_update_expert_bias_with_checks_off_on_one_rank(world, device):
    """Issue 24: the bias update exchanges the same payload in every mode (the problem slots zero when checks
    are off). Before, a rank with checks off sent E counts while its peers sent E + world: a size mismatch
    inside the all-reduce (a gloo error or a hang). Now every rank returns the same summed load."""
    import dataclasses

    from spmdmoe.types import checks

    layer = parallelize_moe(reference_moe(dataclasses.replace(CFG, load_balance_coeff=1e-3), 0, device), sp_mesh=world)
    rows = 4 * world.size()
    y = layer(spmdmoe.from_local(_rows(world, rows, device), world))
    y.local.sum().backward()  # the counts are added in the backward
    with checks(world.get_local_rank() != 0):  # checks off on rank 0 only
        load = layer.update_expert_bias()
    every = [torch.empty_like(load) for _ in range(world.size())]
    torch.distributed.all_gather(every, load, group=world.get_group())
    assert all(torch.equal(other, load) for other in every)
    assert int(load.sum()) == rows * CFG.top_k


def test_parallelize_moe_with_checks_off_on_one_rank_raises_everywhere(world, device):
    """Issue 24: parallelize_moe exchanges the same payload in every mode. Before, a rank with checks off
    skipped the agreement its peers ran (they hung). Now every rank raises, naming the setting."""
    from spmdmoe.types import checks

    with checks(world.get_local_rank() != world.size() - 1):
        assert_raises_everywhere(MoEConfigError, lambda: parallelize_moe(reference_moe(CFG, 0, device), sp_mesh=world),
                                 match="checks setting")
    with checks(False):  # off everywhere: accepted, and still one exchange
        parallelize_moe(reference_moe(CFG, 0, device), sp_mesh=world)


@pytest.mark.parametrize("plan_name", ["sp_ep", "sp_x_ep", "gather_ep"])
def test_other_placement_on_one_rank_with_sp_and_ep(plan_name, world, device, request):
    """A layer with SP and EP; the last rank builds a Replicate tensor locally (no cross-rank check there)
    instead of its Shard(0) rows. It stands in zero rows, so every rank runs the same collectives; the
    step's forward, backward and ``check_errors`` raise the same SPMDLayoutError, naming it, on every rank."""
    from moe_plans import build_plan
    plan = build_plan(plan_name, reference_moe(CFG, 0, device), 11, world, request)
    full = reference_tensor((11, D), 2, device=device)
    x = plan.wrap(full[plan.rows])
    last = world.size() - 1
    if world.get_local_rank() == last:
        x = spmdmoe.SPMDTensor(full[:5], x.axis, Replicate(), global_tokens=5)

    def step():
        y = plan.layer(x)
        (y.local if isinstance(y, spmdmoe.SPMDTensor) else y).sum().backward()
        spmdmoe.check_errors()

    assert_raises_everywhere(SPMDLayoutError, step, match=rf"rank {last}: input is not in the layer's layout")


@pytest.mark.parametrize("mode", ["on", "collectives"])
@pytest.mark.parametrize("ep_mode", ["sync", "sync_free"])
def test_replicate_of_every_row_on_one_rank_of_an_sp_ep_layer(world, device, request, monkeypatch, mode, ep_mode):
    """The sp_ep plan (SP = EP = world); the last rank passes a Replicate tensor of all T rows (a valid layout on its
    own: built locally, with no cross-rank check), the others their Shard(0) rows. Every rank raises the layer's
    input error (SPMDLayoutError naming that rank), in the default and in the collective-checking mode, in the
    forward (sync EP raises at its count exchange) or at the step boundary (sync-free EP), and the next step,
    with good inputs everywhere, runs clean. (Reported to hang every rank; it does not on this tree: the bad rank
    stands in zero rows, the token exchange reads T only from a Shard input on the layer's axis.)"""
    from moe_plans import build_plan

    monkeypatch.setenv("SPMDMOE_CHECK_TIMEOUT", "10")  # a rank out of step fails fast instead of waiting 60 s
    previous = spmdmoe.set_checks("collectives" if mode == "collectives" else True)
    try:
        T = 11
        plan = build_plan("sp_ep", reference_moe(CFG, 0, device), T, world, request, ep_mode=ep_mode)
        full = reference_tensor((T, D), 2, device=device)
        x = plan.wrap(full[plan.rows].clone().requires_grad_())
        last = world.size() - 1
        if world.get_local_rank() == last:
            x = spmdmoe.SPMDTensor(full.clone().requires_grad_(), x.axis, Replicate(), global_tokens=T)

        def step(x):
            y = plan.layer(x)
            y.local.sum().backward()
            plan.layer.update_expert_bias()

        err = assert_raises_everywhere(SPMDLayoutError, lambda: step(x),
                                       match=rf"rank {last}: input is not in the layer's layout")
        assert type(err) is SPMDLayoutError, f"{type(err).__name__}: {err}"
        step(plan.wrap(full[plan.rows].clone().requires_grad_()))
    finally:
        spmdmoe.set_checks(previous)


@pytest.mark.parametrize("plan", ["sync", "sync_free", "gather"])
def test_shard_of_another_length_on_one_rank_in_the_collective_checking_mode(world, device, monkeypatch, plan):
    """An SP layer (SP = EP = world, or gather mode); rank 2 (the last on fewer ranks) builds its input with the
    local constructor ``shard`` from 36 rows, its peers from 37: each rank's tensor is valid on its own. The
    collective-checking mode compares the layer's input at every forward (docs/guide.md), so every rank raises
    SPMDLayoutError naming the global_tokens each rank declared. (Before, the layer skipped its input there: sync
    EP returned a T = 36 output on rank 2 alone, sync-free EP and gather mode aborted inside gloo.)"""
    monkeypatch.setenv("SPMDMOE_CHECK_TIMEOUT", "10")
    previous = spmdmoe.set_checks("collectives")
    try:
        bad = min(2, world.size() - 1)
        layer = parallelize_moe(reference_moe(CFG, 0, device), sp_mesh=world,
                                ep_mesh=None if plan == "gather" else world, ep_mode="sync_free" if plan == "sync_free"
                                else "sync", sp_mode="gather" if plan == "gather" else "local")
        x = spmdmoe.shard(reference_tensor((36 if world.get_local_rank() == bad else 37, D), 5, device=device), world)
        assert_raises_everywhere(SPMDLayoutError, lambda: layer(x),
                                 match=rf"global_tokens is 37 on axis rank\(s\) .*36 on axis rank\(s\) \[{bad}\]")
    finally:
        spmdmoe.set_checks(previous)


@pytest.mark.parametrize("mode", ["on", "collectives"])
def test_local_replicate_on_one_rank_while_its_peers_call_from_local(world, device, monkeypatch, mode):
    """Issue 60's first snippet, as a user writes it: an SP x EP layer (SP = EP = world); rank 2 (the last on fewer
    ranks) wraps all 37 rows as a ``Replicate`` SPMDTensor (a local constructor: no exchange), its peers wrap
    their rows with ``from_local`` (which exchanges); then the layer, backward, ``check_errors``. Rank 2's first
    exchange is the layer's count exchange while its peers are in ``from_local``'s: the two check exchanges meet
    (``spmdmoe.agreement.mixed_ops_error``) and every rank raises rank 2's layout problem, SPMDLayoutError; in the
    collective-checking mode the layer's record (``MoE layer``, with rank 2's problem) meets ``from_local``'s, and
    the problem decides there too."""
    monkeypatch.setenv("SPMDMOE_CHECK_TIMEOUT", "10")
    previous = spmdmoe.set_checks("collectives" if mode == "collectives" else True)
    try:
        n, rank, T = world.size(), world.get_local_rank(), 37
        bad = min(2, n - 1)
        layer = parallelize_moe(reference_moe(CFG, 0, device), sp_mesh=world, ep_mesh=world)
        X = reference_tensor((T, D), 5, device=device)
        start = layout.chunk_offset(T, n, rank)

        def step():
            x = (spmdmoe.SPMDTensor(X, world, Replicate(), global_tokens=T) if rank == bad
                 else spmdmoe.from_local(X[start:start + layout.local_tokens(T, n, rank)], world, global_tokens=T))
            y = layer(x)
            y.local.sum().backward()
            spmdmoe.check_errors(world)

        err = assert_raises_everywhere(SPMDLayoutError, step, match=rf"rank {bad}: input is not in the layer's layout")
        assert type(err) is SPMDLayoutError, f"{type(err).__name__}: {err}"
    finally:
        spmdmoe.set_checks(previous)


@pytest.mark.parametrize("mode", ["on", "collectives"])
def test_torchtitan_state_dict_missing_a_key_on_one_rank(mesh2d_wide, world, device, monkeypatch, mode):
    """Issue 60's second snippet: a torchtitan-style state dict (``to_torchtitan``'s names) whose experts are
    DTensors ``Shard(0)`` over the world, loaded into a layer with EP over one axis of a 2-D mesh; rank 2's dict
    lacks the first expert weight. Every rank raises ``SPMDLayoutError`` naming rank 2. (The snippet as the
    issue wrote it deletes ``experts.w1_EFD``, a key ``to_torchtitan(names="new")`` does not write: a
    ``KeyError`` in the user's own line on rank 2, before any spmdmoe call, which no library can turn into an
    error on the other ranks.)"""
    from torch.distributed.tensor import Shard, distribute_tensor

    from spmdmoe.moe.checkpoint import to_torchtitan

    monkeypatch.setenv("SPMDMOE_CHECK_TIMEOUT", "10")
    previous = spmdmoe.set_checks("collectives" if mode == "collectives" else True)
    try:
        bad = 2
        sd = to_torchtitan(reference_moe(CFG, 1, device).state_dict(), names="new")
        sd = {k: distribute_tensor(v, world, [Shard(0)]) if k.startswith("routed_experts.") else v
              for k, v in sd.items()}
        if world.get_local_rank() == bad:
            del sd["routed_experts.inner_experts.w1_EFD"]
        layer = parallelize_moe(reference_moe(CFG, 0, device), ep_mesh=mesh2d_wide["sp"])
        err = assert_raises_everywhere(SPMDLayoutError, lambda: layer.load_state_dict(sd), match=rf"rank {bad}")
        assert type(err) is SPMDLayoutError, f"{type(err).__name__}: {err}"
    finally:
        spmdmoe.set_checks(previous)
