"""A whole transformers model under sequence parallelism: :func:`sequence_parallel` and :func:`sp_batch`.

Legend: ``B`` batch, ``T`` the whole sequence, ``L`` this rank's part of it, ``H`` / ``Hkv`` query / key-value
heads, ``h`` a head's width.

``swap_moe(model, sp_mesh=sp)`` runs the MoE blocks over SP; the rest of the model must then see only this rank's
chunk of the sequence too, and still compute what one process computes on the whole sequence
(``docs/porting.md``, section 4). :func:`sequence_parallel` does that for transformers' decoder models:

* **Attention** (transformers' attention interface, implementation ``"spmdmoe_sp"``): each layer all-gathers its
  keys and values over SP (``spmdmoe.all_gather``: exact ``T`` rows; its backward a reduce-scatter) and runs
  ``scaled_dot_product_attention`` of this rank's queries against every key, causal by global position.
* **Positions**: a forward pre-hook agrees ``T`` over SP (``spmdmoe.from_local`` of the ids: one small
  exchange a forward; a split that breaks the chunk rule, or a refused argument below on one rank, raises on
  every rank) and passes ``position_ids``
  starting at this rank's offset (``spmdmoe.chunk_offset``) when the call gives none.
* **Dense gradients**: every parameter outside the swapped MoE blocks gets its gradient summed over SP
  (``spmdmoe.moe.replicate_grads``); the blocks sum their gate's and shared experts' themselves. So after the
  backward every rank holds the one-process gradients: keep the SP axis out of your data parallelism.
* **Loss**: :func:`sp_batch` gives each rank its chunk of the ids with the next token of each as its label
  (``shift_labels``, crossing the chunk boundary) and the whole batch's count (``num_items_in_batch``), so each
  rank's loss is its share of the one-process mean: their sum is that mean.

Refused (``MoEConfigError``): MoE blocks not swapped over this SP mesh, an ``attention_mask`` (no padding
under SP: pack or drop it), sliding-window attention, a KV cache. The MoE layer's rows follow the chunk rule
of ``B * T`` tokens: ``B = 1`` (any ``T``), or ``T`` a multiple of the SP size. Eager (the pre-hook's exchange
is a host read).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import AttentionInterface

from ..collectives import all_gather
from ..construct import _from_local, shard
from ..moe import replicate_grads
from ..types.errors import MoEConfigError
from ..types.layout import chunk_offset
from ..types.mesh import MeshAxis, MeshLike, mesh_axis
from ..types.placement import Shard
from ..types.tensor import SPMDTensor
from .transformers import SwappedMoeBlock, _families

__all__ = ["sequence_parallel", "sp_batch", "IMPLEMENTATION"]

IMPLEMENTATION = "spmdmoe_sp"  # the attention implementation's name in transformers' registry


class _Sequence:
    """This forward's SP facts, shared by a model's attention layers: the axis and the agreed ``T``."""

    def __init__(self, axis: MeshAxis):
        self.axis = axis
        self.tokens: Optional[int] = None


_SEQUENCES: dict[int, _Sequence] = {}  # id(model config) -> its SP facts


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
               sliding_window: Optional[int] = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: ``query`` (B, H, L, h), ``key`` (B, Hkv, L, h), ``value`` (B, Hkv, L, h_v)
    of this rank's chunk -> ``(B, L, H, h_v)``, every key of the sequence gathered over SP."""
    seq = _SEQUENCES.get(id(module.config))
    if seq is None or seq.tokens is None:
        raise MoEConfigError(f"attention implementation {IMPLEMENTATION!r} outside a model prepared by "
                             "spmdmoe.integrations.transformers_sp.sequence_parallel; call that first")
    if sliding_window is not None or attention_mask is not None:
        raise MoEConfigError("sequence_parallel: sliding-window attention and attention masks are not supported "
                             "under SP; use full causal attention without padding")
    axis, T, h = seq.axis, seq.tokens, key.shape[-1]
    kv = SPMDTensor(torch.cat([key, value], dim=-1), axis, Shard(2), global_tokens=T)
    full = all_gather(kv).local
    key, value = full[..., :h], full[..., h:]
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    L = query.shape[2]
    first = chunk_offset(T, axis.size, axis.rank)
    mask = torch.arange(T, device=query.device) <= torch.arange(first, first + L, device=query.device)[:, None]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _before_forward(seq: _Sequence) -> Any:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        ids = kwargs.get("input_ids", args[0] if args else None)
        rows = ids if ids is not None else kwargs.get("inputs_embeds")
        if rows is None:
            raise MoEConfigError("sequence_parallel: the model needs input_ids or inputs_embeds")
        problem = None  # this rank's, raised on every rank by the exchange below (never here alone: peers would wait)
        if kwargs.get("attention_mask") is not None or (len(args) > 1 and args[1] is not None):
            problem = ("config", f"rank {seq.axis.rank}: sequence_parallel: an attention_mask was passed; drop it "
                                 "(no padding under SP: every token of the sequence attends causally)")
        elif kwargs.get("use_cache") or kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
            problem = ("config", f"rank {seq.axis.rank}: sequence_parallel: a KV cache was asked for; pass "
                                 "use_cache=False (no cache under SP)")
        seq.tokens = _from_local(rows, seq.axis, Shard(1), None, False, 0, problem=problem).global_tokens
        kwargs["use_cache"] = False
        if kwargs.get("position_ids") is None:
            first = chunk_offset(seq.tokens, seq.axis.size, seq.axis.rank)
            positions = torch.arange(first, first + rows.shape[1], device=rows.device)
            kwargs["position_ids"] = positions.unsqueeze(0).expand(rows.shape[0], -1)
        return args, kwargs
    return hook


def sequence_parallel(model: nn.Module, sp_mesh: MeshLike) -> nn.Module:
    """Run transformers model ``model`` (a decoder whose MoE blocks :func:`swap_moe` swapped with this
    ``sp_mesh``, or one without MoE blocks) sequence-parallel over ``sp_mesh`` (module docstring); returns it.
    Call it once, on every rank, after ``swap_moe``; feed it :func:`sp_batch`'s chunks."""
    axis = mesh_axis(sp_mesh)
    blocks = [n for n, m in model.named_modules() if isinstance(m, SwappedMoeBlock)]
    others = [n for n in blocks if getattr(model.get_submodule(n).layer, "sp", None) != axis]
    if others:
        raise MoEConfigError(f"sequence_parallel: {', '.join(others)} not swapped over this SP mesh; call "
                             "swap_moe(model, sp_mesh=...) with the same mesh first")
    families = _families()
    unswapped = [n for n, m in model.named_modules() if type(m) in families]
    if unswapped:
        raise MoEConfigError(f"sequence_parallel: {', '.join(unswapped)} not swapped; call swap_moe(model, "
                             "sp_mesh=...) first")
    AttentionInterface.register(IMPLEMENTATION, _attention)
    model.set_attn_implementation(IMPLEMENTATION)
    if model.config._attn_implementation != IMPLEMENTATION:
        raise MoEConfigError(f"sequence_parallel: {type(model).__name__} does not take the attention implementation "
                             f"{IMPLEMENTATION!r} (transformers' attention interface)")
    seq = _Sequence(axis)
    for m in model.modules():
        config = getattr(m, "config", None)
        if config is not None:
            _SEQUENCES[id(config)] = seq
    model.register_forward_pre_hook(_before_forward(seq), with_kwargs=True)
    moe = {f"{b}.{n}" for b in blocks for n, _ in model.get_submodule(b).named_parameters()}
    replicate_grads(model, axis, include=lambda name: name not in moe, overlap=False)
    return model


def sp_batch(input_ids_BT: torch.Tensor, sp_mesh: MeshLike, ignore_index: int = -100) -> dict[str, Any]:
    """This rank's part of a batch ``input_ids_BT`` (the whole batch, the same on every rank) for a model under
    :func:`sequence_parallel`: ``input_ids`` and ``labels`` its chunk of the sequence (chunk rule), ``shift_labels``
    each of its tokens' next token (``ignore_index`` after the last), ``num_items_in_batch`` the batch's number
    of targets, so transformers' causal-LM loss on this rank is its share of the one-process mean."""
    axis = mesh_axis(sp_mesh)
    local = shard(input_ids_BT, axis, dim=1).local
    following = F.pad(input_ids_BT[:, 1:], (0, 1), value=ignore_index)
    return {"input_ids": local, "labels": local, "shift_labels": shard(following, axis, dim=1).local,
            "num_items_in_batch": int(input_ids_BT.shape[0] * (input_ids_BT.shape[1] - 1))}
