"""Single-device MoE: against a per-token loop written from the definition, routing rules,
the permutation gathers, the grouped-GEMM seam, load statistics and config errors."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import spmdmoe
from spmdmoe import MoEConfigError, SPMDShapeError
from spmdmoe.moe import MoE, MoEConfig, route
from spmdmoe.moe.routing.balance import aux_loss
from spmdmoe.moe.experts.grouped import grouped_swiglu
from spmdmoe.moe.experts.gemm import grouped_mm, native_grouped_mm_ok
from spmdmoe.kernels import expert_order
from spmdmoe.moe.routing.permute import scatter_rows, weighted_combine
from spmdmoe.moe.transports.routed import RoutedTokens

CONFIGS = [
    dict(dim=16, hidden_dim=16, num_experts=8, top_k=2),
    dict(dim=16, hidden_dim=8, num_experts=4, top_k=1, score_func="sigmoid", num_shared_experts=2),
    dict(dim=8, hidden_dim=16, num_experts=8, top_k=3, route_norm=True, route_scale=1.7, num_expert_groups=4,
         num_limited_groups=2, score_func="sigmoid"),
    dict(dim=6, hidden_dim=5, num_experts=3, top_k=2, num_shared_experts=1),  # unaligned: the mm loop fallback
]


def _moe(cfg: MoEConfig, seed: int = 0, device="cpu", dtype=torch.float32) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(cfg)
    moe.init_weights(init_std=0.3)
    with torch.no_grad():
        moe.experts.w1.normal_(0, 0.3)
        moe.expert_bias.normal_(0, 0.05)
    return moe.to(device=device, dtype=dtype)


def _loop_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_k w[t,k] * w2 @ (silu(w1 @ x) * (w3 @ x)) + shared(x), one token at a time."""
    r = route(x, moe.router.gate.weight, moe.expert_bias, moe.config)
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        for k in range(moe.config.top_k):
            e = int(r.ids_TK[t, k])
            h = F.silu(moe.experts.w1[e] @ x[t]) * (moe.experts.w3[e] @ x[t])
            acc = acc + r.weights_TK[t, k] * (moe.experts.w2[e] @ h)
        rows.append(acc)
    out = torch.stack(rows) if rows else torch.zeros_like(x)
    if moe.shared_experts is not None:
        s = moe.shared_experts
        out = out + (s.w2.weight @ (F.silu(s.w1.weight @ x.T) * (s.w3.weight @ x.T))).T
    return out


@pytest.mark.parametrize("tokens", [0, 1, 7, 50])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"E{c['num_experts']}k{c['top_k']}D{c['dim']}")
def test_matches_per_token_loop(cfg, tokens):
    """In fp64, to 1e-10: a sum of 50 tokens' fp32 gradients in another order differs from the loop's by more
    than fp32's 1e-6 on some CPUs, while a wrong index or weight is off by O(1) in any dtype."""
    moe = _moe(MoEConfig(**cfg), dtype=torch.float64)
    x = torch.randn(tokens, cfg["dim"], dtype=torch.float64, requires_grad=True)
    g = torch.randn(tokens, cfg["dim"], dtype=torch.float64)
    y = moe(x)
    (y * g).sum().backward()
    grads = {n: p.grad.clone() for n, p in moe.named_parameters()}
    xg = x.grad.clone()
    moe.zero_grad()
    x.grad = None
    ref = _loop_reference(moe, x)
    if tokens:
        (ref * g).sum().backward()
    else:
        x.grad = torch.zeros_like(x)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(xg, x.grad, rtol=1e-10, atol=1e-12)
    for n, p in moe.named_parameters():
        assert grads[n] is not None
        torch.testing.assert_close(grads[n], p.grad if p.grad is not None else torch.zeros_like(p), rtol=1e-10,
                                   atol=1e-12)


def test_leading_dims_are_tokens_and_dim_is_checked():
    moe = _moe(MoEConfig(**CONFIGS[0]))
    x = torch.randn(2, 3, 16)
    torch.testing.assert_close(moe(x), moe(x.reshape(6, 16)).view(2, 3, 16))
    with pytest.raises(SPMDShapeError, match="dim=16"):
        moe(torch.randn(4, 15))


def test_routing_rules():
    cfg = MoEConfig(dim=8, hidden_dim=8, num_experts=8, top_k=3, num_expert_groups=4, num_limited_groups=2,
                    score_func="sigmoid", route_norm=True, route_scale=2.0)
    x, w = torch.randn(64, 8), torch.randn(8, 8)
    bias = torch.randn(8)
    r = route(x, w, bias, cfg)
    scores = torch.sigmoid(x @ w.T)
    # weights are the unbiased scores of the chosen experts, normalised, scaled
    chosen = scores.gather(1, r.ids_TK)
    torch.testing.assert_close(r.weights_TK, 2.0 * chosen / chosen.sum(1, keepdim=True))
    # chosen experts lie in the token's top-2 groups (group score: sum of its top-2 biased scores)
    biased = (scores + bias).view(64, 4, 2)
    top_groups = biased.topk(2, dim=-1).values.sum(-1).topk(2, dim=-1).indices
    for t in range(64):
        assert set((r.ids_TK[t] // 2).tolist()) <= set(top_groups[t].tolist())
    # the bias steers selection: a large bias forces an expert in
    forced = torch.zeros(8)
    forced[6] = 100.0
    plain = MoEConfig(dim=8, hidden_dim=8, num_experts=8, top_k=1)
    r2 = route(x, w, forced, plain)
    assert (r2.ids_TK == 6).all()
    torch.testing.assert_close(r2.weights_TK[:, 0], torch.softmax(x @ w.T, -1)[:, 6])


def test_fp32_gate_runs_in_fp32_inside_autocast():
    """torch.autocast(bf16) would round an fp32 gate GEMM to bf16 and pick other experts; the router turns
    autocast off for it, as torchtitan's does (a bf16 router_dtype still follows autocast)."""
    cfg = MoEConfig(dim=64, hidden_dim=8, num_experts=16, top_k=4)
    x, w = torch.randn(256, 64), torch.randn(16, 64)
    plain = route(x, w, torch.zeros(16), cfg)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = route(x, w, torch.zeros(16), cfg)
        rounded = F.linear(x, w)
    assert rounded.dtype == torch.bfloat16  # autocast is on: the same GEMM outside the router rounds
    assert torch.equal(inside.logits_TE, plain.logits_TE) and torch.equal(inside.ids_TK, plain.ids_TK)
    meta = route(x.to("meta"), w.to("meta"), torch.zeros(16, device="meta"), cfg)  # no autocast on meta: planning
    assert meta.ids_TK.shape == (256, 4) and meta.ids_TK.is_meta


def test_scatter_rows_backward_is_the_index_select_gradient():
    src = torch.randn(5, 3, requires_grad=True)
    ids = torch.randint(0, 4, (5, 2))
    pos, ends, counts = expert_order(ids, 0, 4, 10)
    assert counts.tolist() == torch.bincount(ids.flatten(), minlength=4).tolist()
    assert ends.tolist() == counts.cumsum(0).tolist()
    order = torch.empty(10, dtype=torch.int64).scatter_(0, pos.flatten(), torch.arange(10))
    assert torch.equal(ids.flatten()[order], ids.flatten().sort(stable=True).values)
    out = scatter_rows(src, pos)
    torch.testing.assert_close(out, src[order // 2])
    g = torch.randn_like(out)
    (out * g).sum().backward()
    ref = torch.zeros_like(src).index_add_(0, order // 2, g)
    torch.testing.assert_close(src.grad, ref)


def test_weighted_combine_matches_autograd_of_the_plain_formula():
    T, K, D, R = 6, 3, 5, 22  # R > T*K: a capacity-sized y whose unnamed rows are NaN
    pos = torch.randperm(R)[: T * K].view(T, K)
    y = torch.randn(R, D, dtype=torch.float64)
    unnamed = torch.ones(R, dtype=torch.bool)
    unnamed[pos.flatten()] = False
    y[unnamed] = float("nan")
    y.requires_grad_()
    w = torch.rand(T, K, dtype=torch.float64, requires_grad=True)
    out = weighted_combine(y, pos, w)
    y_ok = y.detach()[pos].clone().requires_grad_()
    w_ok = w.detach().clone().requires_grad_()
    ref = (w_ok.unsqueeze(-1) * y_ok).sum(1)
    torch.testing.assert_close(out, ref)
    g = torch.randn(T, D, dtype=torch.float64)
    out.backward(g)
    ref.backward(g)
    torch.testing.assert_close(y.grad[pos], y_ok.grad)
    assert (y.grad[unnamed] == 0).all()
    torch.testing.assert_close(w.grad, w_ok.grad)


@pytest.mark.parametrize("dims", [(16, 8), (6, 5)])
def test_grouped_mm_native_and_fallback_agree(dims):
    K, N = dims
    sizes = [3, 0, 5, 1]
    x = torch.randn(sum(sizes), K, requires_grad=True)
    w = torch.randn(4, N, K, requires_grad=True)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    y = grouped_mm(x, w, offs)
    ref = torch.cat([x[a : a + s] @ w[i].T for i, (a, s) in enumerate(zip([0, 3, 3, 8], sizes))])
    torch.testing.assert_close(y, ref)
    y.sum().backward()
    assert w.grad is not None and torch.count_nonzero(w.grad[1]) == 0
    assert native_grouped_mm_ok(x, w) == (dims == (16, 8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch's grouped GEMM)")
@pytest.mark.parametrize("sizes", [[0, 0, 0, 0], [96, 32, 0, 0], [0, 128, 0, 0]], ids=["all empty", "trailing empty", "one"])
def test_grouped_gemms_with_empty_groups_at_the_buffer_end(sizes, nan_empty):
    """torch's grouped GEMM (CUTLASS) on a capacity buffer that a capacity factor fills (the last offset equal to
    the rows) or an idle rank leaves empty (every offset zero): an empty group's operands start at the
    allocation's end. The up- and down-projections forward and backward: valid rows and every weight gradient
    against per-group ``mm``; an empty group's weight gradient exactly zero (CUTLASS leaves the accumulator of a
    problem with no K tiles unwritten: NVIDIA/cutlass#2674), nothing non-finite (``torch.empty`` hands out NaN)."""
    from spmdmoe.moe.experts.gemm import grouped_mm_pair

    R, D, Fh, dev = sum(sizes) or 128, 256, 128, "cuda"
    x = torch.randn(R, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w1, w3 = ((torch.randn(4, Fh, D, device=dev) / D**0.5).bfloat16().requires_grad_() for _ in range(2))
    w2 = (torch.randn(4, D, Fh, device=dev) / Fh**0.5).bfloat16().requires_grad_()
    offs = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
    h = grouped_mm_pair(x, w1, w3, offs)
    y = grouped_mm(F.silu(h[:, :Fh]) * h[:, Fh:], w2, offs)  # rows past the last offset: unspecified, never read
    valid = int(sum(sizes))
    g = torch.randn(R, D, device=dev, dtype=torch.bfloat16)
    y.backward(g)
    refs = [t.detach().float().requires_grad_() for t in (x, w1, w3, w2)]
    rx, r1, r3, r2 = refs
    starts = [0, *torch.tensor(sizes).cumsum(0).tolist()[:-1]]
    out = [(F.silu(rx[a:a + n] @ r1[i].T) * (rx[a:a + n] @ r3[i].T)) @ r2[i].T
           for i, (a, n) in enumerate(zip(starts, sizes))]
    if valid:
        torch.cat(out).backward(g[:valid].float())

    def rel(a, b):  # bf16 GEMMs against fp32: the error's norm against the reference's
        return float((a.float() - b).norm() / b.norm().clamp(min=1e-30))

    if valid:
        assert rel(y[:valid], torch.cat(out)) < 1e-2
    for name, got, ref in (("w1", w1.grad, r1.grad), ("w3", w3.grad, r3.grad), ("w2", w2.grad, r2.grad)):
        assert torch.isfinite(got).all(), f"{name}: non-finite weight gradient"
        for i, n in enumerate(sizes):
            if n == 0:
                assert torch.count_nonzero(got[i]) == 0, f"{name}[{i}] (an empty group) is not zero"
        if valid:
            assert rel(got, ref) < 1e-2, (name, rel(got, ref))
    assert torch.isfinite(x.grad[:valid]).all()


def test_masked_loop_keeps_a_nan_tail_out_of_every_gradient():
    """The compiled fallback on a capacity buffer: its tail rows (past the last offset) and the gradient
    arriving for them hold NaN; the output's tail is zero and no gradient of the valid rows or the weights
    sees a NaN (under inductor on NCCL the incoming gradient's tail was NaN and reached ``w``'s)."""
    from spmdmoe.moe.experts.gemm import _masked_loop

    sizes, tail = [3, 0, 5], 4
    x = torch.randn(sum(sizes) + tail, 6)
    x[sum(sizes):] = float("nan")
    x.requires_grad_()
    w = torch.randn(3, 5, 6, requires_grad=True)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    y = _masked_loop(x, w, offs)
    assert torch.equal(y[sum(sizes):], torch.zeros(tail, 5))
    g = torch.randn_like(y)
    g[sum(sizes):] = float("nan")
    y.backward(g)
    ref_x, ref_w = x.detach()[: sum(sizes)].clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = torch.cat([ref_x[a : a + n] @ ref_w[i].T for i, (a, n) in enumerate(zip([0, 3, 3], sizes))])
    ref.backward(g[: sum(sizes)])
    torch.testing.assert_close(y[: sum(sizes)], ref)
    torch.testing.assert_close(w.grad, ref_w.grad)
    torch.testing.assert_close(x.grad[: sum(sizes)], ref_x.grad)


def test_aux_loss_formula():
    scores = torch.softmax(torch.randn(10, 4), -1)
    ids = torch.topk(scores, 2).indices
    counts = torch.bincount(ids.flatten(), minlength=4)
    got = aux_loss(scores, counts, 2, 0.5)
    f = counts.float() / (10 * 2)
    P = scores.mean(0)
    torch.testing.assert_close(got, 0.5 * 4 * (f * P).sum())


def test_load_counts_and_bias_update_single_device():
    moe = _moe(MoEConfig(dim=16, hidden_dim=16, num_experts=4, top_k=2, load_balance_coeff=0.1))
    x = torch.randn(30, 16, requires_grad=True)
    checkpoint(moe, x, use_reentrant=False).sum().backward()  # recompute must not count twice
    r = route(x, moe.router.gate.weight, moe.expert_bias, moe.config)
    counts = torch.bincount(r.ids_TK.flatten(), minlength=4)
    assert torch.equal(moe.tokens_per_expert, counts)
    bias_before = moe.expert_bias.clone()
    load = moe.update_expert_bias()
    delta = 0.1 * torch.sign(counts.float().mean() - counts.float())
    torch.testing.assert_close(moe.expert_bias, bias_before + delta - delta.mean())
    assert torch.equal(load, counts.float()) and int(moe.tokens_per_expert.sum()) == 0
    assert "tokens_per_expert" not in moe.state_dict() and "expert_bias" in moe.state_dict()


def test_eval_and_no_grad_forwards_count_nothing():
    """Issue 6: only training forwards count load (at their backward) and compute the aux loss."""
    moe = _moe(MoEConfig(dim=16, hidden_dim=16, num_experts=4, top_k=2, aux_loss_coeff=0.1))
    x = torch.randn(30, 16)
    moe.eval()
    moe(x)
    assert moe.aux_loss is None and int(moe.tokens_per_expert.sum()) == 0
    moe.train()
    with torch.no_grad():
        moe(x)
    assert int(moe.tokens_per_expert.sum()) == 0
    y = moe(x)
    assert moe.aux_loss is not None and int(moe.tokens_per_expert.sum()) == 0  # counted at the backward
    (y.sum() + moe.aux_loss).backward()
    assert int(moe.tokens_per_expert.sum()) == 30 * 2
    moe.eval()
    with torch.enable_grad():  # an eval forward with grad (e.g. a validation loss): still not counted
        moe(x).sum().backward()
    assert int(moe.tokens_per_expert.sum()) == 30 * 2


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpoint_counts_once(reentrant):
    moe = _moe(MoEConfig(dim=16, hidden_dim=16, num_experts=4, top_k=2))
    x = torch.randn(30, 16, requires_grad=True)
    checkpoint(moe, x, use_reentrant=reentrant).sum().backward()
    r = route(x, moe.router.gate.weight, moe.expert_bias, moe.config)
    assert torch.equal(moe.tokens_per_expert, torch.bincount(r.ids_TK.flatten(), minlength=4))


def test_expert_bias_stays_fp32_under_to():
    """Issue 5: .to(bf16) used to make expert_bias bf16, where +-1e-3 steps round away above |0.25|."""
    cfg = MoEConfig(dim=16, hidden_dim=16, num_experts=4, top_k=2, load_balance_coeff=1e-3)
    ref = _moe(cfg)
    with torch.no_grad():
        ref.expert_bias.copy_(torch.tensor([0.3001, -0.7003, 1.5007, 0.0011]))
    assert not torch.equal(ref.expert_bias.bfloat16().float(), ref.expert_bias)
    for convert in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.to("cpu", torch.bfloat16),
                    lambda m: m.bfloat16().float().bfloat16()):
        moe = _moe(cfg)
        moe.load_state_dict(ref.state_dict())  # a bias that bf16 / fp16 cannot hold: conversion must keep it
        moe = convert(moe)
        assert moe.expert_bias.dtype == torch.float32 and moe.router.gate.weight.dtype != torch.float32
        assert torch.equal(moe.expert_bias, ref.expert_bias)
        want = ref.expert_bias.clone()
        for step in range(3):
            counts = torch.tensor([5, 1, 9, 3]) * (step + 1)
            moe.tokens_per_expert.copy_(counts)
            moe.update_expert_bias()
            delta = 1e-3 * torch.sign(counts.float().mean() - counts.float())
            want += delta - delta.mean()
        assert torch.equal(moe.expert_bias, want), (moe.expert_bias, want)  # every expert moved, exactly as fp32


def test_bf16_gate_chooses_as_fp32_and_rounds_its_gradient_once():
    """Issue 7: the gate GEMM runs in fp32 by default: bf16 activations pick the experts of an fp32
    gate (here bitwise: the same fp32 product), and the weight gradient is the fp32 one rounded once."""
    torch.manual_seed(3)
    cfg = MoEConfig(dim=64, hidden_dim=16, num_experts=64, top_k=6)
    x = torch.randn(4000, 64).bfloat16()
    gate = torch.nn.Parameter((torch.randn(64, 64) / 8).bfloat16())
    bias = torch.zeros(64)
    r = route(x, gate, bias, cfg)
    gate32 = gate.detach().float().requires_grad_()
    r32 = route(x.float(), gate32, bias, cfg)
    assert torch.equal(r.ids_TK, r32.ids_TK)
    g = torch.randn(r.weights_TK.shape)
    (r.weights_TK * g).sum().backward()
    (r32.weights_TK * g).sum().backward()
    assert gate.grad.dtype == torch.bfloat16 and torch.equal(gate.grad, gate32.grad.bfloat16())
    cheap = route(x, gate.detach(), bias, MoEConfig(dim=64, hidden_dim=16, num_experts=64, top_k=6, router_dtype="input"))
    differ = (cheap.ids_TK.sort(-1).values != r.ids_TK.sort(-1).values).any(-1).float().mean().item()
    assert differ > 0.001, differ  # the bf16 gate really picks other experts for some tokens (why fp32 is the default)


def test_dtype_mismatch_is_our_error():
    """Issue 15: a bf16 layer fed fp32 raises SPMDDtypeError, not torch's matmul dtype error."""
    moe = _moe(MoEConfig(dim=16, hidden_dim=16, num_experts=4, top_k=2)).to(torch.bfloat16)
    with pytest.raises(spmdmoe.SPMDDtypeError, match=r"computes in torch.bfloat16.*found input of dtype torch.float32"):
        moe(torch.randn(3, 16))


def test_bad_mesh_dim_name_is_our_error():
    pg = spmdmoe.testing.single_process_group()
    mesh = spmdmoe.init_mesh("cpu", (1, 1), mesh_dim_names=("dp", "sp"))
    with pytest.raises(spmdmoe.SPMDMeshError, match=r"no dim 'tp': expected one of \('dp', 'sp'\)"):
        spmdmoe.shard(torch.zeros(3, 2), (mesh, "tp"))
    assert pg is not None


def test_parameter_names_and_shapes():
    moe = MoE(MoEConfig(dim=8, hidden_dim=4, num_experts=6, top_k=2, num_shared_experts=2))
    shapes = {n: tuple(p.shape) for n, p in moe.named_parameters()}
    assert shapes == {
        "router.gate.weight": (6, 8),
        "experts.w1": (6, 4, 8),
        "experts.w2": (6, 8, 4),
        "experts.w3": (6, 4, 8),
        "shared_experts.w1.weight": (8, 8),
        "shared_experts.w2.weight": (8, 8),
        "shared_experts.w3.weight": (8, 8),
    }


@pytest.mark.parametrize("bad", [
    dict(top_k=9), dict(top_k=0), dict(score_func="relu"), dict(num_expert_groups=3, num_limited_groups=1),
    dict(num_limited_groups=1), dict(num_expert_groups=4, num_limited_groups=1, top_k=3),
    dict(num_expert_groups=True, num_limited_groups=1), dict(num_expert_groups=2, num_limited_groups=True),
    dict(router_dtype="bfloat16"),
], ids=["top_k>E", "top_k=0", "score_func", "groups%E", "limited_alone", "top_k>reachable", "groups=True",
        "limited=True", "router_dtype"])
def test_config_errors(bad):
    args = dict(dim=8, hidden_dim=8, num_experts=8, top_k=2)
    args.update(bad)
    with pytest.raises(MoEConfigError):
        MoEConfig(**args)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_cuda_matches_cpu(dtype, rtol):
    cfg = MoEConfig(dim=64, hidden_dim=32, num_experts=8, top_k=2, num_shared_experts=1)
    cpu = _moe(cfg)
    gpu = _moe(cfg, device="cuda", dtype=dtype)
    x = torch.randn(300, 64).to(dtype).float()  # both route the same (representable) input: no near-tie flips
    ref = cpu(x)
    got = gpu(x.to("cuda", dtype)).float().cpu()
    torch.testing.assert_close(got, ref, rtol=rtol, atol=rtol * ref.abs().max().item())


@pytest.mark.parametrize("style", ["ours", "new", "older", "oldest"])
def test_single_device_loads_torchtitan_state_dicts(style):
    """Issue 8: torchtitan 0.3.0 names (routed_experts.inner_experts.w1_EFD, expert_bias_E) load and
    round-trip; the earlier _EFD names load; the oldest (E, D, F) orientation only through from_torchtitan."""
    from spmdmoe.moe.checkpoint import from_torchtitan, to_torchtitan

    cfg = MoEConfig(dim=16, hidden_dim=8, num_experts=4, top_k=2, num_shared_experts=1)
    src, dst = _moe(cfg, seed=1), _moe(cfg, seed=2)
    sd = {k: v.clone() for k, v in src.state_dict().items()}
    if style == "new":  # torchtitan 0.3.0, built by hand (torchtitan is not a dependency)
        sd = {{"experts.w1": "routed_experts.inner_experts.w1_EFD", "experts.w2": "routed_experts.inner_experts.w2_EDF",
               "experts.w3": "routed_experts.inner_experts.w3_EFD", "expert_bias": "expert_bias_E"}.get(k, k): v
              for k, v in sd.items()}
        sd["tokens_per_expert_E"] = torch.ones(4)
        assert sd.keys() == to_torchtitan(src.state_dict()).keys() | {"tokens_per_expert_E"}
    if style == "older":
        sd = {k.replace("experts.w1", "experts.w1_EFD").replace("experts.w2", "experts.w2_EDF")
              .replace("experts.w3", "experts.w3_EFD") if k.startswith("experts.") else k: v for k, v in sd.items()}
    if style == "oldest":
        sd = {k: (v.transpose(1, 2).contiguous() if k.startswith("experts.") else v) for k, v in sd.items()}
        with pytest.raises(ValueError, match="orientation='EDF'"):
            dst.load_state_dict(sd)
        sd = from_torchtitan(sd, orientation="EDF")
    dst.load_state_dict(sd)
    for name, p in src.state_dict().items():
        assert torch.equal(dst.state_dict()[name], p), name
    with pytest.raises(ValueError, match="expected shape .* a plain tensor must hold every expert"):
        dst.load_state_dict({**src.state_dict(), "experts.w1": torch.zeros(2, 8, 16)})  # an EP rank's slice
    with pytest.raises(ValueError, match="expected shape .* another num_experts, dim or hidden_dim"):
        dst.load_state_dict({**src.state_dict(), "experts.w1": torch.zeros(8, 8, 16)})  # another config's
    back = {k: v.clone() for k, v in to_torchtitan(dst.state_dict()).items()}
    assert "routed_experts.inner_experts.w1_EFD" in back and "expert_bias_E" in back
    src.load_state_dict(back)
    assert torch.equal(src.experts.w1, dst.experts.w1)


def test_oldest_orientation_is_never_guessed_when_dim_equals_hidden():
    """Issue 13: with D == F an (E, D, F) tensor has our shape; nothing can tell, so nothing is
    transposed by load_state_dict, and from_torchtitan(orientation='EDF') transposes explicitly."""
    from spmdmoe.moe.checkpoint import from_torchtitan

    cfg = MoEConfig(dim=16, hidden_dim=16, num_experts=4, top_k=2)
    src, dst = _moe(cfg, seed=1), _moe(cfg, seed=2)
    oldest = {k: (v.transpose(1, 2).contiguous() if k.startswith("experts.") else v) for k, v in src.state_dict().items()}
    dst.load_state_dict(from_torchtitan(oldest, orientation="EDF"))
    assert torch.equal(dst.experts.w1, src.experts.w1) and torch.equal(dst.experts.w2, src.experts.w2)
    dst.load_state_dict(oldest)  # taken as ours, as documented: the caller must say "EDF"
    assert torch.equal(dst.experts.w1, src.experts.w1.transpose(1, 2))


@pytest.mark.parametrize("dims", [(16, 8), (6, 5)])  # torch's grouped GEMM, the per-group fallback
def test_experts_on_a_capacity_buffer_never_read_past_valid_rows(dims):
    """SwiGLU and the GEMM seam on a capacity-sized buffer whose rows past ``valid_rows`` are NaN: the
    valid rows and every gradient match the exact-size buffer; the NaN never reaches them."""
    D, F_ = dims
    sizes = [3, 0, 5, 1]
    valid, cap = sum(sizes), sum(sizes) + 7
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    w = [torch.randn(4, F_, D), torch.randn(4, D, F_), torch.randn(4, F_, D)]
    x = torch.randn(valid, D)
    g = torch.randn(valid, D)

    def run(rows: int, fill: float):
        buf = torch.full((rows, D), fill)
        buf[:valid] = x
        buf.requires_grad_()
        ws = [t.clone().requires_grad_() for t in w]
        routed = RoutedTokens(buf, offs, rows, None, None)
        assert routed.valid_rows is not None and routed.valid_rows.tolist() == [valid]
        y = grouped_swiglu(routed, *ws)
        assert y.shape == (rows, D)
        gy = torch.zeros(rows, D)
        gy[:valid] = g
        y.backward(gy)
        return y[:valid], buf.grad[:valid], [t.grad for t in ws]

    y_cap, gx_cap, gw_cap = run(cap, float("nan"))
    y_ref, gx_ref, gw_ref = run(valid, 0.0)
    torch.testing.assert_close(y_cap, y_ref)
    torch.testing.assert_close(gx_cap, gx_ref)
    for a, b in zip(gw_cap, gw_ref):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b)


def test_experts_pack_w1_w3_side_by_side():
    """w1 and w3 share one storage after construction, after .to() and in a deepcopy, so the up-projection is
    one GEMM on a view; their gradients are contiguous (no copy by autograd); unpack() gives each its own."""
    import copy

    from spmdmoe.moe.experts.gemm import joined

    moe = MoE(MoEConfig(dim=16, hidden_dim=8, num_experts=4, top_k=2)).to(torch.float64)
    ex = moe.experts
    assert joined(ex.w1, ex.w3) is not None
    twin = copy.deepcopy(ex)
    assert joined(twin.w1, twin.w3) is not None and torch.equal(twin.w1, ex.w1) and torch.equal(twin.w3, ex.w3)
    moe.to(torch.float32)  # fp32: the fused GEMM path (torch's grouped GEMM) on CPU
    assert joined(ex.w1, ex.w3) is not None
    w1 = ex.w1.detach().clone()
    moe(torch.randn(7, 16)).sum().backward()
    assert ex.w1.grad.is_contiguous() and ex.w3.grad.is_contiguous()
    ex.unpack()
    assert joined(ex.w1, ex.w3) is None and ex.w1.is_contiguous() and torch.equal(ex.w1, w1)
    ex.to(torch.float64)
    assert joined(ex.w1, ex.w3) is None  # unpacked stays unpacked (FSDP2), in a copy too
    twin = copy.deepcopy(ex)
    assert joined(twin.w1, twin.w3) is None and not twin.packing


def test_output_may_be_modified_in_place():
    """The layer's output is an ordinary tensor, not a view made inside a custom autograd Function (autograd
    forbids modifying those in place): ``out.mul_(2)`` and its backward match ``2 * out``."""
    torch.manual_seed(0)
    moe = MoE(MoEConfig(dim=16, hidden_dim=8, num_experts=4, top_k=2))
    x = torch.randn(10, 16, requires_grad=True)
    out = moe(x)
    out.mul_(2)
    out.sum().backward()
    want = x.grad.clone()
    x.grad = None
    (2 * moe(x)).sum().backward()
    assert torch.equal(x.grad, want)
