"""A transformers Qwen3-MoE model, swapped (``spmdmoe.integrations.transformers.swap_moe``) against unswapped:
training step time and step peak memory, one process, candidates interleaved (issue 45).

The model is Qwen3-30B-A3B-shaped per block (hidden 2048, 32 query / 4 KV heads of 128, 128 experts of 768,
top-8, renormalised), cut to ``--layers`` blocks and a ``--vocab`` so it fits one GPU; bf16 weights, AdamW is
not run (a step is the model's forward with its own loss, router aux loss included, and backward). The
unswapped model runs transformers' default experts implementation (``grouped_mm``); a third candidate swaps with
FP8 experts (``--no-fp8`` drops it). Before the timing the bf16 models' losses are compared on the same batch
(within 2 %).

    python benchmarks/hf_model.py                 # GPU: prints a table (append it to RESULTS.md)
    python benchmarks/hf_model.py --smoke         # CPU, tiny, fp32: the loss check only

On the GPU host (no network) transformers comes from git-ignored wheels: ``bash benchmarks/hf_wheels.sh``
here writes them to ``.whl/`` (carry it), and ``gpu_session.sh hf`` installs and runs this.
"""

from __future__ import annotations

import argparse
import copy
import datetime

import torch

from spmdmoe.integrations.transformers import swap_moe
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM


def build(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> Qwen3MoeForCausalLM:
    torch.manual_seed(0)
    if args.smoke:
        shape = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, num_experts=16, num_experts_per_tok=4)
    else:
        shape = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8)
    config = Qwen3MoeConfig(vocab_size=args.vocab, num_hidden_layers=args.layers, norm_topk_prob=True,
                            router_aux_loss_coef=0.001, output_router_logits=True, **shape)
    with torch.device(device):
        return Qwen3MoeForCausalLM(config).to(dtype)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny, fp32: the loss check only")
    ap.add_argument("--no-fp8", action="store_true", help="no swapped FP8 candidate (expert_precision='fp8_rowwise')")
    args = ap.parse_args()
    if args.smoke:
        args.layers, args.vocab, args.batch, args.seq = 2, 128, 2, 33
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    plain = build(args, device, dtype)
    swapped = copy.deepcopy(plain)
    swap_moe(swapped)
    models = {"transformers": plain, "spmdmoe": swapped}
    if not args.smoke and not args.no_fp8:
        models["spmdmoe FP8"] = copy.deepcopy(plain)
        swap_moe(models["spmdmoe FP8"], expert_precision="fp8_rowwise")
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1)).to(device)

    def step(model: torch.nn.Module) -> float:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.detach()

    losses = {name: float(step(m)) for name, m in (("transformers", plain), ("spmdmoe", swapped))}
    gap = abs(losses["spmdmoe"] - losses["transformers"]) / abs(losses["transformers"])
    ok = gap <= (1e-5 if args.smoke else 2e-2)
    print(f"losses: {losses} (relative gap {gap:.2e}): {'OK' if ok else 'DIFFERENT'}", flush=True)
    assert ok, losses
    if args.smoke:
        print("OK: smoke, the swapped model's loss matches", flush=True)
        return

    from timing import report, timed

    ms = timed({name: (lambda m=m: step(m)) for name, m in models.items()}, args.iters, args.reps)
    peak = {}
    for name, model in models.items():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step(model)
        torch.cuda.synchronize()
        peak[name] = (torch.cuda.max_memory_allocated() - base) / 2**30
    tokens = args.batch * args.seq
    lines = [f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, transformers "
             f"{__import__('transformers').__version__}, {datetime.date.today()}; Qwen3-30B-A3B-shaped blocks x "
             f"{args.layers}, vocab {args.vocab}, {args.batch} x {args.seq} tokens, bf16, forward + backward with "
             f"the model's loss (aux included); losses {losses}",
             "", "| model | step ms | tokens/s | step peak GiB | vs transformers |", "|---|---|---|---|---|"]
    for name in models:
        lines.append(f"| {name} | {ms[name]:.2f} | {tokens / ms[name] * 1e3:,.0f} | {peak[name]:.2f} | "
                     f"{ms['transformers'] / ms[name]:.2f}x |")
    report("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
