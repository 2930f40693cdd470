"""``torch.compile(fullgraph=True)`` of the parallel MoE layer on every plan, against the same layer eager.

Each plan's layer is built twice from the same weights; one runs eager, the
other compiled (``aot_eager`` on CPU: inductor on 2 cores is too slow for CI;
inductor on NCCL, the GPU run). For a sequence of token counts, each step's
routing another (new inputs; every rank holding at least 2 rows), with no
size specialised on a step's received rows (a runtime assertion such as
``Eq(u0 + u1, ...)`` would fail a later step), the compiled layer must give the eager
outputs, input and parameter gradients, aux loss and load counts (fp32,
``rtol = 1e-5``, ``atol = 1e-5 * max|eager|``: the compiled grouped GEMM of
fp32 rows is a masked loop, ``spmdmoe.moe.experts.gemm``), compile ONE graph for all
of them (``dynamic=True``: the token counts, the local rows and the global
``T``, are symbolic from the first call; with torch's default automatic
dynamic shapes a rank compiles at most twice more, when it first sees its rows
and ``T`` change), and the bias
update after the steps must give the same ``expert_bias`` bitwise. Neither forward may consult ``sync_grads``'
call-site cache (``_steps_agree``). A step's assertions are agreed across ranks (``on_every_rank``): a failure on
one rank fails the step on every rank, so no rank goes on into collectives its peers have left.

Plain pytest runs one case per transport (``FIRST``; on 2 cores each case is half a minute of 4 processes
tracing); the other plans carry the ``compile_matrix`` marker: ``make test-compile``, CI's torch-2.11 leg, and
``benchmarks/gpu_session.sh compile4`` on 4 GPUs run them all.
"""

import copy
import os
from unittest import mock

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from moe_plans import PLANS, build_plan, compile_backend, reference_moe
from spmdmoe import SPMDTensor
from spmdmoe.moe import MoEConfig
from spmdmoe.moe.params import grads
from spmdmoe.testing import all_ranks_agree, reference_tensor
from spmdmoe.types import layout
from test_moe_parity import close

def _steps(n):
    """Six token counts: on up to 4 ranks every rank holds >= 2 rows in every plan; on more, six counts spread
    over those that give every rank >= 2 rows by the chunk rule (a rank's one row would be specialised on: a
    graph more)."""
    if n <= 4:
        return [12, 11, 14, 15, 18, 20]
    fit = [t for t in range(3 * n, 8 * n) if min(layout.local_tokens(t, n, r) for r in range(n)) >= 2]
    return fit[:: max(1, len(fit) // 6)][:6]


STEPS = _steps(int(os.environ.get("WORLD_SIZE", "1")))
D = 16


def on_every_rank(check):
    """Run ``check`` (a step's assertions); when it fails on any rank, fail on every rank, so that no rank goes on
    into the next step's collectives (or the next test's) while another has left."""
    try:
        check()
        problem = ""
    except AssertionError as e:
        problem = str(e)
    failed = all_ranks_agree(not problem)
    if failed:
        raise AssertionError(f"failed on ranks {failed}" + (f"; this rank: {problem}" if problem else ""))


def _step(plan, layer, X, G):
    leaf = X[plan.rows].clone().requires_grad_()
    y = layer(plan.wrap(leaf))
    y_local = y.local if isinstance(y, SPMDTensor) else y
    loss = (y_local * G[plan.rows]).sum()
    if plan.layer.aux_loss is not None:
        loss = loss + plan.layer.aux_loss
    loss.backward()
    return y_local.detach(), leaf.grad, plan.layer.aux_loss


SYNC_FREE = {"ep_mode": "sync_free", "max_tokens": max(STEPS)}  # static buffers: one T_max for every step
# plain pytest runs one case per transport (the 2-D SP x EP plan, sync; EP sync-free); the rest is the
# compile_matrix marker's (`make test-compile`, CI's torch-2.11 leg, `benchmarks/gpu_session.sh compile4`)
FIRST = {("sp_x_ep", False), ("ep", True)}
CASES = [pytest.param(p, o, id=p + ("-sync_free" if o else ""),
                      marks=() if (p, bool(o)) in FIRST else pytest.mark.compile_matrix)
         for p, o in [(p, {}) for p in PLANS] + [(p, SYNC_FREE) for p in ("sp_ep", "ep", "sp_x_ep", "gather_ep")]]


@pytest.mark.parametrize("plan_name,options", CASES)
def test_compiled_layer_matches_eager_with_one_graph(world, device, request, plan_name, options):
    _compare(plan_name, options, True, world, device, request)


@pytest.mark.compile_matrix
@pytest.mark.parametrize("plan_name", ["ep", "gather_ep"])
def test_compiled_sync_free_without_max_tokens(world, device, request, plan_name):
    """Sync-free EP off the SP axis without ``max_tokens``, compiled with ``fullgraph=True`` from its first call:
    the first forward agrees ``T_max`` host to host while Dynamo traces it (a constant of that graph, the count
    specialised), later ones use it (one more graph, then no other); the token counts only shrink after the
    first step, so that ``T_max`` holds them all."""
    _compare(plan_name, {"ep_mode": "sync_free"}, True, world, device, request, max_graphs=2,
             steps=sorted(STEPS, reverse=True))


@torch._dynamo.config.patch(capture_scalar_outputs=True)  # the EP split sizes; restored when it returns
def _compare(plan_name, options, dynamic, world, device, request, max_graphs=1, steps=STEPS):
    if plan_name == "sp_ep" and options:
        options = {"ep_mode": "sync_free"}  # EP on the SP axis: T_max from the layout (symbolic in T)
    torch._dynamo.reset()
    cfg = MoEConfig(dim=D, hidden_dim=16, num_experts=8, top_k=2, num_shared_experts=1, aux_loss_coeff=0.01,
                    load_balance_coeff=1e-3)
    moe = reference_moe(cfg, 3, device)
    eager = build_plan(plan_name, copy.deepcopy(moe), steps[0], world, request, **options).layer
    compiled = build_plan(plan_name, copy.deepcopy(moe), steps[0], world, request, **options).layer
    run = torch.compile(compiled, backend=compile_backend(device), fullgraph=True, dynamic=dynamic)
    with mock.patch.object(grads, "_agreed_at_call_site", _no_lookup):
        _steps_agree(plan_name, moe, eager, compiled, run, world, device, request, max_graphs, steps)


def _no_lookup(*args, **kwargs):
    raise AssertionError("the layer's forward consulted sync_grads' call-site cache")


def _steps_agree(plan_name, moe, eager, compiled, run, world, device, request, max_graphs, steps=STEPS):
    """Every step of ``STEPS`` eager and compiled: equal results, at most ``max_graphs`` graphs, neither forward
    reaching ``sync_grads``' call-site cache (the layer keeps the set of SP-replicated weights it agreed on when
    wrapped as a plain attribute: the cache is keyed by ``id()`` of group and tensors, which torch 2.11's Dynamo
    cannot trace)."""
    plan_rows = lambda total: build_plan(plan_name, moe, total, world, request, layer=eager).rows  # noqa: E731
    for i, total in enumerate(steps):
        X = reference_tensor((total, D), 100 + i, device=device)
        G = reference_tensor((total, D), 200 + i, device=device)
        for layer in (eager, compiled):
            layer.zero_grad(set_to_none=True)
        want = _step(build_plan(plan_name, moe, total, world, request, layer=eager), eager, X, G)
        got = _step(build_plan(plan_name, moe, total, world, request, layer=compiled), run, X, G)

        def checks(i=i, total=total, got=got, want=want):
            for name, a, b in zip(("output", "input gradient", "aux loss"), got, want):
                close(a.reshape(-1), b.reshape(-1), f"step {i} (T={total}) {name}")
            for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
                close(p.grad, q.grad, f"step {i} {name} gradient")
            close(compiled.tokens_per_expert, eager.tokens_per_expert, f"step {i} load counts", 0)
            code = type(compiled).forward.__code__
            graphs = len(_debug_get_cache_entry_list(code))
            why = [str(r) for r in torch._dynamo.utils.guard_failures.get(code, [])]
            assert graphs <= max_graphs, (f"step {i} (T={total}, {X[plan_rows(total)].shape[0]} rows here): {graphs} "
                                          f"graphs compiled (at most {max_graphs}); recompiled for: {why}")
        on_every_rank(checks)
    eager.update_expert_bias()
    compiled.update_expert_bias()
    on_every_rank(lambda: torch.testing.assert_close(compiled.expert_bias, eager.expert_bias, rtol=0, atol=0))
