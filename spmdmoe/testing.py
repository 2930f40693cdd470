"""Helpers for testing parallel code against a single-device reference.

Every helper that can fail makes its verdict collectively: a mismatch on one rank raises on every rank (naming the ranks
that failed), so a failing test never leaves the other ranks waiting in the next test's collective.

* :func:`reference_tensor` — the same random tensor on every rank, from a seed.
* :func:`assert_close_everywhere` — compare with a reference, fail on all ranks.
* :func:`assert_raises_everywhere` — a call must raise the given error on every rank.
* :func:`check_layout` — verify an ``SPMDTensor``'s layout across ranks (for
  tensors made by the local constructors, which check nothing across ranks).
* :func:`single_process_group` — a world-size-1 gloo group for examples and doctests.
* :func:`markdown_python_blocks` — the ``python`` code blocks of a Markdown file (docs run as tests).

Every verdict goes through ``spmdmoe.agreement`` (one exchange of a small row per rank).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Type

import torch
import torch.distributed as dist

from .agreement import exchange_rows
from .types.checks import checks
from .construct import from_local
from .types.mesh import MeshLike, mesh_axis
from .types.placement import Varying
from .types.tensor import SPMDTensor

__all__ = [
    "reference_tensor",
    "assert_close_everywhere",
    "assert_raises_everywhere",
    "all_ranks_agree",
    "check_layout",
    "single_process_group",
    "sync_error_mode",
    "capture_training_step",
    "markdown_python_blocks",
]


def single_process_group() -> dist.ProcessGroup:
    """The default group, initialised as a 1-rank gloo group if there is none."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() != 1:
        raise RuntimeError("single_process_group() is for one-process examples; use your real group")
    return dist.group.WORLD  # type: ignore[return-value]


def reference_tensor(
    shape: Sequence[int],
    seed: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: Optional[torch.device | str] = None,
) -> torch.Tensor:
    """A standard-normal tensor that is bitwise identical on every rank for one seed."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float64).to(dtype=dtype, device=device)


def all_ranks_agree(ok: bool, mesh: Optional[MeshLike] = None) -> list[int]:
    """The ranks (in the axis; default: the world) where ``ok`` is false; the same list on every rank."""
    table = exchange_rows(None if mesh is None else mesh_axis(mesh), [0 if ok else 1], "spmdmoe.testing check")
    return [r for r, (bad,) in enumerate(table) if bad]


def check_layout(x: SPMDTensor) -> None:
    """Raise the same ``SPMDLayoutError`` on every rank of ``x``'s axis unless its layout is one layout.

    The local constructors (``SPMDTensor(...)``, ``SPMDTensor.from_buffer``, ``with_local``, ``shard``) check only this
    rank's rows against this rank's metadata; they cannot see a ``global_tokens``, dtype, feature shape or placement
    that differs on another rank (the next collective would then abort or hang). This runs :func:`spmdmoe.from_local`'s
    collective check on ``x`` as it is, also with checks switched off: one check exchange of a few int64 and one host
    read. Meant for tests and debugging.

    >>> import torch, spmdmoe
    >>> pg = spmdmoe.testing.single_process_group()
    >>> spmdmoe.testing.check_layout(spmdmoe.shard(torch.zeros(5, 2), pg))
    """
    if not isinstance(x, SPMDTensor):
        raise TypeError(f"check_layout takes an SPMDTensor, found {type(x).__name__}")
    total = None if isinstance(x.placement, Varying) else x.global_tokens
    with checks(True):
        from_local(x.local, x.axis, placement=x.placement, global_tokens=total, token_dim=x.token_dim)


def assert_close_everywhere(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    rtol: float,
    atol: float,
    name: str = "tensor",
    mesh: Optional[MeshLike] = None,
) -> None:
    """``torch.testing.assert_close`` on every rank, failing on all ranks if any fails.

    Shapes must match exactly; values within ``atol + rtol * |expected|``.
    """
    message = ""
    try:
        torch.testing.assert_close(actual, expected.to(actual.device), rtol=rtol, atol=atol)
    except AssertionError as e:
        message = str(e)
    failed = all_ranks_agree(not message, mesh)
    if failed:
        mine = f"\nthis rank's mismatch: {message}" if message else ""
        raise AssertionError(f"{name}: mismatch against the reference on ranks {failed}{mine}")


def assert_raises_everywhere(
    error: Type[BaseException], fn: Callable[[], Any], *, match: Optional[str] = None, mesh: Optional[MeshLike] = None
) -> BaseException:
    """Call ``fn``; it must raise ``error`` (message matching ``match``) on every rank."""
    caught: Optional[BaseException] = None
    problem = ""
    try:
        fn()
        problem = "returned without raising"
    except error as e:  # noqa: PERF203
        caught = e
        if match is not None and not re.search(match, str(e)):
            problem = f"raised {type(e).__name__} but the message {str(e)!r} does not match {match!r}"
    except BaseException as e:  # a different error: report it on every rank
        problem = f"raised {type(e).__name__}: {e}"
    failed = all_ranks_agree(not problem, mesh)
    if failed:
        raise AssertionError(
            f"expected {error.__name__} on every rank; ranks {failed} did not"
            + (f"\nthis rank: {problem}" if problem else "")
        )
    assert caught is not None
    return caught


def sync_error_mode(fn: Callable[[], Any]) -> Any:
    """``fn()`` under ``torch.cuda.set_sync_debug_mode("error")``: any synchronizing call in it raises
    (``spmdmoe.host.to_host``, the documented transfers, lifts the mode for itself). The mode is reset after.
    """
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def capture_training_step(step: Callable[[], Any], module: torch.nn.Module, *leaves: torch.Tensor,
                          warmup: int = 3) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``step()`` (a forward and its backward) captured in one CUDA graph: ``(graph, what the captured step
    returned)``. ``warmup`` eager calls on a side stream first (allocator pools, Triton compiles, caches);
    ``module``'s and the ``leaves``' gradients are set to ``None`` before each call, so the captured
    backward allocates them from the graph's pool and every ``graph.replay()`` rewrites them in place."""

    def reset() -> None:
        module.zero_grad(set_to_none=True)
        for leaf in leaves:
            leaf.grad = None

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            reset()
            step()
    torch.cuda.current_stream().wait_stream(side)
    reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def markdown_python_blocks(path: "str | Path") -> list[tuple[int, str]]:
    r"""``(line, code)`` of each fenced ````python`` block of the Markdown file ``path``, in order; ``line`` is
    the block's first code line (1-based), for error messages. Other fences (````text``, ````bash``) are left out.

    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile("w", suffix=".md", delete=False) as f:
    ...     _ = f.write("Intro\n\n```python\nx = 1\n```\n\n```text\nnot code\n```\n")
    >>> markdown_python_blocks(f.name)
    [(4, 'x = 1\n')]
    """
    text = Path(path).read_text()
    return [(text[: m.start()].count("\n") + 2, m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M)]

