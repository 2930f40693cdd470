"""README command 1's job, short: examples/train_moe.py on 4 processes must match one process.

With FP8 experts (emulated on CPU) the parallel loss curve must track the full-precision single-process
one within 1e-3 relative (5.4e-6 measured over 6 steps on CPU). Launched wrongly (no torchrun; ``--device cuda``
where no GPU is visible) it says what is wrong instead of failing inside torch."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("plan", [["--steps", "3"], ["--steps", "2", "--sp", "2", "--ep", "2", "--seq-len", "61"],
                                  ["--steps", "3", "--expert-precision", "fp8_rowwise", "--tolerance", "1e-3"]])
def test_train_moe_example_matches_single_process(plan, torchrun_job):
    returncode, out, err = torchrun_job("examples/train_moe.py", *plan, timeout=540)
    assert returncode == 0, out[-3000:] + err[-3000:]
    tolerance = plan[plan.index("--tolerance") + 1] if "--tolerance" in plan else "1e-4"
    assert "| step | single-process loss |" in out and f"(tolerance {float(tolerance):.0e}): OK" in out
    assert out.count("step ") >= int(plan[1])


def _example(name: str):
    """``examples/<name>.py`` as a module of this process."""
    spec = importlib.util.spec_from_file_location(f"{name}_example", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _example_main(monkeypatch, *argv: str, **env: str) -> int:
    """``examples/train_moe.py``'s ``main()`` in this process with ``argv`` and launch variables ``env`` (its
    checks of how it was launched come before any process group: no processes need starting for them)."""
    module = _example("train_moe")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", ["train_moe.py", *argv])
    return module.main()


def test_train_moe_example_explains_how_to_launch(monkeypatch, capsys):
    assert _example_main(monkeypatch) == 2 and "torchrun --nproc-per-node 4" in capsys.readouterr().err


@pytest.mark.parametrize("local_rank", ["0", "1"])
def test_train_moe_example_without_a_gpu_says_so(monkeypatch, capsys, local_rank):
    """``--device cuda`` where no GPU is visible, as each of 2 processes of the example's NCCL launch line: one
    clear error naming the flag (from local rank 0; the others leave quietly, so torchrun cannot cut it short), and
    every rank returns before any process group is made (no NCCL init, no hang, no raw ``torch._C``
    AttributeError)."""
    groups = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **k: groups.append((a, k)))
    code = _example_main(monkeypatch, "--device", "cuda", "--steps", "1", RANK=local_rank, WORLD_SIZE="2",
                         LOCAL_RANK=local_rank, LOCAL_WORLD_SIZE="2")
    err = capsys.readouterr().err
    assert groups == []
    message = "error: --device cuda needs one CUDA GPU per process (2 on this node), but no CUDA GPU is visible"
    assert (code, err.count(message)) == ((2, 1) if local_rank == "0" else (0, 0)), err


@pytest.mark.timeout(300)
def test_port_moe_example(torchrun_job, monkeypatch, capsys):
    """``examples/port_moe.py`` (``docs/porting.md``): the ported per-expert ``nn.Linear`` MoE matches the
    original forward and backward in one process (its ``main()`` here, outside torchrun), and its SP x EP layer
    matches one process on 4."""
    monkeypatch.delenv("RANK", raising=False)
    _example("port_moe").main()
    assert capsys.readouterr().out.rstrip().endswith("OK")
    returncode, out, err = torchrun_job("examples/port_moe.py", timeout=240)
    assert returncode == 0 and out.count("SP x EP over 4 ranks within") == 4 and out.count("OK") == 4, out[-2000:] + err[-2000:]
