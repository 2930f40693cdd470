"""The FP8 quantizers against their plain-torch references, on fresh random data.

Bit-exact: both compute ``amax``, ``448 / amax`` (an IEEE division), one fp32
product and a round-to-nearest-even cast, so ``q`` and ``s`` must be equal
bit for bit (``tests/test_kernels.py`` explains the CPU interpreter set-up).
Also checked against the format itself: every dequantized value within half
an e4m3 step of the input, scales finite and positive on all-zero rows, pad
rows zero, rows past the valid count (NaN here) never read.
"""

from __future__ import annotations

import pytest
import torch

from spmdmoe import kernels as K
from spmdmoe.kernels.fp8_cols import padded_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.usefixtures("three_programs")  # conftest.py: the row kernels' loop turns


DTYPES = [torch.bfloat16, torch.float32]
# (R, C): odd sizes, wider than one tile (the two-read path), one column, empty
ROW_SHAPES = [(7, 33), (5, 5000), (4, 16), (0, 8), (3, 1)]
# group sizes (empty groups first, last, between), rows past the last group, columns of the two operands
GROUPS = [([3, 0, 17, 5], 4, 33, 20), ([0, 0], 0, 16, 16), ([40], 3, 70, 5), ([0, 9, 0], 1, 8, 24), ([1], 0, 3, 1)]
if DEVICE == "cuda":
    ROW_SHAPES += [(4099, 2048), (333, 2816), (65, 1408)]
    GROUPS += [([700, 0, 1301, 15, 16, 1], 37, 2048, 1408)]


# (R, F, valid rows, max tile width): odd sizes, no valid rows, empty, rows wider than one tile, a real F
SWIGLU_SHAPES = [(9, 24, 6, None), (5, 7, 5, None), (4, 16, 0, None), (0, 8, 0, None), (11, 40, 9, 16),
                 (6, 1408 if DEVICE == "cuda" else 48, 5, None)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _assert_equal(got, want, what):
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and a.dtype == b.dtype, (what, i, a.shape, b.shape, a.dtype, b.dtype)
        bad = (_bits(a) != _bits(b)).nonzero()
        assert bad.numel() == 0, (f"{what}: output {i} differs in {bad.shape[0]} places, first at "
                                  f"{bad[:4].tolist()}: got {a[tuple(bad[:4].t())].float().tolist()}, "
                                  f"want {b[tuple(bad[:4].t())].float().tolist()}")


def _within_half_step(q: torch.Tensor, s: torch.Tensor, x: torch.Tensor) -> None:
    """``q * s`` is ``x`` rounded to e4m3 on ``x``'s scale: within 2^-4 relative (normal) or half a
    subnormal step (2^-10 of 448 scale units)."""
    deq = q.float() * s
    err = (deq - x.float()).abs()
    bound = torch.maximum(x.float().abs() * 2.0 ** -4, s * 2.0 ** -10) * (1 + 1e-6)
    assert (err <= bound).all(), float((err - bound).max())


def _rows_input(R: int, C: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    tiny = 1e-20 if dtype == torch.bfloat16 else 1e-30
    mags = torch.tensor([1.0, 3e4, tiny, 0.0, 7.5])[torch.arange(R) % 5]  # huge, tiny and all-zero rows
    return (torch.randn(R, C, generator=gen) * mags[:, None]).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("R,C", ROW_SHAPES)
@pytest.mark.parametrize("cut", [None, 2])
def test_quantize_rows(R, C, dtype, cut):
    gen = torch.Generator().manual_seed(R * 7919 + C)
    x = _rows_input(R, C, dtype, gen)
    valid = None
    n = R
    if cut is not None:
        n = max(R - cut, 0)
        valid = torch.tensor([n], dtype=torch.int32, device=DEVICE)
        x[n:] = float("nan")  # past the device-side count: never read
    got = K.quantize_rows_triton(x, valid)
    want = K.quantize_rows_reference(x, valid)
    _assert_equal([t[:n] for t in got], [t[:n] for t in want], "rows")
    q, s = want
    assert torch.isfinite(s[:n]).all() and (s[:n] > 0).all()
    _within_half_step(q[:n], s[:n, None], x[:n])
    if n:
        torch.testing.assert_close(s[:n] * 448, x[:n].float().abs().amax(1).clamp(min=1e-12), rtol=1e-6, atol=0)


# the default tiles in both dtypes; the narrow ones (many programs: the interpreter's time) in one dtype per group
COLS_CASES = ([("default", g, d) for g in GROUPS for d in DTYPES]
              + [(t, g, DTYPES[i % 2]) for t in ("narrow", "narrow, all split") for i, g in enumerate(GROUPS)])


@pytest.mark.parametrize("tiles,group,dtype", COLS_CASES)
def test_quantize_cols_pair(group, dtype, tiles, monkeypatch):
    """The default split rule gives a mix ([3, 0, 17, 5]: the 17-row group is split, the others are cast whole by
    one program). ``narrow``: tiles of few rows and columns, so a split group spans many tiles dealt to three
    row programs, the cast pass splits a split group's rows in three parts, and its grid takes the other
    order; ``all split``: every non-empty group takes the two-pass path."""
    from spmdmoe.kernels import fp8_cols
    if tiles != "default":
        monkeypatch.setitem(fp8_cols.CONFIG, "block_r", 4)
        monkeypatch.setitem(fp8_cols.CONFIG, "block_c", 16)
        monkeypatch.setitem(fp8_cols.CONFIG, "row_programs", 3)
        monkeypatch.setitem(fp8_cols.CAST_CONFIG, "group_major", not fp8_cols.CAST_CONFIG["group_major"])
        monkeypatch.setitem(fp8_cols.CAST_CONFIG, "splits", 3)
        monkeypatch.setitem(fp8_cols.CAST_CONFIG, "block_r", 4)
        monkeypatch.setitem(fp8_cols.CAST_CONFIG, "block_c", 8)
    if tiles == "narrow, all split":
        monkeypatch.setattr(fp8_cols, "SPLIT_ABOVE", 0)
    sizes, extra, A, B = group
    gen = torch.Generator().manual_seed(sum(sizes) * 31 + A * 7 + B)
    R, e = sum(sizes) + extra, len(sizes)
    a = _rows_input(R, A, dtype, gen)
    b = (torch.randn(R, B, generator=gen) * 0.01).to(DEVICE, dtype)
    a[R - extra:] = float("nan")  # a capacity buffer's tail: never read
    b[R - extra:] = float("nan")
    offsets = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(DEVICE)
    got = K.quantize_cols_pair_triton(a, b, offsets)
    want = K.quantize_cols_pair_reference(a, b, offsets)
    _assert_equal(got, want, "cols")
    qa, qb, sa, sb, padded = want
    P = padded_rows(R, e)
    assert qa.shape == (A, P) and qb.shape == (B, P) and sa.shape == (e, A) and sb.shape == (e, B)
    ends = padded.tolist()
    assert padded.dtype == torch.int32 and ends[-1] == P and all(v % 16 == 0 for v in ends)
    start, pstart = 0, 0
    for g, size in enumerate(sizes):
        for x, q, s in ((a, qa, sa), (b, qb, sb)):
            rows = x[start:start + size].float()  # (size, C)
            assert torch.isfinite(s[g]).all() and (s[g] > 0).all()
            _within_half_step(q[:, pstart:pstart + size].t(), s[g][None, :], rows)
            assert (_bits(q[:, pstart + size:ends[g]]) == 0).all(), "pad rows must be zero"
        start, pstart = start + size, ends[g]


def test_cols_pair_scales_are_per_group():
    """A group's scale sees only its own rows: a huge row in group 0 leaves group 1's scale alone."""
    a = torch.ones(6, 4, device=DEVICE)
    a[0] = 1000.0
    offsets = torch.tensor([2, 6], dtype=torch.int32, device=DEVICE)
    for impl in (K.quantize_cols_pair_triton, K.quantize_cols_pair_reference):
        _, _, sa, _, _ = impl(a, a, offsets)
        assert torch.equal(sa[0], torch.full((4,), 1000.0 / 448, device=DEVICE))
        assert torch.equal(sa[1], torch.full((4,), 1.0 / 448, device=DEVICE))


def _swiglu_inputs(R: int, F: int, valid: int, dtype: torch.dtype, weighted: bool, gen: torch.Generator):
    """``(h13, count, w)``: ``h13`` rows of all magnitudes, NaN past the device-side count ``valid`` (never
    read); the routing weights (``weighted``) with zeros among them, NaN past ``valid``, else ``None``."""
    h13 = _rows_input(R, 2 * F, dtype, gen)
    h13[valid:] = float("nan")
    w = None
    if weighted:
        w = torch.rand(R, generator=gen).to(DEVICE)
        w[::3] = 0.0
        w[valid:] = float("nan")
    return h13, torch.tensor([valid], dtype=torch.int32, device=DEVICE), w


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("R,F,valid,block", SWIGLU_SHAPES)
def test_swiglu_quant(R, F, valid, block, dtype, weighted, monkeypatch):
    """The fused SwiGLU + rowwise quantizer equals the SwiGLU kernel followed by the rowwise quantizer, bit
    for bit (``block``: rows wider than one tile, the recomputing path; ``weighted``: the routing weights
    folded in, a zero weight among them), and its reference likewise."""
    from spmdmoe.kernels import swiglu_fp8
    if block is not None:
        monkeypatch.setitem(swiglu_fp8.CONFIG, "max_block_f", block)
    gen = torch.Generator().manual_seed(R * 131 + F + valid)
    h13, count, w = _swiglu_inputs(R, F, valid, dtype, weighted, gen)
    # (fused, the SwiGLU alone, the rowwise quantizer): kernels with kernels, references with references
    cases = {"kernel": (K.swiglu_quant_forward_triton, K.swiglu_forward_triton, K.quantize_rows_triton),
             "reference": (K.swiglu_quant_forward_reference, K.swiglu_forward_reference, K.quantize_rows_reference)}
    for impl, (fused, swiglu, quantize) in cases.items():
        got = fused(h13, count, w)
        out = swiglu(h13, count, w)
        want = (out, *quantize(out, count))
        _assert_equal([t[:valid] for t in got], [t[:valid] for t in want], f"forward {impl}")
        assert torch.isfinite(got[2][:valid]).all() and (got[2][:valid] > 0).all()


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("R,F,valid,block", SWIGLU_SHAPES)
@pytest.mark.parametrize("reload", [False, True])
def test_swiglu_quant_backward(R, F, valid, block, dtype, weighted, reload, monkeypatch):
    """The fused SwiGLU backward + rowwise quantizer of ``dh13``: ``dh13`` bit for bit the SwiGLU backward
    kernel's, ``(q, s)`` bit for bit the rowwise quantizer's of it (over all ``2F`` columns), the routing
    weights' gradient within fp32 summation-order error of the plain kernel's (``block``: rows wider than
    one tile: the second pass recomputes, or ``reload``s the rows it stored); rows past ``valid`` (NaN) never
    read. Its reference likewise."""
    from spmdmoe.kernels import swiglu_fp8
    if block is not None:
        monkeypatch.setitem(swiglu_fp8.BWD_CONFIG, "max_block_f", block)
    monkeypatch.setitem(swiglu_fp8.BWD_CONFIG, "reload", reload)  # the multi-tile path: e4m3 from the stored rows
    gen = torch.Generator().manual_seed(R * 131 + F + valid + 7)
    h13, count, w = _swiglu_inputs(R, F, valid, dtype, weighted, gen)
    g = (torch.randn(R, F, generator=gen) * 3).to(DEVICE, dtype)
    g[valid:] = float("nan")
    cases = {"kernel": (K.swiglu_quant_backward_triton, K.swiglu_backward_triton, K.quantize_rows_triton),
             "reference": (K.swiglu_quant_backward_reference, K.swiglu_backward_reference, K.quantize_rows_reference)}
    for impl, (fused, plain, quantize) in cases.items():
        d13, q, s, dw = fused(g, h13, count, w)
        want_d13, want_dw = plain(g, h13, count, w)
        _assert_equal([d13[:valid], q[:valid], s[:valid]], [want_d13[:valid], *(t[:valid] for t in quantize(want_d13, count))],
                      f"backward {impl}")
        assert torch.isfinite(s[:valid]).all() and (s[:valid] > 0).all()
        assert dw.shape == want_dw.shape
        if weighted:
            torch.testing.assert_close(dw[:valid], want_dw[:valid], rtol=1e-5, atol=1e-5 * F)
    # in place (the e4m3 over g's bytes, 2-byte g only): the same bits, rows past valid of g untouched
    if g.element_size() != 2:
        with pytest.raises(ValueError, match="2-byte"):
            K.swiglu_quant_backward_inplace_triton(g.clone(), h13, count, w)
        return
    for impl, (fused, inplace) in {"kernel": (K.swiglu_quant_backward_triton, K.swiglu_quant_backward_inplace_triton),
                                   "reference": (K.swiglu_quant_backward_reference,
                                                 K.swiglu_quant_backward_inplace_reference)}.items():
        want = fused(g, h13, count, w)
        over = g.clone()
        d13, s, dw = inplace(over, h13, count, w)
        _assert_equal([t[:valid] for t in (d13, over.view(torch.float8_e4m3fn), s, dw)], [t[:valid] for t in want],
                      f"in place {impl}")
        assert over[valid:].isnan().all(), f"in place {impl}: rows past valid written"


# (e, A, C, dtype): the small shapes (several experts among them) in both dtypes; the larger ones, where the CPU
# interpreter spends its time, in one dtype each (the dtype changes the loads, not the loops): many rows, wide rows
WEIGHT_PAIRS = ([(3, 33, 20), (2, 16, 70), (0, 4, 4), (1, 5, 1)]
                + ([(4, 2816, 2048), (3, 2048, 1408)] if DEVICE == "cuda" else []))
# (``narrow`` below: every shape but the 700 columns on the CPU interpreter, 11 s there; the tiles are narrower
# than the rows of the smaller shapes too)
WEIGHT_PAIRS = ([s + (d,) for s in WEIGHT_PAIRS for d in DTYPES]
                + [(2, 40, 700, torch.float32), (1, 290, 3, torch.bfloat16)])
WEIGHT_PAIRS = [s + (n,) for s in WEIGHT_PAIRS for n in (False, True) if not (n and s[2] == 700 and DEVICE != "cuda")]


@pytest.mark.parametrize("e,A,C,dtype,narrow", WEIGHT_PAIRS)
def test_quantize_weight_pair(e, A, C, dtype, narrow, monkeypatch):
    """Both layouts of a weight (rowwise, and the transpose per column without a transposing copy) equal the
    rowwise quantizer on ``w`` and on the transposed copy bit for bit: rows and columns of every magnitude
    (huge, tiny, all zero), more rows than one program takes (A = 290: 10 programs of the rows pass, 3 blocks
    of the columns pass, the last partial); ``narrow``: launch configurations with tiles narrower than the rows
    (the two-read path) and few rows per program."""
    from spmdmoe.kernels import fp8_weights
    if narrow:
        monkeypatch.setattr(fp8_weights, "ROWS_CONFIG", {16: (8, 4, 4)})
        monkeypatch.setattr(fp8_weights, "TILED_CONFIG", (8, 16, 4))
        monkeypatch.setattr(fp8_weights, "COLS_CONFIG", {"block_r": 16, "block_c": 16, "rows": 64, "num_warps": 4})
    gen = torch.Generator().manual_seed(e * 1000 + A + C)
    col_mags = torch.tensor([1.0, 0.0, 3e4, 2.0, 1e-3])[torch.arange(C) % 5].to(DEVICE, dtype)
    w = (_rows_input(e * A, C, dtype, gen) * col_mags).view(e, A, C)
    got = K.quantize_weight_pair_triton(w)
    want = K.quantize_weight_pair_reference(w)
    _assert_equal(got, want, "weight pair")
    assert [t.shape for t in got] == [(e, A, C), (e, A), (e, C, A), (e, C)]
    # the reference is the rowwise quantizer on both layouts (so the kernel is too)
    rows_q, rows_s = K.quantize_rows_reference(w.transpose(1, 2).reshape(e * C, A))
    _assert_equal((got[2].reshape(e * C, A), got[3].reshape(-1)), (rows_q, rows_s), "transposed layout")


@pytest.mark.parametrize("gate", [0, 1])
def test_gated_writes_into_given_tensors(gate):
    """The weight cache's quantizer writes into its tensors exactly when the device flag is set: an open gate
    gives the allocating kernel's bits, a closed one leaves the (poisoned) tensors untouched; kernel and
    reference alike."""
    from spmdmoe.kernels import fp8_weights
    from spmdmoe.kernels.fp8_common import write_where

    gen = torch.Generator().manual_seed(17 + gate)
    w = _rows_input(2 * 33, 5, torch.bfloat16, gen).view(2, 33, 5)  # three row blocks per expert
    flag = torch.tensor([gate], dtype=torch.int64, device=DEVICE)

    def poisoned():
        return [torch.full(s, 0x7F, dtype=torch.uint8, device=DEVICE).view(d) if d == torch.float8_e4m3fn
                else torch.full(s, -3.0, dtype=d, device=DEVICE)
                for s, d in [((2, 33, 5), torch.float8_e4m3fn), ((2, 33), torch.float32),
                             ((2, 5, 33), torch.float8_e4m3fn), ((2, 5), torch.float32)]]

    fresh = K.quantize_weight_pair_triton(w)
    for name, write in (
            ("kernel", lambda *qs: fp8_weights._launch(fp8_weights._rows_pass, fp8_weights._cols_pass, w, *qs, flag)),
            ("reference", lambda *qs: write_where(flag, qs, K.quantize_weight_pair_reference(w)))):
        outs = poisoned()
        write(*outs)
        _assert_equal(outs, fresh if gate else poisoned(), f"{name}, gate {gate}")


FINGERPRINT_CASES = [  # (dtype, shapes): 32-bit words, 16-bit words (odd byte counts of 4), several tensors, empty
    (torch.bfloat16, [(3, 5, 8), (4, 6)]), (torch.bfloat16, [(4, 6), (4, 6)]), (torch.bfloat16, [(3, 5, 7)]), (torch.float32, [(33,), (2, 3), (0,)]),
    (torch.float16, [(5,), (9000,)]), (torch.float64, [(4, 4)])]


@pytest.mark.parametrize("dtype,shapes", FINGERPRINT_CASES)
def test_fingerprint_kernel_matches_reference_and_sees_every_change(dtype, shapes):
    """Kernel and reference keep the same state bit for bit, call after call; the verdict is "changed" on
    the first call, after any one-element edit (in any tensor, at either end), a swap of two elements, or
    the tensors given in another order, and "unchanged" otherwise."""
    gen = torch.Generator().manual_seed(len(shapes) * 7 + sum(map(len, shapes)))
    ts = [torch.randn(s, generator=gen).to(DEVICE, dtype) for s in shapes]
    states = {impl: K.fingerprint.new_state(DEVICE) for impl in (K.fingerprint_triton, K.fingerprint_reference)}

    def verdict(tensors):
        for impl, state in states.items():
            impl(tensors, state)
        (a, s_a), (b, s_b) = states.items()
        assert torch.equal(s_a, s_b), (s_a.tolist(), s_b.tolist())
        assert s_a[2:5].eq(0).all(), "accumulators and ticket are cleared for the next call"
        return int(s_a[K.fingerprint.CHANGED])

    assert verdict(ts) == 1, "first call"
    assert verdict(ts) == 0, "unchanged"
    big = max(range(len(ts)), key=lambda i: ts[i].numel())
    flat = ts[big].view(-1)
    for where in (0, flat.numel() - 1):
        old = flat[where].clone()
        flat[where] = old * 2 + 1
        assert verdict(ts) == 1, f"one element at {where}"
        assert verdict(ts) == 0
        flat[where] = old
        assert verdict(ts) == 1, "and back"
    if flat.numel() > 1:
        flat[[0, 1]] = flat[[1, 0]].clone()
        assert verdict(ts) == 1, "a swap of two elements"
    if len(ts) > 1 and ts[0].shape == ts[-1].shape:
        assert verdict(ts[::-1]) == 1, "the same tensors in another order"
    assert int(states[K.fingerprint_triton][K.fingerprint.COUNT]) >= 4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("S,J,D", [(7, 3, 33), (5, 2, 5000), (0, 2, 8), (9, 1, 16)] +
                         ([(1031, 6, 2048)] if DEVICE == "cuda" else []))
def test_fan_out_fp8_quantizes_once_per_source_row(S, J, D, dtype):
    """The dispatch's fan-out with the rowwise e4m3 of each source row written into its ``J`` slots: kernel
    and reference bit for bit, and both bit for bit what the rowwise quantizer makes of the copies (quantizing
    once per token before the fan-out changes no bit); with ``copies=False`` the same e4m3 and nothing else."""
    gen = torch.Generator().manual_seed(S * 31 + D)
    x = _rows_input(S, D, dtype, gen)
    index = torch.randperm(S * J, generator=gen).view(S, J).to(DEVICE)
    got = K.fan_out_fp8_triton(x, index, S * J)
    want = K.fan_out_fp8_reference(x, index, S * J)
    _assert_equal(got, want, "fan_out_fp8")
    _assert_equal(got[0:1], K.fan_out_reference(x, index, S * J)[:1], "the copies")
    _assert_equal(got[1:], K.quantize_rows_reference(got[0]), "quantized once per source row")
    for impl in (K.fan_out_fp8_triton, K.fan_out_fp8_reference):  # the e4m3 alone: the same bits, no copies
        out, q, s = impl(x, index, S * J, copies=False)
        assert out.shape == (0, D)
        _assert_equal([q, s], got[1:], f"{impl}, copies=False")


@pytest.mark.parametrize("dtype", DTYPES)
def test_fan_out_fp8_skips_copies_marked_minus_one(dtype):
    """A ``-1`` in the index skips that copy (the EP receiver's fan-out: a received token's copies for other
    ranks' experts): the named rows bit for bit the reference's, nothing written elsewhere."""
    S, J, D = 11, 4, 40
    gen = torch.Generator().manual_seed(5)
    x = _rows_input(S, D, dtype, gen)
    rows = S * J + 3
    index = torch.randperm(rows, generator=gen)[: S * J].view(S, J)
    index = torch.where(torch.rand(S, J, generator=gen) < 0.4, -1, index).to(DEVICE)
    named = torch.zeros(rows + 1, dtype=torch.bool, device=DEVICE)
    named[torch.where(index >= 0, index, rows).reshape(-1)] = True
    named = named[:rows]
    got = K.fan_out_fp8_triton(x, index, rows)
    want = K.fan_out_fp8_reference(x, index, rows)
    _assert_equal([t[named] for t in got], [t[named] for t in want], "fan_out_fp8 with skipped copies")
    assert (got[0][~named] == 0).all(), "rows past M*J no copy names are zero"
