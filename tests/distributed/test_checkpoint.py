"""Checkpoints of parallel MoE layers: DCP saves every expert and loads across EP / TP layouts;
torchtitan state dicts (0.3.0 and older names, plain and DTensor values) load everywhere; a bad entry
on one rank raises on every rank.

Every comparison is exact (rtol = atol = 0): checkpoints move bytes."""

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor import Shard as DShard

from moe_plans import build_plan, expert_grad_slice, reference_moe
from spmdmoe import SPMDLayoutError
from spmdmoe.moe import MoEConfig, parallelize_moe
from spmdmoe.moe.checkpoint import from_torchtitan, to_torchtitan
from spmdmoe.testing import assert_close_everywhere, assert_raises_everywhere

CFG = MoEConfig(dim=16, hidden_dim=8, num_experts=8, top_k=2, num_shared_experts=1, load_balance_coeff=1e-3)
EXACT = dict(rtol=0, atol=0)


def _check(plan, ref, what):
    want = dict(ref.named_parameters())
    for name, p in plan.layer.named_parameters():
        expected = expert_grad_slice(name, want[name], plan) if name.startswith("experts.") else want[name]
        assert_close_everywhere(p.detach(), expected.detach(), **EXACT, name=f"{what}: {name}")
    assert_close_everywhere(plan.layer.expert_bias, ref.expert_bias, **EXACT, name=f"{what}: expert_bias")


@pytest.mark.parametrize("source", ["sp_ep", "gather", "gather_ep"])
@pytest.mark.parametrize("target", ["sp_ep", "sp_x_ep", "sp", "gather", "gather_ep"])
def test_dcp_save_and_load_across_layouts(world, device, request, shared_tmp, source, target, monkeypatch):
    ref = reference_moe(CFG, 1, device)
    with torch.no_grad():
        ref.expert_bias.copy_(torch.linspace(-1, 1, CFG.num_experts))
    saved = build_plan(source, ref, 8, world, request).layer
    sd = saved.state_dict()
    for name in ("experts.w1", "experts.w2", "experts.w3"):
        assert isinstance(sd[name], DTensor) and sd[name].shape == ref.state_dict()[name].shape
    dcp.save(sd, checkpoint_id=shared_tmp)

    plan = build_plan(target, reference_moe(CFG, 2, device), 8, world, request)
    target_sd = plan.layer.state_dict()
    full = []  # no rank materialises a full expert tensor: DCP reads each rank's shards only
    real = DTensor.full_tensor
    monkeypatch.setattr(DTensor, "full_tensor", lambda self, **kw: (full.append(self.shape), real(self, **kw))[1])
    dcp.load(target_sd, checkpoint_id=shared_tmp)
    plan.layer.load_state_dict(target_sd)
    assert full == [], f"full_tensor() called on {full}"
    _check(plan, ref, f"saved by {source}, loaded by {target}")


def test_one_expert_a_rank_loads_its_own_state_dict(world, device, shared_tmp):
    """E = EP size (Mixtral's 8 experts at EP 8): a rank's expert weights are a ``(1, F, D)`` slice of the packed
    ``[w1 | w3]``, and its state dict's view of them has other strides in the size-1 dim; loading that state dict
    (as ``load_state_dict(state_dict())`` and DCP's in-place load do) made ``copy_`` refuse a "partial overlap".
    Found at 8 gloo processes with the suite's E = 8."""
    n = world.size()
    cfg = MoEConfig(dim=16, hidden_dim=8, num_experts=n, top_k=1)
    ref = reference_moe(cfg, 6, device)
    layer = parallelize_moe(ref, sp_mesh=world, ep_mesh=world)
    before = {k: v.detach().clone() for k, v in layer.named_parameters()}
    layer.load_state_dict(layer.state_dict())
    sd = layer.state_dict()
    dcp.save(sd, checkpoint_id=shared_tmp)
    dcp.load(sd, checkpoint_id=shared_tmp)
    layer.load_state_dict(sd)
    for name, p in layer.named_parameters():
        assert_close_everywhere(p.detach(), before[name], **EXACT, name=name)


def test_dcp_checkpoint_loads_into_the_single_device_layer(world, device, request, shared_tmp):
    ref = reference_moe(CFG, 3, device)
    dcp.save(build_plan("sp_ep", ref, 8, world, request).layer.state_dict(), checkpoint_id=shared_tmp)
    single = reference_moe(CFG, 4, device)
    sd = single.state_dict()
    dcp.load(sd, checkpoint_id=shared_tmp)
    single.load_state_dict(sd)
    for name, p in single.named_parameters():
        assert_close_everywhere(p.detach(), ref.state_dict()[name], **EXACT, name=f"EP 1: {name}")


@pytest.mark.parametrize("style", ["new", "old", "dtensor"])
@pytest.mark.parametrize("target", ["sp_ep", "sp_x_ep", "gather", "ep"])
def test_torchtitan_state_dicts_load_into_parallel_layers(world, device, request, style, target):
    ref = reference_moe(CFG, 5, device)
    sd = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    sd["tokens_per_expert"] = torch.zeros(CFG.num_experts, device=device)
    if style == "old":  # oldest torchtitan: (E, D, F) w1/w3 and (E, F, D) w2, no expert_bias; explicit
        sd = {k: (v.transpose(1, 2).contiguous() if k.startswith("experts.") else v) for k, v in sd.items()}
        del sd["expert_bias"]
        sd = from_torchtitan(sd, orientation="EDF")
    else:  # torchtitan 0.3.0 names, as its MoE module writes them
        sd = to_torchtitan(sd, names="new")
        assert {"routed_experts.inner_experts.w1_EFD", "expert_bias_E"} <= set(sd)
    if style == "dtensor":  # torchtitan EP: experts sharded on dim 0 over the world
        sd = {k: (distribute_tensor(v, world, [DShard(0)]) if k.startswith("experts.") else v) for k, v in sd.items()}
    plan = build_plan(target, reference_moe(CFG, 6, device), 8, world, request)
    plan.layer.load_state_dict(sd)
    _check(plan, ref if style != "old" else _without_bias(ref), f"torchtitan {style} into {target}")


def _without_bias(ref):
    with torch.no_grad():
        ref.expert_bias.zero_()  # an old dict has no expert_bias: the target keeps its own (zeros)
    return ref


def test_save_back_in_torchtitan_names(world, device, request):
    ref = reference_moe(CFG, 7, device)
    layer = build_plan("sp_ep", ref, 8, world, request).layer
    out = to_torchtitan(layer.state_dict(), names="new")
    assert {"routed_experts.inner_experts.w1_EFD", "routed_experts.inner_experts.w2_EDF",
            "routed_experts.inner_experts.w3_EFD", "expert_bias_E", "router.gate.weight"} <= set(out)
    assert_close_everywhere(out["routed_experts.inner_experts.w2_EDF"].full_tensor(), ref.experts.w2.detach(), **EXACT,
                            name="w2_EDF")
    plan = build_plan("sp_x_ep" if world.size() == 4 else "sp_ep", reference_moe(CFG, 8, device), 8, world, request)
    plan.layer.load_state_dict(out)  # round trip in torchtitan's names, across layouts
    _check(plan, ref, "torchtitan names round trip")


@pytest.mark.one_rank_bad
@pytest.mark.parametrize("bad", ["shape", "missing", "kind", "transposed"])
def test_bad_entry_on_one_rank_raises_everywhere(world, device, request, bad):
    """Issue 13: a state dict that is wrong on ONE rank used to hang the others (in the gathers that
    loading a DTensor of another layout needs); every rank now raises before any gather."""
    ref = reference_moe(CFG, 9, device)
    sd = {k: (distribute_tensor(v.detach(), world, [DShard(0)]) if k.startswith("experts.") else v.detach().clone())
          for k, v in ref.state_dict().items()}
    layer = build_plan("gather", reference_moe(CFG, 10, device), 8, world, request).layer
    if dist.get_rank() == world.size() - 1:
        if bad == "shape":
            sd["router.gate.weight"] = torch.zeros(3, 3, device=device)
        elif bad == "missing":
            del sd["experts.w2"]
        elif bad == "kind":  # a plain full tensor here, DTensors elsewhere: the others would gather alone
            sd["experts.w1"] = ref.experts.w1.detach().clone()
        else:
            sd["experts.w1"] = ref.experts.w1.detach().transpose(1, 2).contiguous()
    last = world.size() - 1
    common = "disagree on the kind of entry experts.w1" if bad == "kind" else \
        rf"\(rank {last}: state dict entry cannot be loaded\)"
    err = assert_raises_everywhere(ValueError, lambda: layer.load_state_dict(sd), match=common)
    own = {"shape": "router.gate.weight: expected shape", "missing": "experts.w2 is missing",
           "kind": "", "transposed": "orientation='EDF'"}[bad]
    assert dist.get_rank() != last or own in str(err), str(err)


@pytest.mark.parametrize("source,target", [("sp_ep", "gather"), ("gather", "sp_ep"), ("sp_ep", "sp_ep")])
def test_in_memory_state_dict_of_another_layout_on_the_same_mesh(world, device, request, source, target,
                                                                monkeypatch):
    """A state dict whose experts are DTensors of another layout on the same mesh (EP blocks into a
    tensor-parallel layer and back) loads by redistribution: exact, and no full expert tensor on any rank."""
    ref = reference_moe(CFG, 5, device)
    sd = build_plan(source, ref, 8, world, request).layer.state_dict()
    plan = build_plan(target, reference_moe(CFG, 6, device), 8, world, request)
    full = []
    real = DTensor.full_tensor
    monkeypatch.setattr(DTensor, "full_tensor", lambda self, **kw: (full.append(self.shape), real(self, **kw))[1])
    plan.layer.load_state_dict(sd)
    assert full == [], f"full_tensor() called on {full}"
    _check(plan, ref, f"{source} state dict into {target}")


@pytest.mark.world4
@pytest.mark.timeout(60)
def test_grid_mesh_is_an_exchange_within_the_ep_group_made_once():
    """The 2-D ``(ep, sp)`` checkpoint mesh of a gather-mode layer with EP (``parallelize_moe`` builds it per
    layer) waits on the EP group only: ranks 1 and 3 (one EP group, a pipeline stage with such a layer) build
    it while ranks 0 and 2 (a stage without one) never call it; the mesh is the 2x2 grid. A second layer on
    the same axes reuses it with no collective: rank 1 alone asks again and gets the same mesh (a world
    all-gather hung here, and once per layer)."""
    import spmdmoe
    from spmdmoe.moe.params.checkpoint import grid_mesh
    from spmdmoe.types.mesh import mesh_axis

    mesh = spmdmoe.init_mesh("cuda" if dist.get_backend() == "nccl" else "cpu", (2, 2), mesh_dim_names=("ep", "sp"))
    ep, sp = mesh_axis(mesh["ep"]), mesh_axis(mesh["sp"])
    rank = dist.get_rank()
    if rank in (1, 3):
        grid = grid_mesh(ep, sp)
        assert grid.mesh.tolist() == [[0, 1], [2, 3]] and grid.mesh_dim_names == ("ep", "sp")
        assert tuple(grid.get_coordinate()) == (ep.rank, sp.rank)
        if rank == 1:
            assert grid_mesh(ep, sp) is grid
    dist.barrier()


@pytest.mark.one_rank_bad
@pytest.mark.parametrize("bad", ["missing", "plain"])
def test_bad_entry_on_one_rank_with_dtensors_wider_than_the_layers_group(world, device, mesh2d_wide, bad):
    """The experts are DTensors sharded over the whole world; the layer's EP group (and its agree_over) is one
    axis of a 2x2 mesh (2 x world/2 on more ranks). Before: the bad rank's group agreed and raised, while the other group went on into the
    DTensors' own gathers over the world and waited there. The load now agrees over the world whenever some
    rank's DTensors span ranks outside the layer's group (it asks its group first), so every rank raises."""
    ref = reference_moe(CFG, 9, device)
    sd = {k: (distribute_tensor(v.detach(), world, [DShard(0)]) if k.startswith("experts.") else v.detach().clone())
          for k, v in ref.state_dict().items()}
    ep = mesh2d_wide["sp"]
    layer = parallelize_moe(reference_moe(CFG, 10, device), ep_mesh=ep, agree_over=ep)
    last = world.size() - 1
    if dist.get_rank() == last:
        if bad == "missing":
            del sd["experts.w2"]
        else:  # no DTensor at all on this rank: it learns from its group that the load reaches past it
            sd.update({k: v.detach().clone() for k, v in ref.state_dict().items() if k.startswith("experts.")})
    match = rf"\(rank {last}: state dict entry cannot be loaded\)" if bad == "missing" else \
        "disagree on the kind of entry experts.w1"
    err = assert_raises_everywhere(SPMDLayoutError, lambda: layer.load_state_dict(sd), match=match)
    assert type(err) is SPMDLayoutError, f"{type(err).__name__}: {err}"


@pytest.mark.one_rank_bad
@pytest.mark.parametrize("bad", ["missing", "shape"])
def test_single_device_layer_loading_dtensors_with_a_bad_entry_on_one_rank(world, device, bad):
    """A single-device MoE on every rank of a job loads a state dict of DTensors sharded over the world (each rank
    gathers the full experts). It agreed on nothing: a rank missing an expert (or holding a misshapen one) skipped
    that gather, and its peers waited in it. A rank whose experts are DTensors on a mesh of other ranks now agrees
    over those ranks first, so every rank raises."""
    ref = reference_moe(CFG, 9, device)
    sd = {k: (distribute_tensor(v.detach(), world, [DShard(0)]) if k.startswith("experts.") else v.detach().clone())
          for k, v in ref.state_dict().items()}
    layer = reference_moe(CFG, 10, device)
    last = world.size() - 1
    if dist.get_rank() == last:
        if bad == "missing":
            del sd["experts.w2"]
        else:
            sd["experts.w2"] = distribute_tensor(torch.zeros(CFG.num_experts, CFG.dim, 3, device=device), world, [DShard(0)],
                                                 src_data_rank=None)
    err = assert_raises_everywhere(SPMDLayoutError, lambda: layer.load_state_dict(sd),
                                   match=rf"\(rank {last}: state dict entry cannot be loaded\)")
    assert type(err) is SPMDLayoutError, f"{type(err).__name__}: {err}"
