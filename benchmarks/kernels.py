"""Each Triton kernel of spmdmoe.kernels against its torch reference (eager and compiled), in TB/s.

    python benchmarks/kernels.py [--tokens 16384] [--out FILE] [--sweep]
    python benchmarks/kernels.py --only "expert order" --base DIR   # beside an older copy (a kernel change's A/B,
        # before it lands: bash benchmarks/base_copy.sh REV DIR)

MoE shapes (bf16): T tokens, K=6 copies, D=2048; SwiGLU over R = T*K rows of
F=1408. Bytes = what a kernel must read and write at least (each row once);
TB/s against the 4.2 TB/s device-to-device copy ceiling (H200, REFERENCE.md).
Rows: the routing of the T rows and its backward (E=64 fp32 logits in; scores, ids, weights and counts out), the
expert order of the N copies (each copy's row, the groups' ends; ids in, rows out), the dispatch
fan-out (x_TD into N expert-major rows), its backward (the
sum over K copies), the combine (weighted sum over K rows, fp32) and its
backward (weighted fan-out + the weights' gradient dots), SwiGLU forward and
backward (alone, and fused with the rowwise FP8 of their output, beside the
unfused pair of kernels); the FP8 quantizers: rowwise scale+cast of the N routed rows of D,
and the dual per-group colwise quantization of the wgrad operands (N x D and
N x F, E=64 groups) into the 16-aligned layout, each beside torchao's kernel
for the same job when torchao is importable (bytes: bf16 in once, e4m3 and
fp32 scales out); the FP8 weight cache: the fingerprint of the weights alone, and
one use of the cache with the weights unchanged and changed (bytes: the weights
read by the fingerprint, plus the quantizers' traffic when they changed). Candidates interleaved (benchmarks/timing.py), median. ``--sweep``
first times every launch configuration of each kernel and keeps the fastest.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

import importlib
import importlib.util
import types

MODULES = {"fo": "fan_out", "gs": "gather_sum", "sw": "swiglu", "fr": "fp8_rows", "fc": "fp8_cols",
           "sq": "swiglu_fp8", "fg": "fingerprint", "fw": "fp8_weights", "eo": "expert_order",
           "orec": "overflow_record", "tr": "topk_route"}
fo, gs, sw, fr, fc, sq, fg, fw, eo, orec, tr = (
    importlib.import_module(f"spmdmoe.kernels.{m}") for m in MODULES.values())
from timing import report, timed

CEILING = 4.2e12


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=1408)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-only", default=None, help="comma-separated kernel modules to sweep (e.g. fp8_cols,swiglu_fp8,"
                    "swiglu_fp8_bwd: its BWD_CONFIG, fp8_weights_cols: its COLS_CONFIG; fp8_weights' rows pass: "
                    "benchmarks/sweep_weight_rows.py)")
    ap.add_argument("--sweep-out", default=None, help="write each swept module's fastest CONFIG here (JSON)")
    ap.add_argument("--only", default=None, help="comma-separated substrings: time only the kernels named so")
    ap.add_argument("--out", default=None)
    ap.add_argument("--base", default=None, help="a folder holding `spmdmoe_base` (benchmarks/base_copy.sh): each "
                    "case's Triton call made with its kernel modules (where it has them) joins the rotation as 'base'")
    args = ap.parse_args()
    T, K, D, F = args.tokens, args.top_k, args.dim, args.hidden
    N = T * K
    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(T, D, device=dev, dtype=bf)
    pos = torch.randperm(N, device=dev).view(T, K)
    w = torch.rand(T, K, device=dev)
    y = torch.randn(N, D, device=dev, dtype=bf)
    g = torch.randn(T, D, device=dev, dtype=bf)
    h13 = torch.randn(N, 2 * F, device=dev, dtype=bf)
    gh = torch.randn(N, F, device=dev, dtype=bf)
    h13c = torch.cat([h13, h13])
    valid = torch.tensor([N], device=dev, dtype=torch.int32)
    wN = torch.rand(N, device=dev)
    e = 2  # bytes per bf16 element
    cases = {  # name: (triton, reference, bytes)
        "dispatch fan-out": (lambda: fo.fan_out_triton(x, pos, N), lambda: fo.fan_out_reference(x, pos, N), (T + N) * D * e),
        "fan-out backward (sum of K)": (lambda: gs.gather_sum_triton(y, pos), lambda: gs.gather_sum_reference(y, pos), (N + T) * D * e),
        "combine (weighted sum of K)": (lambda: gs.gather_sum_triton(y, pos, w), lambda: gs.gather_sum_reference(y, pos, w), (N + T) * D * e),
        "combine backward (+ weight dots)": (lambda: fo.fan_out_triton(g, pos, N, w, y), lambda: fo.fan_out_reference(g, pos, N, w, y),
                                             (T + 2 * N) * D * e),
        "SwiGLU forward": (lambda: sw.swiglu_forward_triton(h13, valid), lambda: sw.swiglu_forward_reference(h13, valid), 3 * N * F * e),
        # sync-free EP's experts' buffer: a capacity of twice the rows (EP 2), the rows past the count never launched
        "SwiGLU forward, 2N capacity, N valid": (lambda: sw.swiglu_forward_triton(h13c, valid),
                                                 lambda: sw.swiglu_forward_reference(h13c, valid), 3 * N * F * e),
        "SwiGLU backward": (lambda: sw.swiglu_backward_triton(gh, h13, valid),
                            lambda: sw.swiglu_backward_reference(gh, h13, valid), 5 * N * F * e),
        "SwiGLU backward, routing weights folded (+ row dots)": (
            lambda: sw.swiglu_backward_triton(gh, h13, valid, wN), lambda: sw.swiglu_backward_reference(gh, h13, valid, wN),
            5 * N * F * e + 8 * N),
        "dispatch fan-out + FP8 rows, quantized once per token": (
            lambda: fo.fan_out_fp8_triton(x, pos, N), lambda: fo.fan_out_fp8_reference(x, pos, N),
            T * D * e + N * D * (e + 1) + 4 * N),
    }
    E = 64
    # the expert order of N copies: a rank's own (int64 ids, every expert here), and EP 2's received rows (the fp32
    # ids beside the weights of 2T rows, half the experts here, every id counted); bytes: the ids in, the rows out
    ids = torch.randint(0, E, (T, K), device=dev)
    meta = torch.cat([w, ids.float(), w, torch.randint(0, E, (T, K), device=dev).float()], 1).view(2 * T, 2 * K)
    cases["expert order, all here (N int64 ids)"] = (lambda: eo.expert_order_triton(ids, 0, E, N, E),
                                                     lambda: eo.expert_order_reference(ids, 0, E, N, E), N * 16)
    cases["expert order, EP 2 received (2N fp32 ids, E/2 here)"] = (
        lambda: eo.expert_order_triton(meta[:, K:], E // 2, E // 2, 2 * N, E),
        lambda: eo.expert_order_reference(meta[:, K:], E // 2, E // 2, 2 * N, E), 2 * N * 12)
    ids4 = torch.randint(0, E, (4 * T, K), device=dev).float()  # EP 4's received ids (the symmetric transport: 4T rows)
    cases["expert order, EP 4 received (4N fp32 ids, E/4 here)"] = (
        lambda: eo.expert_order_triton(ids4, E // 4, E // 4, 4 * N, E),
        lambda: eo.expert_order_reference(ids4, E // 4, E // 4, 4 * N, E), 4 * N * 12)
    # the sync-free overflow record: two 0-d demands in, the 4-int64 state read and written; 12 scalar ops eagerly
    rec = (torch.tensor(T // 2, device=dev), torch.tensor(N // 2, device=dev), torch.zeros(4, dtype=torch.int64, device=dev),
           T // 2, N // 2, 2, N, T)  # its own names: the cases below rebind state
    cases["sync-free overflow record (4 int64)"] = (lambda: orec.overflow_record_triton(*rec),
                                                    lambda: orec.overflow_record_reference(*rec), 80)
    # the routing of T rows (logits T x E fp32 in; scores out, ids and weights, counts) and its backward (scores,
    # ids, weights and their gradient in, the logits' gradient out); the reference: ~15 and ~5 torch ops
    logits, bias_E, g_w = torch.randn(T, E, device=dev), torch.zeros(E, device=dev), torch.randn(T, K, device=dev)
    route = (logits, bias_E, None, K, False, False, 4)
    r_ids, r_w, r_scores, _ = tr.topk_route_triton(*route)
    cases["topk route (T x E fp32 logits)"] = (lambda: tr.topk_route_triton(*route),
                                               lambda: tr.topk_route_reference(*route), T * E * 8 + T * K * 12)
    back = (r_scores, r_ids, r_w, g_w, None, False, False)
    cases["topk route backward"] = (lambda: tr.topk_route_backward_triton(*back),
                                    lambda: tr.topk_route_backward_reference(*back), T * E * 8 + T * K * 16)
    sizes = torch.distributions.Multinomial(N, torch.ones(E)).sample().to(torch.int64)
    offs = sizes.cumsum(0).to(device=dev, dtype=torch.int32)
    gy = torch.randn(N, D, device=dev, dtype=bf)
    P = fc.padded_rows(N, E)
    cases["FP8 rowwise scale+cast (N x D)"] = (lambda: fr.quantize_rows_triton(y, valid), lambda: fr.quantize_rows_reference(y, valid),
                                               N * D * 3 + N * 4)
    cases["FP8 rowwise scale+cast (N x 2F: dh13)"] = (lambda: fr.quantize_rows_triton(h13, valid),
                                                      lambda: fr.quantize_rows_reference(h13, valid), N * 2 * F * 3 + N * 4)
    cases["FP8 dual colwise, 16-aligned (N x D, N x F)"] = (
        lambda: fc.quantize_cols_pair_triton(gy, gh, offs), lambda: fc.quantize_cols_pair_reference(gy, gh, offs),
        N * (D + F) * 2 + P * (D + F) + E * (D + F) * 4)
    hot = torch.full((E,), N, device=dev, dtype=torch.int32)  # every row routed to expert 0: the split path
    cases["FP8 dual colwise, one hot expert"] = (
        lambda: fc.quantize_cols_pair_triton(gy, gh, hot), lambda: fc.quantize_cols_pair_reference(gy, gh, hot),
        N * (D + F) * 2 + P * (D + F) + E * (D + F) * 4)
    cases["SwiGLU forward + FP8 rows of h (fused)"] = (
        lambda: sq.swiglu_quant_forward_triton(h13, valid), lambda: sq.swiglu_quant_forward_reference(h13, valid),
        N * F * 7 + N * 4)
    cases["SwiGLU backward + FP8 rows of dh13 (fused, weights folded)"] = (
        lambda: sq.swiglu_quant_backward_triton(gh, h13, valid, wN),
        lambda: sq.swiglu_quant_backward_reference(gh, h13, valid, wN), N * F * 12 + N * 12)
    from spmdmoe.moe.experts.fp8 import quantize_weights
    w13 = torch.randn(E, 2 * F, D, device=dev, dtype=bf)
    w2 = torch.randn(E, D, F, device=dev, dtype=bf)
    w1v, w3v = w13[:, :F], w13[:, F:]

    def weights_by_copies() -> None:  # the transposed layouts through transposing copies
        for w in (w13, w2):
            fr.quantize_rows_triton(w.reshape(-1, w.shape[-1]))
            fr.quantize_rows_triton(w.transpose(1, 2).contiguous().reshape(-1, w.shape[1]))
    nw = w13.numel() + w2.numel()
    cases["FP8 weights, both layouts of [w1|w3] and w2 (E=64)"] = (
        lambda: quantize_weights(w1v, w2, w3v), weights_by_copies, nw * (2 + 2 + 1 + 1))
    # the FP8 weight cache (spmdmoe.moe.experts.fp8_cache): its fingerprint alone, then a whole use with the weights
    # unchanged (fingerprint + gated quantizers that write nothing) and changed (one element flipped first)
    from spmdmoe.moe.experts.fp8_cache import Fp8WeightCache
    state = fg.new_state(dev)
    cache = Fp8WeightCache(w1v, w2, w3v)
    cache.get(w1v, w2, w3v)
    one = w2[:1, :1, :1]

    def changed() -> None:
        one.neg_()
        cache.get(w1v, w2, w3v)
    cases["fingerprint of the expert weights ([w1|w3], w2; E=64)"] = (
        lambda: fg.fingerprint_triton([w13, w2], state), None, nw * 2)
    cases["FP8 weight cache, weights unchanged (fingerprint, no write)"] = (lambda: cache.get(w1v, w2, w3v), None, nw * 2)
    cases["FP8 weight cache, weights changed (fingerprint + both layouts)"] = (changed, None, nw * (2 + 2 + 2 + 1 + 1))
    # the same jobs unfused: the SwiGLU kernel, then the rowwise quantizer reading its output back
    unfused = {
        "FP8 weights, both layouts of [w1|w3] and w2 (E=64)": weights_by_copies,
        "SwiGLU forward + FP8 rows of h (fused)": lambda: fr.quantize_rows_triton(sw.swiglu_forward_triton(h13, valid), valid),
        "SwiGLU backward + FP8 rows of dh13 (fused, weights folded)": lambda: fr.quantize_rows_triton(
            sw.swiglu_backward_triton(gh, h13, valid, wN)[0], valid),
        "dispatch fan-out + FP8 rows, quantized once per token": lambda: fr.quantize_rows_triton(
            fo.fan_out_triton(x, pos, N)[0], valid)}
    base, keep = {}, (args.only.split(",") if args.only else [""])
    if args.base:
        import sys
        sys.path.insert(0, args.base)
        if importlib.util.find_spec("spmdmoe_base.moe.experts.fp8"):  # (an older base: moe/fp8.py, not timed)
            base_weights = importlib.import_module("spmdmoe_base.moe.experts.fp8").quantize_weights
            base["FP8 weights, both layouts of [w1|w3] and w2 (E=64)"] = lambda: base_weights(w1v, w2, w3v)
        older = {k: importlib.import_module(f"spmdmoe_base.kernels.{m}") for k, m in MODULES.items()
                 if importlib.util.find_spec(f"spmdmoe_base.kernels.{m}")}
        for name, (tri, _, _) in cases.items():  # the same call, the names above bound to the base's modules
            uses = MODULES.keys() & set(tri.__code__.co_names)
            if not (any(k in name for k in keep) and uses and uses <= older.keys()):
                continue
            call = types.FunctionType(tri.__code__, dict(tri.__globals__, **older), name, None, tri.__closure__)
            try:
                call()
            except Exception:  # not in the base, or another signature there
                continue
            base.setdefault(name, call)
    torchao = {}
    try:
        from torchao.prototype.moe_training.kernels.float8_rowwise import triton_fp8_rowwise_2d_scale_and_cast
        from torchao.prototype.moe_training.kernels.jagged_float8_scales import triton_fp8_per_group_colwise_scales_dual

        fp8 = torch.float8_e4m3fn
        torchao["FP8 rowwise scale+cast (N x D)"] = lambda: triton_fp8_rowwise_2d_scale_and_cast(y, fp8, True)
        torchao["FP8 dual colwise, 16-aligned (N x D, N x F)"] = lambda: triton_fp8_per_group_colwise_scales_dual(
            gy, gh, offs, fp8, True)
    except ImportError as exc:
        print(f"torchao not importable ({exc}): no torchao column", flush=True)
    if args.sweep or args.sweep_only:
        sweep(cases, args)
    lines = [f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, T={T} K={K} D={D} F={F}; "
             f"configs: fan_out {fo.CONFIG}, gather_sum {gs.CONFIG}, swiglu {sw.CONFIG}, fp8_rows {fr.CONFIG}, "
             f"fp8_cols {fc.CONFIG} / {fc.CAST_CONFIG}, fp8_weights {fw.ROWS_CONFIG} / {fw.TILED_CONFIG} / {fw.COLS_CONFIG}, swiglu_fp8 {sq.CONFIG} / backward "
             f"{sq.BWD_CONFIG}, fingerprint {fg.CONFIG}", "",
             "| kernel | Triton ms | TB/s | % of 4.2 | torch eager ms | torch compiled ms | Triton vs compiled | "
             "torchao ms (TB/s) | ours vs torchao |",
             "|---|---|---|---|---|---|---|---|---|"]
    notes: list[str] = []
    for name, (tri, ref, nbytes) in cases.items():
        if not any(k in name for k in keep):
            continue
        fns = {"triton": tri} if ref is None else {"triton": tri, "eager": ref, "compiled": torch.compile(ref)}
        if name in torchao:
            fns["torchao"] = torchao[name]
        if name in unfused:
            fns["unfused"] = unfused[name]
        if name in base:
            fns["base"] = base[name]
        t = timed(fns, args.iters, args.reps)
        tbs = nbytes / (t["triton"] * 1e-3) / 1e12
        tao = (f"{t['torchao']:.3f} ({nbytes / (t['torchao'] * 1e-3) / 1e12:.2f}) | {t['torchao'] / t['triton']:.2f}x"
               if "torchao" in t else "– | –")
        torch_cols = (f"{t['eager']:.3f} | {t['compiled']:.3f} | {t['compiled'] / t['triton']:.2f}x" if "eager" in t
                      else "– | – | –")
        lines.append(f"| {name} | {t['triton']:.3f} | {tbs:.2f} | {tbs * 1e12 / CEILING:.0%} | {torch_cols} | {tao} |")
        if "unfused" in t:
            notes.append(f"{name}: {t['triton']:.3f} ms vs unfused Triton {t['unfused']:.3f} ms "
                         f"({t['unfused'] / t['triton']:.2f}x)")
        if "base" in t:
            notes.append(f"{name}: {t['triton']:.3f} ms vs the base copy's {t['base']:.3f} ms "
                         f"({t['base'] / t['triton']:.2f}x)")
    report("\n".join(lines + [""] + notes), args.out)


def sweep(cases, args) -> None:
    """Time every launch configuration; keep the fastest in each module's CONFIG (printed)."""
    grids = {  # module: (case or cases, grid); (module, "BWD_CONFIG") sweeps that dict of the module instead (named
        # module_bwd / module_cast in --sweep-only)
        fo: ("dispatch fan-out", {"block_d": [256, 512, 1024, 2048], "num_warps": [2, 4, 8, 16]}),
        gs: ("combine (weighted sum of K)", {"block_d": [256, 512, 1024, 2048], "num_warps": [2, 4, 8, 16]}),
        sw: (("SwiGLU forward", "SwiGLU backward, routing weights folded (+ row dots)"),  # the local transport's pair
             {"block_r": [1, 2, 4, 8], "block_f": [256, 512, 1024, 2048], "num_warps": [4, 8]}),
        fr: (("FP8 rowwise scale+cast (N x D)", "FP8 rowwise scale+cast (N x 2F: dh13)"),
             {"block_r": [1, 2, 4, 8], "max_block_c": [1024, 2048, 4096], "num_warps": [4, 8, 16]}),
        # the amax pass reads split (hot) groups only; the cast pass serves both
        fc: ("FP8 dual colwise, one hot expert", {"block_r": [64, 128, 256], "block_c": [32, 64, 128],
                                                  "row_programs": [32, 64, 128], "num_warps": [2, 4]}),
        (fc, "CAST_CONFIG"): (("FP8 dual colwise, 16-aligned (N x D, N x F)", "FP8 dual colwise, one hot expert"),
                              {"splits": [2, 4], "block_r": [64, 128], "block_c": [32, 64], "group_major": [False, True],
                               "num_warps": [4]}),
        sq: ("SwiGLU forward + FP8 rows of h (fused)", {"block_r": [1, 2, 4, 8], "max_block_f": [512, 1024, 2048],
                                                        "num_warps": [4, 8, 16]}),
        (sq, "BWD_CONFIG"): ("SwiGLU backward + FP8 rows of dh13 (fused, weights folded)",
                             {"block_r": [1, 2, 4], "max_block_f": [256, 512, 1024, 2048], "num_warps": [4, 8, 16],
                              "reload": [False, True]}),
        (fw, "COLS_CONFIG"): ("FP8 weights, both layouts of [w1|w3] and w2 (E=64)",
                              {"block_r": [32, 64, 128], "block_c": [32, 64, 128], "rows": [256, 1024, 4096],
                               "num_warps": [4, 8]}),
        fg: ("fingerprint of the expert weights ([w1|w3], w2; E=64)", {"block": [1024, 2048, 4096, 8192],
                                                                       "programs_per_sm": [2, 4, 8],
                                                                       "num_warps": [4, 8, 16]}),
    }
    only = set(args.sweep_only.split(",")) if args.sweep_only else None
    chosen: dict[str, dict] = {}
    for key, (case, grid) in grids.items():
        module, attr = key if isinstance(key, tuple) else (key, "CONFIG")
        name = module.__name__.rsplit(".", 1)[1] + ("" if attr == "CONFIG" else "_" + attr.split("_")[0].lower())
        if only is not None and name not in only:
            continue
        config = getattr(module, attr)
        names = case if isinstance(case, tuple) else (case,)  # several cases: the config with the least summed time
        before = tuple(config[k] for k in grid)
        results = {}
        for values in itertools.product(*grid.values()):
            config.update(zip(grid, values))
            results[values] = sum(timed({"k": cases[c][0]}, args.iters, 5)["k"] for c in names)
        best = min(results, key=results.get)
        config.update(zip(grid, best))
        chosen[f"{module.__name__}.{attr}"] = dict(config)
        table = ", ".join(f"{v}: {ms:.3f}" for v, ms in sorted(results.items(), key=lambda kv: kv[1])[:6])
        print(f"sweep {name} ({case}), ms, fastest first: {table}; the configuration before, {before}: "
              f"{results.get(before, float('nan')):.3f}", flush=True)
    if args.sweep_out:
        with open(args.sweep_out, "w") as f:
            json.dump(chosen, f)


if __name__ == "__main__":
    main()
