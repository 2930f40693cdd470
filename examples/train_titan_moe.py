"""Train torchtitan's DeepSeek-V3 with spmdmoe's MoE layers, through torchtitan's own ``parallelize``.

    torchrun --nproc-per-node 4 examples/train_titan_moe.py                  # CPU / gloo: the debug model, 3 blocks
    torchrun --nproc-per-node 4 examples/train_titan_moe.py --device cuda --flavor 16B --layers 8
    ... --ep 2                 # dp 2 x ep 2 for the experts (default: EP over every process)
    ... --moe torchtitan       # torchtitan's own MoE, for comparison (the same script, the same numbers)
    ... --cp 2                 # torchtitan's context parallelism: dp_shard = processes / 2 x cp 2 (GPUs)

One line makes the swap: ``swapped_model_spec(model_registry(flavor))``. Its ``parallelize_fn`` gives every MoE
block spmdmoe's layer (EP on torchtitan's "ep" mesh), then runs torchtitan's own ``parallelize_fn`` as its
Trainer calls it: FSDP over every process, EP, activation checkpointing (``--ac``, torchtitan's default
``selective``), per-block compile (``--compile``). The model is built on meta and initialised by torchtitan's
``init_states`` from one seed, so ``--moe torchtitan`` starts from the same weights.

Attention is torchtitan's causal SDPA (its FlexAttention has no backward on CPU; ``--attention flex`` takes the
flavor's own FlexAttention, with torchtitan's document-causal masks from the positions, on GPUs). Each process trains
on its own random tokens (a few fixed batches, cycled: the loss falls as the model learns them). The loss is the sum
over the step's tokens over their count, as torchtitan's Trainer computes it. The last line gives tokens a second per
GPU over the timed steps (all but the first two) and MFU by torchtitan's own count
(``get_nparams_and_flops``: 6 x active non-embedding parameters per token, plus attention).

``--cp N`` applies torchtitan's context parallelism as its Trainer does (``partial_dtensor`` backend): the mesh
``ParallelDims(dp_shard=processes / N, cp=N)``, FSDP over dp_shard x cp, EP cut from the same ranks (so the MoE
exchange crosses the CP axis); ``parallelize_fn`` wraps each block's inner attention (``apply_cp_to_forward``: ring
SDPA through DTensor, or FlexAttention with K/V all-gathered); each step's batch, labels and positions (and Flex
masks) go through ``prepare_context_parallel_input`` (head-tail load balancing for SDPA, PTRR for Flex). The N
processes of a CP group get the same batch (seeded by the data-parallel rank) and each keeps its share of every
sequence (with SDPA a head and a tail chunk); the loss is each process's sum over its tokens over the step's tokens,
counted once, and tokens/s counts each token once. DTensor's ring SDPA runs cuDNN, flash or memory-efficient kernels;
on CPU DTensor's SDPA takes the math path and fails, so ``--cp`` > 1 runs on GPUs.

torchtitan 0.3.0 is written against torch 2.13. On an older torch its FSDP of the experts under EP (FSDP2's
per-parameter meshes) does not exist; this script then gives the routed experts an FSDP unit of their own
(torchtitan 0.2's layout, ``benchmarks/titan_expert_fsdp.py`` in this repository), which per-block compile
cannot trace.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist

import spmdmoe

# torch < 2.13 only: torchtitan 0.3.0's FSDP of the experts under EP, in its 0.2 layout (see the docstring)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from titan_expert_fsdp import fsdp_meshes_per_parameter, nested_expert_fsdp  # noqa: E402

PEAK_BF16_TFLOPS = 989.5  # H100 and H200 SXM, dense bf16


def parallel_dims(ep: int, device: str, backend: Optional[str] = None, cp: int = 1):  # type: ignore[no-untyped-def]
    """torchtitan's ``ParallelDims`` (FSDP over every process, EP ``ep``, CP ``cp``: dp_shard = processes / cp) and
    ``ParallelismConfig``, with its SPMD ``backend`` (default: torchtitan's own where this torch and the device allow
    it; ``partial_dtensor`` with CP, the backend whose CP torchtitan's Trainer applies by ``apply_cp_to_forward``)."""
    import torchtitan.distributed.parallel_dims as dims_module
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed.utils import set_spmd_backend

    world = dist.get_world_size()
    if device == "cpu":  # torchtitan assumes an accelerator
        dims_module.device_type = "cpu"
    # torchtitan's default backend needs torch 2.13's FSDP2, and NCCL (its all-to-all is uneven); else partial_dtensor
    default = device == "cuda" and fsdp_meshes_per_parameter() and cp == 1
    backend = backend or (ParallelismConfig().spmd_backend if default else "partial_dtensor")
    set_spmd_backend(backend)
    dims = dims_module.ParallelDims(dp_replicate=1, dp_shard=world // cp, cp=cp, tp=1, pp=1, ep=ep, world_size=world,
                                    spmd_backend=backend)
    dims.build_mesh()
    return dims, ParallelismConfig(expert_parallel_degree=ep, data_parallel_shard_degree=world // cp,
                                   context_parallel_degree=cp, spmd_backend=backend)


def build(args: argparse.Namespace, dims, parallelism, device: str):  # type: ignore[no-untyped-def]
    """The model: torchtitan's flavor cut to ``--layers`` blocks, swapped (or not), parallelized, initialised;
    and its FLOPs per token (torchtitan's count)."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.deepseek_v3 import model_registry
    from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config

    from spmdmoe.integrations.torchtitan import swapped_model_spec

    spec = model_registry(args.flavor)
    if args.moe == "spmdmoe":
        spec = swapped_model_spec(spec, ep_mode=args.ep_mode, expert_precision=args.expert_precision)
    config = spec.model
    config.layers = config.layers[:args.layers]
    if getattr(args, "attention", "sdpa") == "sdpa":  # else the flavor's own FlexAttention
        for layer in config.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    set_deepseek_v3_sharding_config(config, enable_sp=False, enable_ep=dims.ep > 1)
    with torch.device("meta"):
        model = config.build()
    _, flops_per_token = config.get_nparams_and_flops(model, args.seq)
    if dims.ep > 1 and nested_expert_fsdp() and args.compile:  # the patch: torch < 2.13 only (else it does nothing)
        raise SystemExit("--compile with EP needs torch 2.13: on this torch the experts' own FSDP unit breaks "
                         "torchtitan's fullgraph compile of each block at its hooks")
    ac = {"none": None, "full": FullAC.Config(), "selective": SelectiveAC.Config()}[args.ac]
    model = spec.parallelize_fn(model, parallel_dims=dims, training=TrainingConfig(), parallelism=parallelism,
                                compile_config=CompileConfig(enable=args.compile), ac_config=ac, dump_folder="")
    if device == "cpu":  # gloo lacks FSDP2's PREMUL_SUM / AVG
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device=device)
    torch.manual_seed(args.seed)  # every process: the same weights (FSDP keeps its shard)
    with torch.no_grad():
        model.init_states(buffer_device=torch.device(device))
    return model, config.vocab_size, flops_per_token


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--moe", choices=["spmdmoe", "torchtitan"], default="spmdmoe")
    ap.add_argument("--flavor", default=None, help="torchtitan's DeepSeek-V3 flavor (default debugmodel; 16B on GPUs)")
    ap.add_argument("--layers", type=int, default=3, help="its first blocks (the first dense)")
    ap.add_argument("--ep", type=int, default=None, help="EP degree (default: every process)")
    ap.add_argument("--cp", type=int, default=1, help="torchtitan's context parallelism degree (GPUs)")
    ap.add_argument("--attention", choices=["sdpa", "flex"], default="sdpa",
                    help="torchtitan's causal SDPA, or the flavor's FlexAttention (GPUs)")
    ap.add_argument("--ep-mode", choices=["sync", "sync_free"], default="sync", help="spmdmoe's EP transport")
    ap.add_argument("--expert-precision", choices=["bf16", "fp8_rowwise"], default="bf16", help="spmdmoe's experts")
    ap.add_argument("--batch", type=int, default=None,
                    help="sequences a process (with --cp: a CP group) a step (default 2; 4 on GPUs)")
    ap.add_argument("--seq", type=int, default=None, help="tokens a sequence (default 64; 4096 on GPUs)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--ac", choices=["none", "full", "selective"], default="selective", help="activation checkpointing")
    ap.add_argument("--compile", action="store_true", help="compile each block as torchtitan does")
    ap.add_argument("--lr", type=float, default=8e-4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    gpu = args.device == "cuda"
    args.flavor = args.flavor or ("16B" if gpu else "debugmodel")
    args.batch = args.batch or (4 if gpu else 2)
    args.seq = args.seq or (4096 if gpu else 64)
    if "RANK" not in os.environ:
        print("train_titan_moe.py runs under torchrun, e.g.\n"
              "    torchrun --nproc-per-node 4 examples/train_titan_moe.py", file=sys.stderr)
        return 2
    import spmdmoe.integrations.torchtitan  # noqa: F401  (before torchtitan: on torch < 2.13 it supplies names)

    if gpu:
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local), timeout=datetime.timedelta(minutes=10))
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
        torch.set_num_threads(1)
    device = f"cuda:{torch.cuda.current_device()}" if gpu else "cpu"
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.cp < 1 or world % args.cp or (args.cp > 1 and args.seq % (2 * args.cp)):
        raise SystemExit(f"--cp {args.cp} must divide the {world} processes, and 2 x cp the sequence ({args.seq}: "
                         "torchtitan's head-tail load balancer cuts it into 2 x cp chunks)")
    if args.cp > 1 and args.attention == "flex" and args.seq % (128 * args.cp):
        raise SystemExit(f"--attention flex --cp {args.cp}: the sequence ({args.seq}) must divide into cp x "
                         "FlexAttention's 128-token blocks (torchtitan's PTRR load balancer deals out whole blocks)")
    dims, parallelism = parallel_dims(args.ep or world, "cuda" if gpu else "cpu", cp=args.cp)
    model, vocab, flops_per_token = build(args, dims, parallelism, device)
    from torchtitan.components.optimizer import register_moe_load_balancing_hook
    from torchtitan.distributed.context_parallel import prepare_context_parallel_input

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    register_moe_load_balancing_hook(optimizer, [model], dims)  # the aux-loss-free bias update, as its Trainer
    if rank == 0:
        print(f"torchtitan DeepSeek-V3 {args.flavor}, {args.layers} blocks, MoE: {args.moe}; {world} processes "
              f"({'NCCL' if gpu else 'gloo'}): FSDP {world}, EP {dims.ep}"
              f"{f', CP {dims.cp} (dp_shard {dims.dp_shard})' if dims.cp > 1 else ''}; AC {args.ac}"
              f"{', blocks compiled' if args.compile else ''}"
              f"{', FlexAttention' if args.attention == 'flex' else ''}; {args.batch} x {args.seq} tokens a "
              + (f"CP group a step ({args.batch} x {args.seq // dims.cp} a process)" if dims.cp > 1
                 else "process a step"))
    batch_mesh = dims.get_optional_mesh("batch")  # the data-parallel ranks; a CP group shares one
    dp_rank = batch_mesh.get_local_rank() if batch_mesh is not None else 0  # (= rank without CP)
    g = torch.Generator().manual_seed(args.seed + 1 + dp_rank)  # each data-parallel rank its own batches
    data = [torch.randint(0, vocab, (args.batch, args.seq + 1), generator=g).to(device) for _ in range(2)]
    tokens = args.batch * args.seq * (world // dims.cp)  # a step, all processes, each token once
    positions = torch.arange(args.seq, device=device).expand(args.batch, -1)  # as torchtitan's data loader gives
    timed = 0.0
    for step in range(args.steps):
        batch = data[step % len(data)]
        if gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        inputs, labels, extra = batch[:, :-1], batch[:, 1:], {}
        if args.attention == "flex" or dims.cp > 1:  # as torchtitan's Trainer.post_dataloading_process
            extra["positions"] = positions
            if args.attention == "flex":
                extra["attention_masks"] = model.get_attention_masks(positions=positions)
            if dims.cp > 1:  # each process: its head and tail chunks of every sequence
                inputs, labels, extra = prepare_context_parallel_input(
                    inputs, labels, extra, dims.get_mesh("cp"), torch.device(device),
                    "ptrr" if args.attention == "flex" else parallelism.context_parallel_load_balancer)
        logits = model(inputs, **extra)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                                                 reduction="sum") / tokens
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total = loss.detach()
        dist.all_reduce(total)  # the step's loss: every process's share
        value = total.item()  # (waits for the step)
        if step >= 2:
            timed += time.perf_counter() - start
        if rank == 0:
            print(f"step {step}: loss {value:.4f}")
    if rank == 0 and args.steps > 2:
        per_gpu = tokens * (args.steps - 2) / timed / world
        extra = ""
        if gpu:
            mfu = per_gpu * flops_per_token / (PEAK_BF16_TFLOPS * 1e12)
            extra = (f", MFU {mfu:.1%} (of {PEAK_BF16_TFLOPS} TFLOP/s), peak memory "
                     f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
        print(f"tokens/s per {'GPU' if gpu else 'process'}: {per_gpu:,.0f}{extra}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    spmdmoe.shutdown(main())
