"""``spmdmoe.integrations.transformers.swap_moe`` on tiny Qwen3-MoE, Mixtral and DeepSeek-V3 models (random
weights from a config, ``tests/hf_models.py``), against the unswapped model from the same seed, on CPU.

Tolerances (fp32): logits, loss and router logits within 1e-5 of the largest magnitude, every gradient within
1e-4 of its largest (summation order differs: transformers adds expert by expert, spmdmoe per token);
bf16: within 2 % of the largest logit.
"""

from __future__ import annotations

import copy

import pytest
import torch

from hf_models import MODELS, VARIANTS, VOCAB  # noqa: E402  (skips this module without transformers)

from spmdmoe.integrations.transformers import SwappedMoeBlock, swap_moe  # noqa: E402
from spmdmoe.types.errors import MoEConfigError  # noqa: E402


def _pair(name: str, seed: int = 0, **options) -> tuple[torch.nn.Module, torch.nn.Module]:
    ref = {**MODELS, **VARIANTS}[name](seed)
    ours = copy.deepcopy(ref)
    swap_moe(ours, **options)
    return ref, ours


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max()) <= tol * max(float(a.abs().max()), 1e-30)


def _run(model: torch.nn.Module, ids: torch.Tensor):  # type: ignore[no-untyped-def]
    return model(input_ids=ids, labels=ids, output_router_logits=True)


@pytest.mark.parametrize("name", sorted(MODELS) + sorted(VARIANTS))
def test_parity_with_the_unswapped_model(name):
    """Logits, loss, router logits, the load-balancing loss and every gradient match the unswapped model's;
    the module paths, parameter names and their order, state-dict keys and the gate objects are kept."""
    ref, ours = _pair(name)
    blocks = [n for n, m in ours.named_modules() if isinstance(m, SwappedMoeBlock)]
    assert blocks and all(n.endswith(".mlp") for n in blocks)
    assert [n for n, _ in ref.named_parameters()] == [n for n, _ in ours.named_parameters()]
    assert list(ref.state_dict()) == list(ours.state_dict())
    ids = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(1))
    a, b = _run(ref, ids), _run(ours, ids)
    assert _close(a.logits, b.logits, 1e-5) and _close(a.loss, b.loss, 1e-5)
    assert len(a.router_logits) == len(b.router_logits) == len(blocks)
    assert all(_close(x, y, 1e-5) and x.dtype == y.dtype for x, y in zip(a.router_logits, b.router_logits))
    if getattr(a, "aux_loss", None) is not None:
        assert _close(a.aux_loss, b.aux_loss, 1e-5)
    a.loss.backward()
    b.loss.backward()
    for (n, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None:
            assert _close(p.grad, q.grad, 1e-4), n


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_bf16_parity(name):
    """bf16 models: the first block's router logits bitwise equal (Qwen3-MoE's gate GEMM in bf16 as transformers';
    DeepSeek-V3's gate kept fp32, as transformers' loading keeps it, with bf16 experts), the model's logits within
    bf16 rounding."""
    ref, ours = _pair(name)
    ref, ours = ref.to(torch.bfloat16), ours.to(torch.bfloat16)
    for model in (ref, ours) if name == "deepseek_v3" else ():
        for layer in model.model.layers[1:]:  # transformers' _keep_in_fp32_modules_strict, as from_pretrained applies it
            gate = layer.mlp.gate
            gate.weight.data, gate.e_score_correction_bias.data = gate.weight.data.float(), gate.e_score_correction_bias.float()
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(2))
    a, b = _run(ref, ids), _run(ours, ids)
    assert torch.equal(a.router_logits[0], b.router_logits[0])  # the first block's input is the same: bitwise
    assert _close(a.logits, b.logits, 2e-2)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_save_pretrained_round_trip(name, tmp_path):
    """A swapped model saves the unswapped model's checkpoint (same files, keys and tensors: transformers'
    per-expert layout), the unswapped model loads it, and a swapped model loads the unswapped one's."""
    ref, ours = _pair(name)
    with torch.no_grad():  # make the swapped model's weights its own, so a load is seen
        for p in ours.parameters():
            p.add_(0.01)
    ours.save_pretrained(tmp_path / "swapped")
    ref.save_pretrained(tmp_path / "plain")
    from safetensors.torch import load_file

    saved, plain = load_file(tmp_path / "swapped" / "model.safetensors"), load_file(tmp_path / "plain" / "model.safetensors")
    assert sorted(saved) == sorted(plain) and any(".experts.0." in k for k in saved)
    loaded = type(ref).from_pretrained(tmp_path / "swapped")
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), ours.state_dict().values()))
    back = type(ref).from_pretrained(tmp_path / "plain")
    swap_moe(back)
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), ref.state_dict().values()))
    ours.load_state_dict(ref.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), ref.state_dict().values()))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_training_steps_track_the_unswapped_model(name):
    """Six AdamW steps with the model's own loss (the load-balancing loss in it where the model has one): the
    two models' losses agree within 1e-4 at every step and fall."""
    ref, ours = _pair(name)
    ids = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(3))
    losses = []
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (ref, ours)]
    for _ in range(6):
        step = []
        for model, opt in zip((ref, ours), opts):
            loss = _run(model, ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            step.append(float(loss.detach()))
        losses.append(step)
    assert all(abs(a - b) <= 1e-4 * abs(a) for a, b in losses), losses
    assert losses[-1][1] < losses[0][1] - 0.05, losses


def test_gate_hooks_see_transformers_router_output():
    """A forward hook on ``mlp.gate`` gets transformers' ``(router_logits, weights, ids)`` for the block's rows."""
    ref, ours = _pair("mixtral")
    seen: dict[str, tuple] = {}
    for tag, model in (("ref", ref), ("ours", ours)):
        model.model.layers[0].mlp.gate.register_forward_hook(lambda m, a, out, tag=tag: seen.__setitem__(tag, out))
    ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(4))
    _run(ref, ids), _run(ours, ids)
    (la, wa, ia), (lb, wb, ib) = seen["ref"], seen["ours"]
    assert _close(la, lb, 1e-6) and torch.equal(ia.sort(-1).values, ib.sort(-1).values)
    assert _close(wa.gather(1, ia.argsort(-1)), wb.gather(1, ib.argsort(-1)), 1e-6)


def test_refusals():
    """What cannot be mapped exactly is refused with MoEConfigError naming the module and the fix."""
    model = MODELS["mixtral"](0)
    model.model.layers[1].mlp.jitter_noise = 0.1
    with pytest.raises(MoEConfigError, match=r"model.layers.1.mlp: router_jitter_noise=0.1; set"):
        swap_moe(model)
    assert type(model.model.layers[0].mlp).__name__ == "MixtralSparseMoeBlock"  # refused before any block is swapped
    model.model.layers[0].mlp._hf_hook = object()  # what accelerate's device_map dispatch attaches
    model.model.layers[1].mlp.jitter_noise = 0.0
    with pytest.raises(MoEConfigError, match="model.layers.0.mlp: dispatched by accelerate"):
        swap_moe(model)
    model = MODELS["qwen3_moe"](0)
    model.model.layers[0].mlp.experts.config.hidden_act = "gelu"
    with pytest.raises(MoEConfigError, match="activation is 'gelu'"):
        swap_moe(model)
    model = MODELS["qwen3_moe"](0)
    block = model.model.layers[1].mlp
    block.__class__ = type("MyBlock", (type(block),), {})  # a subclass: its forward may differ
    with pytest.raises(MoEConfigError, match="MyBlock.*not a transformers MoE block spmdmoe maps"):
        swap_moe(model)
    model = MODELS["qwen3_moe"](0)
    swap_moe(model)
    with pytest.raises(MoEConfigError, match="holds no transformers MoE block"):
        swap_moe(model)


def _grads_close(ref: torch.nn.Module, ours: torch.nn.Module, tol: float) -> bool:
    return all(_close(p.grad, q.grad, tol) for p, q in zip(ref.parameters(), ours.parameters()) if p.grad is not None)


def test_activation_checkpointing_and_compile():
    """transformers' activation checkpointing of its decoder layers (the swapped block recomputed in the
    backward), and ``torch.compile`` of the swapped model (``aot_eager`` on CPU): loss, aux loss and gradients as
    the unswapped eager model's."""
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))
    ref, ours = _pair("qwen3_moe")
    a = _run(ref, ids)
    a.loss.backward()
    ours.activation_checkpointing_enable()
    calls = []
    ours.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))  # (the recompute may stop early)
    b = _run(ours, ids)
    b.loss.backward()
    assert len(calls) == 2  # the forward, and its recompute in the backward
    assert _close(a.loss, b.loss, 1e-5) and _grads_close(ref, ours, 1e-4)
    ours = copy.deepcopy(ref)
    ours.zero_grad()
    swap_moe(ours)
    b = _run(torch.compile(ours, backend="aot_eager"), ids)
    b.loss.backward()
    assert _close(a.loss, b.loss, 1e-5) and _close(a.aux_loss, b.aux_loss, 1e-5) and _grads_close(ref, ours, 1e-4)


def test_fp8_experts():
    """``expert_precision="fp8_rowwise"`` (emulated on CPU): a bf16 model's logits within 2 % of the unswapped
    bf16 model's, the loss within 1e-3 (FP8 rounding of the expert GEMMs' operands)."""
    ref, ours = _pair("qwen3_moe", expert_precision="fp8_rowwise")
    ref, ours = ref.to(torch.bfloat16), ours.to(torch.bfloat16)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(6))
    a, b = _run(ref, ids), _run(ours, ids)
    assert ours.model.layers[0].mlp.experts.precision == "fp8_rowwise"
    assert _close(a.logits, b.logits, 2e-2) and _close(a.loss, b.loss, 1e-3)


def test_swap_on_meta_then_materialise(nan_empty):
    """A model built and swapped on meta, then ``to_empty`` (``torch.empty`` handing out NaN / the largest int
    here) and a load: the swapped layer's own buffers (problem flags, load counts) are zero, and it matches the
    unswapped model."""
    ref = MODELS["deepseek_v3"](0)
    with torch.device("meta"):
        model = type(ref)(ref.config)
    swap_moe(model)
    model.to_empty(device="cpu")
    model.load_state_dict(ref.state_dict())
    with torch.no_grad():  # transformers' non-persistent buffers (rotary frequencies) are not in the state dict
        mine = dict(model.named_buffers())
        for name, a in ref.named_buffers():
            mine[name].copy_(a)
    block = model.model.layers[1].mlp
    assert block.tokens_per_expert_E.eq(0).all() and all(b.eq(0).all() for b in block.layer._buffers.values())
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(7))
    assert _close(ref(input_ids=ids).logits, model(input_ids=ids).logits, 1e-5)


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_aux_loss_free_bias_update(name, nan_empty):
    """``swap_moe(load_balance_coeff=c)``: before each optimizer step every block's bias moves by ``c`` against
    its load (``sign(mean - load)``, centred), and the counts restart. DeepSeek-V3 updates its own
    ``e_score_correction_bias``; Qwen3-MoE gets one, fp32 zeros (also after ``to_empty`` from meta), saved in the
    state dict, which steers the choice of experts."""
    ref, ours = _pair(name, load_balance_coeff=0.1)
    block = ours.model.layers[-1].mlp
    before = block.gate.e_score_correction_bias.clone()
    if name == "qwen3_moe":
        assert before.dtype == torch.float32 and before.eq(0).all()
        assert "model.layers.1.mlp.gate.e_score_correction_bias" in ours.state_dict()
        with torch.device("meta"):
            meta = type(ref)(ref.config)
        swap_moe(meta, load_balance_coeff=0.1)
        meta.to_empty(device="cpu")
        assert meta.model.layers[-1].mlp.gate.e_score_correction_bias.eq(0).all()
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    ours(input_ids=ids, labels=ids).loss.backward()
    load = block.tokens_per_expert_E.clone().float()
    assert load.sum() == 2 * 9 * 2  # every token's top 2
    torch.optim.SGD(ours.parameters(), lr=0.0).step()
    delta = 0.1 * torch.sign(load.mean() - load)
    assert torch.allclose(block.gate.e_score_correction_bias - before, delta - delta.mean())
    assert block.tokens_per_expert_E.eq(0).all()
    if name == "qwen3_moe":  # the bias now steers: an expert pushed far down is chosen by no token
        with torch.no_grad():
            block.gate.e_score_correction_bias[0] = -100.0
        seen = []
        block.gate.register_forward_hook(lambda gate, args, out: seen.append(out[2]))
        ours(input_ids=ids)
        assert seen and not (seen[-1] == 0).any()


def test_step_hook_runs_each_layer_once_for_its_own_optimizer():
    """The step hook runs a swapped layer's ``before_step`` (here the bias update) at the step of the first
    optimizer that held its parameters, once a step: another live model's optimizer leaves it alone (two models
    in one process), and a second optimizer over the same model (dense and expert parameters apart) does not
    run it again."""
    a, b = (copy.deepcopy(MODELS["qwen3_moe"](0)) for _ in range(2))
    for model in (a, b):
        swap_moe(model, load_balance_coeff=0.1)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    bias = lambda m: m.model.layers[-1].mlp.gate.e_score_correction_bias.clone()  # noqa: E731
    experts = [p for n, p in b.named_parameters() if ".experts." in n]
    dense = [p for n, p in b.named_parameters() if ".experts." not in n]
    opt_a = torch.optim.SGD(a.parameters(), lr=0.0)
    opt_b = [torch.optim.SGD(experts, lr=0.0), torch.optim.SGD(dense, lr=0.0)]
    for model in (a, b):
        model(input_ids=ids, labels=ids).loss.backward()
    before_a, before_b = bias(a), bias(b)
    load = b.model.layers[-1].mlp.tokens_per_expert_E.float()
    delta = 0.1 * torch.sign(load.mean() - load)
    for opt in opt_b:
        opt.step()
    assert torch.allclose(bias(b) - before_b, delta - delta.mean())  # once, not once per optimizer
    assert torch.equal(bias(a), before_a)  # another model's layers are not b's step's
    opt_a.step()
    assert not torch.equal(bias(a), before_a)
