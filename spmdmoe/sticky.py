"""Mode (c) of the agreement (``spmdmoe.agreement``): sticky flags.

A forward's :class:`spmdmoe.agreement.Problem` (a bad input, non-finite router logits on this rank) goes to the layer's
transport, which either sends the bits along its count exchange (mode (a)) or records them here (the problem's sink). A
check whose verdict could differ between ranks and that has no exchange to ride (a single-device layer, SP modes, EP
beside a ``dp_mesh``) records this rank's bits on the device, in the layer's :class:`ProblemFlag`: no sync, no
collective. They are raised on every rank at once by the next exchange of flags: a layer's ``update_expert_bias`` (its
count all-reduce carries them) or :func:`check_errors` (one check exchange of every rank's bits and one host read).
"""

from __future__ import annotations

import weakref
from typing import Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from .agreement import exchange_rows, problems_error, world_axis
from .types.mesh import MeshLike, mesh_axis

__all__ = ["ProblemFlag", "check_errors", "clear_all", "raise_and_clear"]


class ProblemFlag:
    """Mode (c): this rank's sticky problem bits, recorded without a sync, raised at an exchange.

    Each MoE layer owns one (so its ``update_expert_bias`` raises exactly the problems of the ranks it exchanges with);
    :func:`check_errors` exchanges every flag of the process over the world. ``on_clear`` runs whenever the flag is
    cleared after a raise (a layer drops the step's load counts).
    """

    def __init__(self, on_clear: Optional[Callable[[], object]] = None,
                 home: Optional[Callable[[], Optional[torch.Tensor]]] = None) -> None:
        self._bits: dict[torch.device, torch.Tensor] = {}  # one int64 scalar per other device used
        self.details: list[str] = []
        self.on_clear = on_clear
        self.home = home  # the owner's int64 scalar buffer (moves with it): recorded into with no new tensor
        self.generation = 0  # how often it was cleared: a delayed read of older bits is stale after a clear
        # run before every exchange of this flag (``update_expert_bias``, :func:`check_errors`): an SP layer's ride
        # raises there, on this rank alone, a grad mode that differed (``moe/parallel/ride.py``)
        self.before_exchange: Callable[[], None] = lambda: None
        _flags.add(self)

    def _home(self) -> Optional[torch.Tensor]:
        return self.home() if self.home is not None else None

    def _tensors(self) -> list[torch.Tensor]:
        """The flag's storage; a meta layer's (a plan without data, nothing to read) is left out."""
        home = self._home()
        return [t for t in ([home] if home is not None else []) + list(self._bits.values()) if not t.is_meta]

    def record(self, bits: Union[int, torch.Tensor], device: torch.device, details: Sequence[str] = ()) -> None:
        """OR ``bits`` (a host int, or a device int64 scalar: no sync) into this rank's flag."""
        if isinstance(bits, int) and not bits:
            return
        device = torch.device(device)
        home = self._home()
        # the home buffer first: a compiled forward records into it with no side effect on this object
        own = home if home is not None and home.device == device else self._bits.get(device)
        if own is None:
            own = self._bits[device] = torch.zeros((), dtype=torch.int64, device=device)
        own.bitwise_or_(bits)
        self.details.extend(details)

    def bits_into(self, out: torch.Tensor) -> None:
        """OR this rank's bits into ``out`` (a device int64 tensor of one element): no sync."""
        for own in self._tensors():
            out.bitwise_or_(own.to(out.device))

    def slots(self, device: torch.device) -> torch.Tensor:
        """A ``(world_size,)`` int64 vector: this rank's bits in its own slot, zeros elsewhere.

        Summed over any set of orthogonal axes, it gives every rank of their
        product the bits of every rank of it (each slot has one contributor).
        """
        world, me = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
        slots = torch.zeros(world, dtype=torch.int64, device=device)
        self.bits_into(slots[me])
        return slots

    def clear(self) -> None:
        for own in self._tensors():
            own.zero_()
        self.details.clear()
        self.generation += 1
        if self.on_clear is not None:
            self.on_clear()


_flags: "weakref.WeakSet[ProblemFlag]" = weakref.WeakSet()


def raise_and_clear(op: str, slots: Sequence[int], flags: Sequence[ProblemFlag],
                    ranks: Optional[Sequence[int]] = None) -> None:
    """Raise the verdict of exchanged ``slots`` (host ints, one per rank), clearing ``flags`` first."""
    details = dict.fromkeys(d for flag in flags for d in flag.details)  # once each (every layer's flag may hold it)
    error = problems_error(op, slots, list(details), ranks)
    if error is not None:
        for flag in flags:
            flag.clear()
        raise error


def check_errors(mesh: Optional[MeshLike] = None) -> None:
    """Raise, on every rank at once, the problems any rank recorded since the last check.

    A collective over ``mesh`` (default: the world): one check exchange (``spmdmoe.agreement.check_exchange``) of every
    flag of this process OR-ed into one int64, and one host read (a sync); a peer in another spmdmoe check exchange
    meets it there and every rank raises. Call it where a step should fail if any rank saw a problem its peers could not
    see, e.g. once per step before ``optimizer.step()`` (each MoE layer's ``update_expert_bias`` does the same for its
    own problems over its own axes), and at the end of an evaluation pass. Without an initialised process group it reads
    this process' flags. What was recorded is raised once, then cleared, and every layer drops the load counts of the
    failed step.

    >>> import spmdmoe
    >>> spmdmoe.check_errors()   # nothing recorded: returns
    """
    axis = (world_axis() if mesh is None else mesh_axis(mesh)) if dist.is_initialized() else None
    device = torch.device("cpu") if axis is None else axis.metadata_device()
    flags = list(_flags)
    mine = torch.zeros(1, dtype=torch.int64, device=device)
    for flag in flags:
        flag.before_exchange()
        flag.bits_into(mine)
    bits = [row[0] for row in exchange_rows(axis, mine, "check_errors", mine[0])]
    raise_and_clear("check_errors", bits, flags, None if axis is None else axis.ranks)


def clear_all() -> None:
    """Forget every recorded problem of this process (tests use it to start clean)."""
    for flag in list(_flags):
        flag.clear()
