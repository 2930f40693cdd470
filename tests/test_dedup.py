"""The rank-deduplicated dispatch's index maths (``spmdmoe.moe.transports.dedup``), in one process.

``destinations`` and ``send_positions`` against a loop over the tokens, packed and with a slot (tokens past
a block's slot dropped), with zero tokens, one rank, every token's experts on the lower half of the ranks (one
rank at n = 2), and tokens that need no rank (a table given directly); on a GPU also compiled with inductor,
static and dynamic shapes, equal to eager and to the loop (torch 2.11's inductor could not generate code for
the scan the positions were computed with before, static shapes only: ``vs_torchtitan.py`` at EP 4). The rows
that carry their weights and ids (``launch_tokens``' packing) both ways, any width and dtype.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from spmdmoe.moe.transports.dedup import destinations, send_positions

# T tokens, K top-k, E experts, e local experts, n EP ranks


def _positions_by_loop(need_Tn: torch.Tensor, slot: Optional[int]) -> torch.Tensor:
    T, n = need_Tn.shape
    out_Tn = torch.full((T, n), -1, dtype=torch.int64)
    start = 0
    for d in range(n):
        within = 0
        for t in range(T):
            if need_Tn[t, d]:
                if slot is None:
                    out_Tn[t, d] = start + within
                elif within < slot:
                    out_Tn[t, d] = d * slot + within
                within += 1
        start += within
    return out_Tn


def _routing(T: int, E: int, K: int, seed: int, one_rank: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(T, E, generator=gen)
    if one_rank:
        scores[:, E // 2:] = -1  # every token's experts on the first ranks' half
    return scores.topk(K, dim=1).indices


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("T", [0, 1, 7, 300])
def test_destinations_and_positions_match_a_loop(n, T):
    E, K = 16, 3
    for seed, one_rank in ((0, False), (1, True)):
        ids_TK = _routing(T, E, K, seed, one_rank)
        need_Tn = destinations(ids_TK, E // n, n)
        want = torch.zeros(T, n, dtype=torch.bool)
        for t in range(T):
            for k in range(K):
                want[t, int(ids_TK[t, k]) // (E // n)] = True
        assert torch.equal(need_Tn, want)
        for slot in (None, 0, 1, max(T // 3, 1), T):
            assert torch.equal(send_positions(need_Tn, slot), _positions_by_loop(need_Tn, slot)), (slot, one_rank)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("fill", [0.0, 0.3, 1.0])
def test_positions_of_any_table_match_a_loop(n, fill):
    """Tables ``destinations`` never makes: tokens that need no rank (a token whose copies were all
    dropped), or every rank."""
    need_Tn = torch.rand(300, n, generator=torch.Generator().manual_seed(n)) < fill
    for slot in (None, 0, 1, 50, 300):
        assert torch.equal(send_positions(need_Tn, slot), _positions_by_loop(need_Tn, slot)), slot


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_positions_compile_with_inductor_on_cuda(n, dynamic):
    torch._dynamo.reset()
    E, K = 64, 6

    def positions(ids_TK: torch.Tensor, slot: Optional[int]) -> torch.Tensor:
        return send_positions(destinations(ids_TK, E // n, n), slot)

    run = torch.compile(positions, fullgraph=True, dynamic=dynamic)
    for T in (16384, 300):
        ids_TK = _routing(T, E, K, T).cuda()
        for slot in (None, T // (2 * n)):
            got = run(ids_TK, slot)
            assert torch.equal(got, positions(ids_TK, slot)), (T, slot)
            if T == 300:  # and the loop's, off the GPU
                need_Tn = destinations(ids_TK.cpu(), E // n, n)
                assert torch.equal(got.cpu(), _positions_by_loop(need_Tn, slot)), (T, slot)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("D,K", [(33, 3), (16, 1), (1, 6), (2048, 6)])
def test_rows_carry_their_weights_and_ids(dtype, D, K):
    """``launch_tokens``' packed rows (``dedup._Pack``, ``dedup._Unpack``; the exchange between them left out, as
    on one rank): each row arrives at its send position with its exact weights and ids, any ``D`` (odd, narrow,
    wide) and row dtype; backward, a row's gradient is its copies' sum and its weights' gradient the sum of their
    weights' gradients, in the weights' dtype (a bit pattern summed as rows would not be)."""
    from spmdmoe.moe.transports.dedup import _meta, _Pack, _Unpack

    gen = torch.Generator().manual_seed(D + K)
    T, n, E = 7, 3, 12
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ids_TK = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(device)
    need_Tn = destinations(ids_TK, E // n, n)
    pos_Tn = send_positions(need_Tn)
    sent = int(need_Tn.sum())
    x_TD = torch.randn(T, D, generator=gen, dtype=torch.float64).to(device, dtype).requires_grad_()
    w_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    w_TK = torch.rand(T, K, generator=gen, dtype=torch.float64).to(device, w_dtype).requires_grad_()
    meta_dtype = torch.promote_types(w_dtype, torch.float32)
    rows_SP = _Pack.apply(x_TD, w_TK, ids_TK, pos_Tn, sent, meta_dtype)
    assert rows_SP.shape[1] % 16 == 0 and rows_SP.shape[1] >= D
    x_SD, w_SK, ids_SK = _Unpack.apply(rows_SP, D, K, meta_dtype)
    tok_S = torch.full((sent,), -1, dtype=torch.int64, device=device)
    tok_S[pos_Tn[pos_Tn >= 0]] = torch.arange(T, device=device).unsqueeze(1).expand(T, n)[pos_Tn >= 0]
    assert torch.equal(x_SD, x_TD.detach()[tok_S])
    assert torch.equal(w_SK, w_TK.detach()[tok_S].to(meta_dtype))
    assert torch.equal(ids_SK, ids_TK[tok_S].to(meta_dtype)) and not ids_SK.requires_grad
    gx_SD = torch.randn(sent, D, generator=gen, dtype=torch.float64).to(device, dtype)
    gw_SK = torch.randn(sent, K, generator=gen, dtype=torch.float64).to(device, meta_dtype)
    torch.autograd.backward([x_SD, w_SK], [gx_SD, gw_SK])
    want_x = torch.zeros(T, D, dtype=torch.float64, device=device).index_add_(0, tok_S, gx_SD.double())
    want_w = torch.zeros(T, K, dtype=torch.float64, device=device).index_add_(0, tok_S, gw_SK.double())
    tol = {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(x_TD.grad.double(), want_x.to(dtype).double(), **tol)
    torch.testing.assert_close(w_TK.grad.double(), want_w, rtol=1e-6, atol=1e-6)
    assert _meta(rows_SP, D, K, meta_dtype).data_ptr() % meta_dtype.itemsize == 0
