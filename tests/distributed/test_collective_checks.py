"""The collective-checking mode (``spmdmoe.set_checks("collectives")``): inputs wrong on ONE rank, built with the
local constructors that skip every cross-rank check, raise the same error on every rank instead of hanging or
aborting inside the collective. Each scenario runs on its own fresh gloo group with a 30 s timeout."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import spmdmoe
from spmdmoe import (Partial, Replicate, Shard, SPMDCollectiveError, SPMDDtypeError, SPMDLayoutError,
                     SPMDShapeError, SPMDTensor)
from spmdmoe.testing import assert_raises_everywhere, all_ranks_agree

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def fresh(monkeypatch):
    """A fresh gloo group over every rank (so a scenario that leaves ranks out of step cannot touch the next one),
    in the collective-checking mode, with a short arrival timeout."""
    monkeypatch.setenv("SPMDMOE_CHECK_TIMEOUT", "5")
    previous = spmdmoe.set_checks("collectives")
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
    yield group
    spmdmoe.set_checks(previous)


def _bad_rank() -> int:
    return 1 % dist.get_world_size()


def test_agreeing_inputs_pass_and_match_the_default_mode(fresh):
    full = torch.arange(10.0).view(5, 2)
    x = spmdmoe.shard(full, fresh)
    assert torch.equal(spmdmoe.all_gather(x).local, full)
    p = spmdmoe.from_local(full, fresh, placement=Partial())
    assert torch.equal(spmdmoe.all_reduce(p).local, full * dist.get_world_size())
    assert spmdmoe.reduce_scatter(p).global_tokens == 5
    assert spmdmoe.redistribute(spmdmoe.redistribute(x, Replicate()), Shard(0)).local_tokens == x.local_tokens


@pytest.mark.parametrize("what,error,match", [
    ("tokens", SPMDLayoutError, r"global_tokens is 5 on axis rank\(s\) \[0.*6 on axis rank\(s\) \[1\]"),
    ("dtype", SPMDDtypeError, r"dtype is .*torch.float64.* on axis rank\(s\) \[1\]"),
    ("width", SPMDShapeError, r"features is \[2\] .*\[3\] on axis rank\(s\) \[1\]"),
    ("placement", SPMDLayoutError, r"all_gather rejected the input on axis rank\(s\) \[1\].*takes a Shard tensor"),
])
def test_one_rank_builds_a_different_tensor(fresh, what, error, match):
    """Before: all_gather hung or aborted inside gloo (the tensors are built locally, with no cross-rank check)."""
    bad = dist.get_rank() == _bad_rank()
    rows, width, dtype = 5, 2, torch.float32
    if bad and what == "tokens":
        rows = 6
    if bad and what == "width":
        width = 3
    if bad and what == "dtype":
        dtype = torch.float64
    x = spmdmoe.shard(torch.zeros(rows, width, dtype=dtype), fresh)
    if bad and what == "placement":
        x = SPMDTensor(torch.zeros(5, 2), fresh, Replicate(), global_tokens=5)
    assert_raises_everywhere(error, lambda: spmdmoe.all_gather(x), match=match)


def test_replicated_content_that_differs_on_one_rank(fresh):
    """Before: redistribute(Replicate -> Shard) silently kept each rank's own "replicated" rows."""
    data = torch.ones(4, 3)
    if dist.get_rank() == _bad_rank():
        data[2, 1] = 2.0
    x = SPMDTensor(data, fresh, Replicate(), global_tokens=4)
    assert_raises_everywhere(SPMDCollectiveError, lambda: spmdmoe.redistribute(x, Shard(0)),
                             match=r"checksum is .* on axis rank\(s\) \[1\].*replicated content differs")


def test_one_rank_calls_another_collective(fresh):
    full = torch.zeros(4, 2)
    p, x = spmdmoe.from_local(full, fresh, placement=Partial()), spmdmoe.shard(full, fresh)  # from_local: a collective
    if dist.get_rank() == _bad_rank():
        call = lambda: spmdmoe.reduce_scatter(p)  # noqa: E731
    else:
        call = lambda: spmdmoe.all_gather(x)  # noqa: E731
    assert_raises_everywhere(SPMDCollectiveError, call, match=r"op is .*reduce_scatter.* on axis rank\(s\) \[1\]")


def test_one_rank_skips_a_collective(fresh):
    """The ranks that arrive name the one that never does (within SPMDMOE_CHECK_TIMEOUT), instead of hanging."""
    x = spmdmoe.shard(torch.zeros(4, 2), fresh)
    problem = ""
    if dist.get_rank() != _bad_rank():
        try:
            spmdmoe.all_gather(x)
            problem = "returned"
        except SPMDCollectiveError as e:
            if "axis rank(s) [1] (global [1]) did not arrive" not in str(e):
                problem = str(e)
    assert not all_ranks_agree(not problem), problem



@pytest.mark.one_rank_bad
@pytest.mark.parametrize("how", ["from_buffer", "constructor", "with_local", "padded_empty", "shard"])
def test_local_constructor_rejects_on_one_rank_before_a_collective(fresh, how):
    """Before: a local constructor raised on the bad rank alone (here from_buffer given the wrong row count), and its
    peers waited in the next collective (reduce_scatter) for a rank that never came. Now the bad rank hands its
    problem to the axis' next collective check before it raises, and every rank raises the same error type."""
    n, bad = dist.get_world_size(), dist.get_rank() == _bad_rank()
    rows = -(-5 // n) * n  # a Partial buffer for T=5: the padded global rows
    error = {"padded_empty": spmdmoe.SPMDTokenCountError, "shard": spmdmoe.SPMDLayoutError}.get(how, SPMDLayoutError)

    def step():
        if how == "from_buffer":
            p = SPMDTensor.from_buffer(torch.zeros(rows + (1 if bad else 0), 2), fresh, Partial(), global_tokens=5)
        elif how == "constructor":
            p = SPMDTensor(torch.zeros(6 if bad else 5, 2), fresh, Partial(), global_tokens=5)
        elif how == "with_local":
            p = SPMDTensor(torch.zeros(5, 2), fresh, Partial(), global_tokens=5)
            p = p.with_local(torch.zeros(4 if bad else 5, 2))
        elif how == "padded_empty":
            p = spmdmoe.padded_empty(fresh, Partial(), -1 if bad else 5, (2,))
        else:  # a token dim out of range on one rank
            p = spmdmoe.redistribute(spmdmoe.shard(torch.zeros(5, 2), fresh, dim=2 if bad else 0), Partial())
        return spmdmoe.reduce_scatter(p)

    err = assert_raises_everywhere(error, step, match=r"rank 1\b")
    assert type(err) is error, f"expected exactly {error.__name__}, found {type(err).__name__}: {err}"


@pytest.mark.one_rank_bad
@pytest.mark.parametrize("target,error,match", [
    ("Shard(1)", SPMDLayoutError, r"redistribute rejected the input on axis rank\(s\) \[1\].*token dim"),
    ("Partial()", SPMDCollectiveError, r"target is .*Partial.* on axis rank\(s\) \[1\]"),
])
def test_redistribute_to_another_target_on_one_rank(fresh, target, error, match):
    """Before: the input check passed on every rank, then the bad rank raised on its own (a Shard target off the
    token dim) or zero-extended locally (Partial) while its peers waited in the all-gather of Shard -> Replicate.
    The target's problems and the target itself are now part of the check: every rank raises the same error."""
    x = spmdmoe.shard(torch.zeros(5, 2), fresh)
    dst = {"Shard(1)": Shard(1), "Partial()": Partial()}[target] if dist.get_rank() == _bad_rank() else Replicate()
    err = assert_raises_everywhere(error, lambda: spmdmoe.redistribute(x, dst), match=match)
    assert type(err) is error, f"expected exactly {error.__name__}, found {type(err).__name__}: {err}"
