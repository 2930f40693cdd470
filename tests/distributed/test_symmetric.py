"""The symmetric-memory sync-free EP transport (``spmdmoe/moe/transports/symmetric.py``).

On NCCL (one host) ``ep_mode="sync_free"`` takes it, with real CUDA symmetric memory and its bounded barriers. On
gloo (CI) the same transport runs with its symmetric buffer emulated: each barrier all-gathers every rank's
buffer (the peers' as this rank would read them; the buffer starts as NaN), the kernels' torch references read
them; so its logic (which rows cross, the ids read from every rank, the shared overflow verdict, the custom ops'
autograd and compile, EP over a subgroup) is tested on CPU too. What the emulation cannot show (a missing
barrier, a restage racing a peer's read, the kernels' address table) only the NCCL run and
``tests/test_kernels.py::test_peer_rows`` do. Against the sync transport and the padded all-to-all one: outputs, input and every parameter gradient
bit for bit (bf16 and FP8 experts, ``T = 0`` on some ranks, ``T < ranks``, idle experts, all tokens on one
expert, under activation checkpointing); a capacity overflow: the copies past ``R`` dropped by the documented
rule, the same verdict on every rank, ``SPMDCapacityError`` everywhere; on NCCL a rank that skips a layer makes
its peer's barrier trap within its bound (a separate job), not hang.
"""

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.utils._python_dispatch import TorchDispatchMode

import spmdmoe
from moe_plans import build_plan, kept_copies, kept_reference, reference_moe
from spmdmoe import MoEConfigError, SPMDCapacityError, SPMDTensor
from spmdmoe.moe import MoEConfig, parallelize_moe
from spmdmoe.moe.transports import symmetric, sync_free
from spmdmoe.testing import all_ranks_agree, assert_close_everywhere, assert_raises_everywhere, reference_tensor

D, F, E = 16, 16, 8


class _GlooHandle:
    """A symmetric buffer emulated over gloo: each rank keeps a copy of every peer's buffer, refreshed by the
    barrier (an all-gather), which is where the real one makes the peers' writes visible. ``buf`` may be a view
    into a larger block (``_gloo_pooled``): the handle's buffers are the blocks, as a pooled allocation gives."""

    def __init__(self, buf: torch.Tensor, group: str):
        self.pg = c10d._resolve_process_group(group)
        block = buf if buf._base is None else buf._base
        self.buf, self.rank, self.world_size = block, dist.get_rank(self.pg), dist.get_world_size(self.pg)
        self.copies = [block if r == self.rank else torch.empty_like(block) for r in range(self.world_size)]

    def get_buffer(self, rank: int, sizes: tuple, dtype: torch.dtype, storage_offset: int = 0) -> torch.Tensor:
        return self.copies[rank].view(dtype)[storage_offset: storage_offset + sizes[0]]

    def barrier(self, channel: int = 0, timeout_ms: int = 0) -> None:
        got = [torch.empty_like(self.buf) for _ in range(self.world_size)]
        dist.all_gather(got, self.buf, group=self.pg)
        for r, c in enumerate(self.copies):
            if r != self.rank:
                c.copy_(got[r])


def _gloo_allocate(group, device, nbytes):
    buf = torch.full((nbytes,), 255, dtype=torch.uint8, device=device)  # NaN in every float view, as nan_empty
    return buf, _GlooHandle(buf, group)


def _gloo_pooled(group, device, nbytes):
    """``buf`` 512 bytes into a block that another user of the pool holds around it (the block's other bytes
    must not change)."""
    block = torch.full((nbytes + 1024,), 77, dtype=torch.uint8, device=device)
    buf = block[512: 512 + nbytes]
    buf.fill_(255)
    return buf, _GlooHandle(buf, group)


@pytest.fixture
def peers(device, monkeypatch):
    """Real symmetric memory on CUDA; the gloo emulation on CPU. Makes ``ep_mode="sync_free"`` take the
    symmetric transport either way."""
    if device.type != "cuda":
        monkeypatch.setattr(symmetric, "_allocate", _gloo_allocate)
        monkeypatch.setattr(symmetric, "_staging", {})
        monkeypatch.setattr(symmetric, "_one_host", {})
        monkeypatch.setattr(symmetric, "_nccl", lambda axis: True)  # the rest of symmetric_usable runs as on NCCL


def _step(plan, x, g, checkpointed=False):
    plan.layer.zero_grad(set_to_none=True)
    leaf = x.clone().requires_grad_()
    layer, inp = plan.layer, plan.wrap(leaf)

    def run(t):
        y = layer(t)
        return y.local if isinstance(y, SPMDTensor) else y

    if checkpointed:
        y = torch.utils.checkpoint.checkpoint(run, inp, use_reentrant=False)
    else:
        y = run(inp)
    (y.float() * g).sum().backward()
    return [y.detach(), leaf.grad] + [p.grad for _, p in sorted(layer.named_parameters())]


def _all_three(plan, x, g, checkpointed=False):
    """The step over the symmetric, the padded all-to-all and the sync transport, in that order."""
    layer = plan.layer
    assert isinstance(layer.transport, symmetric.SymmetricTransport)
    runs = [_step(plan, x, g, checkpointed)]
    layer.transport = sync_free.SyncFreeTransport(layer.ep, E, layer.config.top_k, layer.capacity_factor,
                                                  layer.transport.overflow)
    runs.append(_step(plan, x, g, checkpointed))
    layer.set_ep_mode("sync")
    runs.append(_step(plan, x, g, checkpointed))
    layer.set_ep_mode("sync_free")
    return runs


def _equal(runs):
    for name, other in zip(("all-to-all", "sync"), runs[1:]):
        for i, (a, b) in enumerate(zip(runs[0], other)):
            assert torch.equal(a, b), (name, i, (a.float() - b.float()).abs().max())


def test_the_transport_by_backend(world, device, request, monkeypatch):
    """NCCL on one host: ``sync_free`` takes the symmetric transport; gloo, or ``SPMDMOE_EP_SYMMETRIC=0``: the
    padded all-to-all."""
    cfg = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=2)
    layer = build_plan("sp_ep", reference_moe(cfg, 0, device), 9, world, request, ep_mode="sync_free").layer
    want = symmetric.SymmetricTransport if device.type == "cuda" else sync_free.SyncFreeTransport
    assert type(layer.transport) is want
    monkeypatch.setenv("SPMDMOE_EP_SYMMETRIC", "0")
    layer.set_ep_mode("sync_free")
    assert type(layer.transport) is sync_free.SyncFreeTransport


def test_the_transport_setting_differs_on_one_rank(world, device, monkeypatch):
    """``SPMDMOE_EP_SYMMETRIC=0`` on ONE rank: the ranks would take different transports (one reading peer
    memory, one in NCCL's all-to-all: a hang). ``symmetric_usable`` all-gathers the setting: ``MoEConfigError``
    on every rank, naming it, at ``parallelize_moe`` and at ``set_ep_mode`` (on gloo the NCCL check is
    patched: the setting matters only there)."""
    monkeypatch.setattr(symmetric, "_nccl", lambda axis: True)
    monkeypatch.setattr(symmetric, "_one_host", {})
    moe = reference_moe(MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=2), 0, device)
    layer = parallelize_moe(moe, ep_mesh=world)  # sync: the setting is not read
    if world.get_local_rank() == world.size() - 1:
        monkeypatch.setenv("SPMDMOE_EP_SYMMETRIC", "0")
    assert_raises_everywhere(MoEConfigError, lambda: parallelize_moe(moe, ep_mesh=world, ep_mode="sync_free"),
                             match="SPMDMOE_EP_SYMMETRIC=0 on ranks")
    assert_raises_everywhere(MoEConfigError, lambda: layer.set_ep_mode("sync_free"), match="SPMDMOE_EP_SYMMETRIC")


@pytest.mark.parametrize("total", [0, 3, 41])
@pytest.mark.parametrize("precision", ["bf16", "fp8_rowwise"])
@pytest.mark.parametrize("plan_name", ["sp_ep", "ep", "sp_x_ep"])  # sp_x_ep: EP over a subgroup (2x2, 4 ranks)
def test_bitwise_equal_to_the_other_transports(world, device, request, peers, plan_name, precision, total, nan_empty):
    """The experts see the same rows in the same order on all three transports: equal bit for bit (``T = 0``
    everywhere, ``T < ranks``, uneven ``T``; every uninitialised buffer row NaN)."""
    cfg = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=3, num_shared_experts=1, expert_precision=precision)
    plan = build_plan(plan_name, reference_moe(cfg, 3, device), total, world, request, ep_mode="sync_free",
                      **({"max_tokens": max(total, 1)} if plan_name == "ep" else {}))
    x = reference_tensor((total, D), 7, device=device)[plan.rows]
    g = reference_tensor((total, D), 8, device=device)[plan.rows]
    _equal(_all_three(plan, x, g))
    plan.layer.check_capacity()  # lossless


def test_a_buffer_inside_a_pooled_block(world, device, request, peers, monkeypatch, nan_empty):
    """The staging buffer carved out of a larger block (as torch's symmetric-memory pool may give it): every move
    reads and writes the buffer itself, never the block's other bytes, and the results stay bitwise those of the
    other transports (gloo emulation; on CUDA the real allocation is checked at each rendezvous)."""
    if device.type == "cuda":
        pytest.skip("the emulated pool (the real one: symmetric._buffer's check)")
    monkeypatch.setattr(symmetric, "_allocate", _gloo_pooled)  # over the peers fixture's emulation
    cfg = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=3)
    plan = build_plan("sp_ep", reference_moe(cfg, 3, device), 41, world, request, ep_mode="sync_free")
    x = reference_tensor((41, D), 7, device=device)[plan.rows]
    g = reference_tensor((41, D), 8, device=device)[plan.rows]
    _equal(_all_three(plan, x, g))
    block = next(iter(symmetric._staging.values())).buf._base
    assert block[:512].eq(77).all() and block[-512:].eq(77).all()


@pytest.mark.parametrize("case", ["one_expert", "idle_experts"])
def test_skewed_routing(world, device, request, peers, case, nan_empty):
    """All tokens on one expert (two: top-2), or half the experts idle: bit for bit as above, and lossless."""
    cfg = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=2)
    moe = reference_moe(cfg, 4, device)
    if case == "one_expert":
        moe.expert_bias[5:7] = 1e3
    else:
        moe.expert_bias[::2] = -1e3
    plan = build_plan("sp_ep", moe, 37, world, request, ep_mode="sync_free")
    x = reference_tensor((37, D), 9, device=device)[plan.rows]
    g = reference_tensor((37, D), 10, device=device)[plan.rows]
    _equal(_all_three(plan, x, g))
    plan.layer.check_capacity()


@pytest.mark.compile_matrix  # on gloo the transport is emulated; plain pytest compiles it in the test below
@pytest.mark.parametrize("plan_name", ["ep", "sp_ep"])
def test_compiled_matches_eager(world, device, request, peers, plan_name):
    """``torch.compile(fullgraph=True)`` over the symmetric transport's custom ops (``test_compile_moe``'s
    comparison: outputs, input and parameter gradients, load counts, over steps whose ``T`` changes; inductor on
    NCCL, where the compiler orders independent ops as it likes: each of the transport's moves is one op, so
    every rank issues them in the order the data dictates)."""
    from test_compile_moe import SYNC_FREE, _compare

    _compare(plan_name, SYNC_FREE, None, world, device, request, max_graphs=3)


@pytest.mark.parametrize("case", ["no_tokens", "stand_in"])
def test_compiled_every_rank_runs_the_same_moves(world, device, request, peers, monkeypatch, case):
    """Compiled (``fullgraph``, dynamic sizes), the last rank routes no token (``no_tokens``) or more than
    ``max_tokens`` (``stand_in``: it stands in zero rows, whose output and gradient are constants): it still
    runs every move its peers run, in the same order (the ops are ordered side effects; as plain functions
    inductor dropped the empty rank's dispatch backward, and the stand-in rank's combine, moving its backward
    moves into the forward), and the stand-in case raises ``SPMDCapacityError`` on every rank."""
    from moe_plans import compile_backend

    moves = []
    real = symmetric._staged
    monkeypatch.setattr(symmetric, "_staged", lambda *a: (moves.append(sys._getframe(1).f_code.co_name), real(*a))[1])
    torch._dynamo.reset()
    cfg = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=2, num_shared_experts=1)
    layer = build_plan("ep", reference_moe(cfg, 6, device), 8, world, request, ep_mode="sync_free", max_tokens=4).layer
    last = world.get_local_rank() == world.size() - 1
    rows = (0 if last else 3) if case == "no_tokens" else (5 if last else 3)
    x = torch.randn(rows, D, device=device, requires_grad=True)
    run = torch.compile(layer, backend=compile_backend(device), fullgraph=True, dynamic=True)

    def step():
        run(x).sum().backward()
        spmdmoe.check_errors()

    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        if case == "stand_in":
            assert_raises_everywhere(SPMDCapacityError, step, match="more rows than the sync-free EP buffers hold")
        else:
            step()
    seen = [None] * world.size()
    dist.all_gather_object(seen, moves)
    assert moves and all(m == seen[0] for m in seen), seen


def test_activation_checkpointing(world, device, request, peers):
    """The layer under non-reentrant activation checkpointing: the recomputation reads the peers again (a
    collective on every rank) and the step equals the plain one and the other transports bit for bit."""
    cfg = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=2, num_shared_experts=1)
    plan = build_plan("sp_ep", reference_moe(cfg, 5, device), 29, world, request, ep_mode="sync_free")
    x = reference_tensor((29, D), 11, device=device)[plan.rows]
    g = reference_tensor((29, D), 12, device=device)[plan.rows]
    plain = _step(plan, x, g)
    runs = _all_three(plan, x, g, checkpointed=True)
    _equal(runs)
    _equal([plain, runs[0]])


class _Passing(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_eager_moves_skip_the_custom_ops(world, device, request, peers, monkeypatch):
    """An eager step runs the four moves as plain functions (``symmetric._PeerOp``: the custom ops' dispatch is
    host time), the custom ops only under a dispatch mode; both give the same step bit for bit."""
    cfg = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=2)
    plan = build_plan("ep", reference_moe(cfg, 5, device), 29, world, request, ep_mode="sync_free")
    x = reference_tensor((29, D), 11, device=device)[plan.rows]
    g = reference_tensor((29, D), 12, device=device)[plan.rows]
    calls = []
    for move in (symmetric.peer_dispatch, symmetric.peer_dispatch_backward, symmetric.peer_pull_rows,
                 symmetric.peer_pull_sum):
        monkeypatch.setattr(move, "op", lambda *a, _op=move.op, **k: calls.append(_op) or _op(*a, **k))
    eager = _step(plan, x, g)
    assert calls == [], calls
    with _Passing():
        moded = _step(plan, x, g)
    assert sorted(str(op) for op in calls) == sorted(str(op) for op in symmetric.PEER_OPS), calls
    _equal([eager, moded])


@pytest.mark.compile_matrix  # (13 s on 2 cores: CI's torch-2.11 leg, Makefile OLD_DIST)
def test_compiled_checkpointing_with_the_policy(world, device, request, peers):
    """Compiled, under selective activation checkpointing with ``symmetric.checkpoint_policy`` (the moves saved,
    the rest recomputed): the step equals the eager, uncheckpointed one (outputs and input gradients)."""
    import functools

    from moe_plans import compile_backend
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    torch._dynamo.reset()
    cfg = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=2)
    plan = build_plan("ep", reference_moe(cfg, 7, device), 16, world, request, ep_mode="sync_free", max_tokens=16)
    x = reference_tensor((16, D), 13, device=device)[plan.rows]
    g = reference_tensor((16, D), 14, device=device)[plan.rows]
    context = functools.partial(create_selective_checkpoint_contexts, symmetric.checkpoint_policy)
    run = torch.compile(lambda t: checkpoint(plan.layer, t, use_reentrant=False, context_fn=context),
                        backend=compile_backend(device), fullgraph=True)
    got = []
    for fn in (run, plan.layer):
        leaf = x.clone().requires_grad_()
        with torch._dynamo.config.patch(capture_scalar_outputs=True):
            y = fn(leaf)
        (y * g).sum().backward()
        got.append((y.detach(), leaf.grad))
    for a, b in zip(*got):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_overflow_drops_by_the_rule_and_raises_everywhere(world, device, request, peers):
    """A tiny capacity factor: no slot limit here (a source's every token can cross), the experts' buffer keeps
    its first ``R`` copies in expert-major order; the output is the weighted sum of the kept copies
    (``moe_plans.kept_copies`` with ``S = T_max``), every rank holds the same verdict and raises."""
    n = world.size()
    total = 41
    cfg = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=2)
    moe = reference_moe(cfg, 5, device)
    plan = build_plan("ep", moe, total, world, request, ep_mode="sync_free", capacity_factor=0.1, max_tokens=total)
    x = reference_tensor((total, D), 11, device=device)[plan.rows]
    with torch.no_grad():
        y = plan.layer(x)
        r = moe.router(x, moe.expert_bias, moe.router.gate.weight)
    ids_by_rank = [None] * n
    dist.all_gather_object(ids_by_rank, r.ids_TK.tolist())
    assert isinstance(plan.layer.transport, symmetric.SymmetricTransport)
    S, R = plan.layer.transport.sizes(total)  # no slot limit: S = T_max
    kept = kept_copies(ids_by_rank, n, E // n, S, R)[world.get_local_rank()]
    with torch.no_grad():
        want = kept_reference(moe, x, kept)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    state = plan.layer.transport.overflow.clone()
    table = [torch.empty_like(state) for _ in range(n)]
    dist.all_gather(table, state)
    assert all(torch.equal(t, table[0]) for t in table), "every rank holds the same verdict"
    assert int(state[0]) > 0
    assert_raises_everywhere(SPMDCapacityError, plan.layer.check_capacity, match=f"the buffers hold {S} and {R}")


# (tokens per source, capacity factor, dims, dtype): a tiny CPU case, and on CUDA the benchmark's that turned
# NaN (D, F, E, K = 256, 128, 64, 6 in bf16 at 4k tokens a rank, capacity_factor 1.25: `benchmarks/ARCHIVE.md`,
# issue 42, the 12:55 UTC run of 2026-11-27)
_OVERFLOWS = [(41, 0.1, (D, F, E, 2), torch.float32), (41, 0.4, (D, F, E, 2), torch.float32),
              (4096, 1.25, (256, 128, 64, 6), torch.bfloat16)]


@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
@pytest.mark.parametrize("total, factor, dims, dtype", _OVERFLOWS)
def test_overflow_forward_and_backward_read_no_unwritten_row(world, device, request, peers, nan_empty, total, factor,
                                                             dims, dtype, ties):
    """A capacity overflow with ``torch.empty`` handing out NaN: the dropped copies' rows (past ``R``) and every
    buffer's unwritten tail must never reach the output or a gradient. The output and the input gradient equal
    a differentiable reference of the kept copies (``kept_copies`` with ``S = T_max``), eagerly and, on CUDA in
    bf16, replayed from a CUDA graph (bit for bit the eager step); every parameter gradient is finite; the check
    raises ``SPMDCapacityError`` exactly when a copy was dropped on some rank. ``ties``: a zero gate, so every
    router score ties and every token picks the same experts (what a deep stack without residuals reaches: the
    benchmark's fourth layer): one rank's buffer overflows, the others hold no row. Every check is agreed over
    the ranks before the next collective (a failure on one rank fails all, never a hang)."""
    if total > 64 and device.type != "cuda":
        pytest.skip("the large case runs on CUDA (the Triton kernels); the CPU path is the small ones")
    n = world.size()
    Dm, Fm, Em, Km = dims
    cfg = MoEConfig(dim=Dm, hidden_dim=Fm, num_experts=Em, top_k=Km)
    moe = reference_moe(cfg, 5, device, dtype)
    if ties:
        with torch.no_grad():
            moe.router.gate.weight.zero_()
    per_rank = total > 64  # the large case: `total` tokens on every rank, not one batch split unevenly
    plan = build_plan("ep", moe, total * (n if per_rank else 1), world, request, ep_mode="sync_free",
                      capacity_factor=factor, max_tokens=total)
    assert isinstance(plan.layer.transport, symmetric.SymmetricTransport)
    rank = world.get_local_rank()
    rows = slice(rank * total, (rank + 1) * total) if per_rank else plan.rows
    x = reference_tensor((total * (n if per_rank else 1), Dm), 11, device=device, dtype=dtype)[rows]
    g = reference_tensor(x.shape, 12 + rank, device=device)
    got = _step(plan, x, g)
    leaf = x.clone().requires_grad_()
    ids = moe.router(leaf, moe.expert_bias, moe.router.gate.weight).ids_TK.tolist()
    ids_by_rank = [None] * n
    dist.all_gather_object(ids_by_rank, ids)
    S, R = plan.layer.transport.sizes(total)
    kept = kept_copies(ids_by_rank, n, Em // n, S, R)
    want = kept_reference(moe, leaf, kept[rank])
    (want * g).sum().backward()
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    finite = all(torch.isfinite(t).all() for t in got if t is not None)
    assert not all_ranks_agree(finite), "non-finite output or gradients on some rank"
    assert_close_everywhere(got[0].float(), want.detach(), name="output", **tol)
    assert_close_everywhere(got[1].float(), leaf.grad.float(), name="input gradient", **tol)
    if device.type == "cuda" and dtype == torch.bfloat16:  # (fp32's grouped GEMM reads its offsets on the host)
        from spmdmoe.testing import capture_training_step

        leaf2 = x.clone().requires_grad_()

        def step():
            y = plan.layer(leaf2)
            (y.float() * g).sum().backward()
            return y

        graph, y2 = capture_training_step(step, plan.layer, leaf2)
        graph.replay()
        torch.cuda.synchronize()
        same = torch.equal(y2, got[0]) and torch.equal(leaf2.grad, got[1])
        assert not all_ranks_agree(same), "the graph's replay differs from the eager step on some rank"
    dropped = sum(len(ids_by_rank[s]) * Km for s in range(n)) - sum(len(c) for c in kept)
    if dropped:
        assert_raises_everywhere(SPMDCapacityError, plan.layer.check_capacity, match="capacity exceeded")
    else:
        plan.layer.check_capacity()


_SKIP_JOB = """
import os, sys, time, torch, torch.distributed as dist
rank = int(os.environ["RANK"]); torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
from spmdmoe.moe import MoE, MoEConfig, parallelize_moe
torch.manual_seed(0)
layer = parallelize_moe(MoE(MoEConfig(dim=16, hidden_dim=16, num_experts=4, top_k=2)).cuda(), ep_mesh=dist.group.WORLD,
                        ep_mode="sync_free", max_tokens=8)
assert type(layer.transport).__name__ == "SymmetricTransport", type(layer.transport)
x = torch.randn(8, 16, device="cuda")
layer(x); torch.cuda.synchronize()
print(f"rank {rank}: warm", flush=True)
if rank == 0:
    time.sleep(80)  # skips the next forward; its peer's barrier must give up first
else:
    layer(x); torch.cuda.synchronize()
    print("rank 1: the forward finished without its peer", flush=True)
"""


def test_a_rank_skipping_a_layer_traps(world, device, tmp_path):
    """Rank 0 skips a forward that rank 1 runs: rank 1's first barrier gives up after its bound (2 s here) and
    the job ends with the barrier's message, well before rank 0 would come back (80 s). A separate 2-rank job
    (the trap ends the CUDA context of its process), run by rank 0 on this job's first two GPUs."""
    if device.type != "cuda" or world.size() < 2:
        pytest.skip("needs CUDA symmetric memory on 2+ GPUs")
    result = [None]
    if world.get_rank() == 0:
        script = tmp_path / "skip_layer.py"
        script.write_text(_SKIP_JOB)
        env = dict(os.environ, SPMDMOE_PEER_TIMEOUT_MS="2000", PYTHONPATH=os.getcwd(),
                   CUDA_VISIBLE_DEVICES=",".join(os.environ.get("CUDA_VISIBLE_DEVICES", "0,1").split(",")[:2]))
        for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "TORCHELASTIC_RUN_ID", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE"):
            env.pop(k, None)
        t0 = time.time()
        job = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                              str(script)], env=env, capture_output=True, text=True, timeout=100)
        result = [(job.returncode, time.time() - t0, job.stdout + job.stderr)]
    dist.broadcast_object_list(result, src=0)
    rc, seconds, log = result[0]
    assert "warm" in log, log[-3000:]
    assert rc != 0 and "without its peer" not in log, log[-3000:]
    assert seconds < 70, f"the job took {seconds:.0f} s: the barrier did not give up before rank 0 came back"
    assert "failed to receive signal" in log or "failed to send signal" in log, log[-3000:]


test_a_rank_skipping_a_layer_traps = pytest.mark.timeout(200)(test_a_rank_skipping_a_layer_traps)
