"""Property tests of the chunk rule (docs/design.md §2) for sizes 1..1024 and T in 0..10^7."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spmdmoe.types import layout

sizes = st.integers(min_value=1, max_value=1024)
totals = st.integers(min_value=0, max_value=10**7)


@settings(max_examples=200, deadline=None)
@given(total=totals, size=sizes)
def test_counts_sum_to_total(total, size):
    counts = layout.chunk_counts(total, size)
    assert len(counts) == size
    assert sum(counts) == total
    assert all(c >= 0 for c in counts)


@settings(max_examples=200, deadline=None)
@given(total=totals, size=sizes)
def test_at_most_one_partial_rank_and_padding_only_at_tail(total, size):
    p = layout.padded_local_tokens(total, size)
    counts = layout.chunk_counts(total, size)
    partial = [c for c in counts if 0 < c < p]
    assert len(partial) <= 1
    # full ranks, then at most one partial rank, then empty ranks: non-increasing
    assert counts == sorted(counts, reverse=True)
    assert all(c in (0, p) for c in counts if c not in partial)
    # padding only at the tail: the valid rows of the padded buffer are exactly [0, T)
    if total <= 5000:
        assert [r * p + i for r, c in enumerate(counts) for i in range(c)] == list(range(total))
    else:  # same statement, checked by the per-rank offsets
        assert all(layout.chunk_offset(total, size, r) == r * p for r, c in enumerate(counts) if c)


@settings(max_examples=200, deadline=None)
@given(total=totals, size=sizes)
def test_padded_sizes(total, size):
    p = layout.padded_local_tokens(total, size)
    assert p == (0 if total == 0 else -(-total // size))
    assert layout.padded_global_tokens(total, size) == p * size
    assert 0 <= layout.padded_global_tokens(total, size) - total < max(size, 1)
    for r in range(0, size, max(1, size // 8)):
        start = layout.chunk_offset(total, size, r)
        assert start + layout.local_tokens(total, size, r) <= total


@settings(max_examples=200, deadline=None)
@given(total=st.integers(0, 300), size=st.integers(1, 64))
def test_matches_torch_chunk(total, size):
    chunks = torch.arange(total).chunk(size) if total else ()
    lengths = [len(c) for c in chunks] + [0] * (size - len(chunks))
    assert layout.chunk_counts(total, size) == lengths


def test_documented_example():
    assert layout.chunk_counts(5, 4) == [2, 2, 1, 0]
    assert layout.padded_global_tokens(5, 4) == 8
    assert layout.chunk_counts(0, 4) == [0, 0, 0, 0]
    assert layout.chunk_counts(3, 4) == [1, 1, 1, 0]
