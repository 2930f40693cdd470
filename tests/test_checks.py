"""assert_layout, @layout_checked with Annotated hints, and the global switch."""

import time

import pytest
import torch
from typing_extensions import Annotated

import spmdmoe
from spmdmoe import Layout, Partial, Replicate, Shard, SPMDLayoutError, SPMDTensor


@pytest.fixture(scope="module")
def pg():
    return spmdmoe.testing.single_process_group()


def test_assert_layout(pg):
    x = spmdmoe.shard(torch.zeros(5, 2), pg)
    spmdmoe.assert_layout(x, Shard(0), mesh=pg, global_tokens=5)
    with pytest.raises(SPMDLayoutError, match=r"expected placement Replicate\(\), found Shard"):
        spmdmoe.assert_layout(x, Replicate())
    with pytest.raises(SPMDLayoutError, match="expected global_tokens=4, found 5"):
        spmdmoe.assert_layout(x, Shard(0), global_tokens=4)
    with pytest.raises(SPMDLayoutError, match="expected an SPMDTensor"):
        spmdmoe.assert_layout(torch.zeros(5, 2), Shard(0))


@spmdmoe.layout_checked
def _scale(
    x: Annotated[SPMDTensor, Layout(Shard(0), tokens="T", mesh="sp")],
    y: Annotated[SPMDTensor, Layout(Shard(0), tokens="T", mesh="sp")],
    k: float = 2.0,
) -> Annotated[SPMDTensor, Partial()]:
    return SPMDTensor(x.local * k + y.local, x.axis, Partial(), global_tokens=x.global_tokens)


@spmdmoe.layout_checked
def _wrong_return(x: Annotated[SPMDTensor, Shard(0)]) -> Annotated[SPMDTensor, Replicate()]:
    return x


@spmdmoe.layout_checked
def _pair(x: Annotated[SPMDTensor, Shard(0)]) -> tuple[Annotated[SPMDTensor, Shard(0)], int]:
    return x, 3


@spmdmoe.layout_checked
def _pair_bad(x: Annotated[SPMDTensor, Shard(0)]) -> tuple[Annotated[SPMDTensor, Replicate()], int]:
    return x, 3


def test_layout_checked_accepts_and_binds_symbols(pg):
    x = spmdmoe.shard(torch.ones(4, 2), pg)
    out = _scale(x, x)
    assert out.placement == Partial() and out.global_tokens == 4
    assert _pair(x)[1] == 3
    with pytest.raises(SPMDLayoutError, match="argument 'y'.*global_tokens 'T' was 4.*found 3"):
        _scale(x, spmdmoe.shard(torch.ones(3, 2), pg))
    with pytest.raises(SPMDLayoutError, match="argument 'x'.*expected placement Shard"):
        _scale(SPMDTensor(torch.ones(4, 2), pg, Replicate(), global_tokens=4), x)
    with pytest.raises(SPMDLayoutError, match="return value.*expected placement Replicate"):
        _wrong_return(x)
    with pytest.raises(SPMDLayoutError, match=r"return value \[0\]: rank 0: expected placement Replicate"):
        _pair_bad(x)


def test_switch_turns_the_local_checks_off(pg):
    x = spmdmoe.shard(torch.ones(4, 2), pg)
    assert spmdmoe.checks_enabled()
    with spmdmoe.checks(False):
        assert not spmdmoe.checks_enabled()
        _wrong_return(x)  # not checked
        spmdmoe.assert_layout(x, Replicate())  # not checked
        # from_local exchanges and checks in every mode (a rank-local switch never decides whether a
        # collective runs): it still infers T and still rejects a bad split
        assert spmdmoe.from_local(torch.ones(4, 2), pg).global_tokens == 4
        with pytest.raises(SPMDLayoutError, match="bad SP split"):
            spmdmoe.from_local(torch.ones(3, 2), pg, global_tokens=4)
    assert spmdmoe.checks_enabled()
    with pytest.raises(SPMDLayoutError):
        _wrong_return(x)


def test_checked_overhead_is_small_when_off(pg):
    """Not a benchmark: guards against the off-switch doing real work (generous bound)."""
    x = spmdmoe.shard(torch.ones(4, 2), pg)
    n = 2000
    with spmdmoe.checks(False):
        t0 = time.perf_counter()
        for _ in range(n):
            _pair(x)
        off = (time.perf_counter() - t0) / n
    assert off < 50e-6
