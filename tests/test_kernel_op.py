"""``spmdmoe.kernels.backend.kernel_op``: a kernel's launcher reaches its custom op only where something must
see the op whole (``torch.compile``, a dispatch mode); eagerly it runs directly."""

from __future__ import annotations

import subprocess
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from spmdmoe.kernels.backend import GPU_BUILD, kernel_op


@kernel_op("spmdmoe_test::twice")
def twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


class _Seen(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


switches: list[tuple[bool, bool]] = []  # (called through torch.library, wrap_triton on)


@kernel_op("spmdmoe_test::switch")
def switch(x: torch.Tensor) -> torch.Tensor:
    frame, through_op = sys._getframe(1), False
    while frame is not None:  # the custom op's kernel runs the launcher from torch/_library
        through_op = through_op or "_library" in frame.f_code.co_filename
        frame = frame.f_back
    switches.append((through_op, torch._library.triton.is_wrap_triton_enabled()))
    return x.clone()


def test_eager_call_skips_the_custom_op():
    x = torch.arange(4.0)
    assert torch.equal(twice(x), x * 2)
    switches.clear()
    switch(x)
    switch.custom_op()(x)
    assert [through for through, _ in switches] == [False, True]


def test_eager_call_launches_as_the_op_does():
    """``wrap_triton`` off, as in the op's own eager kernel: with it on, every launch went through the
    higher-order op (slow, and filed in a side table never cleared)."""
    switches.clear()
    switch(torch.arange(4.0))
    switch.custom_op()(torch.arange(4.0))
    assert [on for _, on in switches] == [False, False]


def test_input_that_requires_grad_takes_the_custom_op():
    x = torch.arange(4.0, requires_grad=True)
    switches.clear()
    switch(x)
    with torch.no_grad():
        switch(x)
    assert [through for through, _ in switches] == [True, False]


def test_a_launcher_that_writes_an_input_is_the_custom_op():
    @kernel_op("spmdmoe_test::bump", mutates_args=("x",))
    def bump(x: torch.Tensor) -> None:
        x.add_(1)

    x = torch.zeros(2)
    before = x._version
    bump(x)
    assert torch.equal(x, torch.ones(2)) and x._version > before


def test_a_dispatch_mode_sees_the_custom_op():
    x = torch.arange(4.0)
    with _Seen() as mode:
        out = twice(x)
    assert torch.equal(out, x * 2)
    assert mode.ops == ["spmdmoe_test.twice.default"], mode.ops


def _graph_targets(f, x: torch.Tensor) -> list[str]:
    graphs: list[list[str]] = []

    def backend(gm, example_inputs):  # type: ignore[no-untyped-def]
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm

    compiled = torch.compile(f, backend=backend, fullgraph=True)
    assert torch.equal(compiled(x), f(x))
    assert len(graphs) == 1, graphs
    return graphs[0]


def test_compile_traces_the_custom_op():
    twice.custom_op()  # registered at import on CUDA hosts, else at first need
    targets = _graph_targets(lambda x: twice(x) + 1, torch.arange(4.0))
    assert any("spmdmoe_test.twice" in t for t in targets), targets


def test_compile_before_the_op_exists_traces_the_launcher():
    """A CPU build registers the op at its first need, never inside a trace: Dynamo traces the launcher."""

    @kernel_op("spmdmoe_test::thrice")
    def thrice(x: torch.Tensor) -> torch.Tensor:
        return x * 3

    targets = _graph_targets(lambda x: thrice(x) + 1, torch.arange(4.0))
    if GPU_BUILD:
        assert any("spmdmoe_test.thrice" in t for t in targets), targets
    else:
        assert not any("thrice" in t for t in targets) and any("mul" in t for t in targets), targets


def test_import_registers_no_kernel_op_on_a_cpu_build():
    """Registering a Triton op imports torch's inductor (Dynamo, sympy: seconds per process, paid by every rank
    of a torchrun); on a CPU build ``import spmdmoe`` registers none and loads neither, nor DTensor or FSDP2 (about
    1 s more on a 2-core CPU): ``spmdmoe.dtensor`` imports DTensor at its first use."""
    lazy = ("torch._inductor.utils", "torch._dynamo", "torch.distributed.tensor", "torch.distributed.fsdp")
    code = ("import sys, torch, spmdmoe; from torch._library.triton import triton_ops_to_kernels as t; "
            "print(sorted(k for k in t if k.startswith('spmdmoe')) == [], "
            f"*[m in sys.modules for m in {lazy!r}], spmdmoe.dtensor.DTensor.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    none, *loaded, adapter = out.stdout.split()
    assert adapter == "DTensor", out.stdout
    if not GPU_BUILD:
        assert (none, *loaded) == ("True",) + ("False",) * len(lazy), out.stdout
    else:
        assert none == "False", out.stdout
