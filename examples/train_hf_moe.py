"""Train a Hugging Face transformers Qwen3-MoE model with spmdmoe's MoE layers, SP x EP over every process.

    torchrun --nproc-per-node 4 examples/train_hf_moe.py                    # CPU / gloo: a tiny model
    torchrun --nproc-per-node 4 examples/train_hf_moe.py --device cuda      # NCCL: Qwen3-30B-A3B-shaped blocks

The model comes from transformers' own ``Qwen3MoeConfig`` with random weights. On CPU it is tiny. With ``--device
cuda`` it takes Qwen3-30B-A3B's shape per block (hidden 2048, 32 query and 4 key-value heads of 128, 128
experts of 768, top 8), cut to ``--layers`` blocks. Three calls make it parallel:

* ``swap_moe(model, sp_mesh=world, ep_mesh=world)`` gives every MoE block spmdmoe's layer, its experts split
  over the processes (EP);
* ``sequence_parallel(model, world)`` runs the rest of the model on each process's chunk of the tokens (SP):
  attention gathers keys and values, the dense weights' gradients are summed;
* ``sp_batch(ids, world)`` hands each process its chunk of the batch, at any length (the default 509 tokens
  do not divide by 4).

Every process then holds the one-process gradients; AdamW steps as usual. Parameters stay fp32; on the GPU the
forward runs under ``torch.autocast(bfloat16)``. Each step prints the batch's loss (the processes' shares
summed). The last line gives the training throughput: tokens a second over the timed steps (all but the first
two), and per GPU.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

import spmdmoe


def build(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    if args.device == "cuda":  # Qwen3-30B-A3B per block (transformers' defaults), --layers of them
        config = Qwen3MoeConfig(num_hidden_layers=args.layers, vocab_size=args.vocab, max_position_embeddings=32768)
    else:
        config = Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                                num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                num_hidden_layers=args.layers, vocab_size=args.vocab)
    config.use_cache = False
    torch.manual_seed(args.seed)  # the same weights on every process
    return Qwen3MoeForCausalLM(config).to(device)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=2, help="decoder blocks")
    ap.add_argument("--batch", type=int, default=None, help="sequences a step (default 2 on CPU, 8 on GPUs)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens a sequence (default 509 on CPU, 4096 on GPUs)")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary (default 256 on CPU, Qwen3's 151936 on GPUs)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    gpu = args.device == "cuda"
    args.batch = args.batch or (8 if gpu else 2)
    args.seq_len = args.seq_len or (4096 if gpu else 509)
    args.vocab = args.vocab or (151936 if gpu else 256)
    if "RANK" not in os.environ:
        print("train_hf_moe.py runs on several processes; launch it with torchrun, e.g.\n"
              "    torchrun --nproc-per-node 4 examples/train_hf_moe.py", file=sys.stderr)
        return 2
    from spmdmoe.integrations.transformers import swap_moe
    from spmdmoe.integrations.transformers_sp import sequence_parallel, sp_batch

    if gpu:
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(minutes=10))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
        torch.set_num_threads(1)
    world = spmdmoe.init_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("world",))
    rank, size = dist.get_rank(), dist.get_world_size()

    model = build(args, device)
    swap_moe(model, sp_mesh=world, ep_mesh=world)  # every MoE block: spmdmoe's layer, SP x EP on one axis
    sequence_parallel(model, world)                # the rest of the model on this process's chunk
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"Qwen3-MoE, {args.layers} blocks, {params / 1e6:,.1f} M parameters on this process; {size} processes "
              f"({'NCCL' if gpu else 'gloo'}), SP x EP over all; {args.batch} x {args.seq_len} tokens a step")
    g = torch.Generator().manual_seed(args.seed + 1)
    data = [torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=g) for _ in range(2)]
    timed, tokens = 0.0, args.batch * args.seq_len
    for step in range(args.steps):
        batch = sp_batch(data[step % len(data)].to(device), world)  # the same batch in, this rank's chunk out
        if gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=gpu):
            loss = model(**batch).loss  # this process's share of the batch's mean loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)  # the batch's loss: the shares summed
        value = total.item()  # (waits for the step)
        if step >= 2:
            timed += time.perf_counter() - start
        if rank == 0:
            print(f"step {step}: loss {value:.4f}")
    if rank == 0 and args.steps > 2:
        rate = tokens * (args.steps - 2) / timed
        peak = f", peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if gpu else ""
        print(f"tokens/s: {rate:,.0f} ({rate / size:,.0f} per {'GPU' if gpu else 'process'}){peak}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    spmdmoe.shutdown(main())
