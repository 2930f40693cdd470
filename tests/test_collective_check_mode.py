"""The collective-checking mode in one process: the switch, and its refusal under torch.compile."""

import pytest
import torch

import spmdmoe
from spmdmoe import SPMDCollectiveError


def test_switch_and_modes():
    previous = spmdmoe.set_checks("collectives")
    try:
        assert spmdmoe.checks_mode() == "collectives" and spmdmoe.checks_enabled()
        assert spmdmoe.set_checks(False) == "collectives" and spmdmoe.checks_mode() == "off"
        with spmdmoe.checks("collectives"):
            assert spmdmoe.checks_mode() == "collectives"
        assert spmdmoe.checks_mode() == "off"
        with pytest.raises(ValueError, match="True, False or 'collectives'"):
            spmdmoe.set_checks("collective")
    finally:
        spmdmoe.set_checks(previous)


def test_agreeing_call_in_one_process():
    pg = spmdmoe.testing.single_process_group()
    with spmdmoe.checks("collectives"):
        out = spmdmoe.all_gather(spmdmoe.shard(torch.arange(6.0).view(3, 2), pg))
        assert torch.equal(out.local, torch.arange(6.0).view(3, 2))
        with pytest.raises(spmdmoe.SPMDLayoutError, match=r"all_gather rejected the input on axis rank\(s\) \[0\]"):
            spmdmoe.all_gather(out)  # Replicate into all_gather: the local problem, through the exchange


def test_eager_only():
    pg = spmdmoe.testing.single_process_group()
    x = spmdmoe.shard(torch.ones(3, 2), pg)
    torch._dynamo.reset()
    with spmdmoe.checks("collectives"):
        with pytest.raises(Exception, match="collective-checking mode .* is eager only") as info:
            torch.compile(lambda t: spmdmoe.all_gather(t).local, backend="eager", fullgraph=True)(x)
    assert isinstance(info.value, SPMDCollectiveError) or "SPMDCollectiveError" in str(info.value)
