"""Which implementation a kernel call takes: the Triton kernel or its plain-torch reference.

``auto`` (the default): Triton on CUDA tensors, the reference elsewhere (CPU,
meta). Under ``torch.compile`` on CUDA the choice per kernel is
:data:`COMPILED`, measured (``benchmarks/kernels.py``): a user-defined Triton
kernel is opaque to inductor, the reference may be fused with its neighbours.
``set_kernel_backend("torch")`` forces the references (a debugging aid);
``"triton"`` forces the kernels on CUDA tensors.

The kernels are wrapped with ``torch.library.triton_op`` (:func:`kernel_op`), so Dynamo traces
them (``fullgraph=True``) and inductor launches them from its own code; called eagerly with no
dispatch mode active, a launcher runs directly, without the custom op's dispatch.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Literal, Sequence, TypeVar

import torch
import torch._library.triton
from torch.library import triton_op
from torch.utils._python_dispatch import _get_current_dispatch_mode

__all__ = ["set_kernel_backend", "kernel_backend", "use_triton", "cast", "unit_rows", "kernel_op", "op_required",
           "row_programs", "COMPILED"]

Backend = Literal["auto", "triton", "torch"]
_backend: list[Backend] = ["auto"]

# kernel -> implementation under torch.compile on CUDA. Measured (H200, benchmarks/kernels.py), Triton
# vs inductor's compiled reference: fan-out 1.00x, gather-sum 6.6-6.8x, combine backward 2.9x, SwiGLU
# forward 0.96x, backward 1.46x faster; Triton everywhere (the 4 % of the SwiGLU forward is within noise)
COMPILED: dict[str, Literal["triton", "torch"]] = {
    **dict.fromkeys(("fan_out", "gather_sum", "swiglu", "swiglu_fp8", "fp8_rows", "fp8_cols", "fp8_weights",
                     "fingerprint"), "triton"),
    # the reference: inductor compiles it, and sync EP's row count is data-dependent there (no new kernel to
    # trace with an unbacked grid); the host cost it saves is gone under compile anyway
    "expert_order": "torch",
    "overflow_record": "torch",  # twelve scalar ops: inductor fuses them
    # the kernel: compiled and eager then choose the same experts (near-ties: torch's exp and sums round otherwise)
    "topk_route": "triton",
}


_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.int64)  # ints: expert_order's ids


def set_kernel_backend(backend: Backend) -> None:
    """``"auto"``, ``"triton"`` or ``"torch"`` (see the module docstring)."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"kernel backend must be 'auto', 'triton' or 'torch', found {backend!r}")
    _backend[0] = backend


def kernel_backend() -> Backend:
    return _backend[0]


def use_triton(kernel: str, t: torch.Tensor) -> bool:
    """Whether ``kernel`` runs as Triton for tensors like ``t`` (fp64 always takes the reference)."""
    if not t.is_cuda or t.dtype not in _KERNEL_DTYPES or _backend[0] == "torch":
        return False
    if _backend[0] == "triton" or not torch.compiler.is_compiling():
        return True
    return COMPILED[kernel] == "triton"


F = TypeVar("F", bound=Callable[..., Any])


def by_backend(kernel: str, triton_impl: F, reference: F, probe: int = 0) -> F:
    """A kernel's dispatching function, named after its reference: ``triton_impl`` where :func:`use_triton` picks
    ``kernel`` for the positional argument ``probe``, else ``reference`` (same signature): the Triton kernel on
    CUDA, the reference elsewhere."""

    @functools.wraps(reference)
    def call(*args: Any, **kwargs: Any) -> Any:
        return (triton_impl if use_triton(kernel, args[probe]) else reference)(*args, **kwargs)

    call.__name__ = call.__qualname__ = reference.__name__.removesuffix("_reference")
    call.__doc__ = (f"The Triton kernel on CUDA, the reference elsewhere (``spmdmoe.kernels.backend``): "
                    f"{reference.__doc__}")
    return call  # type: ignore[return-value]


def unit_rows(t: torch.Tensor) -> torch.Tensor:
    """A 2-D ``t`` as the row kernels read it (rows ``t.stride(0)`` apart, unit-stride within): ``t`` itself when
    so (a column slice of a wider buffer: ``moe/transports/dedup.py``'s rows and the ids beside their weights),
    else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


@functools.lru_cache(maxsize=None)
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def row_programs(blocks: Any, device: torch.device, per_sm: int = 128) -> Any:
    """The programs of a kernel striding over ``blocks`` row blocks up to a device count: ``per_sm`` a multiprocessor
    (3 under the CPU's interpreter, so its loop turns), none for a capacity buffer's empty rows. H200, 196,608 rows,
    98,304 valid, F = 1408: SwiGLU forward 252.7 -> 202.2 us, backward 383.9 -> 339.0 against a program a row block;
    all valid: 198.8 -> 202.3, 332.5 -> 339.3 (16 a multiprocessor: 225, 402; issue 61)."""
    return torch.sym_min(blocks, _sms(device) * per_sm if device.type == "cuda" else 3)


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, without a node when ``t`` has that dtype already: ``t`` itself, not a no-op ``to``.

    Every reference that an ``autograd.Function`` forward may run ends with this, never ``.to``. A no-op
    ``.to`` returns the very tensor of the intermediate before it, and torch 2.11's Dynamo then records that
    intermediate as a second output of the function's forward; both are one tensor, so autograd routes the
    function's gradient to the wrong output and the inputs get zeros (pytorch/pytorch#180642, fixed in 2.12
    by pytorch/pytorch#180921). In-place ops on a forward's fresh result are the same hazard
    (``tests/test_compile_moe.py`` checks every pipeline gradient on the torch in use)."""
    return t if t.dtype == dtype else t.to(dtype)


def op_required(*args: Any) -> bool:
    """Whether an eager call must take its custom op rather than its function: under a dispatch mode (fake tensors,
    ``make_fx``, selective checkpointing's policy, a mode that logs ops: they must see the op whole), or with an
    input that requires grad in grad mode (the op's autograd formula runs, or its refusal: it has none)."""
    return _get_current_dispatch_mode() is not None or (torch.is_grad_enabled() and any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in args))


# torch's own eager path of a triton_op runs its function with this switch off (wrap_triton launching the kernel
# itself, not through the higher-order op, whose dispatch torch puts at ~1 ms and which files every launch in a
# side table that is never cleared); absent from a torch: every call takes the custom op
_direct = getattr(torch._library.triton, "set_wrap_triton_enabled", None)
# a torch that can run the kernels on a GPU (kernel_op registers their ops at import)
GPU_BUILD = torch.version.cuda is not None or torch.version.hip is not None


def kernel_op(name: str, *, mutates_args: Sequence[str] = ()) -> Callable[[F], F]:
    """``torch.library.triton_op(name, mutates_args=...)`` for a kernel's launcher, whose calls reach the
    custom op only where it is needed: under ``torch.compile`` (Dynamo traces it, inductor launches it), under
    a dispatch mode (fake tensors, ``make_fx``, a mode that logs ops), for a launcher that writes an input
    (the op bumps its version counter) and with an input that requires grad (the op raises: it has no
    autograd formula). Otherwise the launcher runs directly, as the op's own eager kernel runs it (``wrap_triton``
    off): the op's dispatch cost about 10 us of host time a call on a CPU core (13.2 against 3.0 us for a
    launcher that allocates its outputs and launches nothing), paid by every row move of an eager step, whose
    host time is the step's time at small token counts (issue 42). ``.custom_op()`` is the custom op.

    The op is registered at import by a CUDA (or ROCm) build of torch, else at its first need: registering
    imports torch's inductor and parses the launcher's source (1.7 s of a CPU process's 5.8 s ``import spmdmoe``,
    paid by every rank of a ``torchrun``), and a CPU build launches the kernels only in their own tests. (The
    build, not ``torch.cuda.is_available()``, which initialises CUDA: a fork after it cannot use the GPU.) A
    launcher traced by Dynamo before its op exists (a CPU build) is traced as itself: Dynamo traces a Triton
    launch directly."""

    def wrap(fn: F) -> F:
        box: list[Any] = []

        def custom_op() -> Any:
            if not box:
                box.append(triton_op(name, mutates_args=tuple(mutates_args))(fn))
            return box[0]

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():
                return box[0](*args, **kwargs) if box else fn(*args, **kwargs)
            if mutates_args or _direct is None or op_required(*args, *kwargs.values()):
                return custom_op()(*args, **kwargs)
            with _direct(False):
                return fn(*args, **kwargs)

        call.custom_op = custom_op  # type: ignore[attr-defined]
        if GPU_BUILD:
            custom_op()
        return call  # type: ignore[return-value]

    return wrap
