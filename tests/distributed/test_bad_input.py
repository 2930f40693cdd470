"""Bad inputs raise their specific error on EVERY rank, within the test timeout.

Most cases make only one rank wrong: the others must raise too (from_local's
verdict is collective), never wait in a collective. Each test ends with
``assert_raises_everywhere``'s own all-reduce, which proves every rank got
past the call.
"""

import re

import pytest
import torch

import spmdmoe
from spmdmoe import (
    Partial,
    Replicate,
    Shard,
    SPMDDeviceError,
    SPMDLayoutError,
    SPMDMeshError,
    SPMDTokenCountError,
    Varying,
)
from spmdmoe.testing import assert_raises_everywhere
from spmdmoe.types import layout

pytestmark = pytest.mark.one_rank_bad  # fresh process groups, 30 s timeout (conftest.py)


def _rank(world):
    return world.get_local_rank()


def _chunk(world, device, total, features=2):
    return torch.zeros(layout.local_tokens(total, world.size(), _rank(world)), features, device=device)


def test_bad_split_vs_declared_tokens(world, device):
    bad = world.size() - 1
    rows = layout.local_tokens(5, world.size(), _rank(world)) + (1 if _rank(world) == bad else 0)
    err = assert_raises_everywhere(
        SPMDLayoutError,
        lambda: spmdmoe.from_local(torch.zeros(rows, 2, device=device), world, global_tokens=5),
        match=rf"bad Shard\(dim=0\) split on ranks \[{bad}\] for global_tokens=5",
    )
    if _rank(world) == bad:
        assert "expected" in str(err) and "found" in str(err) and "fix" in str(err)


WRONG_SPLITS = {4: ([1, 2, 3, 4], [3, 3, 3, 1]), 2: ([1, 2], [2, 1])}  # ranks: (rows found, rows expected)


def test_jointly_wrong_split_is_caught(world, device):
    """Rows that sum to a valid T split the wrong way (T = 10 on 4 ranks, 3 on 2)."""
    if world.size() not in WRONG_SPLITS:
        pytest.skip(f"examples for {sorted(WRONG_SPLITS)} ranks, found {world.size()}")
    found, expected = WRONG_SPLITS[world.size()]
    assert_raises_everywhere(
        SPMDLayoutError,
        lambda: spmdmoe.from_local(torch.zeros(found[_rank(world)], 2, device=device), world),
        match=re.escape(f"expected rows {expected}, found {found}"),
    )


def test_tokens_differ_across_ranks(world, device):
    declared = 6 if _rank(world) == 0 else 5
    assert_raises_everywhere(
        SPMDLayoutError,
        lambda: spmdmoe.from_local(_chunk(world, device, 5), world, global_tokens=declared),
        match="disagree on the declared global_tokens",
    )


def test_tokens_declared_on_some_ranks_only(world, device):
    declared = None if _rank(world) == 1 else 5
    assert_raises_everywhere(
        SPMDLayoutError,
        lambda: spmdmoe.from_local(_chunk(world, device, 5), world, global_tokens=declared),
        match="disagree on the declared global_tokens",
    )


@pytest.mark.parametrize("bad_value", [-3, 5.0, "5", True, "tensor3", "tensor_float", 2**64, -(2**70)],
                         ids=lambda v: str(v)[:12])
def test_bad_token_value_on_one_rank(world, device, bad_value):
    """Issue 9: values that used to raise a TypeError/ValueError/overflow on the bad rank alone
    (multi-element or float tensors, ints past int64) are now problems agreed on every rank."""
    bad_value = {"tensor3": torch.ones(3, dtype=torch.int64), "tensor_float": torch.tensor(5.0)}.get(bad_value, bad_value) \
        if isinstance(bad_value, str) else bad_value
    declared = bad_value if _rank(world) == 1 else 5
    assert_raises_everywhere(
        SPMDTokenCountError,
        lambda: spmdmoe.from_local(_chunk(world, device, 5), world, global_tokens=declared),
        match=r"rank 1: global_tokens (is not an int|is negative|does not fit in int64)",
    )


def test_numpy_and_tensor_token_counts_are_ints(world, device):
    import numpy as np

    for declared in (np.int64(5), torch.tensor(5)):
        assert spmdmoe.from_local(_chunk(world, device, 5), world, global_tokens=declared).global_tokens == 5


def test_bad_token_value_everywhere_in_constructor(world, device):
    assert_raises_everywhere(
        SPMDTokenCountError, lambda: spmdmoe.padded_empty(world, Partial(), -1, device=device)
    )


def test_dim_out_of_range(world, device):
    assert_raises_everywhere(SPMDLayoutError, lambda: spmdmoe.shard(torch.zeros(5, 2, device=device), world, dim=2),
                             match="token dim 2 is out of range")
    placement = Shard(3) if _rank(world) == 0 else Shard(0)
    assert_raises_everywhere(
        SPMDLayoutError,
        lambda: spmdmoe.from_local(_chunk(world, device, 5), world, placement=placement, global_tokens=5),
        match="rank 0: token dim out of range",
    )


def test_mesh_not_1d(mesh2d, device):
    assert_raises_everywhere(SPMDMeshError, lambda: spmdmoe.shard(torch.zeros(5, 2, device=device), mesh2d),
                             match="expected a 1-D mesh.*found a 2-D mesh.*mesh\\['dp'\\]")
    assert_raises_everywhere(SPMDMeshError, lambda: spmdmoe.from_local(torch.zeros(2, 2, device=device), mesh2d))
    assert_raises_everywhere(SPMDMeshError, lambda: spmdmoe.from_local(torch.zeros(2, 2, device=device), "sp"))


def test_wrong_device_for_backend(world, device):
    # gloo communicates CPU tensors, NCCL CUDA tensors: give one rank the other kind
    wrong = torch.device("meta") if device.type == "cpu" else torch.device("cpu")
    dev = wrong if _rank(world) == 1 else device
    assert_raises_everywhere(
        SPMDDeviceError,
        lambda: spmdmoe.from_local(_chunk(world, dev, 5), world, global_tokens=5),
        match="rank 1: tensor on a device the backend cannot use",
    )
    assert_raises_everywhere(SPMDDeviceError, lambda: spmdmoe.shard(torch.zeros(5, 2, device=wrong), world))


def test_strict_rejects_uneven_tokens(world, device):
    total = 2 * world.size() + 1
    assert_raises_everywhere(
        SPMDLayoutError,
        lambda: spmdmoe.from_local(_chunk(world, device, total), world, global_tokens=total, strict=True),
        match="strict=True needs global_tokens divisible",
    )
    assert_raises_everywhere(
        SPMDLayoutError, lambda: spmdmoe.shard(torch.zeros(total, 2, device=device), world, strict=True)
    )
    strict = _rank(world) == 0
    assert_raises_everywhere(
        SPMDLayoutError,
        lambda: spmdmoe.from_local(_chunk(world, device, 8), world, global_tokens=8, strict=strict),
        match="disagree on the strict",
    )


def test_placement_disagreement(world, device):
    placement = Replicate() if _rank(world) == 0 else Shard(0)
    assert_raises_everywhere(
        SPMDLayoutError,
        lambda: spmdmoe.from_local(_chunk(world, device, 5), world, placement=placement, global_tokens=5),
        match=r"disagree on the placement: per rank \[Replicate, Shard",
    )


def test_dtype_or_feature_shape_disagreement(world, device):
    features = 3 if _rank(world) == 1 else 2
    assert_raises_everywhere(
        SPMDLayoutError,
        lambda: spmdmoe.from_local(_chunk(world, device, 5, features), world, global_tokens=5),
        match=r"disagree on the non-token dims: per rank \[\[2\], \[3\]",  # a (T, D) shard's D shown as it is
    )
    dtype = torch.float64 if _rank(world) == 0 else torch.float32
    assert_raises_everywhere(
        SPMDLayoutError,
        lambda: spmdmoe.from_local(_chunk(world, device, 5).to(dtype), world, global_tokens=5),
        match="disagree on the dtype: per rank \\[float64, float32",
    )


def test_replicate_rows_must_match(world, device):
    rows = 4 if _rank(world) == 2 % world.size() else 5
    assert_raises_everywhere(
        SPMDLayoutError,
        lambda: spmdmoe.from_local(torch.zeros(rows, 2, device=device), world, placement=Replicate(), global_tokens=5),
        match="bad Replicate\\(\\) split",
    )


def test_checks_off_keeps_the_row_check(world, device):
    with spmdmoe.checks(False):
        assert_raises_everywhere(
            SPMDLayoutError,
            lambda: spmdmoe.from_local(torch.zeros(7, 2, device=device), world, global_tokens=5),
            match="bad SP split",
        )


def test_varying_has_no_global_tokens(world, device):
    v = spmdmoe.from_local(torch.zeros(_rank(world), 2, device=device), world, placement=Varying())
    assert_raises_everywhere(SPMDLayoutError, lambda: v.global_tokens, match="Varying")
