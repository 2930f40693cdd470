"""Host reads of the single-device MoE layer: none in its forward, backward and clip; one at the step boundary.

``host_reads.HostReads`` (a proxy at the torch level, on any device) counts every read by its spmdmoe call site;
``tests/distributed/test_host_reads.py`` does the same for every parallel plan.
"""

import pytest
import torch

import spmdmoe
from host_reads import HostReads
from spmdmoe.moe import MoE, MoEConfig

BIAS = "spmdmoe/moe/routing/balance.py:update_expert_bias via host"  # MoE.update_expert_bias: one host sync a call


@pytest.mark.parametrize("options", [{}, {"num_shared_experts": 1, "aux_loss_coeff": 0.01, "load_balance_coeff": 1e-3}],
                         ids=["defaults", "shared-aux-bias"])
def test_single_device_layer_reads_nothing(options):
    torch.manual_seed(0)
    moe = MoE(MoEConfig(dim=16, hidden_dim=16, num_experts=8, top_k=2, **options))
    x = torch.randn(37, 16, requires_grad=True)
    for _ in range(2):  # the second step is checked
        with HostReads() as step:
            (moe(x).square().sum() + (moe.aux_loss if moe.aux_loss is not None else 0)).backward()
            spmdmoe.clip_grad_norm_(moe, 1.0)
        with HostReads() as boundary:
            moe.update_expert_bias()
    assert not step.reads, f"host reads in the forward, backward or clip:\n{step.report({})}"
    wrong = boundary.report({BIAS: 1})  # the documented read is seen (the proxy sees spmdmoe.host's reads)
    assert not wrong, f"update_expert_bias: not its one documented read:\n{wrong}"
