"""SPMDTensor under torch.compile(fullgraph=True): no graph breaks, autograd intact."""

import torch

import spmdmoe
from spmdmoe import Shard, SPMDTensor


def _fn(x: SPMDTensor) -> SPMDTensor:
    h = torch.nn.functional.silu(x.local) * x.global_tokens
    return x.with_local(h @ h.transpose(0, 1)[:, : x.local.shape[1]].transpose(0, 1))


def test_compile_fullgraph_matches_eager():
    pg = spmdmoe.testing.single_process_group()
    torch._dynamo.reset()
    # float64: inductor may fuse/reorder the matmul, so float32 results differ in the last bits
    full = torch.randn(6, 4, dtype=torch.float64)
    leaf_a, leaf_b = full.clone().requires_grad_(), full.clone().requires_grad_()
    eager = _fn(spmdmoe.shard(leaf_a, pg))
    out = torch.compile(_fn, fullgraph=True)(spmdmoe.shard(leaf_b, pg))
    assert isinstance(out, SPMDTensor) and out.placement == Shard(0) and out.global_tokens == 6
    torch.testing.assert_close(out.local, eager.local)
    eager.local.square().sum().backward()
    out.local.square().sum().backward()
    assert leaf_b.grad is not None and leaf_b.grad.abs().sum() > 0
    torch.testing.assert_close(leaf_b.grad, leaf_a.grad)


def test_compile_builds_spmdtensor_inside_graph():
    pg = spmdmoe.testing.single_process_group()
    torch._dynamo.reset()

    def build(t: torch.Tensor, like: SPMDTensor) -> torch.Tensor:
        y = like.with_local(t + 1)
        return y.local * y.padded_local_tokens

    like = spmdmoe.shard(torch.zeros(3, 2), pg)
    got = torch.compile(build, fullgraph=True)(torch.ones(3, 2), like)
    torch.testing.assert_close(got, torch.full((3, 2), 6.0))
