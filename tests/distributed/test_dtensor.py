"""DTensor interop: exact round trips, rejection of wrong DTensor layouts on every rank, gradient
conventions across the boundary (no x world, no / world), and the module adapter.

References are single-device computations from the same seeds; float64 values compare at 1e-12,
the MoE adapter at the MoE parity tolerance (fp32, rtol 1e-5)."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor import Partial as DPartial
from torch.distributed.tensor import Replicate as DReplicate
from torch.distributed.tensor import Shard as DShard

import spmdmoe
from moe_plans import reference_moe
from spmdmoe import Partial, Replicate, Shard, SPMDLayoutError
from spmdmoe.dtensor import DTensorAdapter, from_dtensor, to_dtensor
from spmdmoe.moe import MoEConfig, parallelize_moe
from spmdmoe.testing import assert_close_everywhere, assert_raises_everywhere, reference_tensor
from spmdmoe.types import layout

F64 = dict(rtol=1e-12, atol=1e-12)


def _rows(world, total):
    n, r = world.size(), world.get_local_rank()
    start = layout.chunk_offset(total, n, r)
    return slice(start, start + layout.local_tokens(total, n, r))


@pytest.mark.parametrize("total", [1, 3, 5, 8, 1023])
def test_round_trips(world, device, total):
    full = reference_tensor((total, 6), total, dtype=torch.float64, device=device)
    x = spmdmoe.shard(full, world)
    dt = to_dtensor(x)
    assert dt.shape == (total, 6) and dt.placements == (DShard(0),)
    assert_close_everywhere(dt.full_tensor(), full, rtol=0, atol=0, name="to_dtensor full_tensor")
    y = from_dtensor(dt)
    assert y.placement == Shard(0) and y.global_tokens == total and torch.equal(y.local, x.local)
    # an axis given as a ProcessGroup gets a DeviceMesh built on that group
    via_group = to_dtensor(spmdmoe.shard(full, world.get_group()))
    assert_close_everywhere(via_group.full_tensor(), full, rtol=0, atol=0, name="ProcessGroup axis")
    # a DTensor built by hand with the right shape passes the collective check
    hand = DTensor.from_local(x.local, world, [DShard(0)], shape=(total, 6), stride=(6, 1))
    assert from_dtensor(hand).global_tokens == total
    for placement, dplace in ((Replicate(), DReplicate()), (Partial(), DPartial())):
        z = spmdmoe.from_local(full, world, placement=placement)
        dz = to_dtensor(z)
        assert dz.placements == (dplace,) and dz.shape == (total, 6)
        back = from_dtensor(dz)
        assert back.placement == placement and torch.equal(back.local, full)
    assert_close_everywhere(to_dtensor(spmdmoe.from_local(full, world, placement=Partial())).full_tensor(),
                            world.size() * full, **F64, name="Partial sums")


def test_rejects_inferred_global_shape_everywhere(world, device):
    """DTensor.from_local without shape= on an uneven split infers local x world on each rank."""
    total = 4 * world.size() - 1
    local = reference_tensor((total, 3), 1, device=device)[_rows(world, total)]
    dt = DTensor.from_local(local, world, [DShard(0)])  # ranks disagree on the global size
    err = assert_raises_everywhere(SPMDLayoutError, lambda: from_dtensor(dt), match="local x world")
    assert "shape=" in str(err)


def test_rejects_non_chunk_split_everywhere(world, device):
    n, r = world.size(), world.get_local_rank()
    sizes = list(range(1, n + 1))  # 1, 2, 3, 4 rows: plausible per rank, jointly not the chunk rule
    total = sum(sizes)
    dt = DTensor.from_local(torch.zeros(sizes[r], 2, device=device), world, [DShard(0)], shape=(total, 2), stride=(2, 1))
    assert_raises_everywhere(SPMDLayoutError, lambda: from_dtensor(dt), match="bad Shard")


def test_rejects_unsupported_placements(world, device):
    dt = DTensor.from_local(torch.zeros(3, 2, device=device), world, [DPartial("max")], shape=(3, 2), stride=(2, 1))
    assert_raises_everywhere(SPMDLayoutError, lambda: from_dtensor(dt), match="Partial")
    v = spmdmoe.SPMDTensor(torch.zeros(2, 2, device=device), world, spmdmoe.Varying())
    assert_raises_everywhere(SPMDLayoutError, lambda: to_dtensor(v), match="Varying")


def test_replicate_gradient_dtensor_into_spmdmoe(world, device):
    """A replicated DTensor parameter used by spmdmoe code on each rank's rows: its DTensor
    gradient is the single-device one (spmdmoe's Partial gradients are summed, once)."""
    total = 4 * world.size() + 1
    P = reference_tensor((total, 5), 2, dtype=torch.float64, device=device)
    W = reference_tensor((total, 5), 3, dtype=torch.float64, device=device)
    param = distribute_tensor(P, world, [DReplicate()]).requires_grad_()
    x = from_dtensor(param)
    mine = spmdmoe.redistribute(x, Shard(0))  # this rank's rows of the replicated tensor
    rows = _rows(world, total)
    (mine.local * W[rows]).sum().backward()  # spmdmoe: the per-rank losses sum to (P * W).sum()
    assert isinstance(param.grad, DTensor)
    assert_close_everywhere(param.grad.full_tensor(), W, **F64, name="DTensor parameter gradient")


def test_replicate_gradient_spmdmoe_into_dtensor(world, device):
    """spmdmoe's Replicate (an all-gather) handed to DTensor code whose loss is one logical
    value: the sharded input gets the single-device gradient, not world times it."""
    total = 3 * world.size() - 1
    X = reference_tensor((total, 4), 4, dtype=torch.float64, device=device)
    W = reference_tensor((total, 4), 5, dtype=torch.float64, device=device)
    rows = _rows(world, total)
    leaf = X[rows].clone().requires_grad_()
    g = spmdmoe.all_gather(spmdmoe.from_local(leaf, world, global_tokens=total))
    dt = to_dtensor(g)
    loss = (dt * distribute_tensor(W, world, [DReplicate()])).sum()  # DTensor: one replicated loss
    loss.full_tensor().backward()
    assert_close_everywhere(leaf.grad, W[rows], **F64, name="input gradient through to_dtensor(Replicate)")


def test_shard_gradients_both_ways(world, device):
    """DTensor Shard -> spmdmoe (a row-wise op) -> DTensor Shard -> a DTensor loss: dX = 3 W."""
    total = 2 * world.size() + 1
    X = reference_tensor((total, 3), 6, dtype=torch.float64, device=device)
    W = reference_tensor((total, 3), 7, dtype=torch.float64, device=device)
    rows = _rows(world, total)
    leaf = X[rows].clone().requires_grad_()
    dt = DTensor.from_local(leaf, world, [DShard(0)], shape=(total, 3), stride=(3, 1))
    x = from_dtensor(dt)
    out = to_dtensor(x.with_local(3 * x.local))
    assert out.placements == (DShard(0),) and out.shape == (total, 3)
    (out * distribute_tensor(W, world, [DShard(0)])).sum().full_tensor().backward()
    assert_close_everywhere(leaf.grad, 3 * W[rows], **F64, name="Shard gradient through both adapters")


def test_module_adapter_runs_a_parallel_moe_on_dtensor_activations(world, device):
    cfg = MoEConfig(dim=16, hidden_dim=16, num_experts=8, top_k=2, num_shared_experts=1)
    moe = reference_moe(cfg, 5, device)
    total = 5 * world.size() - 2
    X = reference_tensor((total, 16), 8, device=device)
    G = reference_tensor((total, 16), 9, device=device)
    ref_x = X.clone().requires_grad_()
    ref_y = moe(ref_x)
    (ref_y * G).sum().backward()
    block = DTensorAdapter(parallelize_moe(moe, sp_mesh=world, ep_mesh=world))
    rows = _rows(world, total)
    leaf = X[rows].clone().requires_grad_()
    dt = DTensor.from_local(leaf, world, [DShard(0)], shape=(total, 16), stride=(16, 1))
    out = block(dt)
    assert isinstance(out, DTensor) and out.shape == (total, 16) and out.placements == (DShard(0),)
    (out.to_local() * G[rows]).sum().backward()
    tol = dict(rtol=1e-5, atol=1e-5 * float(ref_y.detach().abs().max()))
    assert_close_everywhere(out.full_tensor(), ref_y.detach(), **tol, name="adapter output")
    assert_close_everywhere(leaf.grad, ref_x.grad[rows], rtol=1e-5, atol=1e-5 * float(ref_x.grad.abs().max()), name="adapter input grad")
    assert [n for n, _ in block.named_parameters()][0].startswith("layer.")


def test_module_adapter_refuses_batch_seq_activations_with_the_fix(world, device):
    """torchtitan's activations as they come, ``(batch, seq, dim)`` sharded on the sequence: the SP layer takes
    ``(tokens, dim)`` rows, so every rank raises SPMDLayoutError saying to flatten them and shard the tokens."""
    block = DTensorAdapter(parallelize_moe(reference_moe(MoEConfig(dim=16, hidden_dim=16, num_experts=8, top_k=2), 5,
                                                         device), sp_mesh=world, ep_mesh=world))
    dt = distribute_tensor(reference_tensor((2, 37, 16), 8, device=device), world, [DShard(1)])
    assert_raises_everywhere(SPMDLayoutError, lambda: block(dt), match=r"DTensorAdapter: flatten it to \(tokens, dim\)")


@pytest.mark.one_rank_bad
def test_unsupported_placement_on_one_rank_raises_everywhere(world, device):
    """Before: the rank whose DTensor had an unsupported placement (Partial('max')) raised on its own, and its
    peers waited in from_local's exchange. Its problem now rides that exchange: every rank raises."""
    total, bad = 5, world.size() - 1
    rows = _rows(world, total)
    full = reference_tensor((total, 3), 1, device=device)
    if world.get_local_rank() == bad:
        dt = DTensor.from_local(full, world, [DPartial("max")], run_check=False, shape=(total, 3), stride=(3, 1))
    else:
        dt = DTensor.from_local(full[rows], world, [DShard(0)], run_check=False, shape=(total, 3), stride=(3, 1))
    err = assert_raises_everywhere(SPMDLayoutError, lambda: from_dtensor(dt), match=rf"rank {bad}: unknown placement")
    assert world.get_local_rank() != bad or "Partial('sum')" in str(err), str(err)
