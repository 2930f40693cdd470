"""SPMDTensor on a one-process group: construction, attributes, with_local, buffers, pytree, autograd."""

import pytest
import torch
import torch.utils._pytree as pytree

import spmdmoe
from spmdmoe import Partial, Replicate, Shard, SPMDLayoutError, SPMDTensor, SPMDTokenCountError, Varying


@pytest.fixture(scope="module")
def pg():
    return spmdmoe.testing.single_process_group()


def test_attributes_shard(pg):
    x = spmdmoe.shard(torch.randn(5, 3), pg)
    assert (x.global_tokens, x.local_tokens, x.padded_local_tokens, x.padded_global_tokens) == (5, 5, 5, 5)
    assert x.placement == Shard(0) and x.token_dim == 0 and x.mesh is pg and x.axis.size == 1
    assert x.global_shape == torch.Size([5, 3]) and x.dtype == torch.float32 and x.buffer is None


def test_negative_dim_is_normalised(pg):
    x = spmdmoe.shard(torch.randn(2, 7), pg, dim=-1)
    assert x.placement == Shard(1) and x.token_dim == 1 and x.global_tokens == 7


def test_immutable(pg):
    x = spmdmoe.shard(torch.randn(5, 3), pg)
    with pytest.raises(AttributeError):
        x.local = torch.zeros(5, 3)
    with pytest.raises(AttributeError):
        x._global_tokens = 3


def test_constructor_checks_rows(pg):
    with pytest.raises(SPMDLayoutError, match="expected 5 rows"):
        SPMDTensor(torch.zeros(4, 2), pg, Shard(0), global_tokens=5)
    with pytest.raises(SPMDLayoutError, match="must hold all 5 rows"):
        SPMDTensor(torch.zeros(4, 2), pg, Replicate(), global_tokens=5)
    with pytest.raises(SPMDTokenCountError):
        SPMDTensor(torch.zeros(4, 2), pg, Shard(0), global_tokens=-1)
    with pytest.raises(SPMDTokenCountError):
        SPMDTensor(torch.zeros(4, 2), pg, Shard(0), global_tokens=4.0)
    with pytest.raises(SPMDTokenCountError):
        SPMDTensor(torch.zeros(4, 2), pg, Shard(0), global_tokens=True)
    with pytest.raises(SPMDLayoutError, match="out of range"):
        SPMDTensor(torch.zeros(4, 2), pg, Shard(2), global_tokens=4)
    with pytest.raises(SPMDLayoutError, match="placement"):
        SPMDTensor(torch.zeros(4, 2), pg, "Shard(0)", global_tokens=4)


def test_with_local_keeps_token_dim(pg):
    x = spmdmoe.shard(torch.randn(5, 3), pg)
    y = x.with_local(x.local @ torch.randn(3, 8))
    assert y.local.shape == (5, 8) and y.global_tokens == 5 and y.placement == Shard(0)
    with pytest.raises(SPMDLayoutError, match="keep the token dimension 0: expected 5 rows"):
        x.with_local(torch.zeros(4, 3))
    with pytest.raises(SPMDLayoutError):
        x.with_local(torch.zeros(()))


def test_varying(pg):
    v = SPMDTensor(torch.zeros(3, 2), pg, Varying())
    assert v.local_tokens == 3 and v.padded_local_tokens == 3
    with pytest.raises(SPMDLayoutError, match="Varying"):
        _ = v.global_tokens
    with pytest.raises(SPMDLayoutError):
        _ = v.padded_global_tokens


def test_padded_empty_and_from_buffer(pg):
    y = spmdmoe.padded_empty(pg, Partial(), 3, (4,), dtype=torch.float64)
    assert y.buffer.shape == (3, 4) and y.local.shape == (3, 4) and y.local.dtype == torch.float64
    assert y.local.data_ptr() == y.buffer.data_ptr()
    with pytest.raises(SPMDLayoutError, match="must have 3 rows"):
        SPMDTensor.from_buffer(torch.zeros(4, 2), pg, Partial(), global_tokens=3)
    with pytest.raises(SPMDLayoutError):
        spmdmoe.padded_empty(pg, Varying(), 3)


def test_pytree_roundtrip(pg):
    x = spmdmoe.shard(torch.randn(5, 3), pg)
    leaves, spec = pytree.tree_flatten({"a": x, "b": [x]})
    assert len(leaves) == 2 and all(isinstance(t, torch.Tensor) for t in leaves)
    back = pytree.tree_unflatten([t * 2 for t in leaves], spec)
    assert isinstance(back["a"], SPMDTensor) and back["a"].global_tokens == 5
    torch.testing.assert_close(back["b"][0].local, x.local * 2)
    mapped = pytree.tree_map(lambda t: t.double(), x)
    assert mapped.dtype == torch.float64 and mapped.placement == Shard(0)


def test_autograd_flows_through_local(pg):
    full = torch.randn(5, 3, requires_grad=True)
    x = spmdmoe.shard(full, pg)
    y = x.with_local(x.local * 3)
    y.local.sum().backward()
    torch.testing.assert_close(full.grad, torch.full((5, 3), 3.0))


def test_repr_names_layout(pg):
    text = repr(spmdmoe.shard(torch.randn(5, 3), pg))
    assert "Shard(dim=0)" in text and "global_tokens=5" in text
