"""``MoE``: the single-device layer, and the row pipeline every layout shares.

Legend: ``T`` tokens (valid rows only), ``D`` model dim, ``F`` expert hidden
dim, ``E`` experts, ``e`` local experts, ``K`` top-k, ``R`` rows received by
the local experts, ``H`` the shared experts' hidden dim (``num_shared_experts * F``).

Pipeline (``docs/design.md``, MoE data flow): route the valid rows -> count
load (training only) -> dispatch (``RoutedTokens``) -> grouped SwiGLU experts
-> combine (weighted gather-sum over the K copies). ``parallelize_moe`` runs
the same pipeline with other weights (its slices, gradient-synced views) and
another transport.

Problems whose verdict could differ between ranks (input layout, width, dtype
on one rank; non-finite router logits) are never raised here: they go to the
transport as problem bits (``spmdmoe.agreement``), which either carries them
in its count exchange or records them in the sticky flag.
"""

from __future__ import annotations

import weakref
from typing import Optional, Union

import torch
import torch.nn as nn

from ..agreement import BIT
from ..sticky import Problem, ProblemFlag
from ..types.checks import checks_enabled
from ..types.errors import SPMDDtypeError, SPMDShapeError
from ..types.mesh import MeshAxis
from . import balance
from .checkpoint import install_hooks
from .config import MoEConfig
from .dispatch import LocalTransport, SizedTransport, Transport
from .experts import GroupedExperts, SharedExperts
from .init import init_parameters
from .permute import count_per_expert
from .router import Router

__all__ = ["MoE"]

SHARED_WEIGHTS = ("shared_experts.w1.weight", "shared_experts.w2.weight", "shared_experts.w3.weight")


class _Layer(nn.Module):
    """Parameters, buffers and the bias/load API shared by ``MoE`` and the parallel layer."""

    config: MoEConfig
    expert_slice: slice  # the global experts this layer holds
    hidden_slice: slice  # the hidden units of each expert it holds (tensor-parallel experts: a slice)
    load_axes: tuple[MeshAxis, ...] = ()  # every token holder of a step: load counts, bias update
    aux_axes: tuple[MeshAxis, ...] = ()  # the ranks one batch spans: the aux loss is per batch

    def _build(
        self, config: MoEConfig, router: Router, experts: GroupedExperts, shared: Optional[SharedExperts],
        expert_bias: torch.Tensor,
    ) -> None:
        self.config = config
        self.router = router
        self.experts = experts
        self.shared_experts = shared
        self.register_buffer("expert_bias", expert_bias)
        counts = torch.zeros(config.num_experts, dtype=torch.int64, device=expert_bias.device)
        self.register_buffer("tokens_per_expert", counts, persistent=False)
        self.aux_loss: Optional[torch.Tensor] = None
        # problems recorded for the step boundary (spmdmoe.sticky); a failed step's load counts are dropped
        self.register_buffer("problem_bits", torch.zeros((), dtype=torch.int64, device=expert_bias.device),
                             persistent=False)  # the sticky flag's storage on the layer's device
        counter = weakref.ref(self)
        self.problems = ProblemFlag(lambda: (layer := counter()) is not None and layer.tokens_per_expert.zero_(),
                                    home=lambda: (layer := counter()) and layer.problem_bits)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        """``expert_bias`` stays fp32 whatever ``.to()`` / ``.half()`` does (its ±coeff steps would round away)."""
        bias = self._buffers.get("expert_bias")
        out = super()._apply(fn, recurse)
        moved = self._buffers.get("expert_bias")
        if bias is not None and moved is not None and moved.dtype != torch.float32:
            source = moved if bias.is_meta else bias
            self._buffers["expert_bias"] = source.to(device=moved.device, dtype=torch.float32)
        return out

    def init_weights(self, init_std: float = 0.02, generator: Optional[torch.Generator] = None) -> None:
        """Truncated-normal init (torchtitan's: std 0.02 for ``w1``, ``init_std`` elsewhere); ``expert_bias``
        and the load counts to zero. A parallel layer initialises only its shards and gets exactly the
        weights the single-device ``MoE`` gets from the same generator state (``spmdmoe.moe.init``): pass
        the same state on every rank. Parameters on the meta device are skipped."""
        init_parameters(self, init_std, generator, self.expert_slice, self.hidden_slice, self.config.hidden_dim)

    def reset_buffers(self) -> None:
        """Zero the layer's buffers (bias, load counts, problem and capacity flags): after ``to_empty``."""
        for buf in self.buffers():
            if not buf.is_meta:
                buf.zero_()

    def weights(self) -> dict[str, torch.Tensor]:
        """The dense parameters the pipeline reads (router, shared experts), by name.

        The router gate comes cast to the router's dtype (``MoEConfig.router_dtype``,
        fp32 by default), so its gradient is made in fp32 and rounded once. The
        routed experts read their own parameters (``GroupedExperts.forward``).
        """
        return {n: p.to(self.read_dtype(n, p)) for n, p in self.dense_params().items()}

    def dense_params(self) -> dict[str, torch.Tensor]:
        """The parameters :meth:`weights` reads, by name, uncast."""
        return {n: p for n, p in self.named_parameters() if not n.startswith("experts.")}

    def read_dtype(self, name: str, p: torch.Tensor) -> torch.dtype:
        """The dtype the pipeline reads dense parameter ``name`` in (the router: ``router_dtype``)."""
        return torch.float32 if name == "router.gate.weight" and self.config.router_dtype == "float32" else p.dtype

    def compute_dtype(self) -> torch.dtype:
        """The dtype the layer computes in, and so expects its input in: its router gate's."""
        return self.router.gate.weight.dtype

    def update_expert_bias(self) -> torch.Tensor:
        """Apply the aux-loss-free bias update and reset the counts; returns the summed load.

        Call it once per optimizer step (e.g. from an optimizer pre-step
        hook), on every rank of the layer's load axes, before the optimizer
        step. Without ``load_balance_coeff`` it only sums and resets the
        counts. It also raises, on every rank, any problem a rank recorded
        during the step (``spmdmoe.sticky``: one host sync per call).
        """
        coeff = self.config.load_balance_coeff
        return balance.update_expert_bias(self.expert_bias, self.tokens_per_expert, coeff or 0.0, self.load_axes,
                                          self.problems)

    def expert_load(self) -> torch.Tensor:
        """Tokens per expert since the last update, summed over the load axes (a collective)."""
        return balance.reduce_counts(self.tokens_per_expert, self.load_axes)

    def _pipeline(
        self, h_TD: torch.Tensor, w: dict[str, torch.Tensor], transport: Union[Transport, SizedTransport],
        own: Optional[torch.Tensor] = None, problem: Optional[Problem] = None, t_max: Optional[int] = None,
        shared_of: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Route, count, dispatch, experts, combine: ``(routed output, shared experts' output)``. ``own``: a bool
        mask of the rows this rank holds (load counting, aux loss, the non-finite check; ``None``: all). A
        mask, not a slice: its bounds would make a compiled graph depend on the token count.

        ``problem``: this rank's problem bits so far; the router adds non-finite
        logits of its own rows (checks on) and the transport carries or records them.
        ``t_max``: what a ``SizedTransport`` (sync-free EP) is sized by this forward (``sync_free.layer_t_max``);
        ``None`` for the others.
        ``shared_of``: the rows the shared experts take (``None``: no shared output), run while the combine's
        rows travel (``Transport.launch_combine``), their backward while the output gradient does; the caller
        adds their output.
        """
        cfg = self.config
        r = self.router(h_TD, self.expert_bias, w["router.gate.weight"])
        weights_TK = r.weights_TK
        # reset only where an aux loss exists: torch 2.11's compile refuses any attribute write inside activation
        # checkpointing, so a layer without one (the torchtitan drop-in's) writes none
        if cfg.aux_loss_coeff is not None:
            self.aux_loss = None
        if self.training:  # not grad mode: a rank-local value must not decide whether the aux all-reduce runs
            counts_E = count_per_expert(r.ids_TK, cfg.num_experts, own)
            grad = torch.is_grad_enabled()  # a forward whose backward can run (balance.py)
            if grad:
                weights_TK = balance.count_on_backward(weights_TK, counts_E, self)
            if cfg.aux_loss_coeff is not None:
                total_E = balance.reduce_counts(counts_E, self.aux_axes)  # with grad off too: peers may train
                own_scores = r.scores_TE if own is None else r.scores_TE * own.unsqueeze(1)
                self.aux_loss = balance.aux_loss(own_scores, total_E, cfg.top_k, cfg.aux_loss_coeff) if grad else None
        problem = problem or Problem()
        problem.flag = self.problems
        if checks_enabled():
            finite_TE = torch.isfinite(r.logits_TE)
            if own is not None:
                finite_TE = finite_TE | ~own.unsqueeze(1)
            problem.bits = problem.bits | (~finite_TE.all()).to(torch.int64) * BIT["nonfinite"]
        sized = {} if t_max is None else {"t_max": t_max}  # a SizedTransport's, and only its
        received = transport.launch_dispatch(h_TD, r.ids_TK, weights_TK, problem=problem,
                                             fp8_rows=self.experts.precision == "fp8_rowwise", **sized)
        # made between the dispatch's launch and its wait, so its node (the up-projection's weight gradients)
        # runs in the backward after the wait's, under the input gradient's exchange (wgrad_later.py); only
        # where that exchange is in flight (else the split would only keep the operands longer)
        later = self.experts.later_wgrad() if transport.backward_in_flight else None
        routed = received()
        y = self.experts(routed) if later is None else self.experts(routed, later=later)
        if shared_of is None or self.shared_experts is None:  # nothing to run under the combine: at once
            return transport.combine(y, routed), None
        returned = transport.launch_combine(y, routed)
        # under the combine's rows in flight, and (made between its launch and wait) their backward under the
        # output gradient's exchange, as the anchor's weight gradients are under dx's
        shared_TD = self.shared_experts(shared_of, *(w[n] for n in SHARED_WEIGHTS))
        return returned(), shared_TD

    @staticmethod
    def _plus(out_TD: torch.Tensor, shared_TD: Optional[torch.Tensor]) -> torch.Tensor:
        """The routed experts' output plus the shared experts' (when the layer has them)."""
        return out_TD if shared_TD is None else out_TD + shared_TD


class MoE(_Layer):
    """A Mixture-of-Experts layer on one device: ``forward(x_TD) -> y_TD``.

    Output = sum_k weight_k * expert_k(x) + shared(x). Parameters:
    ``router.gate.weight`` (E, D); ``experts.w1`` (E, F, D), ``experts.w2``
    (E, D, F), ``experts.w3`` (E, F, D); with shared experts
    ``shared_experts.w{1,2,3}.weight`` ((H, D), (D, H), (H, D), ``H = num_shared_experts * F``). Buffers:
    ``expert_bias`` (E,) (saved), ``tokens_per_expert`` (E,) (not saved).
    ``load_state_dict`` also takes torchtitan names and DTensors (see
    ``spmdmoe.moe.checkpoint``). ``expert_bias`` stays fp32 under ``.to()``.
    Leading dims of ``x`` are flattened into tokens. With ``aux_loss_coeff``,
    ``self.aux_loss`` holds the aux loss of the last training-mode forward with
    grad (add it to the loss); otherwise it is ``None``. A non-finite router
    logit is recorded and raised by :func:`spmdmoe.check_errors` or
    :meth:`update_expert_bias` (``spmdmoe.agreement``).

    >>> import torch
    >>> from spmdmoe.moe import MoE, MoEConfig
    >>> moe = MoE(MoEConfig(dim=8, hidden_dim=16, num_experts=4, top_k=2))
    >>> moe(torch.randn(5, 8)).shape
    torch.Size([5, 8])
    """

    def __init__(self, config: MoEConfig):
        super().__init__()
        shared = (
            SharedExperts(config.dim, config.num_shared_experts * config.hidden_dim)
            if config.num_shared_experts
            else None
        )
        experts = GroupedExperts(config.num_experts, config.dim, config.hidden_dim, config.expert_precision,
                                 config.fp8_wgrad)
        self._build(config, Router(config), experts, shared, torch.zeros(config.num_experts, dtype=torch.float32))
        self.expert_slice, self.hidden_slice = slice(0, config.num_experts), slice(0, config.hidden_dim)
        self.transport = LocalTransport(config.num_experts)
        install_hooks(self, None)
        self.init_weights()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        D = self.config.dim
        if x.dim() == 0 or x.shape[-1] != D:
            raise SPMDShapeError(f"MoE expects (..., dim={D}) input, found shape {tuple(x.shape)}")
        if x.dtype != self.compute_dtype():
            raise SPMDDtypeError(
                f"MoE computes in {self.compute_dtype()} (its parameters' dtype), found input of dtype {x.dtype}; "
                f"cast the input (x.to({self.compute_dtype()})) or the layer (.to({x.dtype}))"
            )
        x_TD = x.reshape(-1, D)
        w = self.weights()
        out_TD = self._plus(*self._pipeline(x_TD, w, self.transport, shared_of=x_TD))
        return out_TD.view(x.shape)


