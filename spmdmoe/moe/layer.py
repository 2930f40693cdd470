"""``MoE``: the single-device layer, and the route every layout shares (``_Layer.forward``).

Legend: ``T`` tokens (valid rows only), ``D`` model dim, ``F`` expert hidden dim, ``E`` experts, ``e`` local experts,
``K`` top-k, ``Q`` rows the dispatch delivered (a token once per rank), ``R`` rows received by the local experts, ``H``
the shared experts' hidden dim (``num_shared_experts * F``).

The route (``docs/design.md``, MoE data flow): admit -> route the valid rows (count load, training only) -> dispatch
(``RoutedTokens``) -> grouped SwiGLU experts -> combine (weighted gather-sum over the K copies) -> shared experts
-> release. A layer differs only in its collaborators: its admission (one
device: the shape checks here; ``parallelize_moe``: ``parallel/admission.py``), its rows (its own, or gathered over SP),
its transport, and its weights (a parallel layer's slices and gradient-synced views).

Problems whose verdict could differ between ranks (input layout, width, dtype on one rank; non-finite router logits) are
never raised here: they go to the transport as problem bits (``spmdmoe.agreement``), which either carries them in its
count exchange or records them in the sticky flag.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, NamedTuple, Optional, Protocol, Union

import torch
import torch.nn as nn

from ..agreement import Problem
from ..kernels.backend import cast
from ..sticky import ProblemFlag
from ..types.checks import checks_enabled
from ..types.errors import SPMDDtypeError, SPMDShapeError
from ..types.mesh import MeshAxis
from .routing import balance
from .params.checkpoint import install_hooks
from .params.overlap import call_joined
from .config import MoEConfig
from .transports.dispatch import LocalTransport, SizedTransport, Transport
from .transports.routed import RoutedTokens
from .experts.grouped import GroupedExperts, SharedExperts
from .experts.wgrad_later import LaterWgrad
from .params.init import init_parameters
from .routing.router import Router

__all__ = ["MoE"]

SHARED_WEIGHTS = ("shared_experts.w1.weight", "shared_experts.w2.weight", "shared_experts.w3.weight")


class _Layer(nn.Module):
    """Parameters, buffers and the bias/load API shared by ``MoE`` and the parallel layer."""

    config: MoEConfig
    expert_slice: slice  # the global experts this layer holds
    hidden_slice: slice  # the hidden units of each expert it holds (tensor-parallel experts: a slice)
    load_axes: tuple[MeshAxis, ...] = ()  # every token holder of a step: load counts, bias update
    aux_axes: tuple[MeshAxis, ...] = ()  # the ranks one batch spans: the aux loss is per batch
    # the forward's collaborators (``forward``): its input's seam, how its rows reach the router, the moves
    admission: "Admission"
    rows: "Rows"
    transport: Union[Transport, SizedTransport]

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
        weights the single-device ``MoE`` gets from the same generator state (``spmdmoe.moe.params.init``): pass
        the same state on every rank. Parameters on the meta device are skipped."""
        init_parameters(self, init_std, generator, self.expert_slice, self.hidden_slice, self.config.hidden_dim)

    def reset_buffers(self) -> None:
        """Zero the layer's buffers (bias, load counts, problem and capacity flags): after ``to_empty``."""
        for buf in self.buffers():
            if not buf.is_meta:
                buf.zero_()

    def weights(self) -> dict[str, torch.Tensor]:
        """The dense parameters the data path reads (router, shared experts), by name.

        The router gate comes cast to the router's dtype (``MoEConfig.router_dtype``, fp32 by default), so its gradient
        is made in fp32 and rounded once. The routed experts read their own parameters (``GroupedExperts.forward``).
        """
        return {n: cast(p, self.read_dtype(n, p)) for n, p in self.dense_params().items()}

    def dense_params(self) -> dict[str, torch.Tensor]:
        """The parameters :meth:`weights` reads, by name, uncast: all but the routed experts'. (The walk over
        every parameter is kept: under torch 2.11's Dynamo it is what guards the experts' strides, so that
        ``GroupedExperts.unpack`` recompiles: ``tests/test_compile_moe.py``.)"""
        return {n: p for n, p in self.named_parameters() if not n.startswith("experts.")}

    def read_dtype(self, name: str, p: torch.Tensor) -> torch.dtype:
        """The dtype the data path reads dense parameter ``name`` in (the router: ``router_dtype``)."""
        return torch.float32 if name == "router.gate.weight" and self.config.router_dtype == "float32" else p.dtype

    def compute_dtype(self) -> torch.dtype:
        """The dtype the layer computes in, and so expects its input in: its router gate's."""
        return self.router.gate.weight.dtype

    def update_expert_bias(self) -> torch.Tensor:
        """Apply the aux-loss-free bias update and reset the counts; returns the summed load.

        Call it once per optimizer step (e.g. from an optimizer pre-step hook), on every rank of the layer's load axes,
        before the optimizer step. Without ``load_balance_coeff`` it only sums and resets the counts. It also raises, on
        every rank, any problem a rank recorded during the step (``spmdmoe.sticky``: one host sync per call).
        """
        coeff = self.config.load_balance_coeff
        return balance.update_expert_bias(self.expert_bias, self.tokens_per_expert, coeff or 0.0, self.load_axes,
                                          self.problems)

    def expert_load(self) -> torch.Tensor:
        """Tokens per expert since the last update, summed over the load axes (a collective)."""
        return balance.reduce_counts(self.tokens_per_expert, self.load_axes)

    def forward(self, x: Any) -> Any:
        """One call: admit (``self.admission``: the single device's shape checks, or the parallel layer's seam,
        ``parallel/admission.py``) -> the data path (:meth:`_moe`), joined (``params/overlap.py``: the SP
        gradient sums of a parallel layer run under the rest of the backward) -> release."""
        a = self.admission.admit(x, self.transport, self.compute_dtype(), self.expert_bias.device, self.training)
        out_TD = call_joined(self._moe, (a.x_TD, a), {}, self.sp_sync_params)
        return self.admission.release(a, out_TD)

    def _moe(self, x_TD: torch.Tensor, a: Admitted) -> torch.Tensor:
        """The data path, each stage one call into the room that owns it: rows in (``self.rows``: gather mode's
        all-gather, ``parallel/gather_mode.py``) -> route (``routing/``) -> dispatch (``transports/``) -> experts
        (``experts/``) -> combine (``transports/``) -> shared experts (under the combine's rows in flight) ->
        rows out."""
        w = self.weights()
        h_TD, own_T = self.rows.gather(x_TD, a)
        ids_TK, weights_TK = self._route(h_TD, w, own_T, a.problem)
        routed, later = self._dispatch(h_TD, ids_TK, weights_TK, a)
        y = self.experts(routed, later=later)
        returned = self._combine(y, routed)
        shared_TD = self._shared(x_TD, w)
        out_TD = self.rows.scatter(returned(), a)
        return out_TD if shared_TD is None else out_TD + shared_TD

    def sp_sync_params(self) -> list[torch.Tensor]:
        """The parameters whose SP gradient sums the forward joins (none on one device)."""
        return []

    def _route(self, h_TD: torch.Tensor, w: dict[str, torch.Tensor], own_T: Optional[torch.Tensor],
               problem: Problem) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids_TK, weights_TK)`` of the rows ``h_TD`` (``routing/router.py``), and what routing feeds: the load
        counts (training-mode forwards with grad, added by their backward: ``routing/balance.py``), the aux loss,
        and non-finite logits of this rank's rows (checks on) added to ``problem`` on the device. ``own_T``: a bool
        mask of the rows this rank holds (gather mode; ``None``: all). A mask, not a slice: its bounds would make
        a compiled graph depend on the token count."""
        cfg = self.config
        r = self.router(h_TD, self.expert_bias, w["router.gate.weight"], own_T)
        weights_TK = r.weights_TK
        # reset only where an aux loss exists: torch 2.11's compile refuses any attribute write inside activation
        # checkpointing, so a layer without one (the torchtitan drop-in's) writes none
        if cfg.aux_loss_coeff is not None:
            self.aux_loss = None
        if self.training:  # not grad mode: a rank-local value must not decide whether the aux all-reduce runs
            grad = torch.is_grad_enabled()  # a forward whose backward can run (balance.py)
            if grad:
                weights_TK = balance.count_on_backward(weights_TK, r.counts_E, self)
            if cfg.aux_loss_coeff is not None:
                total_E = balance.reduce_counts(r.counts_E, self.aux_axes)  # with grad off too: peers may train
                own_scores = r.scores_TE if own_T is None else r.scores_TE * own_T.unsqueeze(1)
                self.aux_loss = balance.aux_loss(own_scores, total_E, cfg.top_k, cfg.aux_loss_coeff) if grad else None
        if checks_enabled():
            problem.add_device(r.nonfinite)
        return r.ids_TK, weights_TK

    def _dispatch(self, h_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, a: Admitted
                  ) -> tuple[RoutedTokens, Optional[LaterWgrad]]:
        """The rows to their experts' ranks (``self.transport``; a ``SizedTransport`` sized by ``a.t_max``), which
        carries or records ``a.problem``; and the experts' up-projection weight gradients as a node of their own
        where the dispatch's backward exchange is in flight (``experts/wgrad_later.py``)."""
        sized = {} if a.t_max is None else {"t_max": a.t_max}  # a SizedTransport's, and only its
        received = self.transport.launch_dispatch(h_TD, ids_TK, weights_TK, problem=a.problem,
                                                  fp8_rows=self.experts.precision == "fp8_rowwise", **sized)
        # made between the dispatch's launch and its wait, so its node (the up-projection's weight gradients)
        # runs in the backward after the wait's, under the input gradient's exchange (wgrad_later.py); only
        # where that exchange is in flight (else the split would only keep the operands longer)
        later = self.experts.later_wgrad() if self.transport.backward_in_flight else None
        return received(), later

    def _combine(self, y_QD: torch.Tensor, routed: RoutedTokens) -> Callable[[], torch.Tensor]:
        """The experts' rows back to their tokens: launched, to wait for after the shared experts ran under them
        (``Transport.launch_combine``: their backward then runs under the output gradient's exchange), or, with
        no shared experts, made at once (``Transport.combine``: nothing to run under it)."""
        if self.shared_experts is None:
            out_TD = self.transport.combine(y_QD, routed)
            return lambda: out_TD
        return self.transport.launch_combine(y_QD, routed)

    def _shared(self, x_TD: torch.Tensor, w: dict[str, torch.Tensor]) -> Optional[torch.Tensor]:
        """The shared experts on this rank's rows (``None`` without them)."""
        if self.shared_experts is None:
            return None
        return self.shared_experts(x_TD, *(w[n] for n in SHARED_WEIGHTS))


class Admitted(NamedTuple):
    """One forward's input, as the data path takes it (``Admission.admit``)."""

    x: Any  # the input as given: the release answers in its layout
    x_TD: torch.Tensor  # this rank's rows; zero rows on a rank whose input was bad (it stands in)
    T: Optional[int]  # gather mode: the SP input's global rows, agreed over SP; else None
    t_max: Optional[int]  # a SizedTransport's T_max (the most rows any rank of the EP group routes); else None
    problem: Problem  # this forward's problem on this rank; the router adds to it, the transport carries it
    stands_in: bool  # this rank's input was bad: the release returns the stand-in
    zeros: Optional[Callable[[int], torch.Tensor]] = None  # zero rows of the layer's width, dtype and device


class Admission(Protocol):
    """The seam between a layer's input and its data path."""

    def admit(self, x: Any, transport: Union[Transport, SizedTransport], dtype: torch.dtype, device: torch.device,
              training: bool) -> Admitted:
        """Check ``x`` against the layer (its compute ``dtype``, ``device``, train mode) and hand the data path
        its rows, ``T``, ``T_max`` (when ``transport`` is a ``SizedTransport``) and this forward's problem."""
        ...

    def release(self, a: Admitted, out_TD: torch.Tensor) -> Any:
        """The layer's output for ``out_TD``, in ``a.x``'s layout (or the stand-in)."""
        ...


class Rows(Protocol):
    """How this rank's rows reach the router and come back: as they are, or gathered over SP (gather mode)."""

    def gather(self, x_TD: torch.Tensor, a: Admitted) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(h_TD, own_T)``: the rows to route, and a bool mask of those this rank holds (``None``: all)."""
        ...

    def scatter(self, out_TD: torch.Tensor, a: Admitted) -> torch.Tensor:
        """This rank's rows of the routed experts' output ``out_TD``."""
        ...


class OwnRows:
    """Local rows: each rank routes its own (``Rows``)."""

    def gather(self, x_TD: torch.Tensor, a: Admitted) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        return x_TD, None

    def scatter(self, out_TD: torch.Tensor, a: Admitted) -> torch.Tensor:
        return out_TD


class DeviceAdmission:
    """One device's admission (``Admission``): the input's last dim is the model dim and its dtype the layer's,
    or it raises at once (no peer can be left waiting); leading dims flattened into tokens and restored."""

    def __init__(self, dim: int, flag: ProblemFlag):
        self.dim, self.flag = dim, flag

    def admit(self, x: Any, transport: Union[Transport, SizedTransport], dtype: torch.dtype, device: torch.device,
              training: bool) -> Admitted:
        D = self.dim
        if x.dim() == 0 or x.shape[-1] != D:
            raise SPMDShapeError(f"MoE expects (..., dim={D}) input, found shape {tuple(x.shape)}")
        if x.dtype != dtype:
            raise SPMDDtypeError(f"MoE computes in {dtype} (its parameters' dtype), found input of dtype {x.dtype}; "
                                 f"cast the input (x.to({dtype})) or the layer (.to({x.dtype}))")
        return Admitted(x, x.reshape(-1, D), None, None, Problem(flag=self.flag), False)

    def release(self, a: Admitted, out_TD: torch.Tensor) -> Any:
        return out_TD.view(a.x.shape)


class MoE(_Layer):
    """A Mixture-of-Experts layer on one device: ``forward(x_TD) -> y_TD``.

    Output = sum_k weight_k * expert_k(x) + shared(x). Parameters: ``router.gate.weight`` (E, D); ``experts.w1`` (E, F,
    D), ``experts.w2`` (E, D, F), ``experts.w3`` (E, F, D); with shared experts ``shared_experts.w{1,2,3}.weight`` ((H,
    D), (D, H), (H, D), ``H = num_shared_experts * F``). Buffers: ``expert_bias`` (E,) (saved), ``tokens_per_expert``
    (E,) (not saved). ``load_state_dict`` also takes torchtitan names and DTensors (see
    ``spmdmoe.moe.params.checkpoint``). ``expert_bias`` stays fp32 under ``.to()``. Leading dims of ``x`` are flattened
    into tokens. With ``aux_loss_coeff``, ``self.aux_loss`` holds the aux loss of the last training-mode forward with
    grad (add it to the loss); otherwise it is ``None``. A non-finite router logit is recorded and raised by
    :func:`spmdmoe.check_errors` or :meth:`update_expert_bias` (``spmdmoe.agreement``).

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
        self.admission: Admission = DeviceAdmission(config.dim, self.problems)
        self.rows: Rows = OwnRows()
        install_hooks(self, None)
        self.init_weights()


