"""Sync-free EP (``parallelize_moe(..., ep_mode="sync_free")``): the padded-even transport and its capacity logic.

On gloo (CI) and NCCL alike: parity with the single-device layer (outputs, input and every parameter
gradient, fp32 ``rtol=1e-5``) and with the sync transport (bitwise: the experts see the same rows in the
same order) on the EP plans over token counts with T = 0, T < ranks and idle experts; all tokens on one
expert; a capacity factor that overflows (dropped copies count as zero, nothing is written past the
static buffers, the same verdict on every rank, ``SPMDCapacityError`` everywhere from ``check_capacity``
and ``update_expert_bias``, and the sync transport as the recovery); ``max_tokens`` exceeded on ONE rank
(raised on every rank at the step boundary); plans that differ between ranks.
"""

import os

import pytest
import torch
import torch.distributed as dist

import spmdmoe
from moe_plans import build_plan, expert_grad_slice, kept_copies, kept_reference, reference_moe, summed_over
from spmdmoe import MoEConfigError, SPMDCapacityError, SPMDTensor
from spmdmoe.moe import MoEConfig, parallelize_moe
from spmdmoe.moe.transports import dedup, sync_free
from spmdmoe.testing import assert_raises_everywhere, reference_tensor
from spmdmoe.types import layout
from test_moe_parity import close, run_parity

# E: at least two experts a rank on any world size (the overflow tests route every token to rank 0's first two)
D, F, E = 16, 16, max(8, 2 * int(os.environ.get("WORLD_SIZE", "1")))
EP_PLANS = ["sp_ep", "ep", "sp_x_ep", "gather_ep"]
TOKENS = [0, 1, 3, 17, 64]


def _options(plan_name, total, factor=None):
    """The sync-free options: the ``ep`` plan (per-rank batches, no SP layout) also tries ``max_tokens``."""
    opts = dict(ep_mode="sync_free", capacity_factor=factor)
    if plan_name in ("ep", "gather_ep") and total % 2:
        opts["max_tokens"] = total  # static; the even totals take the documented all-reduce
    return opts


@pytest.mark.parametrize("total", TOKENS)
@pytest.mark.parametrize("plan_name", EP_PLANS)
def test_parity_with_single_device(world, device, request, plan_name, total, nan_empty):
    cfg = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=2 + total % 3, num_shared_experts=1,
                    aux_loss_coeff=0.01)
    plan = run_parity(plan_name, total, cfg, world, device, request, seed=total, **_options(plan_name, total))
    assert isinstance(plan.layer.transport, sync_free.SyncFreeTransport)


@pytest.mark.parametrize("plan_name", EP_PLANS)
def test_all_tokens_on_one_expert_lossless(world, device, request, plan_name):
    cfg = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=2, num_shared_experts=1)
    bias = torch.zeros(E)
    bias[5] = bias[6] = 1e3
    plan = run_parity(plan_name, 37, cfg, world, device, request, bias=bias, **_options(plan_name, 37))
    plan.layer.check_capacity()  # lossless: nothing overflowed


def _step(layer, x, g):
    layer.zero_grad(set_to_none=True)
    leaf = x.clone().requires_grad_()
    y = layer(spmdmoe.from_local(leaf, layer.sp, global_tokens=TOTAL) if layer.sp is not None else leaf)
    y = y.local if isinstance(y, SPMDTensor) else y
    (y * g).sum().backward()
    return [y.detach(), leaf.grad] + [p.grad for _, p in sorted(layer.named_parameters())]


TOTAL = 41


@pytest.mark.parametrize("precision", ["bf16", "fp8_rowwise"])
@pytest.mark.parametrize("plan_name", ["sp_ep", "ep"])
def test_bitwise_equal_to_the_sync_transport(world, device, request, plan_name, precision, nan_empty):
    """The experts see the same rows in the same order as with the sync transport: equal bit for bit (the
    FP8 experts too: their quantizers read the capacity buffer's valid rows only; every uninitialised row,
    the dead slots' included, holds NaN)."""
    cfg = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=3, expert_precision=precision)
    plan = build_plan(plan_name, reference_moe(cfg, 3, device), TOTAL, world, request, ep_mode="sync_free",
                      **({"max_tokens": TOTAL} if plan_name == "ep" else {}))
    x = reference_tensor((TOTAL, D), 7, device=device)[plan.rows]
    g = reference_tensor((TOTAL, D), 8, device=device)[plan.rows]
    free = _step(plan.layer, x, g)
    plan.layer.set_ep_mode("sync")
    synced = _step(plan.layer, x, g)
    for i, (a, b) in enumerate(zip(free, synced)):
        assert torch.equal(a, b), (i, (a - b).abs().max())


def test_overflow_is_never_silent(world, device, request, monkeypatch):
    """Every token on experts 0 and 1 (rank 0's) with capacity_factor 1: rank 0's slots overflow. The step
    runs to the end on every rank (no hang), the static buffers keep their size, dropped copies count as
    zero, every rank records the same verdict and raises SPMDCapacityError from check_capacity (and from
    update_expert_bias); the sync transport reruns the step exactly; an overflow not yet checked is still raised
    after a switch to the sync transport and back, which keeps one overflow buffer."""
    n = world.size()
    if n < 2:
        pytest.skip("needs EP over 2+ ranks")
    monkeypatch.setenv("SPMDMOE_EP_SYMMETRIC", "0")  # this transport's slots (test_symmetric.py: the other's rule)
    cfg = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=2)
    moe = reference_moe(cfg, 4, device)
    moe.expert_bias[:2] = 1e3
    plan = build_plan("sp_ep", moe, TOTAL, world, request, ep_mode="sync_free", capacity_factor=1.0)
    address = plan.layer.transport.overflow.data_ptr()
    sent = []
    for name in ("exchange_launched", "exchanged_op"):  # the transports' token exchanges (dedup.launch_tokens / SentBack.combine)
        real = getattr(dedup, name)
        monkeypatch.setattr(dedup, name, lambda t, *a, real=real: (sent.append(tuple(t.shape)), real(t, *a))[1])
    x = reference_tensor((TOTAL, D), 9, device=device)[plan.rows]
    g = reference_tensor((TOTAL, D), 10, device=device)[plan.rows]
    dropped = _step(plan.layer, x, g)
    t_max = -(-TOTAL // n)
    S, R = sync_free.capacity_rows(t_max, 2, E // n, n, 1.0)
    assert sent and all(s[0] == n * S for s in sent), (sent, n * S)  # the static buffers, nothing more
    state = plan.layer.transport.overflow.clone()
    table = [torch.empty_like(state) for _ in range(n)]
    dist.all_gather(table, state)
    assert all(torch.equal(t, table[0]) for t in table), "every rank sees the same verdict"
    # the most rows one rank sends another (a token once per rank: its own rows) and every copy on rank 0
    assert int(state[0]) > 0 and int(state[1]) == t_max and int(state[2]) == TOTAL * 2 and int(state[3]) == t_max
    with pytest.raises(SPMDCapacityError) as raised:
        plan.layer.check_capacity()
    fits = float(str(raised.value).split("capacity_factor >= ")[1].split(" ")[0])
    S_fit, R_fit = sync_free.capacity_rows(t_max, 2, E // n, n, fits)
    assert S_fit >= t_max and R_fit >= TOTAL * 2, f"capacity_factor >= {fits} is named, and it must fit"
    assert fits <= TOTAL * 2 / (t_max * 2) + 0.02, "and not much more than what fits"
    plan.layer.check_capacity()  # raised once, then cleared
    # the recovery: the same step over the sync transport, exact; its outputs differ from the dropped ones
    plan.layer.set_ep_mode("sync")
    exact = _step(plan.layer, x, g)
    lossless = build_plan("sp_ep", moe, TOTAL, world, request, ep_mode="sync_free").layer
    for a, b in zip(_step(lossless, x, g), exact):
        assert torch.equal(a, b)
    assert not torch.equal(dropped[0], exact[0]) or x.shape[0] == 0
    plan.layer.set_ep_mode("sync_free")
    _step(plan.layer, x, g)
    # an overflow not yet checked survives a switch away and back, in the same buffer (a captured graph writes it)
    plan.layer.set_ep_mode("sync")
    plan.layer.set_ep_mode("sync_free")
    assert plan.layer.transport.overflow.data_ptr() == address, "one overflow buffer across set_ep_mode switches"
    assert_raises_everywhere(SPMDCapacityError, plan.layer.update_expert_bias, match="EP capacity exceeded")


def test_dropped_copies_count_as_zero(world, device, request, nan_empty, monkeypatch):
    """With a tiny capacity, each output row is the weighted sum of the copies that fit, nothing else: the
    rule of ``sync_free.py`` (a slot keeps its first ``S`` tokens, an experts' buffer its first ``R`` copies in
    expert-major order) simulated from every rank's routing, against the layer; so are the input gradient and
    every parameter gradient (a dropped copy contributes zero to each, never a stale or uninitialised row)."""
    n = world.size()
    monkeypatch.setenv("SPMDMOE_EP_SYMMETRIC", "0")  # this transport's slots (test_symmetric.py: the other's rule)
    cfg = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=2)
    moe = reference_moe(cfg, 5, device)
    plan = build_plan("ep", moe, TOTAL, world, request, ep_mode="sync_free", capacity_factor=0.25, max_tokens=TOTAL)
    x = reference_tensor((TOTAL, D), 11, device=device)[plan.rows].requires_grad_()
    g = reference_tensor((TOTAL, D), 12, device=device)[plan.rows]
    y = plan.layer(x)
    (y * g).sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    r = moe.router(x_ref, moe.expert_bias, moe.router.gate.weight)
    ids_by_rank = [None] * n
    dist.all_gather_object(ids_by_rank, r.ids_TK.tolist())
    S, R = sync_free.capacity_rows(TOTAL, 2, E // n, n, 0.25)  # 6 and 21 on 4 ranks
    kept = kept_copies(ids_by_rank, n, E // n, S, R)[world.get_local_rank()]
    want = kept_reference(moe, x_ref, kept)  # (a rank that keeps no copy still has a backward)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    (want * g).sum().backward()
    close(x.grad, x_ref.grad, "input gradient")
    ref = dict(moe.named_parameters())
    for name, p in plan.layer.named_parameters():  # the reference saw this rank's tokens: sum it over ranks
        mine = ref[name].grad  # None: this rank kept no copy (its reference never reached the parameter)
        full = summed_over(torch.zeros_like(ref[name]) if mine is None else mine, dist.group.WORLD)
        want_grad = expert_grad_slice(name, full, plan) if name.startswith("experts.") else full
        got = p.grad if name.startswith("experts.") else summed_over(p.grad, plan.dp_group)
        close(got, want_grad, f"{name} gradient")
    dropped = torch.tensor([x.shape[0] * 2 - len(kept)], device=device)
    dist.all_reduce(dropped)
    assert int(dropped) > 0, "the test must drop copies somewhere"
    assert_raises_everywhere(SPMDCapacityError, plan.layer.check_capacity, match=f"the buffers hold {S} and {R}")


def test_max_tokens_exceeded_on_one_rank(world, device):
    """One rank routes more tokens than max_tokens: it stands in zero rows (no hang) and every rank raises
    SPMDCapacityError at the step boundary."""
    layer = parallelize_moe(reference_moe(MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=2), 0, device),
                            ep_mesh=world, ep_mode="sync_free", max_tokens=8)
    rows = 9 if world.get_local_rank() == world.size() - 1 else 5
    x = torch.randn(rows, D, device=device, requires_grad=True)

    def step():
        layer(x).sum().backward()
        spmdmoe.check_errors()

    assert_raises_everywhere(SPMDCapacityError, step, match=rf"rank {world.size() - 1}: more rows than the sync-free EP buffers hold")


def test_without_max_tokens_the_first_forward_sizes_the_buffers(world, device):
    """``ep_mode="sync_free"`` without ``max_tokens``: the first forward agrees ``T_max`` over EP (the most rows a
    rank routes, exchanged host to host through the c10d store), later forwards route any count up to it, bitwise equal to the sync layer;
    one rank routing more later stands in zero rows, and every rank raises ``SPMDCapacityError`` at the step
    boundary, naming the ``max_tokens`` that would have held it."""
    cfg = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=2)
    ours = parallelize_moe(reference_moe(cfg, 0, device), ep_mesh=world, ep_mode="sync_free")
    sync = parallelize_moe(reference_moe(cfg, 0, device), ep_mesh=world)
    rank, last = world.get_local_rank(), world.size() - 1
    for step, rows in enumerate((7 - rank % 2, 3 + rank % 3)):  # the first forward's most: 7
        x = reference_tensor((rows, D), 20 + step + rank, device=device)
        assert torch.equal(ours(x), sync(x)), step
        assert ours.admission.learned == 7
    x = torch.randn(9 if rank == last else 5, D, device=device, requires_grad=True)

    def step():
        ours(x).sum().backward()
        spmdmoe.check_errors()

    assert_raises_everywhere(SPMDCapacityError, step, match=rf"rank {last}: more rows than the sync-free EP buffers "
                             r"hold \(the fix: a larger max_tokens")


def test_plans_that_differ_or_cannot_work(world, device):
    moe = reference_moe(MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=2), 0, device)
    last = world.get_local_rank() == world.size() - 1
    assert_raises_everywhere(MoEConfigError, lambda: parallelize_moe(
        moe, ep_mesh=world, ep_mode="sync_free" if last else "sync"), match="ep_mode")
    assert_raises_everywhere(MoEConfigError, lambda: parallelize_moe(
        moe, ep_mesh=world, ep_mode="sync_free", capacity_factor=2.0 if last else 1.5), match="capacity_factor")
    assert_raises_everywhere(MoEConfigError, lambda: parallelize_moe(moe, ep_mesh=world, capacity_factor=2.0),
                             match="pass ep_mode='sync_free'")
    for bad in (-1.0, float("nan"), float("inf")):  # one rank's unusable factor: every rank raises, none hangs
        assert_raises_everywhere(MoEConfigError, lambda: parallelize_moe(
            moe, ep_mesh=world, ep_mode="sync_free", capacity_factor=bad if last else 1.0),
            match=rf"rank {world.size() - 1}: MoE config or plan cannot work")


def test_overflow_in_one_ep_group_raises_everywhere(world, device, request):
    """2x2 (2 x world / 2 on more ranks; EP across the dp batches, SP inside): only the EP group of SP rank 0
    overflows (its ranks hold the rows; the other SP ranks hold none). Every rank of the layer raises
    SPMDCapacityError from the bias update (no rank left in its collective), and the failed step's load counts
    are dropped."""
    mesh = request.getfixturevalue("mesh2d_wide")
    moe = reference_moe(MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=2), 6, device)
    moe.expert_bias[:2] = 1e3
    layer = parallelize_moe(moe, sp_mesh=mesh["sp"], ep_mesh=mesh["dp"], ep_mode="sync_free", capacity_factor=0.01,
                            max_tokens=16)
    T = 1  # per batch: SP rank 0 holds the row, SP rank 1 none
    rows = layout.local_tokens(T, mesh["sp"].size(), mesh["sp"].get_local_rank())
    x = spmdmoe.from_local(torch.randn(rows, D, device=device, requires_grad=True), mesh["sp"], global_tokens=T)
    layer(x).local.sum().backward()
    assert_raises_everywhere(SPMDCapacityError, layer.update_expert_bias, match="more rows than the sync-free")
    assert int(layer.tokens_per_expert.sum()) == 0, "the failed step's load counts are dropped"


def test_gather_mode_over_max_tokens_raises_everywhere(world, device, request):
    """Gather mode with EP across batches: the SP group gathers more rows than max_tokens; recorded with
    the forward's problems, raised on every rank at the step boundary (not only as a slot overflow)."""
    cfg = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=2)
    plan = build_plan("gather_ep", reference_moe(cfg, 7, device), 40, world, request, ep_mode="sync_free",
                      max_tokens=5)
    x = plan.wrap(reference_tensor((40, D), 12, device=device)[plan.rows].clone())

    def step():
        plan.layer(x)
        spmdmoe.check_errors()

    assert_raises_everywhere(SPMDCapacityError, step, match="20 tokens routed, more than max_tokens=5|more rows than")
