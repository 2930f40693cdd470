"""Overlapped SP gradient sums (``spmdmoe.moe.params.overlap``): launched at the use, waited for at the join.

A block ``moe(inp(x)) + inp(x)`` (``inp`` a ``replicate_grads`` Linear, ``moe`` an SP-local layer
with a shared expert; experts replicated along SP, so their gradients are summed too) on the world as
one SP axis, 3 or 13 tokens (3: a rank with none on 4 ranks). What is checked:

* the order: every sum is launched (``async_op=True``) before any is waited for, the MoE's during
  the MoE's backward, and the first wait comes after ``inp``'s backward (the join is the block's
  input); one bucket per ``sync_grads`` call and dtype (here 3, all fp32);
* values: gradients equal those of the same block with every sum waited for at its use (itself
  checked against one device by test_moe_training / test_data_parallel), fp32,
  ``rtol = 1e-6, atol = 1e-6 * max|reference|``; over two micro-batches (only fresh gradients
  summed) and under activation checkpointing, reentrant or not;
* ``torch.compile(fullgraph=True)`` of the wrapped block (the sums are then in the graph), against
  the eager reference at test_compile_moe's tolerance (``rtol = 1e-5``, ``atol = 1e-5 * max``),
  also with rank 0 compiled and the others eager (a dynamo fallback on some ranks): the same
  collectives, no hang;
* a second-order backward (a gradient penalty) through ``replicate_grads`` modules in an
  ``overlap_grads`` module, a ``deepcopy`` of the block, and a backward that raises between the
  MoE's launches and the join, retried on the retained graph (the stale sums are not added in).
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import spmdmoe
import spmdmoe.moe.params.overlap as overlap
from moe_plans import compile_backend, reference_moe
from spmdmoe.moe import MoEConfig, overlap_grads, parallelize_moe, replicate_grads
from spmdmoe.testing import assert_close_everywhere, reference_tensor
from spmdmoe.types import layout

D, F, E = 16, 16, 8
CFG = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=2, num_shared_experts=1)
COMPILED_RTOL = 1e-5


class _Probe(torch.autograd.Function):
    """Identity; its backward appends ``name`` to ``events`` (when backward passes this point)."""

    @staticmethod
    def forward(ctx, x, events, name):
        ctx.events, ctx.name = events, name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.events.append(ctx.name)
        return g, None, None


class Block(nn.Module):
    def __init__(self, layer, sp, events):
        super().__init__()
        self.inp = replicate_grads(nn.Linear(D, D), sp)
        with torch.no_grad():
            self.inp.weight.copy_(reference_tensor((D, D), 5) / D**0.5)
            self.inp.bias.copy_(reference_tensor((D,), 6))
        self.moe, self.events = layer, events

    def forward(self, x):
        local = x.local if self.events is None else _Probe.apply(x.local, self.events, "inp backward done")
        h = x.with_local(self.inp(local))
        return self.moe(h).local + h.local


def _block(device, overlap_on=True, events=None):
    sp = dist.group.WORLD
    layer = parallelize_moe(reference_moe(CFG, 3, device), sp_mesh=sp)
    block = Block(layer, sp, events).to(device)
    if overlap_on:
        return overlap_grads(block)
    layer.grad_overlap = False  # every sum waits at its use: the reference
    return block


def _input(T, device, seed=40):
    n, r = dist.get_world_size(), dist.get_rank()
    X = reference_tensor((T, D), seed, device=device)
    start = layout.chunk_offset(T, n, r)
    local = X[start:start + layout.local_tokens(T, n, r)].clone().requires_grad_()
    return local, spmdmoe.from_local(local, dist.group.WORLD, global_tokens=T)


def _close(actual, expected, name, rtol=1e-6):
    atol = rtol * max(float(expected.abs().max()) if expected.numel() else 0.0, 1e-30)
    assert_close_everywhere(actual.detach(), expected.detach(), rtol=rtol, atol=atol, name=name)


class _Recorder:
    """Stands in for the all-reduce overlap.py launches: records launches and waits in ``events``."""

    def __init__(self, events):
        self.events, self.real = events, overlap.all_reduce

    def __call__(self, flat, group=None, async_op=False):
        self.events.append(("launch", flat.numel(), flat.dtype, async_op))
        work = self.real(flat, group=group, async_op=async_op)
        events = self.events

        class Work:
            def wait(self):
                events.append("wait")
                return work.wait()

        return Work()


def test_sums_launch_at_use_and_wait_behind_the_block(device, monkeypatch):
    events = []
    monkeypatch.setattr(overlap, "all_reduce", _Recorder(events))
    block = _block(device, events=events)
    _local, x = _input(13, device)
    block(x).pow(2).sum().backward()
    launches = [e for e in events if isinstance(e, tuple)]
    synced = [p for _, p in block.named_parameters()]  # every parameter is replicated along SP here
    assert all(async_op for *_, async_op in launches), events
    assert sum(n for _, n, _, _ in launches) == sum(p.numel() for p in synced), events
    # one bucket per sync_grads call: the layer's dense weights, its experts, inp's weights
    assert len(launches) == 3, events
    first_wait, done = events.index("wait"), events.index("inp backward done")
    assert max(i for i, e in enumerate(events) if isinstance(e, tuple)) < first_wait, events
    assert done < first_wait, f"waited before the block's input gradient was done: {events}"
    assert events.index(launches[0]) < done and events.index(launches[1]) < done, events  # the MoE's
    for name, p in block.named_parameters():
        assert p.grad is not None, name


def _grads(block):
    return {n: p.grad.clone() for n, p in block.named_parameters()}


@pytest.mark.parametrize("T", [3, 13])
@pytest.mark.parametrize("mode", ["plain", "micro_batches", "checkpoint", "checkpoint_reentrant"])
def test_gradients_equal_the_waiting_sums(device, T, mode):
    results = []
    for overlap_on in (False, True):
        block = _block(device, overlap_on)
        leaf, x = _input(T, device)
        if mode == "micro_batches":  # two backward passes into the same .grad
            block(x).pow(2).sum().backward()
            leaf2, x2 = _input(T, device, seed=41)
            (3 * block(x2)).sum().backward()
        elif mode.startswith("checkpoint"):
            run = lambda t: block(spmdmoe.from_local(t, dist.group.WORLD, global_tokens=T))  # noqa: E731
            checkpoint(run, leaf, use_reentrant=mode.endswith("reentrant")).pow(2).sum().backward()
        else:
            block(x).pow(2).sum().backward()
        results.append((_grads(block), leaf.grad.clone()))
    (want, want_dx), (got, got_dx) = results
    _close(got_dx, want_dx, "input gradient")
    for n in want:
        _close(got[n], want[n], f"{n} gradient ({mode})")


@pytest.mark.compile_matrix  # (13 s of 4 processes tracing on 2 cores: CI's torch-2.11 leg runs this file whole)
def test_compiled_block_fullgraph(device):
    want_block, got_block = _block(device, False), _block(device, True)
    leaf, x = _input(13, device)
    want_block(x).pow(2).sum().backward()
    torch._dynamo.reset()
    run = torch.compile(got_block, backend=compile_backend(device), fullgraph=True)
    leaf2, x2 = _input(13, device)
    run(x2).pow(2).sum().backward()
    _close(leaf2.grad, leaf.grad, "input gradient, compiled", COMPILED_RTOL)
    for (n, p), q in zip(got_block.named_parameters(), want_block.parameters()):
        _close(p.grad, q.grad, f"{n} gradient, compiled", COMPILED_RTOL)


def test_compiled_on_one_rank_eager_on_the_others(device):
    """A dynamo fallback to eager on some ranks only: the buckets are the compiled graph's collectives."""
    want_block, got_block = _block(device, False), _block(device, True)
    leaf, x = _input(13, device)
    want_block(x).pow(2).sum().backward()
    torch._dynamo.reset()
    run = torch.compile(got_block, backend=compile_backend(device), fullgraph=True) if dist.get_rank() == 0 else got_block
    leaf2, x2 = _input(13, device)
    run(x2).pow(2).sum().backward()
    for (n, p), q in zip(got_block.named_parameters(), want_block.parameters()):
        _close(p.grad, q.grad, f"{n} gradient, rank 0 compiled", COMPILED_RTOL)


def _dense(device, overlap_on):
    torch.manual_seed(0)
    sp = dist.group.WORLD
    a, b = nn.Linear(D, D), nn.Linear(D, D)
    net = nn.Sequential(replicate_grads(a, sp, overlap=overlap_on), nn.Tanh(), replicate_grads(b, sp, overlap=overlap_on))
    return (overlap_grads(net) if overlap_on else net).to(device)


def test_second_order_backward(device):
    """A gradient penalty through replicated dense modules (the MoE layer's own kernels are
    first-order): the join passes dx on with its graph; the second backward, which reaches the
    uses and not the join, sums at the use."""
    results = []
    for overlap_on in (False, True):
        net = _dense(device, overlap_on)
        leaf = reference_tensor((5, D), 50 + dist.get_rank(), device=device).requires_grad_()
        (dx,) = torch.autograd.grad(net(leaf).pow(2).sum(), leaf, create_graph=True)
        dx.pow(2).sum().backward()
        results.append(_grads(net))
    want, got = results
    for n in want:
        _close(got[n], want[n], f"{n} second-order gradient")


def test_deepcopy_runs_the_copy(device):
    """Both wrappers' forwards are methods bound to the module: a copy runs with its own weights
    (``replicate_grads``' too; a copy shares the process groups)."""
    block = _block(device)
    copy_ = copy.deepcopy(block)
    with torch.no_grad():
        for p in copy_.parameters():
            p.mul_(2)
    leaf, x = _input(13, device)
    y, y_copy = block(x), copy_(x)
    assert y.numel() == 0 or not torch.equal(y, y_copy)  # (a rank holding none of the 13 rows: 8 ranks and more)
    y_copy.pow(2).sum().backward()
    assert all(p.grad is None for p in block.parameters())
    assert all(p.grad is not None for p in copy_.parameters())


class _FailOnce(list):
    """An event list whose first append raises (an error in the middle of a backward)."""

    def append(self, item):
        super().append(item)
        if len(self) == 1:
            raise RuntimeError("injected")


def test_backward_retried_after_an_exception(device):
    want_block = _block(device, False)
    got_block = _block(device, True, events=_FailOnce())  # raises after inp's backward, before the join
    leaf, x = _input(13, device)
    want_block(x).pow(2).sum().backward()
    leaf2, x2 = _input(13, device)
    loss = got_block(x2).pow(2).sum()
    with pytest.raises(RuntimeError, match="injected"):
        loss.backward(retain_graph=True)
    got_block.zero_grad(set_to_none=True)
    leaf2.grad = None
    loss.backward()
    _close(leaf2.grad, leaf.grad, "input gradient, retried")
    for (n, p), q in zip(got_block.named_parameters(), want_block.parameters()):
        _close(p.grad, q.grad, f"{n} gradient, retried")
