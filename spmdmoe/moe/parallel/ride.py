"""Deferred problems of an SP layer without EP (or with sync-free EP on the SP axis), carried by its token
exchange (docs/design.md §6).

Legend: ``T`` this rank's tokens, ``D`` model dim.

Each forward's ``T`` exchange (one all-gather over SP) carries, per rank, three more int64: this forward's input
problem bits, the sticky flag's bits from earlier forwards, and 1 when this rank runs the forward with grad off.
The table is copied to the host without waiting (:class:`spmdmoe.host.DelayedRead`) and read, with the same verdict
on every rank, by the backward of this forward's output and by the step boundary's exchanges, before they exchange
(a grad mode that differs between ranks: the ranks with grad off run no backward), or by the layer's next forward
(every problem). Only for a layer whose SP axis is the whole job; eager only. The columns, the reads and why:
``docs/design.md`` §6 (the table's row "the bits of a forward without EP").
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ...agreement import BIT, GRAD_OFF, grad_mode_codes, problems_error
from ...sticky import ProblemFlag
from ...host import DelayedRead, tracing
from ...types.mesh import MeshAxis

__all__ = ["Ride", "COLUMNS"]

COLUMNS = 3  # bad (the T exchange's own column), then the ride's: recorded, grad off


class Ride:
    """One riding layer's pending read: its SP axis, its sticky flag, and the last exchange's table."""

    def __init__(self, axis: MeshAxis, flag: ProblemFlag) -> None:
        self.axis, self.flag = axis, flag
        self.pending: Optional[tuple[DelayedRead, int]] = None
        flag.before_exchange = self.before_exchange

    def fill(self, row: torch.Tensor) -> None:
        """OR the ride's two columns (recorded, grad off) into ``row``, a zeroed device slice of the exchange's
        row after its ``bad`` column: no sync."""
        if not tracing():  # a compiled forward does not ride (no host read follows)
            self.flag.bits_into(row[0:1])
        row[1:2].fill_(int(not torch.is_grad_enabled()))

    def start(self, table: torch.Tensor) -> None:
        """After the exchange: ``table`` is ``(sp, COLUMNS)``, every rank's row; start its copy to the host."""
        if not tracing():
            self.pending = (DelayedRead(table), self.flag.generation)

    def surface(self) -> None:
        """At a forward: raise, on every rank, what the previous forward's exchange carried."""
        if not tracing():
            self._raise(self._take(None), "MoE layer (raised at its next forward: call spmdmoe.check_errors() or "
                                          "update_expert_bias() each step to raise problems in the step)")

    def on_backward(self, out_TD: torch.Tensor) -> torch.Tensor:
        """``out_TD`` itself, with a gradient hook that runs before the layer's backward (a hook, not an identity
        node, so the output stays an ordinary tensor that the caller may modify in place): it raises a grad
        mode that differed between ranks in this forward's exchange."""
        if tracing() or self.pending is None or not out_TD.requires_grad:
            return out_TD
        entry = self.pending
        op = "MoE layer (in the backward of the forward that found it; the next forward raises it on every rank)"
        out_TD.register_hook(lambda grad: self._raise(self._take(entry), op, grad_mode_only=True))
        return out_TD

    def before_exchange(self) -> None:
        """At the step boundary (``update_expert_bias``, ``check_errors``), before their exchange: raise a grad
        mode that differed in the last forward's exchange, on this rank alone and kept pending, as the backward
        does. A rank with grad off ran no backward, so it gets here while its peers raised in theirs and skipped
        the exchange; every rank that gets here raises (the same verdict), so none waits in it."""
        if not tracing():
            self._raise(self._take(None), "MoE layer (at the step boundary of the forward that found it; the next "
                                          "forward raises it on every rank)", grad_mode_only=True)

    def _take(self, entry: Any) -> Optional[tuple[DelayedRead, int]]:
        """The pending read (``entry``: only if it is still the pending one); ``None`` if stale or consumed."""
        pending = self.pending
        if entry is not None and entry is not pending:
            return None  # a later forward read it already (and raised what it held)
        if pending is None or pending[1] != self.flag.generation:
            self.pending = None
            return None
        return pending

    def _raise(self, pending: Optional[tuple[DelayedRead, int]], op: str, grad_mode_only: bool = False) -> None:
        """Raise ``pending``'s verdict. At a forward: consumed, the flag cleared. ``grad_mode_only`` (a backward, the
        step boundary): only when the grad mode differed, and it stays pending, so the next forward raises it again
        on every rank, whichever way each rank raised it in the step."""
        if pending is None:
            return
        bits = grad_mode_codes([bad | recorded | (GRAD_OFF if off else 0) for bad, recorded, off in pending[0].get()])
        if grad_mode_only and not any(b & BIT["grad_mode"] for b in bits):
            return
        error = problems_error(op, bits, [] if grad_mode_only else self.flag.details, list(self.axis.ranks))
        if not grad_mode_only:
            self.pending = None
            if error is not None:
                self.flag.clear()
        if error is not None:
            raise error
