"""Layout assertions, the ``@layout_checked`` decorator and the global switch.

Checking is on by default. ``spmdmoe.set_checks(False)`` (or ``SPMDMOE_CHECKS=0`` at import, or ``with
spmdmoe.checks(False):``) turns off the checks that cost time per call (the MoE layer's input comparison and
non-finite pass, ``@layout_checked``, ``assert_layout``, the problem bits the layers record); the cross-rank
exchanges still run, with the same payloads (``from_local``'s among them). ``spmdmoe.set_checks("collectives")``
(or ``SPMDMOE_CHECKS=collectives``) turns every check on and adds the collective-checking mode, a debugging aid
(:mod:`spmdmoe.collective_check`). What each costs, on and off: ``docs/design.md`` §3; what the mode compares: §6.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, TypeVar, Union

from typing_extensions import Annotated, get_args, get_origin, get_type_hints

from .errors import SPMDLayoutError
from .mesh import MeshAxis, MeshLike, mesh_axis
from .placement import Partial, Placement, Replicate, Shard, Varying
from .tensor import SPMDTensor, _rows_expected

__all__ = [
    "Layout",
    "assert_layout",
    "layout_checked",
    "checks_enabled",
    "checks_mode",
    "set_checks",
    "checks",
]

_MODES = {"0": (False, False), "false": (False, False), "off": (False, False), "no": (False, False),
          "1": (True, False), "true": (True, False), "on": (True, False), "yes": (True, False),
          "collectives": (True, True)}
_on, _collectives = _MODES.get(os.environ.get("SPMDMOE_CHECKS", "1").strip().lower(), (True, False))
_state = {"on": _on, "collectives": _collectives}


def checks_enabled() -> bool:
    """Whether layout checking is on (the default; also in the ``"collectives"`` mode)."""
    return _state["on"]


def checks_mode() -> str:
    """``"off"``, ``"on"`` (the default) or ``"collectives"``."""
    return "collectives" if _state["collectives"] else "on" if _state["on"] else "off"


def set_checks(enabled: Union[bool, str]) -> Union[bool, str]:
    """Turn all layout checking on or off, or on with the collective-checking mode (``"collectives"``);
    returns the previous setting (a bool, or ``"collectives"``).

    The setting is rank-local, but it never decides whether a collective runs or how large its payload is
    (docs/design.md §6). The collective-checking mode must be on on every rank or none: a rank in it waits for
    its peers' records before each collective. Another string raises ``ValueError``.

    >>> import spmdmoe
    >>> previous = spmdmoe.set_checks("collectives")
    >>> spmdmoe.checks_mode()
    'collectives'
    >>> _ = spmdmoe.set_checks(previous)
    """
    if isinstance(enabled, str) and enabled != "collectives":
        raise ValueError(f"set_checks takes True, False or 'collectives', found {enabled!r}")
    previous: Union[bool, str] = "collectives" if _state["collectives"] else _state["on"]
    _state["on"] = bool(enabled)
    _state["collectives"] = enabled == "collectives"
    return previous


@contextlib.contextmanager
def checks(enabled: Union[bool, str]) -> Iterator[None]:
    """Context manager form of :func:`set_checks`."""
    previous = set_checks(enabled)
    try:
        yield
    finally:
        set_checks(previous)


@dataclass(frozen=True)
class Layout:
    """A layout hint for ``Annotated[SPMDTensor, Layout(...)]``.

    ``tokens`` is an int (an exact ``global_tokens``) or a name: every argument and return value that uses the same name
    must have the same ``global_tokens``. ``mesh`` is a name with the same rule for mesh axes. A bare placement is
    shorthand: ``Annotated[SPMDTensor, Shard(0)]``.
    """

    placement: Placement
    tokens: Union[int, str, None] = None
    mesh: Optional[str] = None


def assert_layout(
    x: Any,
    placement: Placement,
    *,
    mesh: Optional[MeshLike] = None,
    global_tokens: Optional[int] = None,
) -> None:
    """Raise :class:`SPMDLayoutError` unless ``x`` is an ``SPMDTensor`` with this layout.

    Checks the placement, the mesh axis (if given), ``global_tokens`` (if given) and that ``x.local`` holds this rank's
    rows. Local only: no communication. A no-op when checking is off.

    >>> import torch, spmdmoe
    >>> pg = spmdmoe.testing.single_process_group()
    >>> x = spmdmoe.shard(torch.zeros(5, 2), pg)
    >>> spmdmoe.assert_layout(x, spmdmoe.Shard(0), global_tokens=5)
    >>> spmdmoe.assert_layout(x, spmdmoe.Replicate())
    Traceback (most recent call last):
    ...
    spmdmoe.types.errors.SPMDLayoutError: rank 0: expected placement Replicate(), found Shard(dim=0) ...
    """
    if not _state["on"]:
        return
    problem = _layout_problem(x, placement, None if mesh is None else mesh_axis(mesh), global_tokens)
    if problem is not None:
        raise SPMDLayoutError(problem)


def _layout_problem(
    x: Any, placement: Placement, axis: Optional[MeshAxis], total: Optional[int]
) -> Optional[str]:
    if not isinstance(x, SPMDTensor):
        return f"expected an SPMDTensor with placement {placement}, found {type(x).__name__}; wrap it with spmdmoe.from_local"
    r = x.axis.rank
    if x.placement != placement:
        return f"rank {r}: expected placement {placement}, found {x.placement} (layout of {x!r})"
    if axis is not None and x.axis != axis:
        return f"rank {r}: expected a tensor on mesh axis {axis}, found one on {x.axis}"
    if total is not None and x.global_tokens != total:
        return f"rank {r}: expected global_tokens={total}, found {x.global_tokens}"
    if x._global_tokens is not None and x.local_tokens != (want := _rows_expected(placement, x._global_tokens, x.axis)):
        return f"rank {r}: local holds {x.local_tokens} rows, the layout says {want}"
    return None


F = TypeVar("F", bound=Callable[..., Any])


def _spec_of(hint: Any) -> Optional[Layout]:
    if get_origin(hint) is not Annotated:
        return None
    base, *extras = get_args(hint)
    if base is not SPMDTensor:
        return None
    for extra in extras:
        if isinstance(extra, Layout):
            return extra
        if isinstance(extra, (Shard, Replicate, Partial, Varying)):
            return Layout(extra)
    return None


def layout_checked(fn: F) -> F:
    """Check ``Annotated[SPMDTensor, ...]`` hints of arguments and the return value.

    >>> import torch, spmdmoe
    >>> from typing_extensions import Annotated
    >>> from spmdmoe import SPMDTensor, Shard, Layout
    >>> @spmdmoe.layout_checked
    ... def double(x: Annotated[SPMDTensor, Layout(Shard(0), tokens="T")]
    ...            ) -> Annotated[SPMDTensor, Layout(Shard(0), tokens="T")]:
    ...     return x.with_local(2 * x.local)
    >>> pg = spmdmoe.testing.single_process_group()
    >>> double(spmdmoe.shard(torch.ones(3, 2), pg)).global_tokens
    3

    The hints are read on the first call. With checking off, the wrapper only reads one flag.
    """
    resolved: dict[str, Any] = {}

    def resolve() -> dict[str, Any]:
        if not resolved:
            hints = get_type_hints(fn, include_extras=True)
            specs = {name: _spec_of(h) for name, h in hints.items()}
            ret = hints.get("return")
            ret_specs: Any = _spec_of(ret)
            if ret_specs is None and get_origin(ret) in (tuple, typing.Tuple):
                ret_specs = tuple(_spec_of(a) for a in get_args(ret))
            resolved["args"] = {k: v for k, v in specs.items() if v is not None and k != "return"}
            resolved["ret"] = ret_specs
            resolved["sig"] = inspect.signature(fn)
        return resolved

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not _state["on"]:
            return fn(*args, **kwargs)
        info = resolve()
        bound = info["sig"].bind(*args, **kwargs)
        symbols: dict[tuple[str, str], Any] = {}
        for name, spec in info["args"].items():
            if name in bound.arguments:
                _check_spec(fn, f"argument {name!r}", bound.arguments[name], spec, symbols)
        out = fn(*args, **kwargs)
        ret = info["ret"]
        if isinstance(ret, Layout):
            _check_spec(fn, "return value", out, ret, symbols)
        elif isinstance(ret, tuple):
            for i, spec in enumerate(ret):
                if spec is not None:
                    _check_spec(fn, f"return value [{i}]", out[i], spec, symbols)
        return out

    return typing.cast(F, wrapper)


def _check_spec(fn: Callable[..., Any], what: str, value: Any, spec: Layout, symbols: dict[tuple[str, str], Any]) -> None:
    total = spec.tokens if isinstance(spec.tokens, int) else None
    problem = _layout_problem(value, spec.placement, None, total)
    if problem is None and isinstance(spec.tokens, str):
        problem = _bind(symbols, ("tokens", spec.tokens), value.global_tokens, "global_tokens")
    if problem is None and spec.mesh is not None:
        problem = _bind(symbols, ("mesh", spec.mesh), value.axis, "mesh axis")
    if problem is not None:
        raise SPMDLayoutError(f"{fn.__qualname__}: {what}: {problem}")


def _bind(symbols: dict[tuple[str, str], Any], key: tuple[str, str], value: Any, what: str) -> Optional[str]:
    seen = symbols.setdefault(key, value)
    if seen != value:
        return f"{what} {key[1]!r} was {seen} for an earlier argument, found {value}"
    return None
