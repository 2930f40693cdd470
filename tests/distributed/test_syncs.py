"""No hidden host syncs on CUDA: every plan's forward and backward under ``set_sync_debug_mode("error")``.

CUDA's sync debug mode raises on any synchronizing call (``.item()``,
``.tolist()``, ``bincount``, a pageable host-to-device copy, ``nonzero``...),
so this sees what a counter kept by the library could not. The one
documented transfers, the EP split sizes of sync mode and an SP layer's
delayed read of its forward's problem exchange, go through ``spmdmoe.host``,
which lifts the mode for themselves and counts them: one per forward with EP,
one per backward of an SP layer without EP (read after the forward's copy
landed), none otherwise.
NCCL only (skipped on gloo/CPU).
"""

import pytest
import torch

from moe_plans import build_plan, reference_moe
from spmdmoe import SPMDTensor
from spmdmoe.host import host_sync_count
from spmdmoe.moe import MoEConfig
from spmdmoe.testing import reference_tensor, sync_error_mode

# plan -> documented syncs (forward, backward): the EP split sizes in each forward; sync-free EP makes none (T_max
# from the layout, or max_tokens where EP is not the SP axis); SP over every rank without EP or with sync-free EP on
# it: the delayed read of the forward's problem exchange (spmdmoe.host.DelayedRead, moe/parallel/ride.py), in its backward
# (``-all_to_all``: sync-free over the padded all-to-all, ``SPMDMOE_EP_SYMMETRIC=0``; plain ``sync_free`` takes the
# symmetric-memory transport on one host; ``-no_max``: without max_tokens, whose first forward agrees T_max host to
# host, so there the first step is checked too)
PLANS = {"sp": (0, 1), "gather": (0, 1), "ep": (1, 0), "sp_ep": (1, 0), "sp_x_ep": (1, 0), "gather_ep": (1, 0),
         "ep-sync_free": (0, 0), "sp_ep-sync_free": (0, 1), "sp_x_ep-sync_free": (0, 0), "gather_ep-sync_free": (0, 0),
         "ep-sync_free-all_to_all": (0, 0), "sp_ep-sync_free-all_to_all": (0, 1),
         "ep-sync_free-no_max": (0, 0), "gather_ep-sync_free-no_max-all_to_all": (0, 0)}


@pytest.mark.parametrize("case", list(PLANS))
def test_no_hidden_sync(world, device, request, monkeypatch, case):
    plan_name, _, mode = case.partition("-")
    if mode.endswith("-all_to_all"):
        monkeypatch.setenv("SPMDMOE_EP_SYMMETRIC", "0")
    if device.type != "cuda":
        pytest.skip("CUDA's sync debug mode needs NCCL on GPUs")
    cfg = MoEConfig(dim=64, hidden_dim=32, num_experts=8, top_k=2, num_shared_experts=1, aux_loss_coeff=0.01,
                    load_balance_coeff=1e-3)
    moe = reference_moe(cfg, 0, device, torch.bfloat16)
    total = 301
    options = {} if not mode else {"ep_mode": "sync_free"} if plan_name == "sp_ep" or "no_max" in mode else \
        {"ep_mode": "sync_free", "max_tokens": total}
    plan = build_plan(plan_name, moe, total, world, request, **options)
    X = reference_tensor((total, 64), 7, dtype=torch.bfloat16, device=device)
    for step in range(2):  # the first step warms up allocations; the second is checked (no_max: both)
        leaf = X[plan.rows].clone().requires_grad_()
        x = plan.wrap(leaf)  # from_local's agreement (a documented read) stays outside
        torch.cuda.synchronize()
        before = host_sync_count()
        run = sync_error_mode if step or "no_max" in mode else (lambda fn: fn())
        y = run(lambda: plan.layer(x))
        y_local = y.local if isinstance(y, SPMDTensor) else y
        forward = host_sync_count() - before
        run(lambda: (y_local.float().square().sum() + plan.layer.aux_loss).backward())
        backward = host_sync_count() - before - forward
        assert (forward, backward) == PLANS[case], (case, forward, backward)
    assert leaf.grad is not None and torch.isfinite(leaf.grad).all()
