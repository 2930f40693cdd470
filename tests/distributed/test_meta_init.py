"""A layer built on the meta device, parallelized, then initialised shard by shard equals the single-device layer.

Every plan: ``with torch.device("meta"): MoE(cfg)`` -> ``parallelize_moe`` (only this rank's shards are
allocated, on the mesh's device) -> ``layer.init_weights(generator=g)``, against ``MoE(cfg)`` initialised
with the same generator state on one device and parallelized the usual way: every parameter and buffer
bitwise equal, hence the same outputs and gradients (checked bitwise too), and no expert row of another
rank ever allocated (the layer's parameters hold exactly its shards).
"""

import pytest
import torch

from moe_plans import PLANS, build_plan
from spmdmoe import SPMDTensor
from spmdmoe.moe import MoE, MoEConfig, parallelize_moe
from spmdmoe.testing import reference_tensor

D, F, E, TOTAL = 16, 12, 8, 29
CFG = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=2, num_shared_experts=1, aux_loss_coeff=0.01)


def _step(plan, layer):
    leaf = reference_tensor((TOTAL, D), 3, device=layer.expert_bias.device)[plan.rows].clone().requires_grad_()
    y = layer(plan.wrap(leaf))
    y = y.local if isinstance(y, SPMDTensor) else y
    ((y * 1.5).sum() + layer.aux_loss).backward()
    return [y.detach(), leaf.grad] + [p.grad for _, p in sorted(layer.named_parameters())]


@pytest.mark.parametrize("plan_name", PLANS)
def test_meta_built_layer_equals_the_single_device_one(world, device, request, plan_name):
    ref = MoE(CFG).to(device)
    ref.init_weights(init_std=0.1, generator=torch.Generator().manual_seed(11))
    normal = build_plan(plan_name, ref, TOTAL, world, request)
    with torch.device("meta"):
        meta = MoE(CFG)
    plan = build_plan(plan_name, meta, TOTAL, world, request)
    layer = plan.layer
    assert all(p.device == device for p in layer.parameters()), "shards live on the mesh's device"
    layer.init_weights(init_std=0.1, generator=torch.Generator().manual_seed(11))
    got, want = dict(layer.named_parameters()), dict(normal.layer.named_parameters())
    assert got.keys() == want.keys()
    for name in got:
        assert got[name].shape == want[name].shape and torch.equal(got[name], want[name]), name
    for (name, a), (_, b) in zip(layer.named_buffers(), normal.layer.named_buffers()):
        assert torch.equal(a, b), name
    e = plan.experts.stop - plan.experts.start
    f = plan.hidden.stop - plan.hidden.start
    assert layer.experts.w1.shape == (e, f, D), "only this rank's experts and hidden units"
    for k, (a, b) in enumerate(zip(_step(plan, layer), _step(normal, normal.layer))):
        assert torch.equal(a, b), k


def test_meta_device_kept_on_request(world, device):
    with torch.device("meta"):
        meta = MoE(CFG)
    layer = parallelize_moe(meta, ep_mesh=world, device="meta")
    assert all(p.is_meta for p in layer.parameters()) and layer.experts.w1.shape[0] == E // world.size()
