"""The parallel layer's admission: the one seam between a forward's input and its data path.

Legend: ``T`` the SP input's global rows (gather mode), ``D`` model dim, ``T_max`` the most rows any rank of the
EP group routes (a sync-free transport's size).

:meth:`Admission.admit` takes the layer's input and returns what the data path needs (``layer.Admitted``): this
rank's rows, ``T``, ``T_max`` and this forward's :class:`spmdmoe.agreement.Problem`; :meth:`Admission.release`
hands the output back. Between them the data path never looks at the input again, and never at a problem's
bits on the host. What ``admit`` does, in order, and ``release``: ``docs/design.md`` §5 ("Plans"); how each
problem then reaches the other ranks: §6.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from typing import Any, Callable, Optional, Union

import torch

from ...agreement import Problem, alone, global_rank, local_problem, problems_error, raise_if
from ...collective_check import check_collective, exchange
from ...stand_in import stand_in
from ...sticky import ProblemFlag
from ...types import layout
from ...types.checks import checks_enabled, checks_mode
from ...types.mesh import MeshAxis
from ...types.tensor import SPMDTensor
from ..layer import Admitted
from ..transports.dispatch import SizedTransport, Transport
from ..transports.sync_free import SyncFreeTransport
from .accept import accept
from .ride import Ride
from .token_exchange import exchange_tokens

__all__ = ["Admission"]

_keys = itertools.count()
_admissions: "weakref.WeakValueDictionary[int, Admission]" = weakref.WeakValueDictionary()


def _learn_t_max(key: int, rows: int) -> int:
    """The most ``rows`` over admission ``key``'s EP group, host to host through the c10d store: no device sync
    (a peer missing for 10 minutes: ``SPMDCollectiveError``); kept as its :attr:`Admission.learned` unless no rank
    routed any (the next forward agrees again, on every rank). Dynamo calls it while tracing, as a constant
    (``torch.compiler.assume_constant_result``, the mark below), so a layer's first forward compiles with
    ``fullgraph=True``; a trace of that forward that restarts finds ``learned`` set and exchanges nothing."""
    admission = _admissions[key]
    assert admission.ep is not None
    if admission.learned is None:
        agreed = max(int(r) for r in exchange(admission.ep, str(rows).encode(), "t_max", timeout=600))
        if not agreed:
            return 0
        admission.learned = agreed
    return admission.learned


_learn_t_max._dynamo_marked_constant = True  # type: ignore[attr-defined]  # (gemm.py's _packed_offset says why)


class Admission:
    """A parallel layer's seam (``layer.Admission``; the module docstring).

    Args:
        sp, ep: the layer's SP and EP axes (``None``: none).
        gather: gather mode (every SP rank routes all ``T`` rows).
        dim: the model dim ``D``.
        flag: the layer's sticky flag: the sink of every forward's ``Problem``.
        ride: the layer's ride (``ride.py``), or ``None`` when its SP axis is not the whole job.
        max_tokens: ``parallelize_moe``'s ``max_tokens`` (sync-free EP off the SP axis), or ``None``.

    Attributes:
        learned: without ``max_tokens``, the ``T_max`` the first forward that routed any rows agreed over EP
            (host to host), which sizes every later forward's buffers as ``max_tokens`` would; ``None`` before.
    """

    def __init__(self, sp: Optional[MeshAxis], ep: Optional[MeshAxis], gather: bool, dim: int, flag: ProblemFlag,
                 ride: Optional[Ride], max_tokens: Optional[int]):
        self.sp, self.ep, self.gather, self.dim = sp, ep, gather, dim
        self.flag, self.ride, self.max_tokens = flag, ride, max_tokens
        self.learned: Optional[int] = None
        self.key = next(_keys)  # this process's name for the layer (_learn_t_max's argument)
        _admissions[self.key] = self

    def admit(self, x: Any, transport: Union[Transport, SizedTransport], dtype: torch.dtype, device: torch.device,
              training: bool) -> Admitted:
        """This forward's rows, ``T``, ``T_max`` (a sync-free ``transport``'s size) and problem (module docstring,
        steps 1-5)."""
        sp = self.sp
        axis = sp if sp is not None else self.ep
        if self.ride is not None:
            self.ride.surface()
        problem = Problem(flag=self.flag)
        x_TD = (accept(x, problem, sp=sp, ep=self.ep, dim=self.dim, dtype=dtype, device=device) if checks_enabled()
                else (x.local if isinstance(x, SPMDTensor) else x))
        if axis is not None and checks_mode() == "collectives":  # the SP input's record (its declared T too; an
            # EP input's rows may differ), this rank's problem and train / eval mode (which decides collectives)
            check_collective("MoE layer", axis, x if sp is not None else None,
                             local_problem(problem.bits, problem.details), {"training": training})
        sized = isinstance(transport, SyncFreeTransport)
        if problem.bits and alone():  # the only process of the job: nobody to leave waiting
            raise_if(problems_error("MoE layer", [problem.bits], problem.details))
        zeros: Callable[[int], torch.Tensor] = lambda rows: torch.zeros(  # noqa: E731
            (rows, self.dim), dtype=dtype, device=device)
        if sp is not None and self.gather:
            T = exchange_tokens(x, problem, sp, self.ride)
            stands_in = problem.bits != 0  # host bits only so far (read as such: torch 2.11 cannot trace bool())
            if stands_in:  # its chunk of zeros at the agreed T
                x_TD = zeros(layout.local_tokens(T, sp.size, sp.rank))
            # EP on another axis: every rank of the SP group routes the same T rows; more than max_tokens is a
            # problem for the step boundary, not a stand-in (the rows are gathered already)
            return Admitted(x, x_TD, T, self._t_max(x, T, problem, sized), problem, stands_in, zeros)
        if self.ride is not None and self.ep is None:  # the exchange only carries the ride (T not needed)
            exchange_tokens(x, problem, sp, self.ride)
        t_max = self._t_max(x, 0 if problem.bits else x_TD.shape[0], problem, sized)
        stands_in = problem.bits != 0
        if stands_in:  # zero rows: the same collectives as the peers, nothing routed
            x_TD = zeros(0)
        return Admitted(x, x_TD, None, t_max, problem, stands_in, zeros)

    def release(self, a: Admitted, out_TD: torch.Tensor) -> Any:
        """The output in ``a.x``'s layout, or the stand-in; the ride's check on its backward."""
        if self.ride is not None:
            out_TD = self.ride.on_backward(out_TD)
        if a.stands_in:
            return stand_in(a.x, out_TD, a.zeros)
        return a.x.with_local(out_TD) if isinstance(a.x, SPMDTensor) else out_TD

    def _t_max(self, x: Any, rows: int, problem: Problem, sized: bool) -> Optional[int]:
        """``T_max`` of a sized transport (``None`` for the others): with EP on the SP axis the SP input's padded
        local count, from the token exchange (no host read on a rank whose input is good); otherwise
        ``max_tokens``, or without it the first forward's agreed count (:attr:`learned`: the most routed rows over
        EP, exchanged host to host through the c10d store, no device sync). More ``rows`` here than that
        bound: a problem added (this rank stands in zero rows; every rank raises at the step boundary)."""
        ep = self.ep
        if not sized or ep is None:
            return None
        if self.sp is not None and self.sp == ep:
            return layout.padded_local_tokens(max(exchange_tokens(x, problem, self.sp, self.ride), 0), ep.size)
        bound = self.max_tokens if self.max_tokens is not None else self.learned
        if bound is None:
            return _learn_t_max(self.key, operator.index(rows))  # (a symbolic count: specialised, once)
        if rows > bound:
            fix = ("split the batch or pass a larger max_tokens to parallelize_moe (or swap_moe)"
                   if self.max_tokens is not None
                   else f"the layer sized them on its first forward, which routed at most {bound} a rank; pass "
                        f"max_tokens={rows} (or the most any rank will route) to parallelize_moe (or swap_moe)")
            problem.add("capacity", f"rank {global_rank()}: {rows} tokens routed, more than "
                                    f"{'max_tokens=' if self.max_tokens is not None else ''}{bound}, which sizes "
                                    f"the sync-free EP buffers; {fix}")
        return int(bound)
