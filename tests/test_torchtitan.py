"""``spmdmoe.integrations.torchtitan.swap_moe`` in one process (CPU): torchtitan's DeepSeek-V3 debug model,
built twice from one seed, one swapped.

Tolerances: torchtitan's experts compute in bf16 (also in an fp32 model) and so do ours by default, so
outputs are compared per token row: relative error <= 1e-2 on rows routed alike, and at most 1 % of tokens
routed to another expert set (routing compared on its own); gradients: ||diff|| / ||ref|| <= 1e-2 per
parameter; training: |loss difference| <= 1 % of the loss at each of 20 steps.
"""

from __future__ import annotations

import copy

import pytest
import torch

from torchtitan_models import NoParallelism, build, debug_config, fsdp_meshes_per_parameter, pair

from spmdmoe.integrations.torchtitan import SwappedMoE, swap_moe  # noqa: E402
from spmdmoe.moe import route  # noqa: E402
from spmdmoe.types.errors import MoEConfigError  # noqa: E402

ROUTERS = {
    "softmax": {},
    "sigmoid-groups": {"score_func": "sigmoid", "route_norm": True, "route_scale": 2.5, "num_expert_groups": 4,
                       "num_limited_groups": 2},
}


# the blocks' compile backend here (CPU): inductor's C++ build of every block took 90 s of the suite on 2 cores;
# inductor compiles the swapped blocks on the GPU (tests/distributed/test_torchtitan.py, NCCL)
BACKEND = "aot_eager"


def _pair(**router):
    return pair(debug_config(**router))


def test_paths_and_init_match_bitwise():
    ref, ours = _pair()
    assert [type(m) for m in ours.modules() if isinstance(m, SwappedMoE)] == [SwappedMoE] * 2
    ref_state, our_state = ref.state_dict(), ours.state_dict()
    assert list(ref_state) == list(our_state)
    assert all(torch.equal(ref_state[k], our_state[k]) for k in ref_state)
    assert [n for n, _ in ref.named_buffers()] == [n for n, _ in ours.named_buffers()]
    assert [n for n, _ in ref.named_parameters()] == [n for n, _ in ours.named_parameters()]
    ours.verify_module_protocol()  # torchtitan's Trainer checks every submodule is one of its Modules


CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                         reason="needs a CUDA GPU")])


@pytest.mark.parametrize("swap_after_init", [False, True], ids=["swap-then-init", "init-then-swap"])
@pytest.mark.parametrize("built_on", ["meta", "cpu", CUDA])
def test_swap_on_every_build_path(built_on, swap_after_init):
    """``swap_moe`` on a model built on meta (torchtitan's Trainer; materialised by ``to_empty``), on the CPU or
    on a GPU (a plain script), before or after ``init_states``: the state dict is the unswapped model's from the
    same seed, bitwise, and a swap after the init changes no value; the layer's own buffers (problem flags) are
    zeros on the model's device; the output and the input gradient match torchtitan's."""
    device = "cuda" if built_on == "cuda" else "cpu"
    where = {"device": device, "on_meta": built_on == "meta"}
    ref = build(debug_config(), **where)
    seen = []

    def swap(model):
        seen.append({k: v.clone() for k, v in model.state_dict().items()})
        return swap_moe(model)
    ours = build(debug_config(), swap, swap_after_init=swap_after_init, **where)
    ref_state, our_state = ref.state_dict(), ours.state_dict()
    assert list(ref_state) == list(our_state)
    assert all(torch.equal(ref_state[k], our_state[k]) for k in ref_state)
    if swap_after_init:
        assert all(torch.equal(seen[0][k], our_state[k]) for k in our_state)
    for moe in (m for m in ours.modules() if isinstance(m, SwappedMoE)):
        own = dict(moe.layer.named_buffers(recurse=False))
        assert "problem_bits" in own
        for name, buf in own.items():
            assert buf.device.type == device and not buf.any(), (name, buf)
    x = torch.randn(3, 37, 256, generator=torch.Generator().manual_seed(2)).to(device)
    err, same, (gx_ref, gx_our) = _rows(ref.layers["1"].moe, ours.layers["1"].moe, x)
    assert (~same).float().mean() <= 0.01
    assert err[same].max() <= 1e-2, err[same].max()
    gx_err = ((gx_ref - gx_our).reshape(-1, 256).norm(dim=-1) / gx_ref.reshape(-1, 256).norm(dim=-1))
    assert gx_err[same].max() <= 1e-2


def _rows(ref_moe, our_moe, x_BLD):
    """Per-row relative output error, and which tokens both routers send to the same expert set."""
    torch.manual_seed(1)
    x_ref = x_BLD.clone().requires_grad_()
    x_our = x_BLD.clone().requires_grad_()
    y_ref, y_our = ref_moe(x_ref), our_moe(x_our)
    g = torch.randn_like(y_ref)
    (y_ref * g).sum().backward()
    (y_our * g).sum().backward()
    D = x_BLD.shape[-1]
    ids_ref = ref_moe.router(x_BLD, ref_moe.expert_bias_E)[1].reshape(-1, ref_moe.router.top_k)
    ours = route(x_BLD.reshape(-1, D), our_moe.router.gate.weight, our_moe.expert_bias_E, our_moe.layer.config)
    same = (ids_ref.sort(-1).values == ours.ids_TK.sort(-1).values).all(-1)
    err = ((y_ref - y_our).reshape(-1, D).norm(dim=-1) / y_ref.reshape(-1, D).norm(dim=-1)).detach()
    return err, same, (x_ref.grad, x_our.grad)


@pytest.mark.parametrize("router", list(ROUTERS))
def test_module_parity_forward_backward(router):
    ref, ours = _pair(**ROUTERS[router])
    ref_moe, our_moe = ref.layers["1"].moe, ours.layers["1"].moe
    with torch.no_grad():  # a bias that steers routing, the same in both
        bias = torch.randn(8, generator=torch.Generator().manual_seed(3)) * 0.01
        ref_moe.expert_bias_E.copy_(bias)
        our_moe.expert_bias_E.copy_(bias)
    x = torch.randn(3, 37, 256, generator=torch.Generator().manual_seed(2))
    err, same, (gx_ref, gx_our) = _rows(ref_moe, our_moe, x)
    assert (~same).float().mean() <= 0.01
    assert err[same].max() <= 1e-2, err[same].max()
    gx_err = ((gx_ref - gx_our).reshape(-1, 256).norm(dim=-1) / gx_ref.reshape(-1, 256).norm(dim=-1))
    assert gx_err[same].max() <= 1e-2
    for (name, p_ref), (_, p_our) in zip(ref_moe.named_parameters(), our_moe.named_parameters()):
        assert (p_ref.grad - p_our.grad).norm() <= 1e-2 * p_ref.grad.norm(), name
    assert torch.equal(ref_moe.tokens_per_expert_E, our_moe.tokens_per_expert_E)


def test_module_parity_under_autocast():
    """torchtitan trains one device under torch.autocast(bf16) with fp32 parameters; its gate GEMM runs in fp32
    there, and so does ours."""
    ref, ours = _pair()
    ref_moe, our_moe = ref.layers["1"].moe, ours.layers["1"].moe
    x = torch.randn(3, 37, 256, generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        err, same, _ = _rows(ref_moe, our_moe, x)
    assert (~same).float().mean() <= 0.01
    assert err[same].max() <= 1e-2, err[same].max()


def _train(model, tokens, steps):
    from torchtitan.components.optimizer import register_moe_load_balancing_hook

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    register_moe_load_balancing_hook(opt, [model], NoParallelism())
    losses = []
    for step in range(steps):
        logits = model(tokens[step, :, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[step, :, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_training_tracks_torchtitan_with_its_load_balancing_hook():
    ref, ours = _pair()
    tokens = torch.randint(0, 2048, (2, 2, 33), generator=torch.Generator().manual_seed(4)).repeat(10, 1, 1)
    ref_losses, our_losses = _train(ref, tokens, 10), _train(ours, tokens, 10)
    for step, (a, b) in enumerate(zip(ref_losses, our_losses)):
        assert abs(a - b) <= 0.01 * abs(a), (step, a, b)
    assert ref_losses[-1] < ref_losses[0] - 0.5
    for moe in (m for m in ours.modules() if isinstance(m, SwappedMoE)):  # torchtitan's hook ran on ours
        assert moe.expert_bias_E.abs().sum() > 0 and not moe.tokens_per_expert_E.any()


def test_activation_checkpointing_and_compiled_blocks():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    _, plain = _pair()
    wrapped = copy.deepcopy(plain)
    for name, block in list(wrapped.layers.named_children()):
        block = checkpoint_wrapper(block, preserve_rng_state=False)
        block.compile(fullgraph=True, backend=BACKEND)
        wrapped.layers.register_module(name, block)
    tokens = torch.randint(0, 2048, (2, 24), generator=torch.Generator().manual_seed(5))
    for model in (plain, wrapped):
        model(tokens).float().pow(2).mean().backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), wrapped.named_parameters()):
        assert (a.grad - b.grad).norm() <= 1e-3 * a.grad.norm() + 1e-12, name
    # the counts: one per routed copy (spmdmoe counts when the backward runs, once under recompute)
    pairs = zip(*([m for m in model.modules() if isinstance(m, SwappedMoE)] for model in (plain, wrapped)))
    for a, b in pairs:
        assert torch.equal(a.tokens_per_expert_E, b.tokens_per_expert_E)
        assert a.tokens_per_expert_E.sum() == 2 * 24 * 3


def test_dcp_checkpoints_load_both_ways(tmp_path):
    import torch.distributed.checkpoint as dcp

    ref, ours = _pair()
    fresh = build(debug_config(), swap_moe, seed=7)
    assert not torch.equal(fresh.layers["1"].moe.router.gate.weight, ref.layers["1"].moe.router.gate.weight)
    dcp.save(ref.state_dict(), checkpoint_id=str(tmp_path / "tt"))
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=str(tmp_path / "tt"))
    fresh.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), fresh.state_dict().values()))
    back = build(debug_config(), seed=8)
    dcp.save(ours.state_dict(), checkpoint_id=str(tmp_path / "ours"))
    state = back.state_dict()
    dcp.load(state, checkpoint_id=str(tmp_path / "ours"))
    back.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), back.state_dict().values()))


def _meta_model():
    with torch.device("meta"):
        return debug_config().build()


def _gate_bias(model):
    moe = model.layers["1"].moe
    moe.router.gate.bias = torch.nn.Parameter(torch.zeros(8, device="meta"))


def _force_balance(model):
    model.layers["1"].moe.router._debug_force_load_balance = True


def _converted_experts(model):
    from torchtitan.models.common.moe import GroupedExperts

    class Fp8Experts(GroupedExperts):
        pass
    inner = model.layers["1"].moe.routed_experts.inner_experts
    inner.__class__ = Fp8Experts


def _dispatcher(model):
    model.layers["1"].moe.routed_experts.token_dispatcher = object()


def _subclass(model):
    from torchtitan.models.common.moe import MoE

    class OwnMoE(MoE):
        pass
    model.layers["1"].moe.__class__ = OwnMoE


def _converted_linear(model):  # what Float8 / MXFP8 linear converters and LoRA do to the gate and shared experts
    from torchtitan.models.common.linear import Linear

    class ConvertedLinear(Linear):
        pass
    model.layers["1"].moe.shared_experts.w2.__class__ = ConvertedLinear


@pytest.mark.parametrize("change,words", [
    (_gate_bias, "router gate has a bias"),
    (_converted_linear, "shared experts' w2 is a test_torchtitan.ConvertedLinear"),
    (_force_balance, "_debug_force_load_balance"),
    (_converted_experts, "expert_precision='fp8_rowwise'"),
    (_dispatcher, "comm_backend='standard'"),
    (_subclass, "MoE classes other than"),
])
def test_refuses_what_it_cannot_map(change, words):
    model = _meta_model()
    change(model)
    with pytest.raises(MoEConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        swap_moe(model)


def test_refuses_a_model_without_torchtitan_moe():
    with pytest.raises(MoEConfigError, match="holds no torchtitan"):
        swap_moe(torch.nn.Linear(2, 2))


@pytest.mark.skipif(not fsdp_meshes_per_parameter(), reason="torchtitan's EP with FSDP needs FSDP2's per-parameter "
                    "meshes (ShardPlacementResult, torch 2.13); EP by hand: tests/distributed/test_torchtitan.py")
def test_torchtitans_parallelize_ep4(torchrun_job):
    """The whole model through torchtitan's ``parallelize_deepseekv3`` with EP = 4 on 4 gloo processes
    (``tests/torchtitan_parallelize.py``): each rank's loss and every gradient match the unparallelized
    torchtitan model's on the same weights."""
    rc, out, err = torchrun_job("tests/torchtitan_parallelize.py", timeout=300)
    assert rc == 0, err[-3000:]
    assert out.count("gradients match") == 4, out


def test_swapped_model_spec_swaps_before_torchtitans_parallelize():
    """The Trainer's path: the spec's ``parallelize_fn`` swaps the meta-built model, then runs the spec's own
    with the same arguments (EP on: torchtitan's "ep" mesh; the EP run itself: ``torchtitan_parallelize.py``)."""
    import dataclasses

    from torchtitan.models.deepseek_v3 import model_registry

    from spmdmoe.integrations.torchtitan import swapped_model_spec

    seen = []

    def parallelize(model, *, parallel_dims, **kwargs):
        seen.append((type(model.layers["1"].moe), parallel_dims, kwargs))
        return model

    spec = swapped_model_spec(dataclasses.replace(model_registry("debugmodel"), parallelize_fn=parallelize))
    dims = NoParallelism()
    model = _meta_model()
    assert spec.parallelize_fn(model, parallel_dims=dims, training="t", dump_folder="") is model
    assert seen == [(SwappedMoE, dims, {"training": "t", "dump_folder": ""})]
    with pytest.raises(TypeError, match="ep_mesh comes from torchtitan's parallel_dims"):
        swapped_model_spec(spec, ep_mesh=None)


def test_swapped_model_spec_refuses_tensor_parallelism_and_passes_a_stage_without_moe(monkeypatch):
    """Under torchtitan's tensor parallelism (its default ``spmd_types`` backend shards the gate's and shared
    experts' weights as plain tensors) the swapped MoE would compute on shards: the spec refuses TP on every rank,
    and the layer refuses weights sharded behind its back at its first forward. A pipeline stage without MoE
    layers (DeepSeek-V3's first stage) is parallelized unswapped, and its process still runs the step's check
    (a collective its peers' stages run)."""
    import dataclasses

    from torchtitan.models.deepseek_v3 import model_registry

    from spmdmoe.integrations import _bound
    from spmdmoe.integrations.torchtitan import swapped_model_spec

    spec = swapped_model_spec(dataclasses.replace(model_registry("debugmodel"), parallelize_fn=lambda m, **kw: m))
    tp = type("TP2", (NoParallelism,), {"tp": 2})()
    with pytest.raises(MoEConfigError, match="tensor_parallel_degree=2"):
        spec.parallelize_fn(_meta_model(), parallel_dims=tp)
    model = build(debug_config(), swap_moe, 0)
    shared = model.layers["1"].moe.shared_experts
    shared.w1.weight = torch.nn.Parameter(shared.w1.weight.detach()[: shared.w1.weight.shape[0] // 2])
    with pytest.raises(MoEConfigError, match="tensor_parallel_degree=1"):
        model(torch.randint(0, 64, (1, 8)))
    checks = []
    monkeypatch.setattr(_bound, "check_errors", lambda: checks.append(1))
    monkeypatch.setattr(_bound, "_SWAPPED", [])
    monkeypatch.setattr(_bound, "_JOINED", [])
    stage = torch.nn.Sequential(torch.nn.Linear(4, 4))  # no MoE: nothing swapped, nothing refused
    assert spec.parallelize_fn(stage, parallel_dims=NoParallelism()) is stage
    torch.optim.SGD(stage.parameters(), lr=0.1).step()
    assert checks == [1]


def test_torch_compat_gives_torchtitan_what_it_takes_from_torch_2_13():
    """``spmdmoe/integrations/_torch_compat.py`` (applied by importing the integration): on torch 2.11 the names
    torchtitan 0.3.0 uses exist and take its keywords (``fully_shard(dp_mesh_dims=None)`` shards as without it,
    ``create_block_mask(separate_full_blocks=...)``); on 2.13 torch's own. Applying it again changes nothing."""
    import torch.distributed.fsdp as fsdp
    import torch.nn.attention.flex_attention as flex
    from torch.distributed.device_mesh import init_device_mesh

    from spmdmoe.integrations._torch_compat import shim_torch
    from spmdmoe.testing import single_process_group

    before = (fsdp.fully_shard, flex.create_block_mask, fsdp.DataParallelMeshDims)
    shim_torch()
    assert (fsdp.fully_shard, flex.create_block_mask, fsdp.DataParallelMeshDims) == before
    assert not torch.compiler._is_non_strict_tracing()
    single_process_group()
    layer = fsdp.fully_shard(torch.nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1,)), dp_mesh_dims=None)
    assert isinstance(layer, fsdp.FSDPModule)
    mask = flex.create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 128, 128, device="cpu",
                                  separate_full_blocks=False)
    assert mask.shape[-2:] == (128, 128)


def test_counts_doubled_where_torchtitan_checkpoints_and_halves():
    """torchtitan's load-balancing hook halves a checkpointed block's counts (its own MoE counts the recompute
    too): through ``swapped_model_spec``, a swapped layer in a block torchtitan's parallelize wrapped with
    non-reentrant checkpointing doubles its counts before the hook, so the hook reads the true ones; the others
    keep theirs."""
    import dataclasses

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
    from torchtitan.models.deepseek_v3 import model_registry

    from spmdmoe.integrations.torchtitan import swapped_model_spec

    def parallelize(model, **kwargs):  # as torchtitan's apply_ac wraps a block
        model.layers["1"] = checkpoint_wrapper(model.layers["1"], checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        return model

    spec = swapped_model_spec(dataclasses.replace(model_registry("debugmodel"), parallelize_fn=parallelize))
    model = spec.parallelize_fn(_meta_model(), parallel_dims=NoParallelism())
    moes = [m for m in model.modules() if isinstance(m, SwappedMoE)]
    assert [m.recomputed for m in moes] == [True] + [False] * (len(moes) - 1)
    for m in moes:
        m.tokens_per_expert_E = torch.arange(m.tokens_per_expert_E.numel())
        m.before_step()
    assert moes[0].tokens_per_expert_E.tolist() == [2 * i for i in range(moes[0].tokens_per_expert_E.numel())]
    assert all(m.tokens_per_expert_E.tolist() == list(range(m.tokens_per_expert_E.numel())) for m in moes[1:])
