"""shard / from_local / padded_empty on several ranks, against a single-device reference.

Every rank builds the full tensor from the same seed (the reference), takes or
wraps its chunk, and the chunks are checked row for row, gathered back with a
raw torch.distributed all-gather, and differentiated. Exact equality (rtol =
atol = 0): these are views and copies, no arithmetic.
"""

import pytest
import torch
import torch.distributed as dist

import spmdmoe
from spmdmoe import Partial, Replicate, Shard, SPMDTensor, Varying
from spmdmoe.testing import assert_close_everywhere, reference_tensor
from spmdmoe.types import layout

TOKENS = [0, 1, 3, 4, 5, 7, 8, 9, 1023]


def _gather_rows(x: SPMDTensor) -> torch.Tensor:
    """Raw torch.distributed gather of every rank's rows along the token dim (test helper)."""
    a = x.axis
    local = x.local.movedim(x.token_dim, 0).contiguous()
    p = x.padded_local_tokens
    send = torch.zeros((p, *local.shape[1:]), dtype=local.dtype, device=local.device)
    send[: local.shape[0]] = local
    out = [torch.empty_like(send) for _ in range(a.size)]
    dist.all_gather(out, send, group=a.group)
    rows = [out[r][: layout.local_tokens(x.global_tokens, a.size, r)] for r in range(a.size)]
    return torch.cat(rows).movedim(0, x.token_dim)


@pytest.mark.parametrize("total", TOKENS)
@pytest.mark.parametrize("features", [1, 64])
def test_shard_matches_reference(world, device, total, features):
    full = reference_tensor((total, features), seed=total * 7 + features, device=device)
    x = spmdmoe.shard(full, world)
    n, r = world.size(), world.get_local_rank()
    start = layout.chunk_offset(total, n, r)
    assert x.global_tokens == total and x.local_tokens == layout.local_tokens(total, n, r)
    assert x.padded_local_tokens == -(-total // n) and x.padded_global_tokens == x.padded_local_tokens * n
    assert_close_everywhere(x.local, full[start : start + x.local_tokens], rtol=0, atol=0, name="shard rows")
    assert_close_everywhere(_gather_rows(x), full, rtol=0, atol=0, name="gathered shards")


SHARD_COUNTS = {4: [2, 2, 1, 0], 2: [3, 2]}  # ranks: each rank's rows of 5


def test_shard_example_counts(world, device):
    if world.size() not in SHARD_COUNTS:
        pytest.skip(f"examples for {sorted(SHARD_COUNTS)} ranks, found {world.size()}")
    x = spmdmoe.shard(torch.zeros(5, 2, device=device), world)
    assert x.local_tokens == SHARD_COUNTS[world.size()][world.get_local_rank()]


@pytest.mark.parametrize("total", [0, 3, 5, 1023])
def test_shard_other_dim(world, device, total):
    full = reference_tensor((2, total, 3), seed=total, device=device)
    x = spmdmoe.shard(full, world, dim=1)
    assert x.placement == Shard(1) and x.global_shape == full.shape
    assert_close_everywhere(_gather_rows(x), full, rtol=0, atol=0)


@pytest.mark.parametrize("total", TOKENS)
def test_from_local_infers_and_checks(world, device, total):
    full = reference_tensor((total, 4), seed=total, device=device)
    chunk = spmdmoe.shard(full, world).local.clone()
    x = spmdmoe.from_local(chunk, world)  # T inferred as the sum of rows, never local * world
    assert x.global_tokens == total and x.placement == Shard(0)
    y = spmdmoe.from_local(chunk, world, global_tokens=total, strict=total % world.size() == 0)
    assert y.global_tokens == total
    assert_close_everywhere(_gather_rows(y), full, rtol=0, atol=0)


def test_from_local_gradient_matches_single_device(world, device):
    total = 7
    full = reference_tensor((total, 3), seed=1, device=device)
    weight = reference_tensor((total, 3), seed=2, device=device)
    # single-device reference: loss = sum(full * weight) -> d loss / d full = weight
    leaf = full.clone().requires_grad_()
    x = spmdmoe.from_local(spmdmoe.shard(leaf, world).local, world, global_tokens=total)
    start = layout.chunk_offset(total, world.size(), world.get_local_rank())
    (x.local * weight[start : start + x.local_tokens]).sum().backward()
    grad = leaf.grad.clone()
    dist.all_reduce(grad)  # the per-rank losses sum to the single-device loss
    assert_close_everywhere(grad, weight, rtol=0, atol=0, name="input gradient")


@pytest.mark.parametrize("placement", [Replicate(), Partial()])
def test_from_local_replicate_partial(world, device, placement):
    t = reference_tensor((5, 2), seed=3, device=device)
    x = spmdmoe.from_local(t, world, placement=placement)
    assert x.global_tokens == 5 and x.local_tokens == 5 and x.padded_global_tokens == -(-5 // world.size()) * world.size()
    y = spmdmoe.from_local(t, world, placement=placement, global_tokens=5)
    assert y.placement == placement


def test_from_local_varying(world, device):
    rows = [3, 0, 5, 1][world.get_local_rank() % 4]
    v = spmdmoe.from_local(torch.zeros(rows, 2, device=device), world, placement=Varying())
    assert v.local_tokens == rows and v.placement == Varying()


def test_named_dim_of_2d_mesh(mesh2d_wide, device):
    """Each named dim of a 2 x world/2 mesh (2x2 on 4 ranks) as an axis, by the sub-mesh or by (mesh, name)."""
    for name in ("sp", "dp"):
        sub = mesh2d_wide[name]
        full = reference_tensor((5, 2), seed=5, device=device)
        x = spmdmoe.shard(full, sub)
        y = spmdmoe.from_local(x.local, (mesh2d_wide, name), global_tokens=5)
        assert x.axis == y.axis and x.axis.size == sub.size()
        assert x.local_tokens == layout.local_tokens(5, sub.size(), sub.get_local_rank())  # 3, 2 on 2 ranks
        assert_close_everywhere(_gather_rows(y), full, rtol=0, atol=0)


def test_process_group_mesh(world, device):
    pg = world.get_group()
    x = spmdmoe.from_local(torch.zeros(2, 2, device=device), pg, global_tokens=2 * world.size())
    assert x.mesh is pg and x.axis == spmdmoe.mesh_axis(world)


def test_padded_empty_buffer(world, device):
    total = 5
    y = spmdmoe.padded_empty(world, Shard(0), total, (3,), device=device)
    p = -(-total // world.size())
    assert y.buffer.shape == (p, 3) and y.local_tokens == layout.local_tokens(total, world.size(), world.get_local_rank())
    z = spmdmoe.padded_empty(world, Partial(), total, (3,), device=device)
    assert z.buffer.shape == (p * world.size(), 3) and z.local.shape == (total, 3)


def test_from_local_exchanges_the_same_with_checks_off(world, device, monkeypatch):
    """Issue 24: the checking switch never decides whether from_local communicates (one check exchange in every mode),
    so a rank with checks off and its peers with checks on still meet in the same exchange."""
    import spmdmoe.agreement as agreement

    calls = []
    real = agreement.all_to_all_single
    monkeypatch.setattr(agreement, "all_to_all_single", lambda *a, **k: calls.append(1) or real(*a, **k))
    chunk = spmdmoe.shard(torch.zeros(9, 2, device=device), world).local
    for on in (True, False):
        with spmdmoe.checks(on):
            assert spmdmoe.from_local(chunk, world, global_tokens=9).global_tokens == 9
            assert spmdmoe.from_local(chunk, world).global_tokens == 9
    assert calls == [1, 1, 1, 1]


def test_mesh_axis_cache_follows_groups_and_stays_bounded(mesh2d, device):
    """Two equal-looking meshes with different groups get different axes; re-indexing a mesh
    (a new DeviceMesh object each time) neither grows the cache nor changes the axis."""
    from spmdmoe.types import mesh as mesh_module

    mesh = mesh2d  # 2 x world/2 (2x2 on 4 ranks)
    other = spmdmoe.init_mesh(mesh.device_type, tuple(mesh.shape), mesh_dim_names=("dp", "sp"))
    assert other["sp"] == mesh["sp"]  # DeviceMesh equality ignores the groups
    a, b = spmdmoe.mesh_axis(mesh["sp"]), spmdmoe.mesh_axis(other["sp"])
    assert a.group is mesh["sp"].get_group() and b.group is other["sp"].get_group() and a != b
    size = len(mesh_module._cache)
    for _ in range(20):
        assert spmdmoe.mesh_axis(mesh["sp"]) is a and spmdmoe.mesh_axis((mesh, "sp")) is a
        spmdmoe.shard(torch.zeros(5, 2, device=device), mesh["sp"])
    assert len(mesh_module._cache) == size


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", ["shape", "names"])
def test_init_mesh_with_another_mesh_on_one_rank_raises_everywhere(device, bad):
    """One rank asks ``init_mesh`` for another shape (or other dim names): every rank raises the same
    ``SPMDMeshError`` naming the field, none waits in ``new_group``."""
    n = dist.get_world_size()
    if n % 2:
        pytest.skip(f"a (2, world / 2) mesh needs an even number of ranks, found {n}")
    odd = dist.get_rank() == n - 1
    shape = (1, n) if odd and bad == "shape" else (2, n // 2)
    names = ("dp", "tp") if odd and bad == "names" else ("dp", "sp")
    with pytest.raises(spmdmoe.SPMDMeshError, match="mesh dim 0" if bad == "shape" else "mesh_dim_names"):
        spmdmoe.init_mesh(device.type, shape, mesh_dim_names=names)


def test_init_mesh_with_a_timeout_makes_new_groups(device):
    """``timeout``: every group of the mesh is new (the world's row too), so it carries that timeout."""
    from datetime import timedelta

    mesh = spmdmoe.init_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("w",),
                             timeout=timedelta(seconds=30))
    assert mesh.get_group() is not dist.group.WORLD
    x = spmdmoe.shard(torch.arange(10.0, device=device).view(5, 2), mesh)
    assert torch.equal(spmdmoe.all_gather(x).local, torch.arange(10.0, device=device).view(5, 2))
