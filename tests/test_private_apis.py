"""The private torch APIs spmdmoe relies on that no single-process test would otherwise watch (docs/design.md §10).

Each test pins the exact property spmdmoe uses, on CPU in one process: a rename, a removal or a change of
behaviour fails here, not only in a GPU or ``torchrun`` suite (or, for a ``getattr`` fallback, nowhere: a
silently slower path). The APIs that ordinary tests already exercise are listed in §10 with their tests.
"""

import inspect

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import spmdmoe


@pytest.fixture(scope="module")
def pg():
    return spmdmoe.testing.single_process_group()


def test_scaled_grouped_mm_takes_both_fp8_call_forms():
    """``torch._scaled_grouped_mm`` as ``spmdmoe.moe.experts.fp8`` calls it (keywords ``offs``, ``out_dtype``,
    ``use_fast_accum``; row-wise 2-D x 3-D and per-group 2-D x 2-D), through torch's meta function, which
    checks the operand layouts and scale sizes. Without the op ``fp8_native`` is false everywhere and the GPU
    tests of ``tests/test_fp8.py`` skip instead of failing."""
    from spmdmoe.moe.experts import fp8

    assert fp8._scaled is not None, "torch._scaled_grouped_mm is gone: FP8 experts would only emulate"
    f8, meta = torch.float8_e4m3fn, {"device": "meta"}
    e, M, K, N = 2, 32, 16, 48
    offs = torch.empty(e, dtype=torch.int32, **meta)
    q, s = torch.empty(M, K, dtype=f8, **meta), torch.empty(M, **meta)
    w, sw = torch.empty(e, N, K, dtype=f8, **meta), torch.empty(e, N, **meta)
    y = fp8._mm_rows(q, s, w, sw, offs, torch.float32, True, "forward")
    assert (y.shape, y.dtype) == ((M, N), torch.float32)
    A, B, P = 16, 32, 64
    qa, qb = torch.empty(A, P, dtype=f8, **meta), torch.empty(B, P, dtype=f8, **meta)
    sa, sb = torch.empty(e, A, **meta), torch.empty(e, B, **meta)
    out = fp8._mm_groups(qa, qb, sa, sb, offs, torch.float32, True)
    assert (out.shape, out.dtype) == ((e, A, B), torch.float32)


def test_assume_constant_result_is_one_attribute():
    """``spmdmoe.moe.experts.gemm`` marks ``_packed_offset`` constant for Dynamo by the attribute that
    ``torch.compiler.assume_constant_result`` sets (calling it imports Dynamo: a second of ``import spmdmoe``)."""
    from spmdmoe.moe.experts import gemm

    def f() -> None: ...

    marked = torch.compiler.assume_constant_result(f)
    assert marked is f and vars(f) == {"_dynamo_marked_constant": True}, vars(f)
    assert gemm._packed_offset._dynamo_marked_constant is True


def test_check_lets_the_tracer_use_the_traced_split_sizes():
    """``torch._check`` as the EP dispatcher uses it under compile (``spmdmoe/moe/transports/dispatch.py``): facts
    about sizes read from a tensor (``.tolist()``) that the tracer cannot see. With them a fullgraph trace
    decides on those sizes; they become runtime asserts (bad counts raise instead of running wrong)."""

    def f(x, counts):
        sizes = counts.tolist()
        for c in sizes:
            torch._check(c >= 0)
        torch._check(sum(sizes) == x.shape[0])
        return x * 2 if sizes[0] >= 0 and sum(sizes) == x.shape[0] else x

    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        run = torch.compile(f, backend="eager", fullgraph=True, dynamic=True)
        assert torch.equal(run(torch.arange(10.0), torch.tensor([3, 0, 7])), torch.arange(10.0) * 2)
        with pytest.raises(RuntimeError, match="[Rr]untime assertion"):
            run(torch.arange(10.0), torch.tensor([3, 0, 6]))
    torch._dynamo.reset()


def test_mark_static_address_makes_a_static_graph_input():
    """``torch._dynamo.mark_static_address`` as the FP8 weight cache calls it (``spmdmoe/moe/experts/fp8_cache.py``,
    CUDA only there): a plain tensor attribute, not a parameter or buffer, becomes one of AOT autograd's
    static inputs (the indices inductor's CUDA graphs use in place instead of copying in); an unmarked
    one does not."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._guards import TracingContext

    class Holder:
        pass

    cache = Holder()
    cache.marked, cache.plain = torch.ones(1, 3), torch.full((3,), 2.0)  # told apart by shape
    torch._dynamo.mark_static_address(cache.marked)
    seen = {}

    def fw_compiler(gm, example_inputs):
        static = TracingContext.try_get().fw_metadata.static_input_indices
        seen["static"] = [tuple(example_inputs[i].shape) for i in static]
        return gm.forward

    torch._dynamo.reset()
    run = torch.compile(lambda x: x * cache.marked + cache.plain, backend=aot_autograd(fw_compiler=fw_compiler),
                        fullgraph=True)
    run(torch.ones(3))
    torch._dynamo.reset()
    assert seen["static"] == [(1, 3)]


def test_is_alias_of_means_the_same_storage():
    """``torch._C._is_alias_of`` as ``gemm._packed_offset`` uses it: true for two disjoint views of one
    storage (``w1`` and ``w3`` packed side by side), false for equal values in another storage."""
    packed = torch.randn(2, 6, 4)
    w1, w3 = packed[:, :3], packed[:, 3:]
    assert torch._C._is_alias_of(w1, w3) and torch._C._is_alias_of(w3, packed.detach())
    assert not torch._C._is_alias_of(w1, w1.clone()) and not torch._C._is_alias_of(w1, torch.randn(2, 3, 4))


class _Probe(torch.autograd.Function):
    """Identity; its backward calls ``probe()`` and records the result."""

    @staticmethod
    def forward(ctx, x, probe, record):
        ctx.probe, ctx.record = probe, record
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.record.append(ctx.probe())
        return g, None, None


def test_current_graph_task_id_names_one_backward():
    """``torch._C._current_graph_task_id`` as ``overlap.Join.launch`` uses it: -1 outside a backward, one
    id for every node of one backward, another id for a second backward of the same graph (an aborted
    backward retried with ``retain_graph``: its stale sums are dropped by the id)."""
    assert torch._C._current_graph_task_id() == -1
    seen = []
    x = torch.randn(3, requires_grad=True)
    y = _Probe.apply(_Probe.apply(x * 2, torch._C._current_graph_task_id, seen) * 3,
                     torch._C._current_graph_task_id, seen)
    loss = y.sum()
    loss.backward(retain_graph=True)
    loss.backward()
    assert len(seen) == 4 and seen[0] == seen[1] >= 0 and seen[2] == seen[3] >= 0 and seen[0] != seen[2], seen
    assert torch._C._current_graph_task_id() == -1


def test_will_engine_execute_node_sees_where_the_backward_stops():
    """``torch._C._will_engine_execute_node`` as ``overlap.Join.joins_this_backward`` uses it: asked in a
    node's backward about a node nearer the inputs (the call's join), true when the running backward
    reaches it, false when it stops short (``torch.autograd.grad`` of an intermediate)."""
    x = torch.randn(3, requires_grad=True)
    start = x * 2  # the "join": its node is reached only by a backward that goes down to x
    mid = start * 3
    seen = []
    y = _Probe.apply(mid, lambda: torch._C._will_engine_execute_node(start.grad_fn), seen)
    torch.autograd.grad(y.sum(), x, retain_graph=True)
    torch.autograd.grad(y.sum(), mid, retain_graph=True)
    y.sum().backward()
    assert seen == [True, False, True]


@pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")
def test_make_nccl_premul_sum_builds_a_reduce_op():
    """``dist._make_nccl_premul_sum`` as ``data_parallel._reduce`` calls it (NCCL, a divide factor other than
    the group size). Its absence is silent there (the gradients are divided first, one more pass), so it
    is watched here."""
    op = dist._make_nccl_premul_sum(1.0 / 3)
    assert isinstance(op, dist.ReduceOp)


def test_fsdp2_units_are_found(pg):
    """``overlap.is_fsdp_unit`` (``isinstance`` of the public ``FSDPModule``; it once matched the class name):
    true for what ``fully_shard`` returns (a 1-rank CPU mesh), false for a plain module. A miss would put
    FSDP2 units' SP sums behind the outer join, after their reduce-scatter."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from spmdmoe.moe.params.overlap import inside_fsdp_unit, is_fsdp_unit

    block = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert not is_fsdp_unit(block[0]) and not inside_fsdp_unit(block, "0.weight")
    fully_shard(block[0], mesh=DeviceMesh.from_group(pg, "cpu"))
    assert isinstance(block[0], FSDPModule) and is_fsdp_unit(block[0])
    assert inside_fsdp_unit(block, "0.weight") and not inside_fsdp_unit(block, "1.weight")


def test_functional_collectives_as_called(pg):
    """``torch.distributed._functional_collectives`` as the compiled EP exchange and sync-free count table
    call it: ``all_to_all_single_autograd(x, output_split_sizes, input_split_sizes, group)`` (positional,
    differentiable) and ``all_gather_tensor(x, gather_dim, group)``; eager on a 1-rank gloo group."""
    import torch.distributed._functional_collectives as funcol

    params = list(inspect.signature(funcol.all_to_all_single_autograd).parameters)
    assert params[1:4] == ["output_split_sizes", "input_split_sizes", "group"], params
    assert list(inspect.signature(funcol.all_gather_tensor).parameters)[1:3] == ["gather_dim", "group"]
    x = torch.arange(6.0).view(3, 2).requires_grad_()
    y = funcol.all_to_all_single_autograd(x * 2, [3], [3], pg)
    assert torch.equal(y, x.detach() * 2)
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((3, 2), 2.0))
    assert torch.equal(funcol.all_gather_tensor(torch.arange(4), 0, pg), torch.arange(4))


def test_module_parameters_slot_takes_a_plain_tensor():
    """``nn.Module._parameters`` as ``replicate_grads``' forward uses it (``spmdmoe/moe/params/grads.py``): a
    non-Parameter tensor put into the slot (``setattr`` refuses one) is what the module's forward reads,
    so the gradient flows through it; putting the Parameter back restores the module."""
    lin = nn.Linear(3, 2)
    weight = lin.weight
    view = weight * 2  # stands in for sync_grads' view (a node on the weight's path)
    lin._parameters["weight"] = view
    try:
        x = torch.randn(4, 3)
        torch.testing.assert_close(lin(x), x @ (2 * weight.detach()).T + lin.bias.detach())
        lin(x).sum().backward()
        torch.testing.assert_close(weight.grad, 2 * x.sum(0).expand(2, 3))
    finally:
        lin._parameters["weight"] = weight
    assert lin.weight is weight and [p for _, p in lin.named_parameters()][0] is weight


def test_symmetric_memory_as_called():
    """``torch.distributed._symmetric_memory`` as ``moe/transports/symmetric.py`` calls it (the sync-free EP transport on one
    host): ``empty(n, dtype=, device=)``, ``rendezvous(tensor, group_name)``, and on the handle
    ``barrier(channel=, timeout_ms=)`` (the bound that traps instead of hanging), ``get_buffer(rank, sizes,
    dtype, storage_offset)``, ``world_size``, ``rank``. Without a GPU only the names and signatures are
    checkable; ``tests/distributed/test_symmetric.py`` runs them on NCCL."""
    from torch.distributed import _symmetric_memory as symm_mem

    assert list(inspect.signature(symm_mem.empty).parameters)[-2:] == ["dtype", "device"]
    assert list(inspect.signature(symm_mem.rendezvous).parameters) == ["tensor", "group"]
    handle = torch._C._distributed_c10d._SymmetricMemory
    for name in ("barrier", "get_buffer", "world_size", "rank"):
        assert hasattr(handle, name), name
    assert "timeout_ms" in handle.barrier.__doc__ and "channel" in handle.barrier.__doc__, handle.barrier.__doc__
    assert "storage_offset" in handle.get_buffer.__doc__, handle.get_buffer.__doc__  # its 4th argument


def test_ordered_effects_as_registered():
    """``_register_effectful_op(custom_op, EffectType.ORDERED)`` as ``moe/transports/symmetric.py`` calls it, on a custom op
    of its own: accepted, and the op's effect then reads ORDERED (what makes the compiler keep and order it)."""
    from torch._higher_order_ops.effects import _get_effect, _register_effectful_op
    from torch._library.effects import EffectType

    @torch.library.custom_op("spmdmoe_test::ordered_probe", mutates_args=())
    def probe(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    _register_effectful_op(probe, EffectType.ORDERED)
    assert _get_effect(probe._opoverload) == EffectType.ORDERED
