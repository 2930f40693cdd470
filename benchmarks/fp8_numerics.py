"""FP8 numerics: each expert GEMM with fast accumulation on and off, and the layer's quality gates.

    python benchmarks/fp8_numerics.py [--out FILE] [--smoke]

Legend: ``M`` rows per expert, ``e`` experts, ``D`` model dim, ``F`` expert hidden dim, ``R = e * M`` rows;
a GEMM's ``I`` / ``O`` input and output width, ``A`` / ``B`` a weight gradient's operand widths.

Hopper's FP8 tensor cores keep partial sums in reduced precision unless the GEMM promotes them to fp32 at
intervals (``use_fast_accum=False``); the error of fast accumulation grows with the reduction length: the
model dim in the forward and dgrad GEMMs, the rows per expert (thousands) in wgrad. Two parts:

1. Per GEMM, at the dims of two presets (``benchmarks/shapes.py``) and M = 4096 and 16384 rows per expert
   (e = 4): the layer's six FP8 GEMMs (forward up/down, dgrad down/up, wgrad down/up) on operands made as
   the layer makes them (routed rows ~ N(0, 1), weights with the layer's init, the SwiGLU of the real
   up-projection, a random output gradient through the real SwiGLU backward), quantized by spmdmoe's
   kernels. SQNR in dB against fp64 of the unquantized operands ("total": what the layer sees) and against
   fp64 of the dequantized operands ("accum": the accumulation's own error), fast accumulation on / off,
   and each GEMM's time on / off (``timing.timed``: the two interleaved, median).
2. The layer (``MoE`` with ``expert_precision="fp8_rowwise"``, bf16) against the same layer in fp64 with
   the same weights, for each ``spmdmoe.moe.experts.fp8.FAST_ACCUM`` setting: output, input gradient and the worst
   single expert's weight gradient, at T = 300 and 16384 tokens of the DeepSeek-MoE-16B shape (E = 64,
   K = 6: about 1.5k rows per expert at 16k) and at 16384 tokens with E = 8, K = 2 (4096 rows per expert);
   the gates (tests/test_fp8.py): output and input grad >= 22 dB, every expert's weight grads >= 21 dB.

``--smoke``: tiny dims on whatever device is there (CPU: the emulation, where the flag does nothing), to
keep the script running in CI.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools

import torch

from expert_gemms import gemms, operands
from spmdmoe.moe import MoE, MoEConfig
from spmdmoe.moe.experts import fp8 as fp8_mod
from shapes import SHAPES
from timing import report, timed

SETTINGS = {  # FAST_ACCUM per kind (forward, dgrad, wgrad)
    "all fast (the default)": (True, True, True),
    "wgrad precise": (True, True, False),
    "dgrad + wgrad precise": (True, False, False),
    "all precise": (False, False, False),
}


def sqnr(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, b = actual.double(), expected.double()
    return float(10 * torch.log10(b.pow(2).sum() / (a - b).pow(2).sum().clamp(min=1e-300)))


def _deq_rows(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return q.double() * s.double().unsqueeze(-1)


def _deq_cols(q_AP: torch.Tensor, s_eA: torch.Tensor, padded: list[int]) -> list[torch.Tensor]:
    """Per group: the group's rows of the transposed operand, dequantized, ``(A, rows)``."""
    starts = [0, *padded[:-1]]
    return [q_AP[:, a:b].double() * s_eA[g].double()[:, None] for g, (a, b) in enumerate(zip(starts, padded))]


def _wgrad_deq(cols: tuple) -> torch.Tensor:
    qa, qb, sa, sb, padded = cols
    ends = padded.tolist()
    return torch.stack([a @ b.t() for a, b in zip(_deq_cols(qa, sa, ends), _deq_cols(qb, sb, ends))])


def gemm_study(D: int, F: int, M: int, e: int, dev: str) -> list[tuple]:
    """Rows of part 1 for one (D, F, M): (GEMM, reduction length, {fast: (total SQNR, accum SQNR, ms)})."""
    o = operands(D, F, [M] * e, dev, seed=M + D)
    q, R = o.q, e * M

    def per_group(a_RI: torch.Tensor, w_eOI: torch.Tensor) -> torch.Tensor:  # fp64 a @ w[g]^T per group
        return torch.bmm(a_RI.double().view(e, M, -1), w_eOI.double().transpose(1, 2)).reshape(R, -1)

    def t_bmm(a_RA: torch.Tensor, b_RB: torch.Tensor) -> torch.Tensor:  # fp64 a[g]^T @ b[g] per group
        return torch.bmm(a_RA.double().view(e, M, -1).transpose(1, 2), b_RB.double().view(e, M, -1))

    rows = {n: _deq_rows(*o.rows[n]) for n in o.rows}
    refs = {  # name: (reduction length, fp64 of the bf16 operands, fp64 of the dequantized FP8 operands)
        "forward up  x @ [w1|w3]^T": (D, per_group(o.x, o.w13), per_group(rows["x"], _deq_rows(q.up, q.up_s))),
        "forward down  h @ w2^T": (F, per_group(o.h, o.w2), per_group(rows["h"], _deq_rows(q.down, q.down_s))),
        "dgrad down  dy @ w2": (D, per_group(o.dy, o.w2.transpose(1, 2)),
                                per_group(rows["dy"], _deq_rows(q.down_t, q.down_t_s))),
        "dgrad up  dh13 @ [w1|w3]": (2 * F, per_group(o.dh13, o.w13.transpose(1, 2)),
                                     per_group(rows["dh13"], _deq_rows(q.up_t, q.up_t_s))),
        "wgrad down  dy^T h": (M, t_bmm(o.dy, o.h), _wgrad_deq(o.cols["dy, h"])),
        "wgrad up  dh13^T x (w1, w3)": (M, t_bmm(o.dh13, o.x), _wgrad_deq(o.cols["dh13, x"])),
    }
    out = []
    for name, (kind, _, fp8_call) in gemms(o).items():
        k, exact, deq = refs[name]
        def run(fast: bool, call=fp8_call, kind=kind) -> object:  # the call under one setting of its kind
            fp8_mod.FAST_ACCUM[kind] = fast
            return call()
        runs = {fast: functools.partial(run, fast) for fast in (True, False)}
        t = timed(runs, 10, 15)  # fast and precise interleaved in one rotation
        figures = {}
        for fast, run in runs.items():
            y = run()
            y = torch.cat(y, dim=1) if isinstance(y, tuple) else y
            figures[fast] = (sqnr(y, exact), sqnr(y, deq), t[fast])
        out.append((name, k, figures))
    return out


def _step(moe: MoE, x: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    moe.zero_grad(set_to_none=True)
    dtype = next(moe.parameters()).dtype
    xi = x.to(dtype).detach().requires_grad_()
    y = moe(xi)
    y.backward(g.to(y.dtype))
    return [y.detach(), xi.grad] + [w.grad for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3)]


def layer_study(cfg: MoEConfig, T: int, dev: str) -> dict[str, list[float]]:
    """Per FAST_ACCUM setting: [output, input grad, worst expert w1/w2/w3 grad] SQNR (dB) vs fp64."""
    torch.manual_seed(T + cfg.num_experts)
    fp8 = MoE(dataclasses.replace(cfg, expert_precision="fp8_rowwise")).to(dev, torch.bfloat16)
    ref = MoE(cfg).to(dev, torch.float64)
    ref.load_state_dict(fp8.state_dict())
    gen = torch.Generator(device=dev).manual_seed(T)
    x = torch.randn(T, cfg.dim, device=dev, generator=gen).to(torch.bfloat16).double()
    g = torch.randn(T, cfg.dim, device=dev, generator=gen, dtype=torch.float64)
    want = _step(ref, x, g)
    used = (ref.tokens_per_expert > 0).nonzero().flatten().tolist()
    out = {}
    for name, (fwd, dgrad, wgrad) in SETTINGS.items():
        fp8_mod.FAST_ACCUM.update(forward=fwd, dgrad=dgrad, wgrad=wgrad)
        got = _step(fp8, x, g)
        out[name] = [sqnr(got[0], want[0]), sqnr(got[1], want[1])] + [
            min(sqnr(a[i], b[i]) for i in used) for a, b in zip(got[2:], want[2:])]
    return out


def gemm_table(dev: str) -> list[str]:
    lines = ["", "Per GEMM (e = 4 experts of M rows each): SQNR dB vs fp64 of the unquantized operands (total) and of "
             "the dequantized ones (accum), fast accumulation / precise; ms fast / precise", "",
             "| D / F | M | GEMM | reduction | total fast | total precise | accum fast | accum precise "
             "| ms fast | ms precise |", "|---|---|---|---|---|---|---|---|---|---|"]
    for shape in ("dsmoe16b", "dsv3-ep8"):
        s = SHAPES[shape]
        for M in (4096, 16384):
            for name, k, out in gemm_study(s.D, s.F, M, 4, dev):
                lines.append(f"| {s.D} / {s.F} | {M} | {name} | {k} | {out[True][0]:.2f} | {out[False][0]:.2f} | "
                             f"{out[True][1]:.2f} | {out[False][1]:.2f} | {out[True][2]:.3f} | {out[False][2]:.3f} |")
            torch.cuda.empty_cache()
    return lines


def layer_table(layers: list[tuple[MoEConfig, int]], dev: str) -> list[str]:
    lines = ["", "The layer vs fp64 (gates: output, input grad >= 22 dB; worst expert's weight grads >= 21 dB); "
             "margin = the smallest distance to its gate", "",
             "| E / K, T | setting (forward, dgrad, wgrad) | output | input grad | worst expert w1 / w2 / w3 | margin |",
             "|---|---|---|---|---|---|"]
    for cfg, T in layers:
        for name, f in layer_study(cfg, T, dev).items():
            margin = min(f[0] - 22, f[1] - 22, min(f[2:]) - 21)
            lines.append(f"| {cfg.num_experts} / {cfg.top_k}, {T} | {name} | {f[0]:.2f} | {f[1]:.2f} | "
                         f"{f[2]:.2f} / {f[3]:.2f} / {f[4]:.2f} | {margin:+.2f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    saved = dict(fp8_mod.FAST_ACCUM)
    try:
        if args.smoke:
            lines = ["smoke"] + layer_table([(MoEConfig(dim=64, hidden_dim=32, num_experts=8, top_k=2), 40)], dev)
        else:
            s = SHAPES["dsmoe16b"]
            base = MoEConfig(dim=s.D, hidden_dim=s.F, num_experts=s.E, top_k=s.K)
            lines = [f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
                     f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}, "
                     "`python benchmarks/fp8_numerics.py`"] + gemm_table(dev) + layer_table(
                         [(base, 300), (base, 16384), (dataclasses.replace(base, num_experts=8, top_k=2), 16384)], dev)
    finally:
        fp8_mod.FAST_ACCUM.update(saved)
    report("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
