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

