"""FP8 rowwise experts on every parallel plan (gloo: the emulation; NCCL on sm90: the FP8 GEMMs).

A parallel FP8 layer cannot equal the single-device FP8 layer bit for bit:
the wgrad scales are per (group, column) over the rows a rank's experts
receive, and those differ by plan. So each plan is held to the quality gates
against the single-device layer in full precision (fp64, same weights and
inputs): SQNR over all ranks (errors and signal summed with an all-reduce) of
the output rows, the input gradient and every expert weight gradient. FP8
training under DDP and FSDP2 (where the experts quantize per call, not from a
cache) tracks single-device full-precision training, and the two wrappers agree.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from moe_plans import PLANS, build_plan, expert_grad_slice, reference_moe
from spmdmoe import SPMDTensor
from spmdmoe.moe import MoEConfig, ddp, fully_shard_moe
from spmdmoe.testing import assert_close_everywhere, reference_tensor

D, F, E = 32, 32, 8
CFG = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=2)
FP8 = dataclasses.replace(CFG, expert_precision="fp8_rowwise")
TOTAL = 301
LR = 0.01


def _global_sqnr(pairs: list[tuple[torch.Tensor, torch.Tensor]], device) -> float:
    """SQNR (dB) of every rank's (actual, expected) pairs together."""
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for a, b in pairs:
        sums[0] += (a.double() - b.double()).pow(2).sum()
        sums[1] += b.double().pow(2).sum()
    dist.all_reduce(sums)
    return float(10 * torch.log10(sums[1] / sums[0].clamp(min=1e-300)))


@pytest.mark.parametrize("plan_name", PLANS)
def test_fp8_plan_meets_the_quality_gates(world, device, request, plan_name):
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    fp8 = reference_moe(FP8, 7, device, dtype)
    ref = reference_moe(CFG, 7, device, torch.float64)
    ref.load_state_dict(fp8.state_dict())  # the same (rounded) weights: no routing flip from other weights
    plan = build_plan(plan_name, fp8, TOTAL, world, request)
    X = reference_tensor((TOTAL, D), 70, dtype=dtype, device=device).double()
    G = reference_tensor((TOTAL, D), 71, dtype=torch.float64, device=device)
    ref_x = X.clone().requires_grad_()
    ys = [ref(ref_x[rows]) for rows in plan.batches]
    ref_y = torch.cat(ys)
    (ref_y * G).sum().backward()

    leaf = X[plan.rows].to(dtype).clone().requires_grad_()
    y = plan.layer(plan.wrap(leaf))
    y_local = y.local if isinstance(y, SPMDTensor) else y
    (y_local.float() * G[plan.rows].float()).sum().backward()

    figures = {
        "output": _global_sqnr([(y_local, ref_y[plan.rows])], device),
        "input grad": _global_sqnr([(leaf.grad, ref_x.grad[plan.rows])], device),
    }
    ref_params = dict(ref.named_parameters())
    for name in ("experts.w1", "experts.w2", "experts.w3"):
        p = dict(plan.layer.named_parameters())[name]
        figures[name] = _global_sqnr([(p.grad, expert_grad_slice(name, ref_params[name].grad, plan))], device)
    if dist.get_rank() == 0:
        print(plan_name, {k: round(v, 1) for k, v in figures.items()})
    assert figures["output"] >= 22 and figures["input grad"] >= 22, figures
    assert min(figures[n] for n in ("experts.w1", "experts.w2", "experts.w3")) >= 21, figures


@pytest.mark.parametrize("plan", ["dp_ep", "dp_sp", "ep"])
def test_fp8_training_under_ddp_and_fsdp2(device, plan, monkeypatch):
    """FP8 experts trained under DDP and FSDP2 (dp x ep, dp x sp, and EP alone: FSDP2 over the EP ranks)."""
    if plan == "dp_ep" and dist.get_world_size() != 4:
        pytest.skip("dp x ep needs 4 ranks (2 x 1 has no EP, and its 5 tokens a step put FP8's noise above the 1 % "
                    "bound: 2.9 % seen); the ep plan covers EP at 2 ranks")
    import test_data_parallel
    from test_data_parallel import STEPS, _batches, _plan, _reference

    monkeypatch.setattr(test_data_parallel, "LR", LR)  # a step that keeps this model's loss descending
    dp_cfg = dataclasses.replace(CFG, dim=16, hidden_dim=16, num_shared_experts=1, load_balance_coeff=1e-2)
    ref_losses, _, _ = _reference(device, _batches(plan), dp_cfg)
    losses = {}
    for wrapper in ("ddp", "fsdp2"):
        net, batch, _, n_batches = _plan(plan, device, dataclasses.replace(dp_cfg, expert_precision="fp8_rowwise"))
        model = ddp(net) if wrapper == "ddp" else fully_shard_moe(net)
        if wrapper == "fsdp2":
            assert net.moe.experts.fp8_cache is None  # gathered afresh each forward: no cache to go stale
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        losses[wrapper] = []
        for step in range(STEPS):
            opt.zero_grad()
            X, Y, count = batch(step)
            loss = ((model(X) - Y) ** 2).sum() / count
            loss.backward()
            net.moe.update_expert_bias()
            opt.step()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses[wrapper].append(total / n_batches)
    if dist.get_rank() == 0:
        print(plan, "reference", [round(v, 3) for v in ref_losses], {k: [round(float(v), 3) for v in l] for k, l in losses.items()})
    for wrapper, got in losses.items():
        got_t, want_t = torch.stack(got), torch.tensor(ref_losses, device=device, dtype=got[0].dtype)
        # FP8 noise (about 24 dB on the layer) on a loss that is a sum of squares: within 1 % (0.3 % seen)
        assert_close_everywhere(got_t, want_t, rtol=1e-2, atol=0, name=f"{plan} {wrapper} FP8 losses")
    assert_close_everywhere(torch.stack(losses["fsdp2"]), torch.stack(losses["ddp"]), rtol=1e-3, atol=0,
                            name=f"{plan}: FSDP2 vs DDP FP8 losses")


@pytest.mark.parametrize("reshard", [True, False])
def test_fp8_cache_follows_fsdp2_regathers(world, device, reshard):
    """FSDP2 set up by hand, the README's route (your own ``fully_shard`` + ``register_spmd_hooks``): the
    weight cache stays on, and after every optimizer step the next forward computes with the weights FSDP2
    gathers again (into storage the cache's old version/pointer key could not tell from the last step's),
    bitwise equal to a layer built from the gathered weights; the weights are quantized once per step."""
    from torch.distributed.fsdp import fully_shard

    from spmdmoe.moe import MoE, register_spmd_hooks

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(3)
    layer = MoE(FP8).to(device, dtype)
    layer.experts.unpack()  # FSDP2 takes contiguous parameters only
    for unit in (layer.experts, layer):
        fully_shard(unit, mesh=world, reshard_after_forward=reshard)
        register_spmd_hooks(unit)
    cache = layer.experts.fp8_cache
    assert cache is not None
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    probe = reference_tensor((13, D), 5, dtype=dtype, device=device)
    for step in range(6):  # the old key missed a step whenever the allocator reused an address (3 runs of 5)
        x = reference_tensor((7 + dist.get_rank(), D), 100 * step + dist.get_rank(), dtype=dtype, device=device)
        layer(x).float().square().sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            got = layer(probe)
        fresh = MoE(FP8).to(device, dtype)
        fresh.experts.fp8_cache = None
        fresh.load_state_dict({n: p.full_tensor() if hasattr(p, "full_tensor") else p
                               for n, p in layer.state_dict().items()})
        with torch.no_grad():
            want = fresh(probe)
        assert_close_everywhere(got, want, rtol=0, atol=0, name=f"reshard={reshard}, step {step}: FSDP2 output")
    assert cache.refreshes() == 7, cache.refreshes()  # the first forward, then once after each step
