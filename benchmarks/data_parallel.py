"""Data-parallel wrappers around a parallel MoE layer, and the cost of crossing the DTensor boundary.

    torchrun --nproc-per-node N benchmarks/data_parallel.py [--tokens 8192] [--out FILE]

Part 1, one training step (fwd + bwd + gradient reduction) of
``parallelize_moe(moe, dp_mesh=world)`` (bf16, D=2048, F=1408, E=64, K=6, T
tokens per rank, every rank its own batch). With EP absent every parameter's
reduction is "sum over dp, divide by dp", which plain DDP also does, so the
rows compare like for like:

* torch DDP: ``DistributedDataParallel`` with its default all-reduce hook;
* spmdmoe ddp: ``spmdmoe.moe.ddp`` (the per-parameter comm hook);
* reduce_grads: no wrapper, one flattened all-reduce per dtype after backward;
* FSDP2: ``spmdmoe.moe.fully_shard_moe`` (adds the parameter all-gathers);
* no reduction: the step without any gradient communication (the floor).

Part 2, host time per call of the interop functions on a (T, D) activation:
``from_dtensor`` (checked: one all-gather of 8 int64 + one host copy), on a
DTensor made by ``to_dtensor`` (check skipped), ``to_dtensor``, against
DTensor's own ``from_local`` with ``run_check=True`` and ``to_local``.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Shard as DShard
from torch.nn.parallel import DistributedDataParallel

import spmdmoe
from spmdmoe.dtensor import from_dtensor, to_dtensor
from spmdmoe.moe import MoE, MoEConfig, ddp, fully_shard_moe, parallelize_moe, reduce_grads
from timing import host_us, report, timed


def _layer(cfg: MoEConfig, world) -> torch.nn.Module:
    torch.manual_seed(0)
    return parallelize_moe(MoE(cfg).to("cuda", torch.bfloat16), dp_mesh=world)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    n = dist.get_world_size()
    world = spmdmoe.init_mesh("cuda", (n,), mesh_dim_names=("dp",))
    cfg = MoEConfig(dim=2048, hidden_dim=1408, num_experts=64, top_k=6)
    x = torch.randn(args.tokens, cfg.dim, device="cuda", dtype=torch.bfloat16)

    models = {
        "torch DDP": DistributedDataParallel(_layer(cfg, world), process_group=world.get_group(), broadcast_buffers=False),
        "spmdmoe ddp": ddp(_layer(cfg, world)),
        "reduce_grads": _layer(cfg, world),
        "FSDP2 (fully_shard_moe)": fully_shard_moe(_layer(cfg, world)),
        "no reduction": _layer(cfg, world),
    }

    def step(name: str, model: torch.nn.Module):
        def run() -> None:
            model.zero_grad(set_to_none=False)
            model(x).float().pow(2).mean().backward()
            if name == "reduce_grads":
                reduce_grads(model)
        return run

    ms = timed({k: step(k, m) for k, m in models.items()}, iters=5, reps=15)
    grad_bytes = sum(p.numel() * p.element_size() for p in models["no reduction"].parameters())
    floor = ms["no reduction"]
    lines = [
        f"### data_parallel.py: {n}x {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d')}, T={args.tokens}/rank, bf16 D=2048 F=1408 E=64 K=6, "
        f"{grad_bytes / 1e9:.2f} GB of gradients per step",
        "",
        "| step (fwd+bwd+reduction) | ms | vs torch DDP | reduction ms over the floor |",
        "|---|---|---|---|",
    ]
    for k, v in ms.items():
        lines.append(f"| {k} | {v:.2f} | {v / ms['torch DDP']:.3f} | {v - floor:.2f} |")

    T = args.tokens
    act = torch.randn(spmdmoe.local_tokens(T, n, dist.get_rank()), 256, device="cuda")
    sx = spmdmoe.from_local(act, world, global_tokens=T)
    made = to_dtensor(sx)
    plain = DTensor.from_local(act, world, [DShard(0)], run_check=False, shape=made.shape, stride=made.stride())
    host = {
        "from_dtensor (checked)": host_us(lambda: from_dtensor(plain)),
        "from_dtensor (made by to_dtensor)": host_us(lambda: from_dtensor(made)),
        "to_dtensor": host_us(lambda: to_dtensor(sx)),
        "DTensor.from_local(run_check=True, shape=)": host_us(
            lambda: DTensor.from_local(act, world, [DShard(0)], run_check=True, shape=made.shape, stride=made.stride())
        ),
        "DTensor.to_local": host_us(lambda: plain.to_local()),
    }
    lines += ["", f"| interop call, ({T}, 256) fp32 on {n} ranks | host us per call |", "|---|---|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in host.items()]
    text = "\n".join(lines)
    if dist.get_rank() == 0:
        report(text, args.out)


if __name__ == "__main__":
    spmdmoe.shutdown(main())  # flush, tear the groups down, leave: no gloo exit abort
