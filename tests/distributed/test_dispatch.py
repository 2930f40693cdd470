"""The EP transports on their own: counts, offsets, the permutation, its round trip, empty ranks
and idle experts, a token sent once per rank, problem bits; against references built from every
rank's inputs (the same seeds on every rank). Exact comparisons: dispatch moves rows; combine sums
K fp64 products.

Legend: ``T`` tokens of a rank, ``K`` top-k, ``D`` model dim, ``E`` experts, ``e`` local experts,
``Q`` rows received (a token once per rank), ``R`` rows of a rank's experts (their copies).
"""

import gc
import time

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import spmdmoe
from spmdmoe import SPMDShapeError
from spmdmoe.agreement import BIT, Problem
from spmdmoe.sticky import ProblemFlag
from spmdmoe.moe import AllToAllTransport, LocalTransport
from spmdmoe.moe.routing.permute import weighted_combine
from spmdmoe.testing import assert_close_everywhere, assert_raises_everywhere, reference_tensor

D, K = 3, 2
EXACT = dict(rtol=0, atol=0)


def _inputs(rank, tokens, E, seed, skew=False):
    """Rank ``rank``'s (x_TD, ids_TK, weights_TK) from seeds: distinct experts per token."""
    T = tokens[rank]
    x_TD = reference_tensor((T, D), seed * 100 + rank, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed * 100 + 50 + rank)
    if skew:  # every token on experts 0 and 1: the others are idle
        ids_TK = torch.tensor([[0, 1]] * T, dtype=torch.int64).view(T, K)
    else:
        ids_TK = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]) if T else torch.zeros(0, K, dtype=torch.int64)
    w_TK = reference_tensor((T, K), seed * 100 + 70 + rank, dtype=torch.float64)
    return x_TD, ids_TK, w_TK


def _expert_rows(x_TD, ids_TK, expert):
    """The rows a source sends to ``expert``, in its stable (token, k) order."""
    return [x_TD[t] for t in range(ids_TK.shape[0]) for k in range(K) if int(ids_TK[t, k]) == expert]


def _experts(routed, expert_of_row):
    """What the experts return for a row-wise "expert" (row * (global expert id + 1)): each received row's
    sum of its copies, weighted with the folded routing weights (``GroupedExperts.forward``'s contract)."""
    y_RD = routed.x_RD * expert_of_row[:, None] * routed.weights_R[:, None].to(routed.x_RD.dtype)
    return weighted_combine(y_RD, routed.copies_TK, None)


@pytest.mark.parametrize("tokens_of", [lambda n: [5] * n, lambda n: [0] + [7] * (n - 1), lambda n: [0] * n,
                                       lambda n: ([1, 0, 9, 2] * n)[:n]], ids=["even", "empty_first", "all_empty", "mixed"])
@pytest.mark.parametrize("skew", [False, True], ids=["random", "idle_experts"])
def test_all_to_all_transport(world, device, tokens_of, skew, nan_empty):
    n, r = world.size(), world.get_local_rank()
    e = 2
    E = e * n
    tokens = tokens_of(n)
    inputs = [_inputs(q, tokens, E, 1, skew) for q in range(n)]
    x_TD, ids_TK, w_TK = (t.to(device).clone() for t in inputs[r])
    x_TD.requires_grad_()
    w_TK.requires_grad_()
    transport = AllToAllTransport(spmdmoe.mesh_axis(world), E)
    routed = transport.dispatch(x_TD, ids_TK, w_TK)

    # what this rank's experts receive: expert-major, then source rank, then the source's stable order
    want_rows, sizes = [], []
    for j in range(e):
        rows = [row for q in range(n) for row in _expert_rows(inputs[q][0], inputs[q][1], r * e + j)]
        want_rows += rows
        sizes.append(len(rows))
    want = torch.stack(want_rows).to(device) if want_rows else torch.zeros(0, D, dtype=torch.float64, device=device)
    assert_close_everywhere(routed.x_RD, want, **EXACT, name="received rows")
    assert routed.group_sizes == sizes and routed.capacity == sum(sizes)
    assert routed.group_offsets.dtype == torch.int32
    assert routed.group_offsets.tolist() == torch.tensor(sizes).cumsum(0).tolist()
    # a token crosses once to each rank holding any of its experts, not once per copy
    visits = [{int(i) // e for i in inputs[q][1][t]} for q in range(n) for t in range(tokens[q])]
    sent = [sum(d in v for v in visits[sum(tokens[:r]):sum(tokens[:r + 1])]) for d in range(n)]
    assert routed.handle.send == sent
    assert routed.handle.recv == [sum(r in {int(i) // e for i in inputs[q][1][t]} for t in range(tokens[q]))
                                  for q in range(n)]

    # combine of a row-wise "expert" (row * (global expert id + 1)) and its gradients
    expert_of_row = torch.repeat_interleave(torch.arange(e, device=device) + r * e + 1,
                                            torch.tensor(sizes, device=device)).to(torch.float64)
    out_TD = transport.combine(_experts(routed, expert_of_row), routed)
    ref_x = inputs[r][0].to(device).clone().requires_grad_()  # separate leaves, also on the CPU
    ref_w = inputs[r][2].to(device).clone().requires_grad_()
    ref = (ref_x[:, None, :] * (ids_TK[:, :, None] + 1) * ref_w[:, :, None]).sum(1)
    assert_close_everywhere(out_TD, ref.detach(), rtol=1e-12, atol=1e-12, name="combined rows")
    g = reference_tensor(tuple(out_TD.shape), 900 + r, dtype=torch.float64, device=device)
    (out_TD * g).sum().backward()
    (ref * g).sum().backward()
    assert_close_everywhere(x_TD.grad, ref_x.grad, rtol=1e-12, atol=1e-12, name="input gradient")
    assert_close_everywhere(w_TK.grad, ref_w.grad, rtol=1e-12, atol=1e-12, name="routing weights' gradient")


def test_sync_dispatch_issues_its_sends_before_the_host_read(world, device, monkeypatch):
    """Sync EP reads its count exchange on the host only after it has issued the send positions
    (``exchange_split_sizes`` returns its read; on CUDA the read waits for the counts' copy alone): the host's
    Python for them runs while the counts travel. One read a dispatch."""
    import spmdmoe.moe.transports.dispatch as dispatch

    seen = []
    for name in ("send_positions", "launch_tokens"):
        real = getattr(dispatch, name)
        monkeypatch.setattr(dispatch, name, lambda *a, real=real, name=name: seen.append(name) or real(*a))
    get = spmdmoe.host.DelayedRead.get
    monkeypatch.setattr(spmdmoe.host.DelayedRead, "get", lambda self: seen.append("read") or get(self))
    n, r = world.size(), world.get_local_rank()
    x_TD, ids_TK, w_TK = (t.to(device) for t in _inputs(r, [5] * n, 2 * n, 3))
    AllToAllTransport(spmdmoe.mesh_axis(world), 2 * n).dispatch(x_TD, ids_TK, w_TK)
    assert seen == ["send_positions", "read", "launch_tokens"], seen


@pytest.mark.parametrize("T", [0, 1, 6])
@pytest.mark.parametrize("skew", [False, True])
def test_local_transport(device, T, skew):
    E = 4
    x_TD, ids_TK, w_TK = (t.to(device) for t in _inputs(0, [T], E, 2, skew))
    routed = LocalTransport(E).dispatch(x_TD, ids_TK, w_TK)
    want_rows = [row for j in range(E) for row in _expert_rows(x_TD, ids_TK, j)]
    sizes = [len(_expert_rows(x_TD, ids_TK, j)) for j in range(E)]
    want = torch.stack(want_rows) if want_rows else torch.zeros(0, D, dtype=torch.float64, device=device)
    assert torch.equal(routed.x_RD, want) and routed.capacity == T * K and routed.group_sizes is None
    assert routed.group_offsets.tolist() == torch.tensor(sizes).cumsum(0).tolist()
    out = LocalTransport(E).combine(_experts(routed, torch.full((T * K,), 3.0, dtype=torch.float64, device=device)), routed)
    torch.testing.assert_close(out, 3 * x_TD * w_TK.sum(1, keepdim=True), rtol=1e-12, atol=1e-12)


def test_problem_bits_ride_the_count_exchange(world, device):
    """Mode (a): a problem on one rank raises on every rank at the exchange (raises=True), or is
    recorded in the sticky flag and the dispatch completes on every rank (raises=False)."""
    n, r = world.size(), world.get_local_rank()
    E = 2 * n
    x_TD, ids_TK, w_TK = (t.to(device) for t in _inputs(r, [4] * n, E, 3))
    bits = BIT["width"] if r == n - 1 else 0
    axis = spmdmoe.mesh_axis(world)
    assert_raises_everywhere(
        SPMDShapeError,
        lambda: AllToAllTransport(axis, E).dispatch(x_TD, ids_TK, w_TK, problem=Problem(bits, [f"rank {r}: mine"])),
        match=rf"MoE dispatch rejected the input on 1 of {n} ranks \(rank {n - 1}: input width",
    )
    flag = ProblemFlag()
    routed = AllToAllTransport(axis, E, raises=False).dispatch(x_TD, ids_TK, w_TK, problem=Problem(bits, [], flag))
    assert routed.x_RD.shape[0] == routed.capacity
    assert_raises_everywhere(SPMDShapeError, spmdmoe.check_errors, match=rf"\(rank {n - 1}: input width")


@pytest.mark.parametrize("options", [{}, {"ep_mode": "sync_free", "max_tokens": 16}], ids=["sync", "sync_free"])
def test_autograd_keeps_no_send_or_receive_buffer(world, device, request, monkeypatch, options):
    """``docs/design.md``: of an EP forward autograd keeps the index maps and the experts' own tensors,
    nothing of the send or receive buffers (the rows with their ids and weights each way, the combine's rows).
    Every buffer the dedup exchange makes (``dedup._pack``'s send buffer, the received rows of
    ``dedup.exchange_launched`` and ``dedup.exchanged_op``) is recorded, and so is every tensor autograd saves
    in the forward: none of the saved ones may share a buffer's storage. A second forward records the
    buffers by weak references only: the dispatch's are gone when the experts run (their rows are in the
    experts' own buffer by then) and none outlives the forward."""
    monkeypatch.setenv("SPMDMOE_EP_SYMMETRIC", "0")  # the all-to-all transports (NCCL: test_symmetric.py)
    from moe_plans import build_plan, reference_moe
    from spmdmoe.moe import MoEConfig
    from spmdmoe.moe.transports import dedup

    buffers = []  # (the tensor, or a weak reference to its storage; whether the dispatch made it)
    weak = [False]

    def note(t, dispatch):
        if t.numel():
            buffers.append((StorageWeakRef(t.untyped_storage()) if weak[0] else t, tuple(t.shape), dispatch))

    def recorded(fn, inputs=False, dispatch=False):
        def call(*args):
            out = fn(*args)
            if inputs:  # an exchange's input: the combine's rows too
                note(args[0], dispatch)
            note(out, dispatch)
            return out
        return call

    monkeypatch.setattr(dedup, "_pack", recorded(dedup._pack, dispatch=True))
    monkeypatch.setattr(dedup, "exchanged_op", recorded(dedup.exchanged_op, inputs=True))
    launch = dedup.exchange_launched  # the dispatch's exchanges: their input now, their rows at the wait
    monkeypatch.setattr(dedup, "exchange_launched",
                        lambda local, *a: (note(local, True), recorded(launch(local, *a), dispatch=True))[1])
    cfg = MoEConfig(dim=8, hidden_dim=16, num_experts=2 * world.size(), top_k=2, num_shared_experts=1)
    moe = reference_moe(cfg, 4, device)
    plan = build_plan("ep", moe, 16, world, request, **options)
    X = reference_tensor((16, 8), 5, device=device)
    leaf = X[plan.rows].clone().requires_grad_()
    rank = world.get_local_rank()
    saved = []

    def keep(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        y = plan.layer(plan.wrap(leaf))
    assert len(buffers) == 5, f"expected a send buffer and 2 exchanges (input, output), recorded {len(buffers)}"
    storages = {b.untyped_storage().data_ptr() for b, _, _ in buffers}
    held = [tuple(t.shape) for t in saved if t.numel() and t.untyped_storage().data_ptr() in storages]
    assert saved and not held, f"rank {rank}: autograd keeps exchange buffers of shapes {held}"
    y.sum().backward()
    buffers.clear()
    saved.clear()

    weak[0] = True
    at_experts = []
    plan.layer.experts.register_forward_pre_hook(
        lambda *_: at_experts.extend(_alive([(ref, shape) for ref, shape, dispatch in buffers if dispatch])))
    y = plan.layer(plan.wrap(leaf))
    assert not at_experts, f"rank {rank}: dispatch buffers of shapes {at_experts} alive while the experts run"
    kept = _alive([(ref, shape) for ref, shape, _ in buffers])  # a launched exchange's work, a closure: nothing
    assert not kept, f"rank {rank}: exchange buffers of shapes {kept} outlive the forward"
    y.sum().backward()  # the step runs to the end


@pytest.mark.parametrize("grad", [True, False], ids=["train", "no_grad"])
@pytest.mark.parametrize("options", [{}, {"ep_mode": "sync_free", "max_tokens": 16}], ids=["sync", "sync_free"])
def test_shared_experts_run_while_the_combine_travels(world, device, request, monkeypatch, options, grad):
    """``Transport.launch_dispatch`` / ``launch_combine``: the layer issues the dispatch's exchange (the rows
    with their ids and weights) asynchronously and waits for it, then launches the combine's exchange, runs
    its shared experts, and only then waits for the rows; in the backward the combine's reverse exchange is
    launched before the shared experts' backward and waited for after it, and the dispatch's reverse
    exchange is launched before the routed experts' up-projection weight gradients (``wgrad_later.py``) and
    waited for after them. The output and the gradients are the same as with each move waited for at once
    (``Transport.dispatch`` / ``combine``) and as with one node making the experts' input and weight
    gradients, bit for bit."""
    monkeypatch.setenv("SPMDMOE_EP_SYMMETRIC", "0")  # the all-to-all transports (NCCL: test_symmetric.py)
    from moe_plans import build_plan, reference_moe
    from spmdmoe.collectives import alltoall
    from spmdmoe.moe import MoEConfig, layer as layer_module
    from spmdmoe.moe.experts.grouped import GroupedExperts

    events = []
    real = alltoall.all_to_all_single

    class Logged:  # the work of an exchange, logging its wait
        def __init__(self, work):
            self.work = work

        def wait(self):
            events.append("wait")
            return self.work.wait()

    def logged(*args, async_op=False, **kwargs):
        work = real(*args, async_op=async_op, **kwargs)
        if async_op:
            events.append("launch")
            return Logged(work)
        return work

    cfg = MoEConfig(dim=8, hidden_dim=16, num_experts=2 * world.size(), top_k=2, num_shared_experts=1)
    moe = reference_moe(cfg, 6, device)
    plan = build_plan("ep", moe, 16, world, request, **options)
    X = reference_tensor((16, 8), 7, device=device)[plan.rows]
    G = reference_tensor((16, 8), 8, device=device)[plan.rows]
    local = lambda y: y.local if isinstance(y, spmdmoe.SPMDTensor) else y  # noqa: E731

    def step():
        plan.layer.zero_grad(set_to_none=True)
        leaf = X.clone().requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            y = local(plan.layer(plan.wrap(leaf)))
        if grad:
            events.append("backward")
            (y * G).sum().backward()
        return [y.detach()] + ([leaf.grad] + [p.grad for p in plan.layer.parameters()] if grad else [])

    plain = step()  # the launched dispatch, not logged: the reference of the two below
    events.clear()
    monkeypatch.setattr(alltoall, "all_to_all_single", logged)
    plan.layer.shared_experts.register_forward_pre_hook(lambda *_: events.append("shared"))
    plan.layer.shared_experts.w1.weight.register_hook(lambda g: events.append("shared backward"))
    plan.layer.experts.w1.register_hook(lambda g: events.append("experts wgrad"))
    launched = step()
    bwd = ["launch", "shared backward", "wait", "launch", "experts wgrad", "wait"]
    assert events == ["launch", "wait", "launch", "shared", "wait"] + (
        ["backward"] + bwd if grad else []), events
    monkeypatch.setattr(GroupedExperts, "later_wgrad", lambda self: None)  # one node: dx, dw1 and dw3
    events.clear()
    one_node = step()
    if grad:  # before the dispatch's reverse exchange is launched (after the combine's wait)
        backward = events[events.index("backward"):]
        assert backward.index("experts wgrad") < backward.index("launch", backward.index("wait")), events
    monkeypatch.setattr(layer_module._Layer, "forward", _waited_at_once(layer_module._Layer.forward))
    waited = step()
    for a, b, c, d in zip(launched, waited, plain, one_node, strict=True):
        assert_close_everywhere(a, c, **EXACT)
        assert_close_everywhere(b, c, **EXACT)
        assert_close_everywhere(d, c, **EXACT)


def _alive(refs, seconds=2.0):
    """The shapes of the storages in ``refs`` (``(weak reference, shape)``) still alive after up to ``seconds``:
    a finished gloo work may be let go by its thread a moment after ``wait()`` returned."""
    deadline = time.monotonic() + seconds
    while True:
        gc.collect()
        alive = [shape for ref, shape in refs if not ref.expired()]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.01)


def _waited_at_once(pipeline):
    """``_Layer.forward`` with each move made at once (nothing runs under it): the dispatch waited for as soon
    as it is launched, the transport's own ``combine`` (one exchange waited for at once) for its launched one."""
    def run(self, *args, **kwargs):
        transport = self.transport
        launch, combine = transport.launch_dispatch, type(transport).combine  # (an EP transport's own combine)
        transport.launch_dispatch = lambda *a, **k: (lambda done: lambda: done)(launch(*a, **k)())
        transport.launch_combine = lambda y, r: (lambda done: lambda: done)(combine(transport, y, r))
        try:
            return pipeline(self, *args, **kwargs)
        finally:
            del transport.launch_dispatch, transport.launch_combine
    return run
