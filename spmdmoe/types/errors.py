"""Exceptions raised by spmdmoe.

Every layout violation is an :class:`SPMDLayoutError` (a ``ValueError``), so
``except SPMDLayoutError`` catches them all. Subclasses name the kind of
mistake for tests and for callers that want to handle one case:

=========================  ====================================================
``SPMDLayoutError``        a shard does not match the declared token layout
``SPMDMeshError``          the mesh argument cannot serve as one mesh axis
``SPMDDeviceError``        a tensor lives on a device the axis' backend cannot use
``SPMDTokenCountError``    a token count that is not a non-negative ``int``
``SPMDShapeError``         a feature shape that does not match the module
``SPMDDtypeError``         a dtype that does not match the module's
``MoEConfigError``         an MoE configuration or parallel plan that cannot work
``SPMDRoutingError``       router output that cannot be routed (NaN logits)
``SPMDCapacityError``      sync-free EP rows past the static capacity (an ``SPMDLayoutError``)
``SPMDCollectiveError``    the collective-checking mode found ranks that disagree on a collective: a
                           different op, or a rank that never arrived (an ``SPMDLayoutError``)
=========================  ====================================================

Messages say what was expected, what was found, on which rank, and how to fix
it. Errors whose verdict could differ between ranks are raised on every rank
together (see ``spmdmoe.agreement``).
"""

from __future__ import annotations

__all__ = [
    "SPMDLayoutError",
    "SPMDMeshError",
    "SPMDDeviceError",
    "SPMDTokenCountError",
    "SPMDShapeError",
    "SPMDDtypeError",
    "MoEConfigError",
    "SPMDRoutingError",
    "SPMDCapacityError",
    "SPMDCollectiveError",
]


class SPMDLayoutError(ValueError):
    """A tensor's layout violates the declared placement or token counts."""


class SPMDMeshError(SPMDLayoutError):
    """The mesh argument is not a usable single mesh axis (e.g. a 2-D mesh)."""


class SPMDDeviceError(SPMDLayoutError):
    """A tensor is on a device that the mesh axis' backend cannot communicate."""


class SPMDTokenCountError(SPMDLayoutError, TypeError):
    """A token count is negative or not an integer."""


class SPMDShapeError(SPMDLayoutError):
    """A tensor's feature shape does not match what the module expects (e.g. model dim)."""


class SPMDDtypeError(SPMDLayoutError):
    """A tensor's dtype does not match what the module expects (e.g. a bf16 layer fed fp32)."""


class MoEConfigError(ValueError):
    """An MoE configuration or parallel plan that cannot work (top_k > E, E % ep != 0, ...)."""


class SPMDRoutingError(ValueError):
    """Router output that cannot be routed, e.g. NaN logits; raised on every rank of the EP group."""


class SPMDCapacityError(SPMDLayoutError):
    """Sync-free EP (``ep_mode="sync_free"``) routed more rows to a (source, destination) slot than its static
    capacity holds; raised on every rank of the EP group by the capacity check, with a factor that fits."""


class SPMDCollectiveError(SPMDLayoutError):
    """The collective-checking mode (``spmdmoe.set_checks("collectives")``) found that the ranks of a collective
    disagree on which collective they run, or that a rank did not arrive within the check's timeout."""
