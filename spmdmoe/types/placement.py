"""Placements: how a tensor is laid out along one mesh axis.

==============  ==========================================================
``Shard(dim)``  the token dimension ``dim`` is split by the chunk rule
``Replicate()`` every rank holds the same full tensor
``Partial()``   every rank holds a summand; the tensor is their sum
``Varying()``   every rank holds its own rows; there is no global tensor
==============  ==========================================================

Placements are immutable, hashable and compare by value, so they can be used
in ``typing_extensions.Annotated`` hints and as dictionary keys (the
redistribute transition table is keyed by placement kinds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

__all__ = ["Shard", "Replicate", "Partial", "Varying", "Placement"]


@dataclass(frozen=True)
class Shard:
    """The tensor is split along ``dim`` by the chunk rule (docs/design.md §2).

    >>> Shard(0)
    Shard(dim=0)
    """

    dim: int = 0


@dataclass(frozen=True)
class Replicate:
    """Every rank holds an identical copy of the whole tensor.

    Gradient convention: the gradient of a replicated tensor is ``Partial``
    (each rank's use of its copy contributes one summand).
    """


@dataclass(frozen=True)
class Partial:
    """Every rank holds one summand; the logical tensor is their sum.

    >>> Partial()
    Partial(reduce_op='sum')
    """

    reduce_op: Literal["sum"] = "sum"

    def __post_init__(self) -> None:
        if self.reduce_op != "sum":
            raise ValueError(
                f"Partial(reduce_op={self.reduce_op!r}) is not supported: expected 'sum'. "
                "Only sum-partials have a well-defined gradient convention here."
            )


@dataclass(frozen=True)
class Varying:
    """Every rank holds its own rows (a per-rank batch, an all-to-all result).

    There is no global tensor, so ``global_tokens`` is undefined; each rank's
    row count is its own business.
    """


Placement = Union[Shard, Replicate, Partial, Varying]
