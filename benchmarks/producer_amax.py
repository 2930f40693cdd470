"""What a per-(group, column) amax costs inside a row-producing kernel: why `quantize_cols_pair` reads its operands
for the amax itself instead of taking it from the kernels that produce them (`python3 benchmarks/producer_amax.py`).

A stand-in producer reads N x C bf16 rows and writes their rowwise e4m3 (the work every producer of a wgrad
operand does); the variants add an atomic max of |x| into m[group(row), col]. Interleaved, median of 20."""
import statistics

import torch
import triton
import triton.language as tl


@triton.jit
def _producer(x_ptr, q_ptr, m_ptr, offs_ptr, N, C, e, E_P2: tl.constexpr, BLOCK_R: tl.constexpr,
              BLOCK_C: tl.constexpr, AMAX: tl.constexpr):
    r0 = tl.program_id(0) * BLOCK_R
    rows = r0 + tl.arange(0, BLOCK_R)
    rmask = rows < N
    cols = tl.arange(0, BLOCK_C)
    cmask = cols < C
    mask = rmask[:, None] & cmask[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    a = tl.abs(x)
    amax = tl.maximum(tl.max(a, axis=1), 1e-12)
    q = (x * (448.0 / amax)[:, None]).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], q, mask=mask)
    if AMAX:
        gi = tl.arange(0, E_P2)
        ends = tl.load(offs_ptr + gi, mask=gi < e, other=2147483647)
        g_lo = tl.sum((ends <= r0).to(tl.int32), axis=0)
        g_hi = tl.sum((ends <= tl.minimum(r0 + BLOCK_R, N) - 1).to(tl.int32), axis=0)
        for g in range(g_lo, g_hi + 1):
            start = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
            end = tl.load(offs_ptr + g)
            inside = (rows >= start) & (rows < end)
            tl.atomic_max(m_ptr + g * C + cols, tl.max(tl.where(inside[:, None], a, 0.0), axis=0), mask=cmask)


def run(N, C, e, block_r, amax, x, q, m, offs):
    _producer[(triton.cdiv(N, block_r),)](x, q, m, offs, N, C, e, E_P2=triton.next_power_of_2(e), BLOCK_R=block_r,
                                          BLOCK_C=triton.next_power_of_2(C), AMAX=amax, num_warps=8 if block_r > 2 else 4)


def main():
    torch.manual_seed(0)
    e = 64
    print("| N x C | rows per program | plain ms | + atomic amax ms | added ms | added per GB read |")
    print("|---|---|---|---|---|---|")
    for N, C in ((98304, 2048), (98304, 2816), (98304, 1408)):
        x = torch.randn(N, C, device="cuda", dtype=torch.bfloat16)
        q = torch.empty(N, C, device="cuda", dtype=torch.float8_e4m3fn)
        m = torch.zeros(e, C, device="cuda", dtype=torch.float32)
        offs = torch.arange(1, e + 1, device="cuda", dtype=torch.int32) * (N // e)
        ref = x.float().abs().view(e, N // e, C).amax(1)
        for block_r in (1, 2, 4, 8):
            run(N, C, e, block_r, True, x, q, m, offs)
            ok = torch.equal(m, ref)
            times = {False: [], True: []}
            for _ in range(20):
                for amax in (False, True):
                    m.zero_()
                    s, t = torch.cuda.Event(True), torch.cuda.Event(True)
                    s.record()
                    run(N, C, e, block_r, amax, x, q, m, offs)
                    t.record()
                    t.synchronize()
                    times[amax].append(s.elapsed_time(t))
            p, a = statistics.median(times[False]), statistics.median(times[True])
            gb = N * C * 2 / 1e9
            print(f"| {N} x {C} | {block_r} | {p:.3f} | {a:.3f} | {a - p:+.3f} | {(a - p) / gb:.3f} ms/GB |"
                  f"{'' if ok else ' AMAX WRONG'}", flush=True)


if __name__ == "__main__":
    main()
