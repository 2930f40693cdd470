"""A whole transformers model under sequence parallelism: :func:`sequence_parallel` and :func:`sp_batch`.

Legend: ``B`` batch, ``S`` the batch's length, ``T`` the token stream (``B * S`` tokens: the batch's rows one after
the other), ``L`` this rank's part of it, ``J`` the keys this rank's queries may see, ``H`` / ``Hkv`` query /
key-value heads, ``h`` a head's width, ``E`` experts, ``K`` top-k.

``swap_moe(model, sp_mesh=sp)`` runs the MoE blocks over SP; :func:`sequence_parallel` runs the rest of a
transformers decoder model over SP too (attention gathering keys and values, global positions, dense gradients
summed, the loss and the load-balancing loss over the whole batch), and :func:`sp_batch` hands each rank its chunk
of the batch laid out as one stream. What it computes, refuses and costs: ``docs/porting.md``, "transformers";
how: ``docs/design.md`` §12.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from transformers import AttentionInterface

from ..agreement import Field, Problem, agree
from ..collectives import all_gather
from ..construct import shard
from ..moe import replicate_grads
from ..types.errors import MoEConfigError
from ..types.layout import chunk_offset, local_tokens
from ..types.mesh import MeshAxis, MeshLike, mesh_axis
from ..types.placement import Shard
from ..types.tensor import SPMDTensor
from .transformers import SwappedMoeBlock, _families

__all__ = ["sequence_parallel", "sp_batch", "SPBatch", "IMPLEMENTATION", "KWARG", "BATCH"]

IMPLEMENTATION = "spmdmoe_sp"  # the attention implementation's name in transformers' registry
KWARG = "spmdmoe_sequence"  # the call's keyword that carries a _Context down to every attention layer
BATCH = "spmdmoe_batch"  # the call's keyword that carries sp_batch's SPBatch to the pre-hook
_UNSUPPORTED = ("softcap", "s_aux", "sinks", "position_bias")  # attention arguments this attention cannot honour
_STREAM = Field("stream length (sp_batch's tokens)", fix="every rank must pass sp_batch(...) of the same batch")
_AUX = Field("load-balancing loss (output_router_logits)", MoEConfigError,
             fix="pass the same output_router_logits on every rank")


@dataclass(frozen=True)
class SPBatch:
    """The whole batch as :func:`sp_batch` lays it out, the same on every rank: ``tokens`` ``T`` (``B * S``),
    ``kept`` the tokens the attention mask keeps (``T`` without one), ``start_T`` int64 ``(T,)`` the stream index
    where each token's sequence (its row, or its packed document) starts, ``kept_T`` bool ``(T,)`` the attention
    mask (``None``: every token)."""

    tokens: int
    kept: int
    start_T: torch.Tensor
    kept_T: Optional[torch.Tensor]


@dataclass(frozen=True)
class _Context:
    """What every attention layer of one forward needs: the SP axis, ``T``, the first key this rank's queries
    see (``first_key``; the keys end at its last query) and the ``(L, J)`` bool mask over them."""

    axis: MeshAxis
    tokens: int
    first_key: int
    mask_LJ: torch.Tensor


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
               sliding_window: Optional[int] = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: ``query`` (1, H, L, h), ``key`` (1, Hkv, L, h), ``value`` (1, Hkv, L, h_v)
    of this rank's chunk -> ``(1, L, H, h_v)``, the keys of the stream gathered over SP. The :class:`_Context`
    comes with the call (:data:`KWARG`), so a recompute under activation checkpointing sees its own forward's."""
    ctx: Optional[_Context] = kwargs.get(KWARG)
    if ctx is None:
        raise MoEConfigError(f"attention implementation {IMPLEMENTATION!r} outside a model prepared by "
                             "spmdmoe.integrations.transformers_sp.sequence_parallel; call that first")
    unsupported = [k for k in _UNSUPPORTED if kwargs.get(k) is not None]
    if sliding_window is not None or attention_mask is not None or unsupported:
        raise MoEConfigError(f"sequence_parallel: {type(module).__name__} asks for "
                             f"{', '.join(unsupported) or 'sliding-window attention or a mask of its own'}, which "
                             "the SP attention does not compute; only full causal attention is supported")
    h = key.shape[-1]
    kv = SPMDTensor(torch.cat([key, value], dim=-1), ctx.axis, Shard(2), global_tokens=ctx.tokens)
    seen = all_gather(kv).local[:, :, ctx.first_key:ctx.first_key + ctx.mask_LJ.shape[1]]
    key, value = seen[..., :h], seen[..., h:]
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=ctx.mask_LJ, dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _mask(batch: SPBatch, first: int, rows: int, device: torch.device) -> tuple[int, torch.Tensor]:
    """``(first_key, mask_LJ)`` for this rank's queries ``[first, first + rows)`` of the stream: causal within each
    sequence, keys the attention mask drops left out. One host read (where the first query's sequence starts)."""
    start_T = batch.start_T.to(device)
    first_key = int(start_T[first]) if rows else first
    q, k = torch.arange(first, first + rows, device=device), torch.arange(first_key, first + rows, device=device)
    mask_LJ = (k <= q[:, None]) & (start_T[k] == start_T[q][:, None])
    if batch.kept_T is not None:
        mask_LJ &= batch.kept_T.to(device)[k]
    return first_key, mask_LJ


class _Balance:
    """One forward's load-balancing sums (transformers' ``load_balancing_loss_func``, split by rank): per layer,
    the top-k counts of this rank's kept tokens (no gradient; summed over SP after the forward) and their router
    probabilities, recorded by a forward hook on each swapped block's gate. Activation checkpointing's recompute
    (after the forward closed) computes them again, unrecorded, so that it saves what the forward saved: the last
    forward's choice and mask hold until the next forward (a recompute follows its own forward's backward)."""

    def __init__(self) -> None:
        self.wanted = False
        self.kept_L: Optional[torch.Tensor] = None
        self.open: Optional[tuple[int, list[torch.Tensor], list[torch.Tensor]]] = None

    def start(self, wanted: bool, kept_L: Optional[torch.Tensor], kept: int) -> None:
        """A forward begins; ``kept_L``: float ``(L,)``, the attention mask of this rank's tokens (``None``: all);
        ``kept``: the batch's kept tokens."""
        self.wanted, self.kept_L = wanted, kept_L
        self.open = (kept, [], []) if wanted else None

    def record(self, gate: nn.Module, args: Any, output: tuple[torch.Tensor, ...]) -> None:
        """The gate's forward hook: ``output`` is transformers' router triple, ``(logits_LE, weights, ids_LK)``."""
        if not self.wanted:
            return
        logits_LE, _, ids_LK = output
        kept_L = self.kept_L
        K = ids_LK.shape[-1]
        probs_LE = torch.softmax(logits_LE, dim=-1)  # as transformers: in the logits' dtype, top-k of it
        top_LK = torch.topk(probs_LE, K, dim=-1).indices
        weight_L = torch.ones(top_LK.shape[0], device=probs_LE.device) if kept_L is None else kept_L
        counts_E = torch.zeros(probs_LE.shape[-1], device=probs_LE.device).scatter_add_(
            0, top_LK.reshape(-1), weight_L.repeat_interleave(K))
        probs_E = (probs_LE.float() * weight_L[:, None]).sum(0)
        if self.open is not None:  # not a recompute
            self.open[1].append(counts_E)
            self.open[2].append(probs_E)

    def close(self, axis: MeshAxis) -> Optional[torch.Tensor]:
        """This rank's share of ``E * sum_e f_e * P_e`` over every layer's kept tokens of the batch (``None`` if
        no forward is open); the counts summed over SP (one all-reduce)."""
        if self.open is None:
            return None
        kept, counts, probs = self.open
        self.open = None
        counts_E = torch.stack(counts).sum(0)
        if dist.is_initialized() and axis.size > 1:
            dist.all_reduce(counts_E, group=axis.group)
        rows = len(counts) * kept
        return (counts_E / rows * (torch.stack(probs).sum(0) / rows)).sum() * counts_E.numel()


def _refused(module: nn.Module, args: tuple, kwargs: dict, batch: Optional[SPBatch], balance: bool) -> Optional[str]:
    """What this rank's call asks for that SP cannot give (raised on every rank by the exchange), or ``None``."""
    def given(name: str, index: int) -> bool:
        return kwargs.get(name) is not None or (len(args) > index and args[index] is not None)
    checks = [
        (batch is None, f"the call has no {BATCH!r}: feed the model sp_batch(...)'s dict, "
                        "model(**sp_batch(input_ids, sp_mesh))"),
        (given("input_ids", 0) == (kwargs.get("inputs_embeds") is not None),
         "pass exactly one of input_ids and inputs_embeds"),
        (given("attention_mask", 1), "an attention_mask was passed to the model; pass it to "
                                     "sp_batch(..., attention_mask=...) instead"),
        (bool(kwargs.get("use_cache")) or any(kwargs.get(k) is not None for k in ("cache", "past_key_values")),
         "a KV cache was asked for; pass use_cache=False"),
        (balance and getattr(module, "router_aux_loss_coef", None) is None,
         f"output_router_logits is on, but {type(module).__name__} computes no load-balancing loss to take them; "
         "call the causal-LM model (e.g. Qwen3MoeForCausalLM) or turn output_router_logits off"),
        (balance and kwargs.get("return_dict") is False, "return_dict=False with the load-balancing loss; drop it"),
    ]
    return next((fix for bad, fix in checks if bad), None)


def _before_forward(axis: MeshAxis, balance: _Balance) -> Any:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        batch = kwargs.pop(BATCH, None)
        # the load-balancing loss: the call's output_router_logits, else the config's (transformers' rule)
        asked = kwargs.get("output_router_logits")
        config = getattr(module, "config", None)
        wanted = bool(getattr(config, "output_router_logits", False) if asked is None else asked)
        found = Problem()
        fix = _refused(module, args, kwargs, batch, wanted)
        rows = kwargs.get("input_ids", args[0] if args else None)
        rows = rows if rows is not None else kwargs.get("inputs_embeds")
        T = batch.tokens if batch is not None else -1
        if fix is not None:
            found.add("config", f"rank {axis.rank}: sequence_parallel: {fix}")
        elif tuple(rows.shape[:2]) != (expected := (1, local_tokens(T, axis.size, axis.rank))):
            found.add("input_layout", f"rank {axis.rank}: sequence_parallel: expected this rank's chunk of the "
                                      f"{T}-token stream, {expected} tokens, found {tuple(rows.shape[:2])}; feed "
                                      "the model sp_batch(...)'s dict")
        # this rank's problem rides the exchange: every rank raises it together (never one alone: peers would wait)
        agree("sequence_parallel", axis, found, [(_STREAM, T), (_AUX, int(wanted))])
        first, L = chunk_offset(T, axis.size, axis.rank), rows.shape[1]
        first_key, mask_LJ = _mask(batch, first, L, rows.device)
        kwargs["use_cache"] = False
        if wanted:  # spmdmoe computes the load-balancing loss (_after_forward), transformers not
            kwargs["output_router_logits"] = False
        kwargs[KWARG] = _Context(axis, T, first_key, mask_LJ)
        kept_T = batch.kept_T
        balance.start(wanted, None if kept_T is None else kept_T[first:first + L].to(rows.device, torch.float32),
                      batch.kept)
        return args, kwargs
    return hook


def _after_forward(axis: MeshAxis, balance: _Balance) -> Any:
    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        share = balance.close(axis)
        if share is not None:  # transformers' own order: aux_loss, and the loss plus its coefficient times it
            output["aux_loss"] = share
            if output.get("loss") is not None:
                output["loss"] = output["loss"] + module.router_aux_loss_coef * share.to(output["loss"].device)
        return output
    return hook


def sequence_parallel(model: nn.Module, sp_mesh: MeshLike) -> nn.Module:
    """Run transformers model ``model`` (a decoder whose MoE blocks :func:`swap_moe` swapped with this
    ``sp_mesh``, or one without MoE blocks) sequence-parallel over ``sp_mesh`` (module docstring); returns it.
    Call it once, on every rank, after ``swap_moe``; call the model with :func:`sp_batch`'s dict."""
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
    AttentionInterface.register(IMPLEMENTATION, _attention)
    model.set_attn_implementation(IMPLEMENTATION)
    if model.config._attn_implementation != IMPLEMENTATION:
        raise MoEConfigError(f"sequence_parallel: {type(model).__name__} does not take the attention implementation "
                             f"{IMPLEMENTATION!r} (transformers' attention interface)")
    balance = _Balance()
    for name in blocks:
        model.get_submodule(name).gate.register_forward_hook(balance.record)
    model.register_forward_pre_hook(_before_forward(axis, balance), with_kwargs=True)
    model.register_forward_hook(_after_forward(axis, balance))
    moe = {f"{b}.{n}" for b in blocks for n, _ in model.get_submodule(b).named_parameters()}
    replicate_grads(model, axis, include=lambda name: name not in moe, overlap=False)
    return model


def sp_batch(input_ids_BS: torch.Tensor, sp_mesh: MeshLike, *, attention_mask: Optional[torch.Tensor] = None,
             position_ids: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
             ignore_index: int = -100) -> dict[str, Any]:
    """This rank's part of a batch for a model under :func:`sequence_parallel`, as keyword arguments of its call.

    ``input_ids_BS`` (B, S) int64, the whole batch, the same on every rank (so a bad shape raises ``ValueError``
    on every rank, before any exchange); ``attention_mask`` (B, S) 0/1, its padding; ``position_ids`` (B, S) or
    (1, S), its positions (packed documents: with no ``attention_mask``, a position that does not follow the one
    before starts a new document, transformers' rule); ``labels`` (B, S) the targets (default ``input_ids``, with
    ``ignore_index`` where the attention mask is 0), each token learning its row's next one.

    Returns ``input_ids``, ``labels``, ``shift_labels`` (each token's target), ``position_ids``: this rank's chunk
    (chunk rule) of the stream of the ``B`` rows end to end, ``(1, L)`` each; ``num_items_in_batch``, the batch's
    number of targets, so transformers' causal-LM loss on this rank is its share of the one-process mean; and
    :data:`BATCH`, the stream's :class:`SPBatch`."""
    B, S = input_ids_BS.shape
    device = input_ids_BS.device
    wrong = [f"{name} {tuple(t.shape)}" for name, t, shapes in (
        ("attention_mask", attention_mask, [(B, S)]), ("position_ids", position_ids, [(B, S), (1, S)]),
        ("labels", labels, [(B, S)])) if t is not None and tuple(t.shape) not in shapes]
    if wrong:
        raise ValueError(f"sp_batch: input_ids are {(B, S)}, but {', '.join(wrong)}; give every tensor of the batch "
                         f"its (batch, length) shape")
    positions_BS = (torch.arange(S, device=device) if position_ids is None else position_ids.to(device)).expand(B, S)
    starts_BS = torch.zeros(B, S, dtype=torch.bool, device=device)
    starts_BS[:, 0] = True
    if position_ids is not None and attention_mask is None:
        starts_BS[:, 1:] = positions_BS.diff(dim=1) != 1
    T = B * S
    start_T = torch.where(starts_BS.reshape(-1), torch.arange(T, device=device), 0).cummax(0).values
    kept_T = None if attention_mask is None else attention_mask.to(device).reshape(-1).bool()
    targets_BS = input_ids_BS if labels is None else labels.to(device)
    if labels is None and attention_mask is not None:
        targets_BS = targets_BS.masked_fill(attention_mask.to(device) == 0, ignore_index)
    following_BS = F.pad(targets_BS[:, 1:], (0, 1), value=ignore_index)
    axis = mesh_axis(sp_mesh)
    chunk = lambda x_BS: shard(x_BS.reshape(1, T), axis, dim=1).local  # noqa: E731
    return {"input_ids": chunk(input_ids_BS), "labels": chunk(targets_BS), "shift_labels": chunk(following_BS),
            "position_ids": chunk(positions_BS), "num_items_in_batch": int((following_BS != ignore_index).sum()),
            BATCH: SPBatch(T, T if kept_T is None else int(kept_T.sum()), start_T, kept_T)}
