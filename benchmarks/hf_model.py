"""A transformers Qwen3-MoE model, swapped (``spmdmoe.integrations.transformers.swap_moe``) against unswapped:
training step time and step peak memory, one process, candidates interleaved (issue 45).

The model is Qwen3-30B-A3B-shaped per block (hidden 2048, 32 query / 4 KV heads of 128, 128 experts of 768,
top-8, renormalised), cut to ``--layers`` blocks and a ``--vocab`` so it fits one GPU; bf16 weights, AdamW is
not run (a step is the model's forward with its own loss, router aux loss included, and backward). The
unswapped model runs transformers' default experts implementation (``grouped_mm``); a third candidate swaps with
FP8 experts (``--no-fp8`` drops it). Before the timing each swapped model's loss and every parameter's gradient
are compared with the unswapped model's on the same batch (the swap keeps transformers' parameter paths, so
they match by name): the loss within 2 % (fp32 smoke: 1e-5), each parameter's gradient within a relative error
||diff|| / ||ref|| of 0.5 (bf16 and FP8: gross errors only, since past the first block the inputs differ by
rounding and tokens near a tie choose other experts, ``GRAD_TOLERANCE``) or 1e-4 (fp32 smoke); a missing
gradient counts as zeros, so a model that skipped weight-gradient work is off by 1 and stops the run.

    python benchmarks/hf_model.py                 # GPU: prints a table (append it to benchmarks/ARCHIVE.md)
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

# ||diff|| / ||ref|| of one parameter's gradient. bf16 and FP8: gross errors only (a gradient skipped, zeros, is 1
# apart): past the first block the two models' inputs differ by rounding, so tokens near a tie choose other experts,
# which moves whole expert and router gradients (torchtitan_model.py measured 0.15 and 0.26 for that at a tiny shape)
GRAD_TOLERANCE = {"smoke": 1e-4, "bf16": 0.5, "fp8": 0.5}


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

    def loss_and_grads(model: torch.nn.Module) -> tuple[float, dict[str, torch.Tensor]]:
        """One step's loss and every parameter's gradient by name (a missing one as zeros); then none."""
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return loss.item(), grads

    def worst_grad_error(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, str]:
        """The largest ||diff|| / ||ref|| of one parameter's gradient, and its name (inf: missing or misshapen)."""
        worst = (0.0, "")
        for n in sorted(set(grads) | set(ref)):
            a, b = grads.get(n), ref.get(n)
            if a is None or b is None or a.shape != b.shape:
                return float("inf"), n
            d, r = (a.float() - b.float()).norm().item(), b.float().norm().item()
            worst = max(worst, (d / r if r > 0 else (float("inf") if d > 0 else 0.0), n))
        return worst

    ref_loss, ref = loss_and_grads(plain)
    losses, ok = {"transformers": ref_loss}, True
    for name, model in models.items():
        if model is plain:
            continue
        losses[name], grads = loss_and_grads(model)
        gap = abs(losses[name] - ref_loss) / abs(ref_loss)
        err, where = worst_grad_error(grads, ref)
        del grads
        tol = GRAD_TOLERANCE["smoke" if args.smoke else "fp8" if "FP8" in name else "bf16"]
        good = gap <= (1e-5 if args.smoke else 2e-2) and err <= tol
        ok &= good
        print(f"{name} vs transformers: loss {losses[name]:.6g} vs {ref_loss:.6g} (relative gap {gap:.2e}), parameter "
              f"gradients' worst rel error {err:.2e} ({where}; tolerance {tol}): {'OK' if good else 'DIFFERENT'}",
              flush=True)
    del ref
    print(f"losses: {losses}: {'OK' if ok else 'DIFFERENT'}", flush=True)
    assert ok, f"not the same model; not timing it: {losses}"
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
