"""Train a small MoE language model with SP x EP, then check it against one process.

    torchrun --nproc-per-node 4 examples/train_moe.py                 # CPU / gloo, SP 4 + EP 4
    torchrun --nproc-per-node 4 examples/train_moe.py --sp 2 --ep 2   # 2x2: SP 2, EP across the 2 batches
    torchrun --nproc-per-node 2 examples/train_moe.py --device cuda   # NCCL
    torchrun --nproc-per-node 4 examples/train_moe.py --expert-precision fp8_rowwise

A byte-level decoder (attention + MoE blocks) learns Python's own standard
library source (real text, shipped with every Python). The sequence length
(509 by default) does not divide by the SP size: spmdmoe handles the uneven
split exactly. Every rank holds its chunk of each sequence; attention
all-gathers keys and values over SP; each MoE block is ``parallelize_moe``'d;
the dense weights (attention, norms, embeddings) get their SP-partial
gradients summed by ``spmdmoe.moe.replicate_grads``. Each step clips the
gradients to ``--max-grad-norm`` (default 1.0; 0: off) by their global norm,
``spmdmoe.clip_grad_norm_``: each EP block and each replica counted once, the
same coefficient on every rank (the reference clips with torch's own
``clip_grad_norm_``). After training, rank 0
trains the same model in one process on the same data and prints both loss
curves: every step must agree within 1e-4 relative (fp32). With
``--expert-precision fp8_rowwise`` the parallel run's routed experts run in FP8
(emulated on CPU) while the reference keeps full precision: the table then
shows how closely FP8 training tracks it: the tolerance is then 1e-3 relative
(over the default 20 steps 1.2e-4 was measured on CPU, 6.4e-5 on one H200).
``--tolerance`` overrides either.

Only the public API is used: ``spmdmoe.shard``, ``all_gather``, ``with_local``, ``clip_grad_norm_``,
``spmdmoe.moe.{MoE, MoEConfig, parallelize_moe, replicate_grads, grad_reductions, reduce_grads}`` (the
data-parallel reduction of the ``--sp 2`` runs: each dp replica's mean loss, averaged).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import sysconfig
import time
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import spmdmoe
from spmdmoe.moe import MoE, MoEConfig, grad_reductions, parallelize_moe, reduce_grads, replicate_grads

CORPUS_MODULES = ["argparse", "textwrap", "difflib", "string", "shlex", "fractions", "heapq", "bisect", "calendar", "glob"]
Activation = Union[spmdmoe.SPMDTensor, torch.Tensor]


def corpus() -> tuple[np.ndarray, str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [root / f"{m}.py" for m in CORPUS_MODULES if (root / f"{m}.py").exists()]
    data = b"".join(f.read_bytes() for f in files)
    return np.frombuffer(data, dtype=np.uint8).astype(np.int64), f"{len(data):,} bytes of Python {sys.version.split()[0]} stdlib source ({len(files)} modules)"


def value(x: Activation) -> torch.Tensor:
    return x.local if isinstance(x, spmdmoe.SPMDTensor) else x


class Attention(nn.Module):
    """Causal multi-head attention; under SP, keys and values are all-gathered (exact T rows)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, h: Activation, positions: torch.Tensor) -> torch.Tensor:
        q, k, v = self.wqkv(value(h)).chunk(3, dim=-1)
        if isinstance(h, spmdmoe.SPMDTensor):  # every query needs every earlier key: gather K and V
            k, v = spmdmoe.all_gather(h.with_local(torch.cat([k, v], dim=-1))).local.chunk(2, dim=-1)
        split = lambda t: t.unflatten(-1, (self.heads, -1)).transpose(0, 1)  # noqa: E731  (H, T, hd)
        mask = positions[:, None] >= torch.arange(k.shape[0], device=k.device)[None, :]
        out = F.scaled_dot_product_attention(split(q), split(k), split(v), attn_mask=mask)
        return self.wo(out.transpose(0, 1).flatten(1))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, moe: MoEConfig):
        super().__init__()
        self.attn_norm, self.attn = nn.RMSNorm(dim), Attention(dim, heads)
        self.moe_norm, self.moe = nn.RMSNorm(dim), MoE(moe)

    def forward(self, x: torch.Tensor, like: Optional[spmdmoe.SPMDTensor], positions: torch.Tensor) -> torch.Tensor:
        wrap = (lambda t: t) if like is None else like.with_local  # the same layout as the tokens
        x = x + self.attn(wrap(self.attn_norm(x)), positions)
        return x + value(self.moe(wrap(self.moe_norm(x))))


class TinyMoELM(nn.Module):
    def __init__(self, args: argparse.Namespace, expert_precision: str = "bf16"):
        super().__init__()
        moe = MoEConfig(dim=args.dim, hidden_dim=args.hidden, num_experts=args.experts, top_k=args.top_k,
                        num_shared_experts=1, load_balance_coeff=1e-2, expert_precision=expert_precision)
        self.tok = nn.Embedding(256, args.dim)
        self.pos = nn.Embedding(args.seq_len, args.dim)
        self.blocks = nn.ModuleList(Block(args.dim, args.heads, moe) for _ in range(args.layers))
        self.norm = nn.RMSNorm(args.dim)
        self.head = nn.Linear(args.dim, 256, bias=False)

    def forward(self, ids: Activation) -> torch.Tensor:
        """Logits of this rank's tokens: ``ids`` is a sequence, or this rank's ``Shard`` of one."""
        like = ids if isinstance(ids, spmdmoe.SPMDTensor) else None
        start = 0 if like is None else spmdmoe.chunk_offset(like.global_tokens, like.axis.size, like.axis.rank)
        positions = torch.arange(start, start + value(ids).shape[0], device=value(ids).device)
        x = self.tok(value(ids)) + self.pos(positions)
        for block in self.blocks:
            x = block(x, like, positions)
        return self.head(self.norm(x))


def build(args: argparse.Namespace, device: torch.device, expert_precision: str = "bf16") -> TinyMoELM:
    torch.manual_seed(args.seed)
    model = TinyMoELM(args, expert_precision)
    for block in model.blocks:
        block.moe.init_weights(init_std=0.05)
    return model.to(device)


def batches(data: np.ndarray, args: argparse.Namespace) -> list[list[np.ndarray]]:
    """Per step, ``args.batch`` random windows of seq_len + 1 bytes (the same on every rank)."""
    rng = np.random.default_rng(args.seed)
    return [[data[o : o + args.seq_len + 1] for o in rng.integers(0, len(data) - args.seq_len - 1, args.batch)]
            for _ in range(args.steps)]


def expert_load(model: nn.Module) -> torch.Tensor:
    """Aux-loss-free bias update of every MoE block (its load summed over every rank that routed tokens: SP, EP
    and the dp replicas); returns the per-expert load summed over blocks."""
    return torch.stack([block.moe.update_expert_bias() for block in model.blocks]).sum(0)


def train_parallel(args, data, device, log) -> list[float]:
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = world // args.sp
    mesh = spmdmoe.init_mesh(device.type, (dp, args.sp), mesh_dim_names=("dp", "sp"))
    sp_mesh, dp_mesh = mesh["sp"], mesh["dp"]
    ep_mesh = None if args.ep == 1 else (sp_mesh if args.ep == args.sp and args.ep_dim == "sp" else dp_mesh)
    model = build(args, device, args.expert_precision)
    ep_options: dict = {}
    if ep_mesh is not None and args.ep_mode == "sync_free":  # EP across dp batches: T_max is not the layout's
        ep_options = {"ep_mode": "sync_free"} | ({} if ep_mesh is sp_mesh else
                                                 {"max_tokens": spmdmoe.padded_local_tokens(args.seq_len, args.sp)})
    replicas = dp_mesh if dp > 1 and ep_mesh is not dp_mesh else None  # batches EP does not already span
    for block in model.blocks:
        block.moe = parallelize_moe(block.moe, sp_mesh=sp_mesh, ep_mesh=ep_mesh, dp_mesh=replicas, **ep_options)
    replicate_grads(model, sp_mesh, include=lambda name: ".moe." not in name)
    # what each gradient still needs across the dp batches: dense ones a mean over every batch, the experts' over
    # the replicas of their block (none when EP spans the batches); one collective now, kept for every step
    reductions = grad_reductions(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    b = dp_mesh.get_local_rank()
    log(f"mesh: dp={dp} x sp={args.sp}, EP={args.ep} ({args.ep_mode})"
        f" ({'none' if ep_mesh is None else 'on the SP group' if ep_mesh is sp_mesh else 'across the dp batches'}),"
        f" {args.batch} sequences of {args.seq_len} tokens per step; "
        f"rank {rank} holds {spmdmoe.local_tokens(args.seq_len, args.sp, sp_mesh.get_local_rank())} tokens per sequence")
    losses, total = [], args.batch * args.seq_len
    mine = total // dp  # this replica's tokens a step: each replica's mean loss, reduce_grads averages them
    for step, windows in enumerate(batches(data, args)):
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        for w in windows[b::dp]:  # this dp replica's sequences
            seq = torch.from_numpy(w).to(device)
            ids, targets = spmdmoe.shard(seq[:-1], sp_mesh), spmdmoe.shard(seq[1:], sp_mesh).local
            ce = F.cross_entropy(model(ids), targets, reduction="sum")
            (ce / mine).backward()
            loss_sum += ce.detach()
        reduce_grads(model, reductions)  # the data-parallel reduction (or spmdmoe.moe.ddp / fully_shard_moe)
        norm = spmdmoe.clip_grad_norm_(model, args.max_grad_norm) if args.max_grad_norm > 0 else None
        opt.step()
        opt.zero_grad(set_to_none=False)
        load = expert_load(model)
        dist.all_reduce(loss_sum)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        losses.append(loss_sum.item() / total)
        clipped = "" if norm is None else f"grad norm {float(norm):.3f} | "
        log(f"step {step + 1:3d}/{args.steps} | loss {losses[-1]:.4f} | {total / dt:8,.0f} tok/s | {clipped}"
            f"expert load max {int(load.max())} min {int(load.min())} (of {total * args.top_k * args.layers // args.experts} even)")
    return losses


def train_single(args, data, device) -> list[float]:
    model = build(args, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    losses, total = [], args.batch * args.seq_len
    for windows in batches(data, args):
        loss_sum = 0.0
        for w in windows:
            seq = torch.from_numpy(w).to(device)
            ce = F.cross_entropy(model(seq[:-1]), seq[1:], reduction="sum")
            (ce / total).backward()
            loss_sum += ce.item()
        if args.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=False)
        expert_load(model)
        losses.append(loss_sum / total)
    return losses


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seq-len", type=int, default=509, help="tokens per sequence (need not divide by --sp)")
    ap.add_argument("--batch", type=int, default=2, help="sequences per step")
    ap.add_argument("--sp", type=int, default=None, help="SP size (default: all processes)")
    ap.add_argument("--ep", type=int, default=None, help="EP size: 1, the SP size, or processes / SP (default: --sp)")
    ap.add_argument("--ep-dim", choices=["sp", "dp"], default="sp", help="where EP runs when both would fit")
    ap.add_argument("--ep-mode", choices=["sync", "sync_free"], default="sync",
                    help="EP transport: one host read of the split sizes per layer, or static buffers and none")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-grad-norm", type=float, default=1.0,
                    help="clip the gradients to this global norm (spmdmoe.clip_grad_norm_; 0: no clipping)")
    ap.add_argument("--tolerance", type=float, default=None,
                    help="largest relative loss difference per step (default 1e-4; 1e-3 with FP8 experts)")
    ap.add_argument("--expert-precision", choices=["bf16", "fp8_rowwise"], default="bf16",
                    help="the parallel run's routed experts (the reference keeps full precision)")
    args = ap.parse_args()
    if args.tolerance is None:
        args.tolerance = 1e-3 if args.expert_precision == "fp8_rowwise" else 1e-4

    if "RANK" not in os.environ:
        print("train_moe.py runs on several processes; launch it with torchrun, e.g.\n"
              "    torchrun --nproc-per-node 4 examples/train_moe.py\n"
              "(or `make demo`, which also creates the environment)", file=sys.stderr)
        return 2
    if args.device == "cuda":
        local, per_node = int(os.environ["LOCAL_RANK"]), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        visible = torch.cuda.device_count()  # 0 without a GPU or with a CPU build of torch
        if visible < per_node:  # every rank of this node stops here, before any process group: none is left waiting
            if local != 0:  # (leave quietly: a rank failing first gets the others SIGTERMed by torchrun, and the
                return 0    # message below was cut that way once; the job still fails, by local rank 0's exit)
            found = "no CUDA GPU is visible" if visible == 0 else f"only {visible} CUDA GPU(s) are visible"
            build = "" if torch.backends.cuda.is_built() else f" (torch {torch.__version__} is a CPU build)"
            fix = "" if visible == 0 else f", or launch at most {visible} processes per node"
            print(f"error: --device cuda needs one CUDA GPU per process ({per_node} on this node), but {found}"
                  f"{build}; leave --device out to train on CPU (gloo){fix}", file=sys.stderr)
            return 2
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(minutes=10))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
        torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    args.sp = args.sp or world
    args.ep = args.sp if args.ep is None else args.ep
    dp = world // args.sp if world % args.sp == 0 else 0
    if not dp or args.ep not in {1, args.sp, dp} or args.experts % args.ep or args.batch % max(dp, 1):
        if rank == 0:
            wrong = (f"--sp must divide the {world} processes (found {args.sp})" if not dp else
                     f"--ep (default: --sp) must be 1, --sp={args.sp} or processes/sp={dp} and divide "
                     f"--experts={args.experts} (found {args.ep})" if args.ep not in {1, args.sp, dp}
                     or args.experts % args.ep else f"--batch must be divisible by processes/sp={dp} (found "
                     f"{args.batch})")
            print(f"error: {wrong}", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    args.ep_dim = "sp" if args.ep == args.sp and (args.ep_dim == "sp" or args.ep != dp) else "dp"

    log = (lambda m: print(m, flush=True)) if rank == 0 else (lambda m: None)
    data, about = corpus()
    log(f"spmdmoe {spmdmoe.__version__}: TinyMoELM on {world} processes ({args.device}, {dist.get_backend()}), "
        f"corpus: {about}")
    t0 = time.perf_counter()
    parallel = train_parallel(args, data, device, log)
    t_par = time.perf_counter() - t0

    ok = torch.zeros((), device=device)
    if rank == 0:
        log(f"\nsingle-process reference: the same model, data and optimizer on one {args.device} device ...")
        t1 = time.perf_counter()
        single = train_single(args, data, device)
        t_single = time.perf_counter() - t1
        rel = [abs(p - s) / abs(s) for p, s in zip(parallel, single)]
        log(f"\n| step | single-process loss | parallel loss ({world} processes) | relative difference |")
        log("|---:|---:|---:|---:|")
        for i, (s, p, r) in enumerate(zip(single, parallel, rel)):
            log(f"| {i + 1} | {s:.6f} | {p:.6f} | {r:.1e} |")
        verdict = "OK" if max(rel) <= args.tolerance else "FAILED"
        log(f"\nmax relative difference {max(rel):.2e} (tolerance {args.tolerance:.0e}): {verdict}")
        log("parallel losses, exact: " + " ".join(float.hex(p) for p in parallel))  # runs compared bit for bit
        log(f"loss {single[0]:.3f} -> {single[-1]:.3f}; wall time: parallel {t_par:.1f} s, "
            f"single process {t_single:.1f} s")
        ok.fill_(1.0 if verdict == "OK" else 0.0)
    dist.broadcast(ok, src=0)
    dist.destroy_process_group()
    return 0 if ok.item() == 1.0 else 1


if __name__ == "__main__":
    spmdmoe.shutdown(main())  # flush, tear the groups down, run atexit handlers, leave: no gloo exit abort
