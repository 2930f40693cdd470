"""Every rank agrees: a bad input on ONE rank raises the specific error on EVERY rank, quickly.

Each case gives one rank (the last) a bad input and runs what a training step runs: the
forward, a backward, and ``update_expert_bias`` (the step boundary). Plans whose EP count
exchange spans every rank the layer talks to raise at the exchange; the others (no EP, EP
beside another SP axis, EP with dp) let every rank finish the step with the bad rank standing
in zero rows, and raise at the step boundary. Either way every rank raises the same error
type, naming the bad rank, and no rank waits: a timeout (60 s here; each case takes well
under one) is a failure. Before this mechanism every case below hung or aborted.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import spmdmoe
from moe_plans import build_plan, expert_grad_slice, reference_moe, summed_over
from spmdmoe import (
    MoEConfigError,
    Replicate,
    Shard,
    SPMDDeviceError,
    SPMDDtypeError,
    SPMDLayoutError,
    SPMDMeshError,
    SPMDRoutingError,
    SPMDShapeError,
    SPMDTensor,
)
from spmdmoe.moe import MoEConfig, parallelize_moe, replicate_grads
from spmdmoe.testing import all_ranks_agree, assert_close_everywhere, assert_raises_everywhere, reference_tensor
from spmdmoe.types import layout

pytestmark = pytest.mark.one_rank_bad  # fresh process groups, 30 s timeout (conftest.py)

D, F, E = 16, 16, 8
CFG = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=2, num_shared_experts=1, load_balance_coeff=1e-3)
SP_PLANS = ["sp", "sp_ep", "gather", "sp_x_ep", "gather_ep", "sp_ep_dp"]
ERRORS = {
    "plain": SPMDLayoutError, "replicate": SPMDLayoutError, "token_dim": SPMDLayoutError, "mesh": SPMDMeshError,
    "width": SPMDShapeError, "dtype": SPMDDtypeError, "device": SPMDDeviceError, "inf": SPMDRoutingError,
}
WHAT = {
    SPMDLayoutError: "input is not in the layer's layout", SPMDMeshError: "input lives on another mesh axis",
    SPMDShapeError: "input width is not the model dim", SPMDDtypeError: "input dtype is not the layer's",
    SPMDDeviceError: "tensor on a device the backend cannot use", SPMDRoutingError: "non-finite router logits",
}


@pytest.fixture(scope="module")
def self_groups():
    """One 1-rank group per rank (every rank creates every group, in the same order)."""
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    return groups[dist.get_rank()]


def _plan(name, world, request, device, total=23):
    moe = reference_moe(CFG, 0, device)
    if name == "sp_ep_dp":  # EP on the SP axis, plus a dp axis: the count exchange does not span the layer
        mesh = request.getfixturevalue("mesh2d_wide")  # 2 x world/2: 2x2 on 4 ranks
        layer = parallelize_moe(moe, sp_mesh=mesh["sp"], ep_mesh=mesh["sp"], dp_mesh=mesh["dp"])
        sp, b = mesh["sp"], mesh["dp"].get_local_rank()
        m = sp.size()
        b_rows = layout.local_tokens(total, 2, b)
        start = layout.chunk_offset(total, 2, b) + layout.chunk_offset(b_rows, m, sp.get_local_rank())
        rows = slice(start, start + layout.local_tokens(b_rows, m, sp.get_local_rank()))

        return SimpleNamespace(layer=layer, rows=rows, wrap=lambda t: spmdmoe.from_local(t, sp, global_tokens=b_rows))
    return build_plan(name, moe, total, world, request)


def _corrupt(x, kind, self_group, device):
    """The bad input of one rank, built with local constructors only (no collective on one rank)."""
    if kind == "plain":
        return x.local if isinstance(x, SPMDTensor) else spmdmoe.SPMDTensor._new(x, spmdmoe.mesh_axis(self_group), Shard(0), x.shape[0], 0)
    if kind == "replicate":
        return SPMDTensor._new(x.local, x.axis, Replicate(), x.local_tokens, 0)
    if kind == "token_dim":
        return SPMDTensor._new(x.local.t().contiguous(), x.axis, Shard(1), x.global_tokens, 1)
    if kind == "mesh":
        return SPMDTensor._new(x.local, spmdmoe.mesh_axis(self_group), Shard(0), x.local_tokens, 0)
    local = x.local if isinstance(x, SPMDTensor) else x
    if kind == "width":
        bad = torch.cat([local, local[:, :1]], dim=1)
    elif kind == "dtype":
        bad = local.double()
    elif kind == "device":
        bad = local.to("meta" if device.type == "cpu" else "cpu")
    else:  # inf: a valid layout, one non-finite value
        bad = local.clone()
        if bad.shape[0]:
            bad[0, 3] = float("inf")
    return x.with_local(bad) if isinstance(x, SPMDTensor) else bad


def _step(layer, x):
    y = layer(x)
    local = y.local if isinstance(y, SPMDTensor) else y
    local.float().sum().backward()
    layer.update_expert_bias()


def _bad_rank_raises_everywhere(plan, kind, self_group, device):
    X = reference_tensor((23, D), 1, device=device)
    leaf = X[plan.rows].clone().requires_grad_()
    x = plan.wrap(leaf)
    last = dist.get_world_size() - 1
    if dist.get_rank() == last:
        x = _corrupt(x, kind, self_group, device)
    error = ERRORS[kind]
    err = assert_raises_everywhere(error, lambda: _step(plan.layer, x), match=rf"\(rank {last}: {WHAT[error]}")
    assert type(err) is error, f"expected exactly {error.__name__}, found {type(err).__name__}: {err}"
    # the step after the error is clean again on every rank (nothing left recorded)
    good = plan.wrap(X[plan.rows].clone().requires_grad_())
    _step(plan.layer, good)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["plain", "replicate", "token_dim", "mesh", "width", "dtype", "device", "inf"])
@pytest.mark.parametrize("plan_name", SP_PLANS)
def test_sp_input_wrong_on_one_rank(world, device, request, self_groups, plan_name, kind):
    """Issue 1 (and 12 for inf): SP modes, the input wrong on one rank only."""
    _bad_rank_raises_everywhere(_plan(plan_name, world, request, device), kind, self_groups, device)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["plain", "width", "dtype", "device", "inf"])
def test_ep_input_wrong_on_one_rank(world, device, request, self_groups, kind):
    """EP only (each rank its own batch): a Shard SPMDTensor instead of rows, or bad rows, on one rank."""
    _bad_rank_raises_everywhere(_plan("ep", world, request, device), kind, self_groups, device)


@pytest.mark.timeout(60)
def test_width_changed_by_with_local_after_from_local(world, device, request):
    """Issue 1: from_local agreed on the width; one rank then changes it with with_local."""
    plan = _plan("gather", world, request, device)
    x = plan.wrap(reference_tensor((23, D), 1, device=device)[plan.rows].clone())
    if dist.get_rank() == 0:
        x = x.with_local(x.local[:, :-1])
    assert_raises_everywhere(SPMDShapeError, lambda: _step(plan.layer, x), match=r"\(rank 0: input width")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("plan_name", ["gather", "sp_ep", "ep", "sp_x_ep"])
def test_input_without_grad_on_one_rank_matches_reference(world, device, request, plan_name):
    """Issue 3: rank 0's input does not require grad; every backward collective still runs on it,
    and every gradient matches the single-device layer (fp32, rtol 1e-5, atol 1e-5 x max|ref|)."""
    moe = reference_moe(CFG, 0, device)
    X, G = reference_tensor((23, D), 1, device=device), reference_tensor((23, D), 2, device=device)
    ref_x = X.clone().requires_grad_()
    plan = build_plan(plan_name, moe, 23, world, request)
    for rows in plan.batches:  # the aux loss is per batch; none here, but keep the reference's shape
        (moe(ref_x[rows]) * G[rows]).sum().backward()
    leaf = X[plan.rows].clone().requires_grad_(dist.get_rank() != 0)
    y = plan.layer(plan.wrap(leaf))
    ((y.local if isinstance(y, SPMDTensor) else y) * G[plan.rows]).sum().backward()
    want_x = ref_x.grad[plan.rows]
    others = _others(world)  # every rank creates the group
    if dist.get_rank() == 0:
        assert leaf.grad is None
    else:
        assert_close_everywhere(leaf.grad, want_x, rtol=1e-5, atol=1e-5 * float(ref_x.grad.abs().max()),
                                name="input gradient", mesh=others)
    ref = dict(moe.named_parameters())
    for name, p in plan.layer.named_parameters():
        want = expert_grad_slice(name, ref[name].grad, plan) if name.startswith("experts.") else ref[name].grad
        got = p.grad if name.startswith("experts.") else summed_over(p.grad, plan.dp_group)
        assert_close_everywhere(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()), name=f"{name} gradient")


def _others(world):
    """The ranks but 0, as a group (every rank must call this, in the same order)."""
    return dist.new_group(list(range(1, world.size())))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["plain", "width", "dtype", "inf"])
@pytest.mark.parametrize("plan_name", ["sp", "sp_ep", "gather", "ep"])
def test_bad_rank_runs_every_backward_upstream(world, device, request, plan_name, kind, self_groups):
    """The bad input comes out of a replicated Linear (its gradient summed over the world in backward)
    and a first MoE layer; the bad rank's stand-in output is linked to its input, so it runs those
    backward collectives too (a stand-in linked to the layer only left the peers in them)."""
    plan = _plan(plan_name, world, request, device)
    second = _plan(plan_name, world, request, device).layer
    lin = replicate_grads(torch.nn.Linear(D, D).to(device), world)
    X = reference_tensor((23, D), 1, device=device)

    def step():
        h = lin(X[plan.rows].clone().requires_grad_())
        y = plan.layer(plan.wrap(h))
        y = y if dist.get_rank() != world.size() - 1 else _corrupt(y, kind, self_groups, device)
        z = second(y)
        (z.local if isinstance(z, SPMDTensor) else z).float().sum().backward()
        plan.layer.update_expert_bias()
        second.update_expert_bias()

    err = ERRORS[kind]
    assert_raises_everywhere(err, step, match=rf"\(rank {world.size() - 1}: {WHAT[err]}")
    # where the error waited for the step boundary, every rank's backward reached the Linear (and so
    # ran its all-reduce; gloo does not always notice a mismatched all-reduce, so this is checked
    # directly); where the exchange raised at once, no rank ran a backward
    reached = lin.weight.grad is not None and plan.layer.router.gate.weight.grad is not None
    missing = all_ranks_agree(reached)
    assert missing in ([], list(range(world.size()))), f"ranks {missing}' backward stopped at the stand-in"


@pytest.mark.timeout(60)
def test_whole_sp_group_without_token_count_beside_ep_peers(world, device, request):
    """Gather mode over sp with EP over dp: every rank of one SP group passes plain rows (no T to
    gather at); they stand in zero tokens, the EP peers go on, and every rank raises at the step boundary."""
    plan = _plan("gather_ep", world, request, device)
    X = reference_tensor((23, D), 1, device=device)
    x = plan.wrap(X[plan.rows].clone().requires_grad_())
    if request.getfixturevalue("mesh2d_wide")["dp"].get_local_rank() == 0:
        x = x.local
    assert_raises_everywhere(SPMDLayoutError, lambda: _step(plan.layer, x), match=r"\(rank 0: input is not in")


@pytest.mark.timeout(60)
def test_bad_rank_in_eval_raises_at_check_errors(world, device, request, self_groups):
    """Eval and no_grad forwards record too; check_errors (e.g. at the end of an eval pass) raises everywhere."""
    plan = _plan("gather", world, request, device)
    x = plan.wrap(reference_tensor((23, D), 1, device=device)[plan.rows].clone())
    if dist.get_rank() == 1:
        x = _corrupt(x, "width", self_groups, device)
    plan.layer.eval()
    with torch.no_grad():
        plan.layer(x)
    assert_raises_everywhere(SPMDShapeError, spmdmoe.check_errors, match=r"\(rank 1: input width")


@pytest.mark.timeout(60)
def test_check_errors_drops_the_failed_steps_counts(world, device, request):
    plan = _plan("sp", world, request, device)
    local = reference_tensor((23, D), 1, device=device)[plan.rows].clone()
    if dist.get_rank() == 0:
        local[0, 0] = float("nan")
    _local = plan.layer(plan.wrap(local.requires_grad_()))
    _local.local.sum().backward()
    assert_raises_everywhere(SPMDRoutingError, spmdmoe.check_errors)
    assert int(plan.layer.tokens_per_expert.sum()) == 0


@pytest.mark.timeout(60)
def test_plain_moe_in_a_job_of_several_processes(world, device):
    """A single-device MoE (e.g. under torch DDP) has no peers it knows of: its forward and bias update
    never raise alone; check_errors raises on every rank."""
    moe = reference_moe(CFG, 0, device)
    x = reference_tensor((7, D), 1, device=device)
    if dist.get_rank() == 1:
        x[2, 2] = float("inf")
    moe(x).sum().backward()
    moe.update_expert_bias()  # no raise on rank 1 alone: it drops the step's counts and keeps its bias
    assert dist.get_rank() != 1 or (int(moe.expert_bias.abs().sum()) == 0 and int(moe.tokens_per_expert.sum()) == 0)
    assert_raises_everywhere(SPMDRoutingError, spmdmoe.check_errors, match=r"\(rank 1: non-finite")


@pytest.mark.timeout(60)
def test_layers_that_differ_per_pipeline_stage(world, device, mesh2d_wide):
    """Each dp row here plays a pipeline stage with its own layer: agreeing over the world rejects it
    (the weights differ), agreeing over the stage's group accepts it; load_state_dict agrees there too."""
    stage, sp = mesh2d_wide["dp"].get_local_rank(), mesh2d_wide["sp"]
    moe = reference_moe(CFG, 10 + stage, device)
    assert_raises_everywhere(MoEConfigError, lambda: parallelize_moe(moe, sp_mesh=sp), match=r"weights")
    layer = parallelize_moe(moe, sp_mesh=sp, agree_over=sp)
    assert layer.agree_over == spmdmoe.mesh_axis(sp)
    layer.load_state_dict(moe.state_dict())


# ------------------------------------------------------------------ the layer itself differs
def _layer_differs(world, device, request, **changes):
    cfg = {**CFG.__dict__}
    moe_seed = 0
    plan_args = dict(sp_mesh=world, ep_mesh=world)
    if dist.get_rank() == world.size() - 1:
        moe_seed = changes.pop("seed", 0)
        plan_args.update(changes.pop("plan", {}))
        cfg.update(changes)
    moe = reference_moe(MoEConfig(**cfg), moe_seed, device)
    return lambda: parallelize_moe(moe, **plan_args)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("change,match", [
    (dict(top_k=3), r"MoEConfig.top_k: per rank \[2, .*3\]"),
    (dict(num_experts=2 * E), r"MoEConfig.num_experts"),  # (divides by any EP size E does: only the value differs)
    (dict(dim=8), r"MoEConfig.dim"),
    (dict(aux_loss_coeff=0.1), r"MoEConfig \(hash of every option\)"),
    (dict(router_dtype="input"), r"MoEConfig \(hash of every option\)"),
    (dict(plan=dict(ep_mesh=None)), r"plan's ep_mesh size"),
    (dict(plan=dict(sp_mode="gather", ep_mesh=None)), r"plan's (ep_mesh size|sp_mode)"),
    (dict(seed=1), r"weights \(fingerprint"),
], ids=["top_k", "num_experts", "dim", "aux_loss_coeff", "router_dtype", "no_ep", "sp_mode", "weights"])
def test_layer_differs_on_one_rank(world, device, request, change, match):
    """Issue 10: ranks that disagree on the layer raise at parallelize_moe, on every rank."""
    assert_raises_everywhere(MoEConfigError, _layer_differs(world, device, request, **change), match=match)


@pytest.mark.timeout(60)
def test_plan_problem_on_one_rank(world, device, request, mesh2d):
    """A mesh that is not one axis, or a layer that is already parallel, on one rank only."""
    moe = reference_moe(CFG, 0, device)
    last = dist.get_rank() == world.size() - 1
    assert_raises_everywhere(SPMDMeshError, lambda: parallelize_moe(moe, sp_mesh=mesh2d if last else world),
                             match=rf"rank {world.size() - 1}: mesh argument not usable")
    once = parallelize_moe(moe, sp_mesh=world)
    assert_raises_everywhere(MoEConfigError, lambda: parallelize_moe(once if last else moe, sp_mesh=world),
                             match=rf"rank {world.size() - 1}: MoE config or plan cannot work")
    assert_raises_everywhere(MoEConfigError, lambda: parallelize_moe(once, sp_mesh=world), match="already parallel")


@pytest.mark.timeout(60)
def test_experts_not_divisible_on_one_rank(world, device):
    cfg = MoEConfig(dim=D, hidden_dim=F, num_experts=E if dist.get_rank() else world.size() + 1, top_k=1)
    err = assert_raises_everywhere(MoEConfigError, lambda: parallelize_moe(reference_moe(cfg, 0, device), ep_mesh=world),
                                   match=r"\(rank 0: MoE config or plan cannot work\)")
    assert dist.get_rank() != 0 or "does not divide" in str(err)


@pytest.mark.timeout(60)
def test_check_layout_catches_local_constructors(world, device):
    """Issue 14: local constructors skip cross-rank checks; spmdmoe.testing.check_layout makes them."""
    n, r = world.size(), world.get_local_rank()
    total = 11 if r == 0 else 10  # T differs on one rank: the next collective would abort
    x = SPMDTensor(torch.zeros(layout.local_tokens(total, n, r), 4, device=device), world, Shard(0), global_tokens=total)
    assert_raises_everywhere(SPMDLayoutError, lambda: spmdmoe.testing.check_layout(x),
                             match="disagree on the declared global_tokens")
    y = spmdmoe.shard(torch.zeros(10, 4, device=device), world)
    if r == 1:
        y = y.with_local(y.local.half())
    assert_raises_everywhere(SPMDLayoutError, lambda: spmdmoe.testing.check_layout(y), match="disagree on the dtype")
    spmdmoe.testing.check_layout(spmdmoe.shard(torch.zeros(10, 4, device=device), world))


@pytest.mark.timeout(60)
def test_check_errors_is_collective_and_clears(world, device):
    """Mode (c) on its own: a problem recorded on one rank, raised by check_errors on every rank."""
    from spmdmoe.sticky import ProblemFlag

    flag = ProblemFlag()
    if dist.get_rank() == 1 % world.size():
        flag.record(torch.tensor(1 << 12, device=device), device, ["rank 1: a detail only it knows"])
    err = assert_raises_everywhere(ValueError, spmdmoe.check_errors, match=r"check_errors rejected the input on 1 of")
    assert dist.get_rank() != 1 % world.size() or "a detail only it knows" in str(err)
    spmdmoe.check_errors()  # cleared on every rank
