"""Porting an MoE written in the usual per-expert ``nn.Linear`` style to spmdmoe (``docs/porting.md``).

Legend: ``T`` tokens, ``D`` model dim, ``F`` expert hidden dim, ``E`` experts, ``K`` top-k.

``MyMoE`` is the kind of layer found in many codebases (and in transformers 4's Mixtral / Qwen-MoE): a gate
``nn.Linear(D, E)``, softmax, top-k, renormalised weights, and a Python loop over ``nn.ModuleList`` experts,
each a SwiGLU of three ``nn.Linear``. The port is three steps: its options as an ``MoEConfig``
(:func:`config_of`), its weights in spmdmoe's layout and back (:func:`to_spmdmoe`, :func:`from_spmdmoe`),
and a check that both layers agree on random data, forward and backward. Run it:

    python examples/port_moe.py          # one process, CPU: prints the check and "OK"
    torchrun --nproc-per-node 4 examples/port_moe.py   # the same, then SP 4 + EP 4 against one process

Under torchrun the ported layer is parallelised with ``parallelize_moe`` (SP and EP over every rank), each
rank feeds its chunk of a sequence whose length does not divide by the world size (``spmdmoe.shard``), and
the output is compared with the single-process layer's rows.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import spmdmoe
from spmdmoe.moe import MoE, MoEConfig, parallelize_moe


class Expert(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)  # gate projection
        self.w3 = nn.Linear(dim, hidden, bias=False)  # up projection
        self.w2 = nn.Linear(hidden, dim, bias=False)  # down projection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MyMoE(nn.Module):
    """The layer to port: softmax router, top-k renormalised, experts in a loop."""

    def __init__(self, dim: int, hidden: int, experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim, hidden) for _ in range(experts))

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        probs_TE = torch.softmax(self.gate(x_TD).float(), dim=-1)
        weights_TK, ids_TK = probs_TE.topk(self.top_k, dim=-1)
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        out_TD = torch.zeros_like(x_TD)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(ids_TK == e)
            out_TD.index_add_(0, rows, expert(x_TD[rows]) * weights_TK[rows, slot, None].to(x_TD.dtype))
        return out_TD


def config_of(layer: MyMoE) -> MoEConfig:
    """Step 1, the router: softmax scores, the top-k renormalised (``route_norm``), the gate GEMM in the
    activations' dtype as ``MyMoE`` computes it (``router_dtype="input"``)."""
    E, D = layer.gate.weight.shape
    F_ = layer.experts[0].w1.weight.shape[0]
    return MoEConfig(dim=D, hidden_dim=F_, num_experts=E, top_k=layer.top_k, score_func="softmax", route_norm=True,
                     router_dtype="input")


def to_spmdmoe(state: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Step 2, the weights: per-expert ``experts.{i}.w1.weight`` (F, D) stacked into ``experts.w1`` (E, F, D),
    ``w3`` likewise, ``w2`` (D, F) into (E, D, F); the gate as it is."""
    stack = lambda name: torch.stack([state[f"experts.{i}.{name}.weight"] for i in range(num_experts)])  # noqa: E731
    return {"router.gate.weight": state["gate.weight"], "experts.w1": stack("w1"), "experts.w2": stack("w2"),
            "experts.w3": stack("w3")}


def from_spmdmoe(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The way back, for checkpoints the original code loads."""
    out = {"gate.weight": state["router.gate.weight"]}
    for name in ("w1", "w2", "w3"):
        for i, w in enumerate(state[f"experts.{name}"]):
            out[f"experts.{i}.{name}.weight"] = w
    return out


def ported(layer: MyMoE) -> MoE:
    moe = MoE(config_of(layer))
    moe.load_state_dict(to_spmdmoe(layer.state_dict(), len(layer.experts)), strict=False)  # + spmdmoe's buffers
    return moe


def check(layer: MyMoE, moe: MoE, T: int) -> float:
    """Step 3: both layers on the same random rows, forward and input gradient; the largest relative error."""
    x = torch.randn(T, layer.gate.in_features, generator=torch.Generator().manual_seed(1))
    g = torch.randn_like(x)
    errors = []
    outs = []
    for module in (layer, moe):
        xi = x.clone().requires_grad_()
        y = module(xi)
        (y * g).sum().backward()
        outs.append((y.detach(), xi.grad))
    for a, b in zip(*outs):
        errors.append(float((a - b).abs().max() / a.abs().max()))
    grads = from_spmdmoe({n: p.grad for n, p in moe.named_parameters()})
    errors += [float((p.grad - grads[n]).abs().max() / p.grad.abs().max()) for n, p in layer.named_parameters()]
    return max(errors)


def main() -> None:
    torch.manual_seed(0)
    layer = MyMoE(dim=64, hidden=32, experts=8, top_k=2)
    moe = ported(layer)
    error = check(layer, moe, T=53)
    assert from_spmdmoe(moe.state_dict()).keys() <= layer.state_dict().keys()
    print(f"ported MyMoE: output, input and weight gradients within {error:.1e} of the original (fp32)")
    assert error <= 1e-5, error
    if "RANK" in os.environ:  # under torchrun: SP x EP over every rank against the single-process layer
        torch.distributed.init_process_group("gloo")
        world = spmdmoe.init_mesh("cpu", (torch.distributed.get_world_size(),), mesh_dim_names=("world",))
        parallel = parallelize_moe(ported(layer), sp_mesh=world, ep_mesh=world)
        x = torch.randn(37, 64, generator=torch.Generator().manual_seed(2))  # 37 tokens: not a multiple of 4
        with torch.no_grad():
            y, full = parallel(spmdmoe.shard(x, world)).local, moe(x)
        error = float((y - spmdmoe.shard(full, world).local).abs().max() / full.abs().max())
        print(f"rank {world.get_local_rank()}: SP x EP over {world.size()} ranks within {error:.1e} of one process")
        assert error <= 1e-5, error
    print("OK")


if __name__ == "__main__":
    spmdmoe.shutdown(main())  # flush, tear the groups down, leave: no gloo exit abort
