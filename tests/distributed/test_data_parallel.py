"""Data parallelism around parallel MoE layers: per-parameter reductions under DDP, FSDP2 and by hand.

A 2x2 mesh (2x1 on 2 GPUs: then EP / SP are trivial, the wrappers still run on NCCL) trains a small model (a dense input projection, then an MoE layer
with a shared expert, plus a residual) for three SGD steps with the
aux-loss-free bias update on, and every step's loss and the final parameters
and expert biases must match a single-device run of the same model on the same
batches, computed on every rank. Objective: the mean over batches of each
batch's loss (sum of squared errors over its tokens / its token count, plus
the batch's aux loss).

* ``dp_ep``: "dp" x "ep"; each of the 4 ranks has its own batch (uneven sizes,
  one empty); experts split over "ep".
* ``dp_sp``: "dp" x "sp"; 2 batches of 37 tokens, each sharded over "sp".

Tolerance: fp32, ``rtol = 1e-5``, ``atol = 1e-5 * max|reference|`` (times ``world / 4`` above 4 ranks: more
batches summed).
"""

import dataclasses
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import spmdmoe
from moe_plans import reference_moe
from conftest import fresh_mesh
from spmdmoe import SPMDTensor
from spmdmoe.moe import (GradReduction, MoEConfig, ddp, fully_shard_moe, grad_reductions, overlap_grads, parallelize_moe,
                         reduce_grads, replicate_grads)
from spmdmoe.testing import assert_close_everywhere, assert_raises_everywhere, reference_tensor
from spmdmoe.types import layout

D, F, E = 16, 16, 8
CFG = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=2, num_shared_experts=1, load_balance_coeff=1e-2,
                aux_loss_coeff=1.0)
STEPS, LR = 3, 0.05
DP_EP_ROWS = [0, 5, 17, 9, 3, 11, 1, 7]  # batch b = rank (dp index * ep size + ep index); the first 4 at 4 ranks
DP_EP_ROWS_2 = [0, 22]  # on 2 ranks (5 tokens a step put FP8's noise above test_fp8_plans' 1 % bound)
DP_SP_ROWS = 37


class Net(nn.Module):
    """``moe(inp(x)) + inp(x)``; takes plain rows or an ``SPMDTensor`` (then returns its local rows)."""

    def __init__(self, moe: nn.Module, seed: int):
        super().__init__()
        self.inp = nn.Linear(D, D)
        with torch.no_grad():
            self.inp.weight.copy_(reference_tensor((D, D), seed) / D**0.5)
            self.inp.bias.copy_(reference_tensor((D,), seed + 1))
        self.moe = moe

    def forward(self, x):
        if isinstance(x, SPMDTensor):
            h = x.with_local(self.inp(x.local))
            return self.moe(h).local + h.local
        h = self.inp(x)
        return self.moe(h) + h


def _mesh(names, shape=None):
    """Fresh groups with a 30 s timeout for every plan (conftest.fresh_mesh): the frozen-parameter scenarios
    below are one-rank-bad, and a plan that leaves ranks out of step must not touch the next test."""
    world = dist.get_world_size()
    return fresh_mesh(shape or (2, world // 2), names)


def _data(step, rows, device):
    return reference_tensor((rows, D), 100 * step + rows, device=device), reference_tensor((rows, D), 7 + 100 * step + rows, device=device)


def _aux(layer):
    return 0 if layer.aux_loss is None else layer.aux_loss


def _reference(device, batches, cfg=CFG):
    """Single-device training on ``batches`` ((rows, shift) each); returns (losses, parameters, expert_bias)."""
    net = Net(reference_moe(cfg, 3, device), 50).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for rows, shift in batches:
            X, Y = _data(step, rows, device)
            loss = (((net(X + shift) - Y) ** 2).sum() / max(rows, 1) + _aux(net.moe)) / len(batches)
            loss.backward()
            total += float(loss.detach())
        net.moe.update_expert_bias()
        opt.step()
        losses.append(total)
    return losses, {n: p.detach() for n, p in net.named_parameters()}, net.moe.expert_bias.clone()


def _ep_rows():
    return DP_EP_ROWS_2 if dist.get_world_size() == 2 else DP_EP_ROWS[: dist.get_world_size()]


def _batches(plan):
    if plan in ("dp_ep", "ep"):
        return [(rows, 0) for rows in _ep_rows()]
    return [(DP_SP_ROWS, 0), (DP_SP_ROWS, 1)] if plan == "dp_sp" else [(DP_SP_ROWS, 0)]


def _plan(plan, device, cfg=CFG):
    """(model, this rank's batch loss function, expert slice, number of batches)."""
    if plan in ("dp_ep", "ep"):  # "ep": a 1 x world mesh, so EP alone spans the batches
        mesh = _mesh(("dp", "ep"), None if plan == "dp_ep" else (1, dist.get_world_size()))
        ep, e = mesh["ep"].get_local_rank(), E // mesh["ep"].size()
        layer = parallelize_moe(reference_moe(cfg, 3, device), ep_mesh=mesh["ep"], dp_mesh=mesh["dp"])
        rows = _ep_rows()[dist.get_rank()]

        def batch(step):
            return (*_data(step, rows, device), max(rows, 1))

        return Net(layer, 50).to(device), batch, slice(ep * e, (ep + 1) * e), dist.get_world_size()
    # "sp", "sp_ep": a 1 x world mesh, one batch over every rank's SP share (and EP on the SP axis)
    mesh = _mesh(("dp", "sp"), None if plan == "dp_sp" else (1, dist.get_world_size()))
    sp = mesh["sp"]
    layer = parallelize_moe(reference_moe(cfg, 3, device), sp_mesh=sp, dp_mesh=mesh["dp"],
                            ep_mesh=sp if plan == "sp_ep" else None)
    net = Net(layer, 50).to(device)
    replicate_grads(net.inp, sp)
    n, r = sp.size(), sp.get_local_rank()
    start = layout.chunk_offset(DP_SP_ROWS, n, r)
    mine = slice(start, start + layout.local_tokens(DP_SP_ROWS, n, r))

    def batch(step):
        X, Y = _data(step, DP_SP_ROWS, device)
        X = X + mesh["dp"].get_local_rank()  # batch d is batch 0 shifted by d (see _batches)
        return spmdmoe.from_local(X[mine].clone(), sp, global_tokens=DP_SP_ROWS), Y[mine], DP_SP_ROWS

    e = E // sp.size() if plan == "sp_ep" else E
    return net, batch, slice(r * e, (r + 1) * e) if plan == "sp_ep" else slice(0, E), mesh["dp"].size()


def _full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def _close(actual, expected, name):
    # fp32 sums over the batches (a rank's each, at most 4 up to 4 ranks): the rounding grows with their count
    batches = max(dist.get_world_size() / 4, 1)
    atol = 1e-5 * batches * max(float(expected.abs().max()) if expected.numel() else 0.0, 1e-30)
    assert_close_everywhere(actual.detach(), expected.detach(), rtol=1e-5, atol=atol, name=name)


WRAPPERS = {
    "ddp": ddp,
    "fsdp2": fully_shard_moe,
    "fsdp2_blocks": lambda net: fully_shard_moe(net, blocks=[net.inp, net.moe]),
    "reduce_grads": lambda net: net,
}
# the same with the whole net joined by overlap_grads (dp_sp: its SP sums then overlap backward)
OVERLAPPED = {f"{name}+overlap": (lambda wrap: lambda net: wrap(overlap_grads(net)))(wrap)
              for name, wrap in WRAPPERS.items()}


@pytest.mark.parametrize(
    "plan, wrapper",
    [(p, w) for p in ("dp_ep", "dp_sp") for w in WRAPPERS] + [("ep", w) for w in WRAPPERS]
    + [("dp_sp", w) for w in OVERLAPPED]
    + [(p, w) for p in ("sp", "sp_ep") for w in ("fsdp2", "fsdp2_blocks", "fsdp2+overlap", "fsdp2_blocks+overlap")],
)
def test_training_matches_single_device(device, plan, wrapper):
    """dp x ep, dp x sp (every wrapper; FSDP2 also with the layers as their own units; every wrapper
    again with the net joined by ``overlap_grads``, whose SP sums then wait at the net's input), and
    over every rank with no dp (so on 2 ranks too, where dp x ep and dp x sp are 2 x 1): EP alone (the
    dense weights' batches are the EP ranks': FSDP2 shards them over EP, each rank's experts in a unit of
    its own), SP alone and EP on the SP axis (FSDP2 shards over the SP ranks, its reduce-scatter making
    the SP sums; with and without ``overlap_grads``)."""
    ref_losses, ref_params, ref_bias = _reference(device, _batches(plan))
    net, batch, experts, n_batches = _plan(plan, device)
    model = {**WRAPPERS, **OVERLAPPED}[wrapper](net)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        X, Y, count = batch(step)
        loss = ((model(X) - Y) ** 2).sum() / count + net.moe.aux_loss
        loss.backward()
        if wrapper.startswith("reduce_grads"):
            reduce_grads(net)
        net.moe.update_expert_bias()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        _close(total / n_batches, torch.tensor(ref_losses[step], device=device, dtype=total.dtype), f"step {step} loss")
    for name, p in net.named_parameters():
        want = ref_params[name][experts] if name.startswith("moe.experts.") else ref_params[name]
        _close(_full(p), want, f"{name} after {STEPS} steps")
    _close(net.moe.expert_bias, ref_bias, "expert_bias")


def test_ddp_no_sync_accumulates_micro_batches(device):
    """dp x ep under DDP, each rank's batch as two micro-batches, the first under no_sync(): the same run
    (without the aux loss, which is per batch, so not additive over micro-batches)."""
    cfg = dataclasses.replace(CFG, aux_loss_coeff=None)
    ref_losses, ref_params, ref_bias = _reference(device, _batches("dp_ep"), cfg)
    net, batch, experts, n_batches = _plan("dp_ep", device, cfg)
    model = ddp(net)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        X, Y, count = batch(step)
        half = X.shape[0] // 2
        with model.no_sync():
            ((model(X[:half]) - Y[:half]) ** 2).sum().div(count).backward()
        ((model(X[half:]) - Y[half:]) ** 2).sum().div(count).backward()
        net.moe.update_expert_bias()
        opt.step()
    for name, p in net.named_parameters():
        want = ref_params[name][experts] if name.startswith("moe.experts.") else ref_params[name]
        _close(p, want, f"{name} after {STEPS} accumulated steps")


def test_fsdp2_micro_batches_with_units_left_unsharded(device):
    """dp x sp under FSDP2 with the layers as units inside an ``overlap_grads`` net, each step as two
    halves of the loss, the units left unsharded between them (torchtitan's accumulation): the
    first forward's net then sees the units' unsharded parameters, whose SP sums must still be done
    inside each unit (before its reduce-scatter), not at the net's input. Same run as one device."""
    cfg = dataclasses.replace(CFG, aux_loss_coeff=None)
    ref_losses, ref_params, ref_bias = _reference(device, _batches("dp_sp"), cfg)
    net, batch, experts, n_batches = _plan("dp_sp", device, cfg)
    model = fully_shard_moe(overlap_grads(net), blocks=[net.inp, net.moe])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        X, Y, count = batch(step)
        for last in (False, True):
            model.set_reshard_after_backward(last, recurse=True)
            (((model(X) - Y) ** 2).sum() / count / 2).backward()
        net.moe.update_expert_bias()
        opt.step()
    for name, p in net.named_parameters():
        _close(_full(p), ref_params[name], f"{name} after {STEPS} accumulated steps")


def test_ddp_hook_with_several_groups_in_one_bucket(device):
    """The experts reduced over a second group object with the same ranks: every bucket then holds
    two groups (two collectives, chained futures), on 2 ranks too; the run is unchanged."""
    ref_losses, ref_params, ref_bias = _reference(device, _batches("dp_ep"))
    net, batch, experts, n_batches = _plan("dp_ep", device)
    reductions = grad_reductions(net)
    half = dist.get_world_size() // 2
    twins = [dist.new_group([c, c + half]) for c in range(half)]  # the "dp" columns, created again
    twin = spmdmoe.mesh_axis(twins[dist.get_rank() % half])
    for name, red in reductions.items():
        if name.startswith("moe.experts."):
            assert sorted(dist.get_process_group_ranks(red.axis.group)) == sorted(dist.get_process_group_ranks(twin.group))
            reductions[name] = GradReduction(twin, red.divide_factor)
    model = ddp(net, reductions)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        X, Y, count = batch(step)
        (((model(X) - Y) ** 2).sum().div(count) + net.moe.aux_loss).backward()
        net.moe.update_expert_bias()
        opt.step()
    for name, p in net.named_parameters():
        want = ref_params[name][experts] if name.startswith("moe.experts.") else ref_params[name]
        _close(p, want, f"{name} after {STEPS} steps")


@pytest.mark.parametrize("factor", [1, "size", 3])
def test_reduce_grads_sums_and_divides(world, device, factor):
    """Sum over the group, then / factor (NCCL: AVG when factor = size, a pre-multiplied sum otherwise)."""
    n = dist.get_world_size()
    factor = n if factor == "size" else factor
    lin = nn.Linear(4, 3, bias=False).to(device)
    lin.weight.grad = torch.full_like(lin.weight, float(dist.get_rank() + 1))
    reduce_grads(lin, {"weight": GradReduction(spmdmoe.mesh_axis(world), factor)})
    expected = torch.full_like(lin.weight, n * (n + 1) / 2 / factor)
    assert_close_everywhere(lin.weight.grad, expected, rtol=1e-6, atol=0, name="reduced gradient")


@pytest.mark.world4
def test_reduction_table(device):
    """dp x ep: dense over all 4 ranks, experts over dp only, both / 4. dp x sp: everything over dp, / 2."""
    mesh = _mesh(("dp", "ep"))
    net = Net(parallelize_moe(reference_moe(CFG, 3, device), ep_mesh=mesh["ep"], dp_mesh=mesh["dp"]), 50)
    red = grad_reductions(net)
    assert set(red) == {n for n, _ in net.named_parameters()}
    dp_ranks = sorted(dist.get_process_group_ranks(mesh["dp"].get_group()))
    for name, r in red.items():
        want = dp_ranks if name.startswith("moe.experts.") else [0, 1, 2, 3]
        assert sorted(dist.get_process_group_ranks(r.axis.group)) == want, name
        assert r.divide_factor == 4 and r.mesh.size() == len(want)
    mesh = _mesh(("dp", "sp"))
    net = Net(parallelize_moe(reference_moe(CFG, 3, device), sp_mesh=mesh["sp"], dp_mesh=mesh["dp"]), 50)
    for name, r in grad_reductions(net).items():
        assert r.axis.group is mesh["dp"].get_group() and r.divide_factor == 2, name


@pytest.mark.world4
def test_layers_with_different_batch_axes_are_rejected(device):
    mesh = _mesh(("dp", "ep"))
    net = nn.Sequential(
        parallelize_moe(reference_moe(CFG, 3, device), ep_mesh=mesh["ep"], dp_mesh=mesh["dp"]),
        parallelize_moe(reference_moe(CFG, 3, device), ep_mesh=mesh["ep"]),
    )
    assert_raises_everywhere(spmdmoe.SPMDMeshError, lambda: grad_reductions(net), match="batch axes")


def test_ddp_without_batch_axes_is_rejected(world, device):
    """SP with EP on it, no dp: no gradient reduction for DDP (FSDP2 still shards over the SP ranks, above);
    a layer on one rank alone: none for FSDP2 either."""
    net = Net(parallelize_moe(reference_moe(CFG, 3, device), sp_mesh=world, ep_mesh=world), 50)
    assert_raises_everywhere(spmdmoe.SPMDMeshError, lambda: ddp(net), match="nothing for DDP")
    alone = spmdmoe.meshes.own_axis(device.type)
    net = Net(parallelize_moe(reference_moe(CFG, 3, device), ep_mesh=alone, agree_over=alone), 50)
    assert_raises_everywhere(spmdmoe.SPMDMeshError, lambda: fully_shard_moe(net), match="nothing to shard over")


@pytest.mark.world4
def test_dp_axis_must_be_orthogonal(world, device):
    mesh = _mesh(("dp", "sp"))
    moe = reference_moe(CFG, 3, device)
    assert_raises_everywhere(
        spmdmoe.SPMDMeshError, lambda: parallelize_moe(moe, sp_mesh=mesh["sp"], dp_mesh=world), match="orthogonal"
    )


@pytest.mark.world4
def test_product_axis(world, device):
    mesh = _mesh(("dp", "sp"))
    both = spmdmoe.product_axis(mesh["dp"], mesh["sp"])
    assert both.size == 4 and spmdmoe.product_axis(mesh["dp"], mesh["sp"]) is both
    assert spmdmoe.product_axis(mesh["dp"], None) == spmdmoe.mesh_axis(mesh["dp"])
    assert_raises_everywhere(
        spmdmoe.SPMDMeshError, lambda: spmdmoe.product_axis(world, mesh["sp"]), match="not orthogonal"
    )


@pytest.mark.parametrize("plan", ["dp_ep", "ep", "sp_ep"])
def test_fsdp2_checkpoint_round_trip(device, shared_tmp, plan):
    """An FSDP2-wrapped model saves global experts: they load into an unwrapped model of the same plan, a
    fresh FSDP2 model and the single-device model, exactly. dp x ep; EP alone (each rank's experts an FSDP2
    unit of their own); EP on the SP axis (FSDP2 over the SP ranks)."""
    import torch.distributed.checkpoint as dcp

    net, batch, experts, _ = _plan(plan, device)
    fully_shard_moe(net)
    X, Y, count = batch(0)
    ((net(X) - Y) ** 2).sum().div(count).backward()
    torch.optim.SGD(net.parameters(), lr=LR).step()
    trained = {n: _full(p).detach().clone() for n, p in net.named_parameters()}
    dcp.save(net.state_dict(), checkpoint_id=shared_tmp)

    for wrap in (lambda m: m, fully_shard_moe):
        other = Net(parallelize_moe(reference_moe(CFG, 9, device), ep_mesh=net.moe.ep, dp_mesh=net.moe.dp,
                                    sp_mesh=net.moe.sp), 51)
        other = wrap(other)
        sd = other.state_dict()
        dcp.load(sd, checkpoint_id=shared_tmp)
        other.load_state_dict(sd)
        for n, p in other.named_parameters():
            assert_close_everywhere(_full(p).detach(), trained[n], rtol=0, atol=0, name=n)

    single = Net(reference_moe(CFG, 9, device), 51)
    sd = single.state_dict()
    dcp.load(sd, checkpoint_id=shared_tmp)
    single.load_state_dict(sd)
    for n, p in single.named_parameters():
        mine = p.detach()[experts] if n.startswith("moe.experts.") else p.detach()
        assert_close_everywhere(mine, trained[n], rtol=0, atol=0, name=f"single device: {n}")


class _NT(NamedTuple):
    h: object


@dataclasses.dataclass
class _DC:
    h: object


@pytest.mark.parametrize("kind", ["plain", "tuple", "namedtuple", "dataclass"])
def test_fsdp2_units_pass_spmd_tensors_in_containers(device, kind):
    """A resharding FSDP2 unit returning an SPMDTensor (bare or inside a container FSDP2 walks) runs
    its backward on gathered parameters: gradients equal those of the unwrapped model."""
    import torch.distributed.fsdp._common_utils as fsdp_utils
    from torch.distributed.fsdp import fully_shard

    from spmdmoe.moe import register_spmd_hooks

    if kind == "dataclass" and not hasattr(fsdp_utils, "collect_grad_tensors"):
        pytest.skip("this torch's FSDP2 walks pytrees, not dataclasses (not even a plain tensor in one)")
    mesh = _mesh(("dp", "sp"))
    wrap = {"plain": lambda y: y, "tuple": lambda y: (y,), "namedtuple": _NT, "dataclass": _DC}[kind]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x):
            return wrap(x.with_local(torch.tanh(self.lin(x.local))))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre, self.block, self.head = nn.Linear(D, D), Block(), nn.Linear(D, 1)

        def forward(self, x):
            out = self.block(x.with_local(self.pre(x.local)))
            h = out if isinstance(out, SPMDTensor) else out[0] if isinstance(out, tuple) else out.h
            return self.head(h.local).sum()

    def grads(model):
        rows = reference_tensor((layout.local_tokens(7, mesh["sp"].size(), mesh["sp"].get_local_rank()), D),
                                dist.get_rank(), device=device)
        model(spmdmoe.from_local(rows, mesh["sp"], global_tokens=7)).backward()
        return {n: _full(p.grad) for n, p in model.named_parameters()}

    torch.manual_seed(0)
    plain = Model().to(device)
    torch.manual_seed(0)
    sharded = Model().to(device)
    fully_shard(sharded.block, mesh=mesh["dp"])
    register_spmd_hooks(sharded.block)
    fully_shard(sharded, mesh=mesh["dp"])
    register_spmd_hooks(sharded)
    want, got = grads(plain), grads(sharded)
    for name, g in want.items():  # FSDP2 averages over dp: compare with the dp mean of the plain grads
        dist.all_reduce(g, group=mesh["dp"].get_group())
        _close(got[name], g / 2, f"{kind}: {name}.grad")


def test_reductions_must_cover_every_parameter(device):
    net, *_ = _plan("dp_ep", device)
    partial = dict(list(grad_reductions(net).items())[1:])
    assert_raises_everywhere(spmdmoe.SPMDLayoutError, lambda: reduce_grads(net, partial), match="no gradient reduction")
    assert_raises_everywhere(spmdmoe.SPMDLayoutError, lambda: ddp(net, partial), match="no gradient reduction")


def _frozen_step(device, frozen_on):
    """One dp x ep step through ``reduce_grads`` with ``inp.weight`` frozen on the ranks in ``frozen_on``;
    returns the net (``check_errors`` not called yet)."""
    net, batch, *_ = _plan("dp_ep", device)
    if dist.get_rank() in frozen_on:
        net.inp.weight.requires_grad_(False)
    X, Y, count = batch(0)
    (((net(X) - Y) ** 2).sum() / count + net.moe.aux_loss).backward()
    reduce_grads(net)
    return net


@pytest.mark.timeout(60)
def test_reduce_grads_with_a_parameter_frozen_on_one_rank_raises_everywhere(device):
    """The last rank froze ``inp.weight``, which its peers train: the reductions still match (its part is
    zeros; before, the payloads differed in size and every rank hung), and ``check_errors`` raises the
    same SPMDLayoutError on every rank, naming it. Nothing is left recorded for the next step."""
    last = dist.get_world_size() - 1
    net = _frozen_step(device, {last})
    assert net.inp.weight.grad is None or dist.get_rank() != last
    assert_raises_everywhere(spmdmoe.SPMDLayoutError, spmdmoe.check_errors,
                             match=rf"rank {last}: it trains another set of parameters")
    spmdmoe.check_errors()  # cleared by the raise


@pytest.mark.timeout(60)
def test_reduce_grads_with_a_parameter_frozen_everywhere(device):
    """Every rank froze ``inp.weight``: no problem, its ``.grad`` stays ``None``, the other gradients are
    those of a run where it is trained (frozen parameters change no other gradient)."""
    want = {n: p.grad.clone() for n, p in _frozen_step(device, set()).named_parameters() if n != "inp.weight"}
    net = _frozen_step(device, set(range(dist.get_world_size())))
    spmdmoe.check_errors()
    assert net.inp.weight.grad is None
    for name, p in net.named_parameters():
        if name != "inp.weight":
            _close(p.grad, want[name], f"{name}.grad")
