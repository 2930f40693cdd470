"""Collectives against a single-device reference, on the world axis and on a 2x2 sub-group.

Reference: every rank builds every rank's data from the same seeds and
computes the single-device result. Forward values are compared exactly
(rtol = atol = 0: gathers and scatters move data; sums of 4 float64 are
compared at 1e-12). Gradients: the loss is the sum of per-rank losses
``sum(y_r * W_r)``, so the single-device gradient is known in closed form.
"""

import pytest
import torch
import torch.distributed as dist

import spmdmoe
from spmdmoe import Partial, Replicate, Shard, SPMDTensor, Varying
from spmdmoe.testing import all_ranks_agree, assert_close_everywhere, reference_tensor
from spmdmoe.types import layout

TOKENS = [0, 1, 3, 4, 5, 7, 8, 9, 1023]
F64 = dict(rtol=1e-12, atol=1e-12)


@pytest.fixture(params=["world", "sub"])
def axis_mesh(request, world, device):
    """The world axis, or the 'sp' dim of a 2 x world/2 mesh (a sub-group: 2 ranks of 4, 4 of 8)."""
    if request.param == "world":
        return world
    return request.getfixturevalue("mesh2d_wide")["sp"]


def _seed(total, features, tag):
    return total * 1000 + features * 10 + tag


@pytest.mark.parametrize("total", TOKENS)
@pytest.mark.parametrize("features", [1, 64])
def test_all_gather(axis_mesh, device, total, features):
    n, r = axis_mesh.size(), axis_mesh.get_local_rank()
    full = reference_tensor((total, features), _seed(total, features, 1), dtype=torch.float64, device=device)
    weights = [reference_tensor((total, features), _seed(total, features, 2 + q), dtype=torch.float64, device=device) for q in range(n)]
    leaf = full.clone().requires_grad_()
    g = spmdmoe.all_gather(spmdmoe.shard(leaf, axis_mesh))
    assert g.placement == Replicate() and g.global_tokens == total and g.local.shape == (total, features)
    assert_close_everywhere(g.local, full, rtol=0, atol=0, name="all_gather values")
    (g.local * weights[r]).sum().backward()
    grad = leaf.grad.clone() if leaf.grad is not None else torch.zeros_like(full)
    dist.all_reduce(grad, group=axis_mesh.get_group())  # each rank's grad covers its own rows
    assert_close_everywhere(grad, sum(weights), **F64, name="all_gather input gradient")


@pytest.mark.parametrize("total", TOKENS)
@pytest.mark.parametrize("features", [1, 64])
def test_reduce_scatter(axis_mesh, device, total, features):
    n, r = axis_mesh.size(), axis_mesh.get_local_rank()
    parts = [reference_tensor((total, features), _seed(total, features, 10 + q), dtype=torch.float64, device=device) for q in range(n)]
    weight = reference_tensor((total, features), _seed(total, features, 3), dtype=torch.float64, device=device)
    leaf = parts[r].clone().requires_grad_()
    y = spmdmoe.reduce_scatter(spmdmoe.from_local(leaf, axis_mesh, placement=Partial(), global_tokens=total))
    start, rows = layout.chunk_offset(total, n, r), layout.local_tokens(total, n, r)
    assert y.placement == Shard(0) and y.local_tokens == rows and y.global_tokens == total
    assert_close_everywhere(y.local, sum(parts)[start : start + rows], **F64, name="reduce_scatter values")
    (y.local * weight[start : start + rows]).sum().backward()
    assert_close_everywhere(leaf.grad, weight, **F64, name="reduce_scatter input gradient")


@pytest.mark.parametrize("total", [0, 1, 5, 1023])
def test_all_reduce(axis_mesh, device, total):
    n, r = axis_mesh.size(), axis_mesh.get_local_rank()
    parts = [reference_tensor((total, 8), 20 + q, dtype=torch.float64, device=device) for q in range(n)]
    weights = [reference_tensor((total, 8), 40 + q, dtype=torch.float64, device=device) for q in range(n)]
    leaf = parts[r].clone().requires_grad_()
    x = spmdmoe.from_local(leaf, axis_mesh, placement=Partial())
    y = spmdmoe.all_reduce(x)
    assert y.placement == Replicate() and y.global_tokens == total
    assert_close_everywhere(y.local, sum(parts), **F64, name="all_reduce values")
    assert_close_everywhere(x.local, parts[r], rtol=0, atol=0, name="input untouched")
    (y.local * weights[r]).sum().backward()
    assert_close_everywhere(leaf.grad, sum(weights), **F64, name="all_reduce input gradient")


@pytest.mark.parametrize("total", [0, 3, 5, 9])
def test_token_dim_other_than_zero(axis_mesh, device, total):
    full = reference_tensor((2, total, 3), total, dtype=torch.float64, device=device)
    x = spmdmoe.shard(full, axis_mesh, dim=1)
    g = spmdmoe.all_gather(x)
    assert g.token_dim == 1 and g.global_shape == full.shape
    assert_close_everywhere(g.local, full, rtol=0, atol=0)
    back = spmdmoe.redistribute(g, Shard(1))
    assert_close_everywhere(back.local, x.local, rtol=0, atol=0)
    partial = spmdmoe.redistribute(x, Partial())
    assert_close_everywhere(spmdmoe.reduce_scatter(partial).local, x.local, rtol=0, atol=0)


@pytest.mark.parametrize("total", TOKENS)
def test_round_trips(axis_mesh, device, total):
    n, r = axis_mesh.size(), axis_mesh.get_local_rank()
    full = reference_tensor((total, 4), total, dtype=torch.float64, device=device)
    assert_close_everywhere(spmdmoe.all_gather(spmdmoe.shard(full, axis_mesh)).local, full, rtol=0, atol=0)
    part = spmdmoe.from_local(reference_tensor((total, 4), 100 + r, dtype=torch.float64, device=device),
                              axis_mesh, placement=Partial(), global_tokens=total)
    via_scatter = spmdmoe.all_gather(spmdmoe.reduce_scatter(part))
    assert_close_everywhere(via_scatter.local, spmdmoe.all_reduce(part).local, **F64, name="rs+ag == ar")
    for src, dst in spmdmoe.collectives.TRANSITIONS:
        start = {Shard: spmdmoe.shard(full, axis_mesh), Replicate: spmdmoe.all_gather(spmdmoe.shard(full, axis_mesh)),
                 Partial: spmdmoe.redistribute(spmdmoe.shard(full, axis_mesh), Partial())}[src]
        target = Shard(0) if dst is Shard else dst()
        moved = spmdmoe.redistribute(start, target)
        assert moved.placement == target and moved.global_tokens == total
        # every layout of the same logical tensor gathers back to `full`
        as_replicate = spmdmoe.redistribute(moved, Replicate())
        assert_close_everywhere(as_replicate.local, full, **F64, name=f"{src.__name__}->{dst.__name__}")


def _random_counts(n, seed):
    """counts[src][dst]: zeros included (a rank that sends nothing, pairs with no rows)."""
    gen = torch.Generator().manual_seed(seed)
    c = torch.randint(0, 5, (n, n), generator=gen)
    c[c == 1] = 0
    c[seed % n] = 0  # one rank sends nothing
    return c.tolist()


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("host_counts", [True, False])
def test_all_to_all(axis_mesh, device, seed, host_counts):
    n, r = axis_mesh.size(), axis_mesh.get_local_rank()
    counts = _random_counts(n, seed)
    data = [reference_tensor((sum(counts[s]), 3), 50 + s + seed, dtype=torch.float64, device=device) for s in range(n)]
    weights = [reference_tensor((sum(counts[s][d] for s in range(n)), 3), 70 + d, dtype=torch.float64, device=device) for d in range(n)]
    leaf = data[r].clone().requires_grad_()
    x = spmdmoe.SPMDTensor(leaf, axis_mesh, Varying())
    if host_counts:
        y = spmdmoe.all_to_all(x, counts[r], [counts[s][r] for s in range(n)])
    else:
        before = spmdmoe.collectives.host_sync_count()
        y = spmdmoe.all_to_all(x, torch.tensor(counts[r], device=device))
        assert spmdmoe.collectives.host_sync_count() == before + 1  # exactly one host transfer
    offsets = [[sum(counts[s][:d]) for d in range(n)] for s in range(n)]
    expected = torch.cat([data[s][offsets[s][r] : offsets[s][r] + counts[s][r]] for s in range(n)])
    assert y.placement == Varying() and y.local_tokens == expected.shape[0]
    assert_close_everywhere(y.local, expected, rtol=0, atol=0, name="all_to_all values")
    (y.local * weights[r]).sum().backward()
    # d loss / d data[r]: rows sent to d are weighted by W_d at their position on d
    want = torch.cat([weights[d][sum(counts[s][d] for s in range(r)) : sum(counts[s][d] for s in range(r + 1))] for d in range(n)])
    assert_close_everywhere(leaf.grad, want, rtol=0, atol=0, name="all_to_all input gradient")


def test_all_to_all_nothing_anywhere(axis_mesh, device):
    n = axis_mesh.size()
    x = spmdmoe.SPMDTensor(torch.zeros(0, 3, device=device, requires_grad=True), axis_mesh, Varying())
    y = spmdmoe.all_to_all(x, [0] * n, [0] * n)
    assert y.local.shape == (0, 3)
    y.local.sum().backward()


# ------------------------------------------------------------------ exact adjoints
def _adjoint_gap(op, x_local_shape, make_input, out_shape_of, device, group, seed):
    """|<A*(g), dx> - <g, A(dx)>| / scale, both summed over ranks (float64)."""
    r = dist.get_rank()
    dx = reference_tensor(x_local_shape, 1000 + seed * 17 + r, dtype=torch.float64, device=device).requires_grad_()
    y = op(make_input(dx))
    g = reference_tensor(tuple(y.local.shape), 2000 + seed * 17 + r, dtype=torch.float64, device=device)
    (adj,) = torch.autograd.grad(y.local, dx, g, allow_unused=True)
    adj = torch.zeros_like(dx) if adj is None else adj
    sums = torch.stack([(adj * dx).sum(), (g * y.local).sum(), adj.norm() * dx.norm() + g.norm() * y.local.norm()]).detach()
    dist.all_reduce(sums, group=group)
    lhs, rhs, scale = sums.tolist()
    return abs(lhs - rhs) / max(scale, 1e-300)


@pytest.mark.parametrize("total", [0, 1, 3, 5, 9, 1023])
def test_exact_adjoints(axis_mesh, device, total):
    n, r = axis_mesh.size(), axis_mesh.get_local_rank()
    group = axis_mesh.get_group()
    rows = layout.local_tokens(total, n, r)
    shard = lambda t: SPMDTensor(t, axis_mesh, Shard(0), global_tokens=total)  # noqa: E731
    rep = lambda t: SPMDTensor(t, axis_mesh, Replicate(), global_tokens=total)  # noqa: E731
    part = lambda t: SPMDTensor(t, axis_mesh, Partial(), global_tokens=total)  # noqa: E731
    cases = {
        "all_gather": (spmdmoe.all_gather, (rows, 5), shard),
        "reduce_scatter": (spmdmoe.reduce_scatter, (total, 5), part),
        "all_reduce": (spmdmoe.all_reduce, (total, 5), part),
        "Replicate->Shard": (lambda x: spmdmoe.redistribute(x, Shard(0)), (total, 5), rep),
        "Shard->Partial": (lambda x: spmdmoe.redistribute(x, Partial()), (rows, 5), shard),
        "Replicate->Partial": (lambda x: spmdmoe.redistribute(x, Partial()), (total, 5), rep),
    }
    counts = _random_counts(n, total)
    cases["all_to_all"] = (
        lambda x: spmdmoe.all_to_all(x, counts[r], [counts[s][r] for s in range(n)]),
        (sum(counts[r]), 5),
        lambda t: SPMDTensor(t, axis_mesh, Varying()),
    )
    for i, (name, (op, shape, make)) in enumerate(sorted(cases.items())):
        gap = _adjoint_gap(op, shape, make, None, device, group, seed=i + total)
        assert gap <= 1e-12, f"{name}: adjoint mismatch {gap:.3e} (T={total})"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter", "all_reduce", "all_to_all"])
def test_input_without_grad_on_one_rank_still_runs_the_backward(axis_mesh, device, op):
    """Issue 3: whether a collective records its backward used to follow THIS rank's
    ``requires_grad``; a rank whose input needed no gradient skipped the backward collective its
    peers ran, and they hung. Now every rank records it (grad mode is what decides), and the
    gradients of the ranks that want one are exact (float64, adjoint check against the rule)."""
    n, r = axis_mesh.size(), axis_mesh.get_local_rank()
    total = 2 * n - 1
    rows = {"all_gather": layout.local_tokens(total, n, r), "all_to_all": n}.get(op, total)
    x = reference_tensor((rows, 3), 300 + r, dtype=torch.float64, device=device).requires_grad_(r != 0)
    placement = {"all_gather": Shard(0), "all_to_all": Varying()}.get(op, Partial())
    t = SPMDTensor(x, axis_mesh, placement, global_tokens=None if op == "all_to_all" else total)
    y = {"all_gather": spmdmoe.all_gather, "reduce_scatter": spmdmoe.reduce_scatter, "all_reduce": spmdmoe.all_reduce,
         "all_to_all": lambda v: spmdmoe.all_to_all(v, [1] * n, [1] * n)}[op](t)
    assert y.local.requires_grad  # on every rank, also rank 0
    g = reference_tensor(tuple(y.local.shape), 400 + r, dtype=torch.float64, device=device)
    (y.local * g).sum().backward()
    if r != 0:  # the gradient of sum_r <y_r, g_r> wrt x_r, from the op's adjoint written out
        out_rows = [layout.local_tokens(total, n, q) if op == "reduce_scatter" else y.local.shape[0] for q in range(n)]
        gs = [reference_tensor((out_rows[q], 3), 400 + q, dtype=torch.float64, device=device) for q in range(n)]
        if op == "all_gather":
            start = layout.chunk_offset(total, n, r)
            want = sum(gs)[start : start + rows]
        elif op == "reduce_scatter":
            want = torch.zeros(total, 3, dtype=torch.float64, device=device)
            for q in range(n):
                start = layout.chunk_offset(total, n, q)
                want[start : start + out_rows[q]] = gs[q]
        elif op == "all_reduce":
            want = sum(gs)
        else:
            want = torch.stack([gs[q][r] for q in range(n)])
        torch.testing.assert_close(x.grad, want, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ padding rules
def _capture(monkeypatch, module, name):
    seen = []
    real = getattr(module, name)

    def spy(out, inp, *args, **kwargs):
        seen.append((out, inp))
        return real(out, inp, *args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return seen


def test_full_ranks_send_without_copy_and_unpad_is_a_view(axis_mesh, device, monkeypatch):
    import spmdmoe.collectives.gather_scatter as ag

    n, r = axis_mesh.size(), axis_mesh.get_local_rank()
    total = 2 * n - 1  # every rank full except the last
    seen = _capture(monkeypatch, ag, "all_gather_single")
    x = spmdmoe.shard(torch.randn(total, 4, device=device), axis_mesh)
    g = spmdmoe.all_gather(x)
    (out, sent), = seen
    full_rank = x.local_tokens == x.padded_local_tokens
    assert (sent.data_ptr() == x.local.data_ptr()) == full_rank  # only the short rank copies
    assert g.local.data_ptr() == out.data_ptr() and g.local.shape[0] == total  # [:T] is a view


def test_reduce_scatter_results_gather_without_copy(axis_mesh, device, monkeypatch):
    import spmdmoe.collectives.gather_scatter as gs

    n = axis_mesh.size()
    total = 2 * n - 1
    ag_seen = _capture(monkeypatch, gs, "all_gather_single")
    y = spmdmoe.reduce_scatter(spmdmoe.from_local(torch.ones(total, 4, device=device), axis_mesh, placement=Partial()))
    assert y.buffer is not None and y.buffer.shape[0] == y.padded_local_tokens
    z = spmdmoe.all_gather(y)  # the Shard is backed by the received p-row block: no padding copy
    assert ag_seen[0][1].data_ptr() == y.buffer.data_ptr()
    assert_close_everywhere(z.local, torch.full((total, 4), float(n), device=device), rtol=0, atol=0)


@pytest.mark.parametrize("total_fn", [lambda n: 2 * n - 1, lambda n: 2 * n], ids=["uneven", "even"])
def test_collective_choice_ignores_rank_local_buffers(axis_mesh, device, monkeypatch, total_fn):
    """Issue 2: the tensor or list form used to follow whether THIS rank's input had a padded buffer
    (a collective mismatch when ranks differed). Rank 0 passes a pre-padded buffer, the others plain
    tensors; every rank must pick the same call (decided by T and n) and the result must be exact."""
    import spmdmoe.collectives.gather_scatter as gs

    n, r = axis_mesh.size(), axis_mesh.get_local_rank()
    total = total_fn(n)
    calls = []
    for name in ("reduce_scatter_single", "reduce_scatter_list"):
        real = getattr(gs, name)
        monkeypatch.setattr(gs, name, lambda out, inp, *a, _real=real, _name=name, **k: (calls.append(_name), _real(out, inp, *a, **k))[1])
    part = reference_tensor((total, 4), 90 + r, device=device)
    x = spmdmoe.from_local(part, axis_mesh, placement=Partial(), global_tokens=total)
    if r == 0:  # the same layout, backed by a pre-padded buffer on this rank only (no communication)
        x = spmdmoe.padded_empty(axis_mesh, Partial(), total, (4,), device=device)
        x.local.copy_(part)
    y = spmdmoe.reduce_scatter(x)
    want = "reduce_scatter_single" if total % n == 0 else "reduce_scatter_list"
    agreed = all_ranks_agree(calls == [want], axis_mesh)
    assert not agreed, f"ranks {agreed} picked another collective: {calls}"
    full = sum(reference_tensor((total, 4), 90 + q, device=device) for q in range(n))
    start = layout.chunk_offset(total, n, r)
    assert_close_everywhere(y.local, full[start : start + y.local_tokens], rtol=1e-6, atol=1e-6)


def test_uneven_reduce_scatter_sends_views_of_the_input(axis_mesh, device, monkeypatch):
    import spmdmoe.collectives.gather_scatter as rs

    n = axis_mesh.size()
    total = 2 * n - 1
    seen = []
    real = rs.reduce_scatter_list
    monkeypatch.setattr(rs, "reduce_scatter_list", lambda out, views, **k: (seen.append(views), real(out, views, **k))[1])
    part = torch.randn(total, 4, device=device)
    y = spmdmoe.reduce_scatter(spmdmoe.from_local(part, axis_mesh, placement=Partial(), global_tokens=total))
    (views,) = seen
    assert [v.shape[0] for v in views] == layout.chunk_counts(total, n)
    assert all(v.untyped_storage().data_ptr() == part.untyped_storage().data_ptr() for v in views)  # no pad copy
    assert y.local_tokens == layout.local_tokens(total, n, axis_mesh.get_local_rank())
