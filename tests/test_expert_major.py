"""``permute.expert_major``: the one map between an EP rank's received rows and its experts' rows.

Legend: ``n`` sources (EP ranks), ``e`` local experts, ``S`` rows of one sync-free slot.

Checked against a plain loop over (source, expert) blocks, for the sync transport's packed buffer and the
sync-free transport's fixed slots (dead rows included), and on CUDA: no host sync (sync debug mode "error")
and capturable in a CUDA graph, replayed on other counts.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from spmdmoe.moe.permute import expert_major


def _loop(recv_ne: torch.Tensor, rows: int, slot: Optional[int]) -> tuple[list[int], list[int], list[int]]:
    """The maps by walking the blocks: expert-major row r <- received row read[r]; ``rows`` marks none."""
    n, e = recv_ne.shape
    counts = recv_ne.tolist()
    read, write = [rows] * rows, [rows] * rows
    r = 0
    for l in range(e):
        for i in range(n):
            start = (i * slot if slot is not None else sum(map(sum, counts[:i]))) + sum(counts[i][:l])
            for k in range(counts[i][l]):
                read[r], write[start + k] = start + k, r
                r += 1
    ends = torch.tensor(counts).sum(0).cumsum(0).tolist()
    return read, write, ends


def _table(g: torch.Generator, n: int, e: int, slot: Optional[int]) -> torch.Tensor:
    raw = torch.randint(0, 5, (n, e), generator=g)
    if slot is None:
        return raw
    kept = raw.cumsum(-1).clamp(max=slot)  # the first S of each slot, in expert order, as the transport keeps
    return torch.diff(kept, dim=-1, prepend=kept.new_zeros(n, 1))


@pytest.mark.parametrize("slots", [False, True], ids=["packed", "slots"])
def test_matches_a_loop_over_blocks(slots):
    g = torch.Generator().manual_seed(3)
    for _ in range(200):
        n, e = (int(v) for v in torch.randint(1, 6, (2,), generator=g))
        slot = int(torch.randint(0, 9, (1,), generator=g)) if slots else None
        recv_ne = _table(g, n, e, slot)
        rows = n * slot if slot is not None else int(recv_ne.sum())
        read_R, write_R, offsets_e = expert_major(recv_ne, rows, slot)
        want = _loop(recv_ne, rows, slot)
        assert (read_R.tolist(), write_R.tolist(), offsets_e.tolist()) == want, (recv_ne, slot)
        assert offsets_e.dtype == torch.int32 and read_R.dtype == write_R.dtype == torch.int64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("slots", [False, True], ids=["packed", "slots"])
def test_no_host_sync_and_graph_capturable_on_cuda(slots):
    n, e, slot = 4, 8, 64
    g = torch.Generator().manual_seed(5)
    tables = [_table(g, n, e, slot if slots else None) for _ in range(3)]
    if not slots:  # the packed buffer's size is a host int the sync transport knows: keep it fixed for the graph
        tables = [tables[0], tables[0][torch.randperm(n, generator=g)], tables[0][:, torch.randperm(e, generator=g)]]
    rows = n * slot if slots else int(tables[0].sum())
    static = tables[0].cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = expert_major(static, rows, slot if slots else None)  # raises on any host sync
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [t.tolist() for t in eager] == list(_loop(tables[0], rows, slot if slots else None))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        expert_major(static, rows, slot if slots else None)  # warm-up off the capture
        with torch.cuda.graph(graph, stream=stream):
            out = expert_major(static, rows, slot if slots else None)
    torch.cuda.current_stream().wait_stream(stream)
    for table in tables[1:]:
        static.copy_(table)
        graph.replay()
        torch.cuda.synchronize()
        assert [t.tolist() for t in out] == list(_loop(table, rows, slot if slots else None))
