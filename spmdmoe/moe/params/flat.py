"""Many gradients as one flat buffer and back: what every gradient collective here sends.

``flatten`` concatenates tensors into one 1-D buffer; ``split_as`` cuts a buffer back into views
of the given shapes (no copy); ``by_dtype`` groups tensors by dtype first (one buffer per dtype, dtypes in a
fixed order, so every rank issues the same collectives). Used by the SP gradient sums (``grads.py``,
``overlap.py``) and the batch reductions (``data_parallel.py``).
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["flatten", "split_as", "by_dtype"]


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors one after another in one 1-D buffer (a copy)."""
    return torch.cat([t.reshape(-1) for t in tensors])


def split_as(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """Views of ``flat``'s consecutive parts with ``shapes`` (the inverse of :func:`flatten`)."""
    return [part.view(shape) for part, shape in zip(flat.split([shape.numel() for shape in shapes]), shapes)]


def by_dtype(tensors: Sequence[torch.Tensor]) -> list[tuple[list[int], torch.Tensor]]:
    """``(indices, flat)`` per dtype, dtypes in a fixed order: the tensors of one dtype flattened, detached. One
    collective per buffer, eager or compiled, waited for at once or at a join: the same collectives on
    every rank whichever way it runs."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return [(idx, flatten([tensors[i].detach() for i in idx]))
            for _, idx in sorted(groups.items(), key=lambda kv: str(kv[0]))]
