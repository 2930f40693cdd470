"""Each Triton kernel against its plain-torch reference, on fresh random data.

On CPU the kernels run under ``TRITON_INTERPRET=1`` (set by ``conftest.py``),
so the shapes are small; on a GPU the same tests run the compiled kernels,
plus larger shapes. Exact where both round once from the same fp32 value
(copies, weighted copies, SwiGLU up to the exp implementation: 1 ulp); sums
of ``J`` rows to fp32 rounding (their order differs from torch's reduction).
"""

from __future__ import annotations

import pytest
import torch

from spmdmoe import kernels as K

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.usefixtures("three_programs")  # conftest.py: the row kernels' loop turns


DTYPES = [torch.bfloat16, torch.float32]
# (S, J, D): odd sizes, one copy, wide rows past one block, empty
SHAPES = [(7, 3, 33), (5, 1, 16), (3, 2, 1500), (0, 4, 8), (1, 6, 1)]
if DEVICE == "cuda":
    SHAPES += [(4099, 6, 2048), (333, 8, 1408)]


def _ulp(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}


def _perm(S: int, J: int, rows: int, gen: torch.Generator, skips: bool = False) -> torch.Tensor:
    """Distinct output rows for the ``S*J`` copies; ``skips``: about a third of them ``-1`` (skipped)."""
    index = torch.randperm(rows, generator=gen)[: S * J].view(S, J)
    if skips:
        index = torch.where(torch.rand(S, J, generator=gen) < 1 / 3, -1, index)
    return index.to(DEVICE)


def _named(index: torch.Tensor, rows: int) -> torch.Tensor:
    """The output rows ``index`` names (its ``-1`` entries name none)."""
    named = torch.zeros(rows + 1, dtype=torch.bool, device=index.device)
    named[torch.where(index >= 0, index, rows).reshape(-1)] = True
    return named[:rows]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("S,J,D", SHAPES)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("extra_rows", [0, 5])
@pytest.mark.parametrize("skips", [False, True])
def test_fan_out(S, J, D, dtype, weighted, extra_rows, skips):
    gen = torch.Generator().manual_seed(S * 1000 + J * 10 + D)
    rows = S * J + extra_rows
    src = torch.randn(S, D, generator=gen).to(DEVICE, dtype)
    index = _perm(S, J, rows, gen, skips)
    w = torch.rand(S, J, generator=gen).to(DEVICE) if weighted else None
    other = torch.randn(rows, D, generator=gen).to(DEVICE, dtype)
    other[~_named(index, rows)] = float("nan")  # never read: a skipped copy's dot is 0
    got, dots = K.fan_out_triton(src, index, rows, w, other)
    want, want_dots = K.fan_out_reference(src, index, rows, w, other)
    # rows no index names: zero past M*J rows, else unspecified (skipped copies)
    named = _named(index, rows) if skips and not extra_rows else torch.ones(rows, dtype=torch.bool, device=DEVICE)
    # unweighted: an exact copy; weighted: one rounding of the same fp32 product (the interpreter
    # rounds fp32 -> bf16 its own way, so 1 bf16 ulp)
    torch.testing.assert_close(got[named], want[named], **(_ulp(dtype) if weighted else {"rtol": 0, "atol": 0}))
    torch.testing.assert_close(dots, want_dots, rtol=1e-4, atol=1e-4 * max(D, 1) ** 0.5)
    assert (dots[index < 0] == 0).all()
    if extra_rows:
        assert (got[~_named(index, rows)] == 0).all()
    plain, empty = K.fan_out_triton(src, index, rows)
    assert empty.numel() == 0
    torch.testing.assert_close(plain[named], K.fan_out_reference(src, index, rows)[0][named], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("S,J,D", SHAPES)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("skips", [False, True])
def test_gather_sum_ignores_unnamed_rows(S, J, D, dtype, weighted, skips):
    gen = torch.Generator().manual_seed(S * 7 + J * 3 + D)
    rows = S * J + 4
    src = torch.randn(rows, D, generator=gen).to(DEVICE, dtype)
    index = _perm(S, J, rows, gen, skips)
    src[~_named(index, rows)] = float("nan")  # a capacity buffer: rows past the valid ones hold anything
    w = torch.rand(S, J, generator=gen).to(DEVICE) if weighted else None
    got = K.gather_sum_triton(src, index, w)
    want = K.gather_sum_reference(src, index, w)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, **_ulp(dtype))
    # against an fp64 sum: the kernel accumulates in fp32 and rounds once
    picked = torch.where(index.unsqueeze(-1) >= 0, src.double()[index.clamp(min=0)], 0)  # -1: adds nothing
    exact = (picked * (w.double() if weighted else torch.ones_like(index, dtype=torch.float64)).unsqueeze(-1)).sum(1)
    torch.testing.assert_close(got.double(), exact.to(dtype).double(), **_ulp(dtype))


def test_overflow_record():
    """The record kernel against its reference over random demands around the buffers (no overflow, exactly full,
    over; a state that a forward does or does not beat), the excess a floor of negative values too."""
    gen = torch.Generator().manual_seed(3)
    for _ in range(40):
        S, R, n, t_max = (int(v) for v in torch.randint(1, 300, (4,), generator=gen))
        balanced = max(t_max * 6, 1)
        slot, rows = (torch.randint(0, 2 * v + 1, (), generator=gen).to(DEVICE) for v in (S, R))
        state = torch.randint(-5000, 5000, (4,), generator=gen).to(DEVICE)
        want = state.clone()
        K.overflow_record_reference(slot, rows, want, S, R, n, balanced, t_max)
        K.overflow_record_triton(slot, rows, state, S, R, n, balanced, t_max)
        assert torch.equal(state, want), (S, R, n, t_max, slot, rows)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("S,J,D", [(7, 3, 33), (3, 2, 1500)])
def test_row_kernels_read_a_column_slice(S, J, D, dtype):
    """The row kernels read a column slice of a wider buffer in place (``backend.unit_rows``: no copy; the EP
    dispatch's received rows, ``moe/transports/dedup.py``): the same result as from a contiguous copy."""
    gen = torch.Generator().manual_seed(S + J + D)
    rows = S * J + 2
    wide = torch.randn(rows, D + 21, generator=gen).to(DEVICE, dtype)
    src = wide[:rows, 5:5 + D]
    assert K.backend.unit_rows(src) is src and not src.is_contiguous()
    index = _perm(S, J, rows, gen, skips=True)
    torch.testing.assert_close(K.gather_sum_triton(src, index), K.gather_sum_triton(src.contiguous(), index),
                               rtol=0, atol=0)
    first = src[:S]
    for got, want in ((K.fan_out_triton(first, index, rows), K.fan_out_triton(first.contiguous(), index, rows)),
                      (K.fan_out_fp8_triton(first, index, rows), K.fan_out_fp8_triton(first.contiguous(), index, rows))):
        named = _named(index, rows)
        torch.testing.assert_close(got[0][named], want[0][named], rtol=0, atol=0)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("R,F,valid", [(9, 24, 6), (5, 7, 5), (4, 16, 0), (0, 8, 0), (17, 1408 if DEVICE == "cuda" else 40, 13),
                                       (6, 1100, 5)])
def test_swiglu_valid_rows_only(R, F, valid, dtype, weighted):
    """Kernel vs reference, and the reference vs torch's SwiGLU and its autograd in fp64; ``weighted``: the
    combine's routing weights folded in (``w * silu(h1) * h3``, a zero weight among them), whose gradient
    is the row dot with the unweighted SwiGLU (F = 1100: several column blocks of the dot)."""
    gen = torch.Generator().manual_seed(R * 31 + F + valid)
    h13 = torch.randn(R, 2 * F, generator=gen).to(DEVICE, dtype)
    g = torch.randn(R, F, generator=gen).to(DEVICE, dtype)
    h13[valid:] = float("nan")  # past the device-side count: never read
    g[valid:] = float("nan")
    count = torch.tensor([valid], dtype=torch.int32, device=DEVICE)
    w = None
    if weighted:
        w = torch.rand(R, generator=gen, dtype=torch.float32).to(DEVICE)
        w[::4] = 0.0
        w[valid:] = float("nan")
    got = K.swiglu_forward_triton(h13, count, w)[:valid]
    want = K.swiglu_forward_reference(h13, count, w)
    assert torch.isfinite(want).all() and (want[valid:] == 0).all()
    torch.testing.assert_close(got, want[:valid], **_ulp(dtype))
    d13, dw = K.swiglu_backward_triton(g, h13, count, w)
    r13, rw = K.swiglu_backward_reference(g, h13, count, w)
    torch.testing.assert_close(d13[:valid], r13[:valid], **_ulp(dtype))
    # the reference is torch's own SwiGLU and its autograd on the valid rows
    a, b = (t.double().requires_grad_() for t in h13[:valid].chunk(2, dim=1))
    wd = (w[:valid].double() if weighted else torch.ones(valid, dtype=torch.float64, device=DEVICE)).requires_grad_()
    out = torch.nn.functional.silu(a) * b * wd[:, None]
    out.backward(g[:valid].double())
    torch.testing.assert_close(want[:valid].double(), out.detach().to(dtype).double(), **_ulp(dtype))
    torch.testing.assert_close(r13[:valid].double(), torch.cat([a.grad, b.grad], 1).to(dtype).double(), **_ulp(dtype))
    if weighted:  # fp32 row dots: kernel against reference, and against fp64 autograd
        torch.testing.assert_close(dw[:valid], rw[:valid].float(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rw[:valid].double(), wd.grad, rtol=1e-4, atol=1e-4)
    else:
        assert dw.numel() == 0 and rw.numel() == 0


def test_dispatch_picks_reference_off_cuda():
    assert not K.use_triton("fan_out", torch.zeros(1))
    K.set_kernel_backend("torch")
    try:
        assert not K.use_triton("fan_out", torch.zeros(1, device=DEVICE))
    finally:
        K.set_kernel_backend("auto")
    with pytest.raises(ValueError, match="kernel backend"):
        K.set_kernel_backend("cuda")  # type: ignore[arg-type]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [0, 5])
@torch._dynamo.config.patch(capture_scalar_outputs=True)  # restored after the test
def test_launchers_take_a_data_dependent_row_count_under_compile(rows):
    """EP's received rows are a traced scalar under ``torch.compile`` (``capture_scalar_outputs``): each launcher
    traces with an unbacked row count, and an empty one launches nothing. The Triton kernels (``COMPILED``),
    compiled with ``fullgraph=True``, against the same calls eagerly, for 0 rows and for 5."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(rows)
    D, F = 32, 16
    src = torch.randn(8, D, generator=gen).to(DEVICE, torch.bfloat16)
    h13 = torch.randn(8, 2 * F, generator=gen).to(DEVICE, torch.bfloat16)
    g = torch.randn(8, F, generator=gen).to(DEVICE, torch.bfloat16)

    def pipeline(count: torch.Tensor) -> list[torch.Tensor]:
        M = count.item()
        torch._check_is_size(M)
        torch._check(M <= src.shape[0])
        x, h, gr = src[:M], h13[:M], g[:M]
        index = torch.arange(M, device=src.device).view(M, 1)
        valid = count.view(1).to(torch.int32)
        copies, _ = K.fan_out(x, index, M)
        q, s = K.quantize_rows(x)
        d13, _ = K.swiglu_backward(gr, h, valid)
        return [K.gather_sum(copies, index), K.swiglu_forward(h, valid), d13, q.float(), s,
                *K.swiglu_quant_forward(h, valid)[:1]]

    count = torch.tensor(rows, device=DEVICE)
    want = pipeline(count)
    got = torch.compile(pipeline, backend="aot_eager", fullgraph=True)(count)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.shape[0] == rows
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_skipped_copies_into_fewer_rows_than_copies(dtype, nan_empty):
    """The EP receiver's regime: about half the copies skipped (``-1``, another rank's experts) into fewer
    output rows than copies, the output from ``torch.empty`` (NaN here): the named rows equal the reference's,
    and the gather-sum back reads only them (finite, each source row times its named copies)."""
    gen = torch.Generator().manual_seed(42)
    S, J, D = 13, 4, 40
    keep = torch.rand(S, J, generator=gen) < 0.5
    rows = int(keep.sum()) + 2
    assert rows < S * J
    index = torch.full((S, J), -1, dtype=torch.int64)
    index[keep] = torch.randperm(rows, generator=gen)[: int(keep.sum())]
    index = index.to(DEVICE)
    src = torch.randn(S, D, generator=gen).to(DEVICE, dtype)
    got, _ = K.fan_out_triton(src, index, rows)
    want, _ = K.fan_out_reference(src, index, rows)
    named = _named(index, rows)
    torch.testing.assert_close(got[named], want[named], rtol=0, atol=0)
    back = K.gather_sum_triton(got, index)
    assert torch.isfinite(back).all()
    copies = (index >= 0).sum(1, keepdim=True).to(torch.float32)
    torch.testing.assert_close(back.float(), src.float() * copies, **_ulp(dtype))
    torch.testing.assert_close(back, K.gather_sum_reference(got, index), **_ulp(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, t_max, D", [(2, 5, 33), (3, 4, 1500), (4, 1, 8), (2, 0, 16)])
def test_peer_rows(dtype, n, t_max, D):
    """The two peer moves (``kernels/peer_rows.py``) against their references, with ``n`` plain buffers of this
    process standing in for the peers' mapped ones (the kernels read them through the same address table):
    the masked pull exactly, a masked-off row zero; the sum over ranks exactly on a GPU (fp32, rank order),
    to 1 ulp under the interpreter (its bf16 rounding)."""
    from spmdmoe.kernels.peer_rows import PeerRows, pull_rows_reference, pull_rows_triton, pull_sum_reference, pull_sum_triton

    gen = torch.Generator().manual_seed(n * 100 + t_max)
    views = tuple(torch.randn(n * t_max * D + 5, generator=gen).to(DEVICE, dtype) for _ in range(n))
    for rank, offset in ((0, 0), (n - 1, 5)):  # a region that starts past the buffer's first element
        peers = PeerRows(views, torch.tensor([v.data_ptr() for v in views], device=DEVICE), rank)
        mask = (torch.rand(n * t_max, generator=gen) < 0.6).to(DEVICE)
        got = pull_rows_triton(peers, mask, t_max, D, offset)
        torch.testing.assert_close(got, pull_rows_reference(peers, mask, t_max, D, offset), rtol=0, atol=0)
        assert not got[~mask].any()
        need = (torch.rand(max(t_max - 1, 0), n, generator=gen) < 0.5).to(DEVICE)
        exact = DEVICE == "cuda" or dtype == torch.float32
        torch.testing.assert_close(pull_sum_triton(peers, need, t_max, D, offset),
                                   pull_sum_reference(peers, need, t_max, D, offset),
                                   **({"rtol": 0, "atol": 0} if exact else _ulp(dtype)))


ORDER_SHAPES = [(7, 3, 0, 4, 4), (50, 6, 8, 8, 16), (300, 6, 4, 4, 16), (0, 2, 0, 3, 3), (129, 1, 0, 5, 5),
                (40, 8, 0, 64, 64), (33, 6, 96, 32, 128)]
if DEVICE == "cuda":
    ORDER_SHAPES += [(8192, 6, 32, 32, 64), (65536, 8, 16, 16, 128)]


@pytest.mark.parametrize("M,J,first,e,E", ORDER_SHAPES)
@pytest.mark.parametrize("ids_as", ["int64", "fp32 beside the weights"])
@pytest.mark.parametrize("spare", [5, 0, -7])
def test_expert_order(M, J, first, e, E, ids_as, spare):
    """``kernels/expert_order.py`` against its reference, exactly: ids of every rank (``-1`` among them, as
    int64 or as the fp32 column slice of a ``(M, 2J)`` ids-and-weights tensor), into a buffer with room to
    spare, exactly full, or too small (the copies past it dropped); and the order itself: the local copies'
    rows are the inverse of a stable sort of their experts."""
    gen = torch.Generator().manual_seed(M * 7 + J + first + e)
    ids = torch.randint(-1, E, (M, J), generator=gen)
    local = ((ids >= first) & (ids < first + e)).sum().item()
    rows = max(local + spare, 0)
    x = ids.to(DEVICE)
    if ids_as != "int64":
        x = torch.cat([torch.rand(M, J, generator=gen).to(DEVICE), x.to(torch.float32)], 1)[:, J:]
    got = K.expert_order_triton(x, first, e, rows, E)
    want = K.expert_order_reference(x, first, e, rows, E)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)
    pos, ends, totals = (t.cpu() for t in got)
    assert torch.equal(totals, torch.bincount(ids[ids >= 0], minlength=E))
    here = (ids >= first) & (ids < first + e)
    keys = torch.where(here, ids - first, e).flatten()
    stable = torch.empty_like(keys).scatter_(0, torch.argsort(keys, stable=True), torch.arange(keys.numel()))
    assert torch.equal(pos.flatten(), torch.where(here.flatten() & (stable < rows), stable, -1))
    assert torch.equal(ends, totals[first: first + e].cumsum(0).clamp(max=rows).to(torch.int32))


ROUTE_SHAPES = [(37, 8, 2), (5, 6, 6), (0, 8, 3), (1, 3, 1), (64, 60, 6), (20, 257, 8)]
if DEVICE == "cuda":
    ROUTE_SHAPES += [(16384, 64, 6), (4099, 128, 8)]


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the interpreter's inf - inf (NaN: wanted)
@pytest.mark.parametrize("T,E,K_", ROUTE_SHAPES)
@pytest.mark.parametrize("sigmoid,norm", [(False, False), (True, True), (False, True)])
@pytest.mark.parametrize("keep", [False, True])
def test_topk_route(T, E, K_, sigmoid, norm, keep):
    """``kernels/topk_route.py`` against its reference on random logits and bias: the ids exactly (random
    scores: no tie), the weights and scores to fp32 rounding, the counts of the kept rows and the non-finite
    flag exactly (a NaN logit in one kept and one unkept row, an inf in another unkept one); then every id of
    a row with non-finite logits is a distinct expert. The backward against its reference, with and without
    the scores' gradient, and the reference against autograd through plain ops."""
    gen = torch.Generator().manual_seed(T * 31 + E + K_)
    logits = (3 * torch.randn(T, E, generator=gen)).to(DEVICE)
    bias = (0.1 * torch.randn(E, generator=gen)).to(DEVICE)
    keep_T = (torch.rand(T, generator=gen) < 0.7).to(DEVICE) if keep else None
    args = (K_, sigmoid, norm, 4)
    clean = K.topk_route_triton(logits, bias, keep_T, *args)
    want = K.topk_route_reference(logits, bias, keep_T, *args)
    torch.testing.assert_close(clean[2], want[2], rtol=2e-6, atol=1e-7)
    # rows whose K + 1 best choices are apart (rounding can order a near-tie either way): the same ids and
    # weights; every row: the kernel's choices are the K best to rounding, its counts those of its ids
    choice = want[2] + bias
    best = choice.topk(min(K_ + 1, E), dim=-1).values
    clear = (best[:, :-1] - best[:, 1:] > 1e-5).all(dim=-1) if K_ < E else torch.ones(T, dtype=torch.bool, device=DEVICE)
    assert torch.equal(clean[0][clear], want[0][clear]) and int(clean[3][E]) == int(want[3][E]) == 0
    torch.testing.assert_close(clean[1][clear], want[1][clear], rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(choice.gather(1, clean[0]), best[:, :K_], rtol=0, atol=1e-5)
    kept = torch.ones(T, dtype=torch.long, device=DEVICE) if keep_T is None else keep_T.long()
    counts = torch.zeros(E, dtype=torch.long, device=DEVICE).scatter_add_(0, clean[0].view(-1),
                                                                          kept.repeat_interleave(K_))
    assert torch.equal(clean[3][:E], counts) and (bool(clear.all()) <= torch.equal(clean[3], want[3]))
    assert T == 0 or clear.float().mean() > 0.9  # the data leave most rows clear
    if T >= 3:
        bad = logits.clone()
        bad[0, E // 2], bad[1, 0], bad[2, E - 1] = float("nan"), float("nan"), float("inf")
        mask = torch.tensor([True, False, False] + [True] * (T - 3), device=DEVICE)
        for keep_bad, flag in ((mask, 4), (~mask, 4), (None, 4), (mask & (torch.arange(T, device=DEVICE) > 0), 4)):
            got = K.topk_route_triton(bad, bias, keep_bad, K_, sigmoid, norm, flag)
            ref = K.topk_route_reference(bad, bias, keep_bad, K_, sigmoid, norm, flag)
            assert int(got[3][E]) == int(ref[3][E]) == (4 if keep_bad is None or bool(keep_bad[:3].any()) else 0)
            assert ((got[0] >= 0) & (got[0] < E)).all()
            assert all(len(set(row)) == K_ for row in got[0][:3].tolist())
            assert torch.equal(got[0][3:][clear[3:]], ref[0][3:][clear[3:]]) and int(got[3][:E].sum()) == K_ * (
                T if keep_bad is None else int(keep_bad.sum()))
    ids, w, scores, _ = want
    g_w = torch.randn(T, K_, generator=gen).to(DEVICE)
    for g_s in (None, torch.randn(T, E, generator=gen).to(DEVICE)):
        got = K.topk_route_backward_triton(scores, ids, w, g_w, g_s, sigmoid, norm)
        ref = K.topk_route_backward_reference(scores, ids, w, g_w, g_s, sigmoid, norm)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
        x = logits.clone().requires_grad_()
        s = torch.sigmoid(x) if sigmoid else torch.softmax(x, dim=-1)
        p = s.gather(1, ids)
        p = p / (p.sum(-1, keepdim=True) + 1e-20) if norm else p
        (p * g_w).sum().add((s * g_s).sum() if g_s is not None else 0).backward()
        torch.testing.assert_close(ref, x.grad, rtol=1e-5, atol=1e-6)
