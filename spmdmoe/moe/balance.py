"""Load statistics, the aux-loss-free bias update and the auxiliary loss.

Legend: ``T`` tokens this rank holds, ``E`` experts, ``K`` top-k.

Counting rule: every rank counts only the valid tokens it *holds* (its own
rows; in gather mode the rows that came from it), so the sum over the layer's
"load axes" (the distinct token holders: the SP axis and the EP axis, once
each when they are the same group) counts every token exactly once. Counts
taken while autograd recomputes a checkpointed forward are not accumulated a
second time.

* ``tokens_per_expert`` (int64 buffer, not saved): this rank's counts since
  the last :func:`update_expert_bias`.
* :func:`update_expert_bias`: sums the counts over the load axes (one
  ``all_reduce`` each; every rank of them must call it), then the DeepSeek-V3
  sign update ``bias += coeff * sign(mean(load) - load)`` (centred). The
  summed counts are the same integers on every rank, so ``expert_bias`` stays
  bitwise identical everywhere.
* aux loss ``coeff * E * sum_e f_e * P_e``, per batch (the layer's "aux
  axes": the SP axis, which one batch spans; not EP when it carries separate
  batches, not DP, as in torchtitan and Megatron's default): ``f_e`` the
  fraction of the batch's routed copies that chose expert ``e`` (no
  gradient), ``P_e`` the mean score of ``e`` over the batch's tokens. Each
  rank's value uses its own tokens' scores in ``P_e``, so the values of a
  batch's ranks sum to the single-device aux loss of that batch, and so do
  their gradients.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .._dist import all_reduce
from ..types.mesh import MeshAxis

__all__ = ["count_tokens", "in_recompute", "reduce_counts", "aux_loss", "update_expert_bias"]


def in_recompute() -> bool:
    """True while autograd's engine runs this forward (activation-checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1


def count_tokens(ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routed copies per expert (int64, on the ids' device)."""
    return torch.bincount(ids_TK.reshape(-1), minlength=num_experts)


def reduce_counts(counts_E: torch.Tensor, axes: Sequence[MeshAxis]) -> torch.Tensor:
    """The sum of ``counts_E`` over the load axes (a new tensor; one all_reduce per axis)."""
    total = counts_E.clone()
    for axis in axes:
        all_reduce(total, group=axis.group)
    return total


def aux_loss(scores_TE: torch.Tensor, total_counts_E: torch.Tensor, top_k: int, coeff: float) -> torch.Tensor:
    """This rank's share of ``coeff * E * sum_e f_e * P_e`` (see the module docstring)."""
    copies = total_counts_E.sum().clamp(min=1).to(torch.float32)
    f_E = total_counts_E.to(torch.float32) / copies
    P_E = scores_TE.sum(dim=0) / (copies / top_k)
    return coeff * total_counts_E.numel() * (f_E * P_E).sum()


@torch.no_grad()
def update_expert_bias(
    expert_bias: torch.Tensor, tokens_per_expert: torch.Tensor, coeff: float, axes: Sequence[MeshAxis]
) -> torch.Tensor:
    """Apply the sign update from the counts summed over ``axes``; reset the counts; return the sums."""
    load = reduce_counts(tokens_per_expert, axes).to(torch.float32)
    delta = coeff * torch.sign(load.mean() - load)
    expert_bias.add_((delta - delta.mean()).to(expert_bias.dtype))
    tokens_per_expert.zero_()
    return load
