"""The chunk rule for token counts (docs/design.md §2), as pure integer functions.

For ``T`` valid tokens on an axis of ``n`` ranks::

    padded_local_tokens  p = ceil(T / n)        (0 when T == 0)
    padded_global_tokens   = p * n
    local_tokens(r)        = clamp(T - r * p, 0, p)
    offset(r)              = min(r * p, T)

This is ``torch.chunk`` / DTensor ``Shard`` semantics. All padding sits at the
tail of the padded global buffer, so after an all-gather of ``p`` rows per
rank the valid rows are exactly ``[0, T)``.

>>> chunk_counts(5, 4)
[2, 2, 1, 0]
>>> padded_local_tokens(5, 4), padded_global_tokens(5, 4)
(2, 8)
"""

from __future__ import annotations

__all__ = [
    "padded_local_tokens",
    "padded_global_tokens",
    "local_tokens",
    "chunk_offset",
    "chunk_counts",
    "contiguous_strides",
]


def padded_local_tokens(total: int, size: int) -> int:
    """Rows every rank contributes to a collective: ``ceil(total / size)``."""
    return -(-total // size)


def padded_global_tokens(total: int, size: int) -> int:
    """The virtually padded global length: ``padded_local_tokens * size``."""
    return padded_local_tokens(total, size) * size


def local_tokens(total: int, size: int, rank: int) -> int:
    """Valid rows held by ``rank``: ``clamp(total - rank * p, 0, p)``."""
    p = padded_local_tokens(total, size)
    return max(0, min(p, total - rank * p))


def chunk_offset(total: int, size: int, rank: int) -> int:
    """Global index of the first valid row held by ``rank``."""
    return min(rank * padded_local_tokens(total, size), total)


def chunk_counts(total: int, size: int) -> list[int]:
    """Valid rows of every rank, in rank order."""
    return [local_tokens(total, size, r) for r in range(size)]


def contiguous_strides(shape: "tuple[int, ...] | list[int]") -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (``torch.empty(shape).stride()``), no allocation.

    >>> contiguous_strides((5, 0, 3))
    (3, 3, 1)
    """
    strides, acc = [], 1
    for size in reversed(tuple(shape)):
        strides.append(acc)
        acc *= max(int(size), 1)
    return tuple(reversed(strides))
