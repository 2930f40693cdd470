"""Exposed SP gradient communication: sums waited for at their use, per layer, or per block.

    torchrun --nproc-per-node N benchmarks/sp_grad_overlap.py [--tokens 8192] [--layers 2] [--out FILE]
    torchrun --nproc-per-node 2 benchmarks/sp_grad_overlap.py --smoke           # CPU/gloo, tiny, no timing
    torchrun --nproc-per-node 2 benchmarks/sp_grad_overlap.py --same-gpu        # gloo, every rank on cuda:0

``--same-gpu`` checks the CUDA stream handling of the joins with one GPU: the dense blocks only
(gloo carries CUDA all-reduces, not the MoE layer's collectives), fp32, D=1024, 4096 rows per rank;
a sum read before its copy back from gloo would give different gradients.

A stack of ``--layers`` blocks, each ``x + mlp(x)`` (a dense stand-in for attention: D -> 4D -> D,
``replicate_grads``) then ``h + moe(h)`` (SP local, no EP: the experts are replicated along SP, so
every expert gradient, 3*E*F*D values per layer, is summed over SP). SP = N, ``--tokens`` rows per
rank, bf16, D=2048, F=1408, E=64, K=8. Candidates, interleaved (``timing.timed``), median, max over
ranks, one fwd+bwd step each:

* ``no SP sums``: the same compute with every SP sum switched off (wrong gradients): the floor;
* ``wait at use``: ``grad_overlap = False``, ``replicate_grads(overlap=False)``: each sum blocks the
  backward where it is made (before this work);
* ``layer join``: the default: each MoE layer's sums wait at the layer's input;
* ``block join``: ``overlap_grads`` on every block: they wait at the block's input, behind the
  dense stand-in's backward.

Exposed communication = step - floor; the all-reduce of the same bytes alone is timed too, so
``hidden = 1 - exposed / alone``. Before the timing, the three real candidates' gradients are
compared: within ``1e-5`` (fp32) or ``3e-2`` (bf16) of the largest, as a join changes the
order in which autograd adds up an input's gradient (the SP sums themselves are the same ``a + b``).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn

import spmdmoe
from spmdmoe.moe import MoE, MoEConfig, overlap_grads, parallelize_moe, replicate_grads

MODES = ("no SP sums", "wait at use", "layer join", "block join")


class Block(nn.Module):
    def __init__(self, moe: "nn.Module | None", D: int, mode: str, sp: dist.ProcessGroup):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D, bias=False), nn.GELU(), nn.Linear(4 * D, D, bias=False))
        if mode != "no SP sums":
            replicate_grads(self.mlp, sp, overlap=mode != "wait at use")
        self.moe = moe

    def forward(self, x: "spmdmoe.SPMDTensor | torch.Tensor") -> "spmdmoe.SPMDTensor | torch.Tensor":
        local = x.local if isinstance(x, spmdmoe.SPMDTensor) else x
        local = local + self.mlp(local)
        if self.moe is None:  # --same-gpu: gloo cannot carry the MoE layer's CUDA collectives
            return local
        x = x.with_local(local)
        return x.with_local(local + self.moe(x).local)


def build(cfg: MoEConfig, layers: int, mode: str, dtype: torch.dtype, device: torch.device,
          dense_only: bool) -> nn.ModuleList:
    sp = dist.group.WORLD
    torch.manual_seed(0)  # the same weights on every rank and for every candidate
    blocks = []
    for _ in range(layers):
        moe = None if dense_only else parallelize_moe(MoE(cfg).to(device=device, dtype=dtype), sp_mesh=sp)
        block = Block(moe, cfg.dim, mode, sp)
        block.mlp.to(device=device, dtype=dtype)
        if moe is not None:
            if mode == "no SP sums":
                moe.sp_synced, moe.experts.grad_axis = (), None
            moe.grad_overlap = mode != "wait at use"
        blocks.append(overlap_grads(block) if mode == "block join" else block)
    return nn.ModuleList(blocks)


def step(stack: nn.ModuleList, x: spmdmoe.SPMDTensor, g: torch.Tensor) -> None:
    stack.zero_grad(set_to_none=True)
    h = x
    for block in stack:
        h = block(h)
    (_local(h).float() * g).sum().backward()


def _local(h: "spmdmoe.SPMDTensor | torch.Tensor") -> torch.Tensor:
    return h.local if isinstance(h, spmdmoe.SPMDTensor) else h


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU/gloo, tiny dims, fp32: the gradient check only")
    ap.add_argument("--same-gpu", action="store_true", help="gloo, every rank on cuda:0: the gradient check only")
    args = ap.parse_args()
    check_only = args.smoke or args.same_gpu
    if args.smoke:
        dist.init_process_group("gloo")
        device, dtype, (D, F, E, K) = torch.device("cpu"), torch.float32, (32, 16, 8, 2)
    elif args.same_gpu:  # the dense blocks only (gloo carries CUDA all-reduces, not the MoE layer's collectives)
        dist.init_process_group("gloo")
        torch.cuda.set_device(0)
        device, dtype, (D, F, E, K) = torch.device("cuda", 0), torch.float32, (1024, 128, 16, 4)
    else:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device, dtype, (D, F, E, K) = torch.device("cuda", local), torch.bfloat16, (2048, 1408, 64, 8)
        dist.init_process_group("nccl", device_id=device)
    n, rank, L = dist.get_world_size(), dist.get_rank(), args.layers
    T = args.tokens if not check_only else (37 if args.smoke else 4096)
    cfg = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=K)
    gen = torch.Generator(device=device).manual_seed(1 + rank)
    local_x = torch.randn(T, D, device=device, dtype=dtype, generator=gen).requires_grad_()
    x = local_x if args.same_gpu else spmdmoe.from_local(local_x, dist.group.WORLD, global_tokens=None)
    g = torch.randn(T, D, device=device, dtype=torch.float32, generator=gen)
    stacks = {mode: build(cfg, L, mode, dtype, device, args.same_gpu) for mode in MODES}

    grads = {}
    for mode in MODES[1:]:
        step(stacks[mode], x, g)
        grads[mode] = [p.grad.clone() for p in stacks[mode].parameters()]
    want = grads["wait at use"]
    worst = max(float((a.float() - b.float()).abs().max()) for mode in MODES[2:] for a, b in zip(grads[mode], want))
    bitwise = all(torch.equal(a, b) for mode in MODES[2:] for a, b in zip(grads[mode], want))
    ok = worst <= (1e-5 if dtype == torch.float32 else 3e-2) * max(float(w.float().abs().max()) for w in want)
    if check_only:
        if rank == 0:
            print(f"OK: {'smoke' if args.smoke else 'same GPU'}, {n} ranks, {device}, gradients of the three "
                  f"anchorings equal: {ok} (bitwise {bitwise}, worst {worst:.3g})", flush=True)
        assert ok
        return

    from timing import report, timed

    t = timed({mode: (lambda s=stacks[mode]: step(s, x, g)) for mode in MODES}, args.iters, args.reps)
    numel = sum(p.numel() for p in stacks["wait at use"].parameters())
    flat = torch.zeros(numel, device=device, dtype=dtype)
    alone = timed({"all-reduce": lambda: dist.all_reduce(flat)}, args.iters, args.reps)["all-reduce"]
    floor = t["no SP sums"]
    lines = [f"device: {n}x {torch.cuda.get_device_name()}, torch {torch.__version__}, SP={n} (local, no EP), "
             f"D={D} F={F} E={E} K={K}, T/rank={T}, {L} blocks, bf16; SP sums {numel * 2 / 2**30:.2f} GiB per step, "
             f"all-reduced alone {alone:.3f} ms; gradients equal across the three waits: {ok} (bitwise {bitwise})",
             "", "| candidate | step ms | exposed comm ms | hidden |", "|---|---|---|---|"]
    for mode, ms in t.items():
        exposed = ms - floor
        hidden = "" if mode == "no SP sums" else f"{100 * (1 - exposed / alone):.0f} %"
        lines.append(f"| {mode} | {ms:.3f} | {exposed:.3f} | {hidden} |")
    if rank == 0:
        report("\n".join(lines), args.out)


if __name__ == "__main__":
    spmdmoe.shutdown(main())  # flush, tear the groups down, leave: no gloo exit abort
