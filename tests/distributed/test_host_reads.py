"""Host reads on the CPU: each plan's training step reads on the host exactly what the docs say, nothing more.

``test_syncs.py`` checks "no hidden sync" with CUDA's sync debug mode, on GPUs only; here ``host_reads.HostReads``
(a proxy at the torch level: ``.item()`` / ``tolist`` / ``bool`` ... and ``_local_scalar_dense`` / ``nonzero`` /
boolean indexing ... on any device) counts every read, named by its spmdmoe call site, in the second of two
steps of each plan (the first warms up: the clip's product group, the ride's first exchange): the forward, the
backward, ``spmdmoe.clip_grad_norm_`` (plain, then with ``error_if_nonfinite``) and ``update_expert_bias``; and
the first step's forward (sync-free EP without ``max_tokens`` agrees its ``T_max`` there, host to host: no read).
Each phase's reads must be exactly its documented ones (below), counted: a documented read that is not seen
fails too, so the proxy is shown to see the library's own deliberate reads (``spmdmoe.host``). CPU only: on
GPUs the symmetric-memory transport and pinned copies differ, and ``test_syncs.py`` covers them.
"""

import pytest
import torch

import spmdmoe
from host_reads import HostReads
from moe_plans import build_plan, reference_moe
from spmdmoe import SPMDTensor
from spmdmoe.moe import MoEConfig
from spmdmoe.testing import all_ranks_agree, reference_tensor

# The documented reads, by call site (``HostReads``' names), with where each is documented:
# sync EP's count exchange: spmdmoe/collectives/alltoall.py's docstring and moe/transports/dispatch.py's table
SPLITS = "spmdmoe/collectives/alltoall.py:read_split_sizes via host"
# an SP layer over the whole job (no EP, or sync-free EP on the SP axis): the forward's exchange read in its
# backward (spmdmoe.host.DelayedRead): moe/parallel/ride.py's docstring
RIDE = "spmdmoe/moe/parallel/ride.py:_raise via host"
# update_expert_bias's sticky-flag read: MoE.update_expert_bias, routing/balance.update_expert_bias
BIAS = "spmdmoe/moe/routing/balance.py:update_expert_bias via host"
# and sync-free EP's overflow read before it: ParallelMoE.update_expert_bias, SyncFreeTransport.overflow_message
OVERFLOW = "spmdmoe/moe/transports/sync_free.py:overflow_message via host"
# clip_grad_norm_(error_if_nonfinite=True) reads whether the norm is finite (spmdmoe.host.to_host): its docstring
NONFINITE = "spmdmoe/moe/training/clip.py:_clip via host"

# case (plan[-ep mode[-without max_tokens]]) -> (forward, backward) reads; the first forward reads what the second
# does (sync-free EP without max_tokens agrees its T_max there host to host, through the c10d store: no read)
CASES = {
    "sp": ({}, {RIDE: 1}), "gather": ({}, {RIDE: 1}),
    "ep": ({SPLITS: 1}, {}), "sp_ep": ({SPLITS: 1}, {}), "sp_x_ep": ({SPLITS: 1}, {}), "gather_ep": ({SPLITS: 1}, {}),
    "ep-sync_free": ({}, {}), "sp_ep-sync_free": ({}, {RIDE: 1}), "sp_x_ep-sync_free": ({}, {}),
    "gather_ep-sync_free": ({}, {}),
    "ep-sync_free-no_max": ({}, {}), "sp_x_ep-sync_free-no_max": ({}, {}), "gather_ep-sync_free-no_max": ({}, {}),
}
CFG = MoEConfig(dim=16, hidden_dim=16, num_experts=8, top_k=2, num_shared_experts=1, aux_loss_coeff=0.01,
                load_balance_coeff=1e-3)
TOTAL = 37


@pytest.mark.parametrize("case", list(CASES))
def test_reads_are_the_documented_ones(world, device, request, case):
    if device.type != "cpu":
        pytest.skip("the CPU proxy; test_syncs.py checks GPUs with CUDA's sync debug mode")
    name, _, mode = case.partition("-")
    options = {"ep_mode": "sync_free"} if mode else {}
    if mode == "sync_free" and name != "sp_ep":  # EP on the SP axis sizes its buffers from the layout
        options["max_tokens"] = TOTAL
    plan = build_plan(name, reference_moe(CFG, 0, device), TOTAL, world, request, **options)
    X = reference_tensor((TOTAL, CFG.dim), 7, device=device)
    forwards = []
    for _ in range(2):  # the second step is checked, and the first's forward
        x = plan.wrap(X[plan.rows].clone().requires_grad_())  # from_local's agreement (documented) stays outside
        with HostReads() as forward:
            y = plan.layer(x)
        forwards.append(forward)
        with HostReads() as backward:
            ((y.local if isinstance(y, SPMDTensor) else y).square().sum() + plan.layer.aux_loss).backward()
        with HostReads() as clip:
            spmdmoe.clip_grad_norm_(plan.layer, 1.0)
        with HostReads() as clip_checked:
            spmdmoe.clip_grad_norm_(plan.layer, 1.0, error_if_nonfinite=True)
        with HostReads() as boundary:
            plan.layer.update_expert_bias()
    allowed = (CASES[case][0], *CASES[case], {}, {NONFINITE: 1},
               {BIAS: 1, **({OVERFLOW: 1} if mode else {})})
    seen = (forwards[0], forward, backward, clip, clip_checked, boundary)
    phases = ("first forward", "forward", "backward", "clip_grad_norm_", "clip_grad_norm_(error_if_nonfinite=True)",
              "update_expert_bias")
    wrong = "\n".join(f"{p}:\n{r.report(a)}" for p, r, a in zip(phases, seen, allowed) if r.report(a))
    failed = all_ranks_agree(not wrong)
    assert not failed, f"{case}: host reads other than the documented ones on ranks {failed}; this rank's:\n{wrong}"
