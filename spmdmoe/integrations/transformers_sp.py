"""A whole transformers model under sequence parallelism: :func:`sequence_parallel` and :func:`sp_batch`.

Legend: ``B`` batch, ``T`` the whole sequence, ``L`` this rank's part of it, ``H`` / ``Hkv`` query / key-value
heads, ``h`` a head's width.

``swap_moe(model, sp_mesh=sp)`` runs the MoE blocks over SP; the rest of the model must then see only this rank's
chunk of the sequence too, and still compute what one process computes on the whole sequence
(``docs/porting.md``, section 4). :func:`sequence_parallel` does that for transformers' decoder models:

* **Attention** (transformers' attention interface, implementation ``"spmdmoe_sp"``): each layer all-gathers its
  keys and values over SP (``spmdmoe.all_gather``: exact ``T`` rows; its backward a reduce-scatter) and runs
  ``scaled_dot_product_attention`` of this rank's queries against every key, causal by global position.
* **Positions**: a forward pre-hook on the decoder (``model.base_model``) agrees ``T`` over SP
  (``spmdmoe.from_local`` of the ids: one small exchange a forward; a split that breaks the chunk rule, or a
  refused argument below on one rank, raises on every rank), passes ``position_ids`` starting at this rank's
  offset (``spmdmoe.chunk_offset``), and passes ``(axis, T)`` down to the attention layers as a keyword of the
  call (:data:`KWARG`), so activation checkpointing's recompute sees its own forward's.
* **Dense gradients**: every parameter outside the swapped MoE blocks gets its gradient summed over SP
  (``spmdmoe.moe.replicate_grads``); the blocks sum their gate's and shared experts' themselves. So after the
  backward every rank holds the one-process gradients: keep the SP axis out of your data parallelism.
* **Loss**: :func:`sp_batch` gives each rank its chunk of the ids with the next token of each as its label
  (``shift_labels``, crossing the chunk boundary) and the whole batch's count (``num_items_in_batch``), so each
  rank's loss is its share of the one-process mean: their sum is that mean.

Refused (``MoEConfigError``; a call's arguments on every rank when one rank passes them): MoE blocks not swapped
over this SP mesh, tied parameters (``tie_word_embeddings``), an ``attention_mask`` (no padding under SP),
``position_ids`` (packed documents), a KV cache, ``output_router_logits`` (transformers' load-balancing loss
would be each rank's own, not the batch's), and attention that asks for a sliding window, a soft cap, sinks or a
position bias. The MoE layer's rows follow the chunk rule of ``B * T`` tokens: ``B = 1`` (any ``T``), or ``T`` a
multiple of the SP size. Eager (the pre-hook's exchange is a host read); activation checkpointing in its
non-reentrant form (transformers' default: a reentrant recompute would bypass the SP sums). Cost: each layer
gathers its keys and values after the projection (DeepSeek-V3's attention: per head, not its compressed latent).
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

__all__ = ["sequence_parallel", "sp_batch", "IMPLEMENTATION", "KWARG"]

IMPLEMENTATION = "spmdmoe_sp"  # the attention implementation's name in transformers' registry


KWARG = "spmdmoe_sequence"  # the decoder call's keyword that carries (axis, T) down to every attention layer
_UNSUPPORTED = ("softcap", "s_aux", "sinks", "position_bias")  # attention arguments this attention cannot honour


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
               sliding_window: Optional[int] = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: ``query`` (B, H, L, h), ``key`` (B, Hkv, L, h), ``value`` (B, Hkv, L, h_v)
    of this rank's chunk -> ``(B, L, H, h_v)``, every key of the sequence gathered over SP. ``(axis, T)`` come with
    the call (:data:`KWARG`), so a recompute under activation checkpointing sees its own forward's."""
    sequence = kwargs.get(KWARG)
    if sequence is None:
        raise MoEConfigError(f"attention implementation {IMPLEMENTATION!r} outside a model prepared by "
                             "spmdmoe.integrations.transformers_sp.sequence_parallel; call that first")
    unsupported = [k for k in _UNSUPPORTED if kwargs.get(k) is not None]
    if sliding_window is not None or attention_mask is not None or unsupported:
        raise MoEConfigError(f"sequence_parallel: {type(module).__name__} asks for "
                             f"{', '.join(unsupported) or 'sliding-window attention or a mask'}, which the SP "
                             "attention does not compute; only full causal attention is supported")
    axis, T = sequence
    h = key.shape[-1]
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


def _refused(kwargs: dict, args: tuple, config: Any) -> Optional[str]:
    """What this rank's call asks for that SP cannot give (raised on every rank by the exchange), or ``None``."""
    given = lambda name, index: kwargs.get(name) is not None or (len(args) > index and args[index] is not None)  # noqa: E731
    checks = [
        (given("input_ids", 0) == (kwargs.get("inputs_embeds") is not None),
         "pass exactly one of input_ids and inputs_embeds"),
        (given("attention_mask", 1), "an attention_mask was passed; drop it (no padding under SP: every token "
                                     "of the sequence attends causally)"),
        (given("position_ids", 2), "position_ids were passed; drop them (sequence_parallel gives each rank its "
                                   "global positions; packed documents are not supported)"),
        (bool(kwargs.get("use_cache")) or kwargs.get("cache") is not None
         or kwargs.get("past_key_values") is not None, "a KV cache was asked for; pass use_cache=False"),
        (bool(kwargs.get("output_router_logits", getattr(config, "output_router_logits", False))),
         "output_router_logits is on: transformers' load-balancing loss would be each rank's alone (not the "
         "batch's); turn it off under SP"),
    ]
    return next((fix for bad, fix in checks if bad), None)


def _before_forward(axis: MeshAxis) -> Any:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        fix = _refused(kwargs, args, getattr(module, "config", None))
        ids = kwargs.get("input_ids", args[0] if args else None)
        rows = ids if ids is not None else kwargs.get("inputs_embeds")
        problem = None if fix is None else ("config", f"rank {axis.rank}: sequence_parallel: {fix}")
        # this rank's problem rides the exchange: every rank raises it together (never one alone: peers would wait)
        T = _from_local(rows, axis, Shard(1), None, False, 0, problem=problem).global_tokens
        first = chunk_offset(T, axis.size, axis.rank)
        positions = torch.arange(first, first + rows.shape[1], device=rows.device)
        kwargs.update(use_cache=False, position_ids=positions.unsqueeze(0).expand(rows.shape[0], -1))
        kwargs[KWARG] = (axis, T)
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
    if model.__dict__.get("_spmdmoe_replicated") is not None:
        raise MoEConfigError("sequence_parallel was already applied to this model (or replicate_grads was)")
    shared = {id(p) for _, p in model.named_parameters()}
    if len(shared) != sum(1 for _ in model.named_parameters(remove_duplicate=False)):
        raise MoEConfigError("sequence_parallel: the model ties parameters (e.g. tie_word_embeddings: lm_head and "
                             "embed_tokens are one tensor), whose gradient replicate_grads would sum over SP for "
                             "one use only; untie them (config.tie_word_embeddings=False) before loading")
    AttentionInterface.register(IMPLEMENTATION, _attention)
    model.set_attn_implementation(IMPLEMENTATION)
    if model.config._attn_implementation != IMPLEMENTATION:
        raise MoEConfigError(f"sequence_parallel: {type(model).__name__} does not take the attention implementation "
                             f"{IMPLEMENTATION!r} (transformers' attention interface)")
    decoder = getattr(model, "base_model", model)  # the call that passes its keywords down to the attention layers
    decoder.register_forward_pre_hook(_before_forward(axis), with_kwargs=True)
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
