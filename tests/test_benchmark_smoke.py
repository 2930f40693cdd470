"""The GPU benchmarks that can run on CPU keep running: their ``--smoke`` modes, on gloo, in subprocesses.

``benchmarks/torchtitan_model.py --smoke`` (one process) trains torchtitan's model and the swapped one, eager and compiled;
its ``--part ep --smoke`` trains both through torchtitan's own ``parallelize`` with FSDP and EP (4 gloo processes,
dp 2 x ep 2; and 2 processes, EP 2 with each block compiled, on torch >= 2.13).
``benchmarks/sync_free.py --smoke`` builds the eager candidate stacks (sync, sync-free, sync-free over the
all-to-all) on 2 gloo processes and checks that they agree bit for bit (the graphs, the symmetric row moves and
the timing are CUDA-only), so the script is known to start before a 2-GPU host is lent to time it. ``benchmarks/sp_grad_overlap.py
--smoke`` builds its four stacks (no SP sums, sums waited for at their use, per layer, per block) on 2
gloo processes and checks that the three real ones give the same gradients. ``benchmarks/fp8_numerics.py
--smoke`` runs its layer study (every fast-accumulation setting against fp64) at a tiny shape.
``benchmarks/vs_torchtitan.py --smoke --shared 1`` builds and steps every candidate at EP 2 (2 gloo processes)
against torchtitan's layer. ``benchmarks/hf_model.py --smoke`` builds a tiny transformers Qwen3-MoE model, swaps a copy
and checks the two losses agree. ``benchmarks/host_cost.py --smoke`` counts each EP layer's ATen ops a step. ``examples/train_hf_moe.py``, the
transformers example a GPU run quotes, trains 3 steps on 2 gloo processes.

Each is a whole benchmark in subprocesses (minutes on a 2-core CPU, most of the single-process suite's time), so
they are marked ``bench`` and left out of a plain ``pytest`` / ``make test`` (``addopts`` deselects the marker);
``make test-bench`` runs them, and CI runs it once, in its torch-2.11 leg (``make test-torch-old``).
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.bench


@pytest.mark.timeout(300)
def test_sync_free_benchmark_smoke():
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(ROOT / "benchmarks" / "sync_free.py"), "--smoke", "--tokens", "37"],
                         cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK: smoke, 2 ranks, sync-free == sync bitwise: True" in out.stdout, out.stdout[-2000:]


@pytest.mark.timeout(300)
def test_sp_grad_overlap_benchmark_smoke():
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(ROOT / "benchmarks" / "sp_grad_overlap.py"), "--smoke"],
                         cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "gradients of the three anchorings equal: True" in out.stdout, out.stdout[-2000:]


@pytest.mark.timeout(120)
def test_fp8_numerics_smoke():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fp8_numerics.py"), "--smoke"],
                         cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 8 / 2, 40 |")]
    assert len(rows) == 4 and all(float(r.split("|")[-2]) > 0 for r in rows), out.stdout[-2000:]


@pytest.mark.timeout(300)
def test_vs_torchtitan_ep_benchmark_smoke():
    """``benchmarks/vs_torchtitan.py --smoke --shared 1`` on 2 gloo processes: every spmdmoe candidate (the
    one-GPU rows beside EP among them) builds, steps, and agrees with torchtitan's EP layer with a shared
    expert in both."""
    pytest.importorskip("torchtitan", reason="torchtitan is an optional extra: pip install '.[torchtitan]'")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(ROOT / "benchmarks" / "vs_torchtitan.py"), "--smoke", "--shared", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    done = next((line for line in out.stdout.splitlines() if line.startswith("OK: smoke, world 2")), "")
    assert "'spmdmoe bf16 eager, one GPU (all experts here, no EP)'" in done, out.stdout[-2000:]
    assert "'spmdmoe FP8 eager, cached (b), one GPU (all experts here, no EP)'" in done, out.stdout[-2000:]
    assert "'spmdmoe" not in done.partition("failed")[2], done


@pytest.mark.timeout(200)
def test_host_cost_benchmark_smoke():
    """``benchmarks/host_cost.py --smoke --ops`` on 2 gloo processes: torchtitan's EP layer and ours (sync,
    sync-free) each step, and their ATen ops a step are counted (the GPU columns are CUDA-only); ours' host time
    op by op, stage by stage, the backward's nodes included."""
    pytest.importorskip("torchtitan", reason="torchtitan is an optional extra: pip install '.[torchtitan]'")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(ROOT / "benchmarks" / "host_cost.py"), "--smoke", "--ops"],
                         cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    for row in ("torchtitan MoE", "ours, EP 2 sync", "ours, EP 2 sync_free (no max_tokens)"):
        assert re.search(rf"\| {re.escape(row)} \| [1-9][0-9]* ATen ops \|", out.stdout), out.stdout[-2000:]
    for stage in ("_route", "_dispatch", "experts.forward", "backward"):  # twice: sync, sync-free
        assert len(re.findall(rf"^\| {re.escape(stage)} \| [1-9][0-9]* \| [0-9]+ \| ", out.stdout, re.M)) == 2, \
            out.stdout[-3000:]


@pytest.mark.timeout(300)
def test_torchtitan_model_benchmark_smoke():
    """Every part of ``benchmarks/torchtitan_model.py`` at tiny size on CPU: both models track each other
    eager and compiled per block, and the benchmark's compiled step runs."""
    pytest.importorskip("torchtitan", reason="torchtitan is an optional extra: pip install '.[torchtitan]'")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "torchtitan_model.py"), "--smoke"],
                         cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert out.stdout.count("OK: every step within 1% of torchtitan's loss") == 2, out.stdout[-2000:]
    assert "OK: smoke, both models compiled per block and stepped" in out.stdout, out.stdout[-2000:]


@pytest.mark.timeout(300)
def test_torchtitan_parallelize_benchmark_smoke():
    """``--part ep --ep 2`` on 4 gloo processes: torchtitan's ``parallelize_fn`` of both specs, FSDP over 4 and
    EP 2 (dp 2 x ep 2 for the experts; on torch < 2.13 their nested FSDP unit, ``titan_expert_fsdp.py``), the
    two models' losses within 1 % at every step and falling, then the whole-model table's timing (once, on CPU)."""
    pytest.importorskip("torchtitan", reason="torchtitan is an optional extra: pip install '.[torchtitan]'")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                          str(ROOT / "benchmarks" / "torchtitan_model.py"), "--part", "ep", "--smoke", "--ep", "2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "OK: every step within 1% of torchtitan's loss, and the loss fell" in out.stdout, out.stdout[-2000:]
    assert "weights bitwise equal after init: yes" in out.stdout, out.stdout[-2000:]
    assert "FSDP over 4, EP 2 (dp 2 x ep 2 for the experts)" in out.stdout, out.stdout[-2000:]
    assert "| MoE | step ms (CPU) | speedup |" in out.stdout, out.stdout[-2000:]  # the whole-model table's code ran


@pytest.mark.timeout(300)
def test_torchtitan_parallelize_compiled_blocks_benchmark_smoke():
    """``--part ep --ep 2 --compile`` on 2 gloo processes: torchtitan's ``parallelize_fn`` with FSDP, EP 2 and
    its per-block compile (``fullgraph=True``, inductor) of both models, losses within 1 % at every step. Torch
    < 2.13 refuses it by name (``titan_expert_fsdp.py``)."""
    pytest.importorskip("torchtitan", reason="torchtitan is an optional extra: pip install '.[torchtitan]'")
    from torchtitan_models import fsdp_meshes_per_parameter

    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(ROOT / "benchmarks" / "torchtitan_model.py"), "--part", "ep", "--smoke", "--ep", "2",
                          "--compile"], cwd=ROOT, capture_output=True, text=True, timeout=280)
    if not fsdp_meshes_per_parameter():
        assert out.returncode != 0 and "not run: torchtitan 0.3.0 compiles each block" in out.stdout, out.stdout[-2000:]
        return
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "| compiled | 6 |" in out.stdout, out.stdout[-2000:]
    assert "OK: every step within 1% of torchtitan's loss, and the loss fell" in out.stdout, out.stdout[-2000:]


@pytest.mark.timeout(200)
def test_hf_model_benchmark_smoke():
    """``benchmarks/hf_model.py --smoke``: the swapped and unswapped transformers models build and agree."""
    pytest.importorskip("transformers", reason="transformers is an optional extra: pip install '.[transformers]'")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "hf_model.py"), "--smoke"],
                         cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "OK: smoke, the swapped model's loss matches" in out.stdout, out.stdout[-2000:]


@pytest.mark.timeout(200)
def test_train_hf_moe_example_smoke(torchrun_job):
    """``examples/train_hf_moe.py`` (the transformers example: a Qwen3-MoE model with ``swap_moe``,
    ``sequence_parallel`` and ``sp_batch``, SP x EP over the processes) trains 3 steps on 2 gloo processes at a
    length the processes do not divide, and ends with its throughput line. Its parity with one process is
    ``tests/distributed/test_transformers.py``'s."""
    pytest.importorskip("transformers", reason="transformers is an optional extra: pip install '.[transformers]'")
    returncode, out, err = torchrun_job("examples/train_hf_moe.py", "--steps", "3", "--seq-len", "61", timeout=180,
                                        nproc=2)
    assert returncode == 0, (out + err)[-3000:]
    assert out.count("step ") == 3 and re.search(r"^tokens/s: [0-9,]+ \([0-9,]+ per process\)$", out, re.M), out[-2000:]


@pytest.mark.timeout(200)
def test_train_titan_moe_example_smoke(torchrun_job):
    """``examples/train_titan_moe.py`` (the torchtitan example: DeepSeek-V3 through ``swapped_model_spec`` and
    torchtitan's own ``parallelize``) trains 3 steps on 2 gloo processes with FSDP and EP 2 (on torch < 2.13 the
    experts' nested FSDP unit), and ends with its throughput line. Its parity with torchtitan's MoE is
    ``test_torchtitan_parallelize_benchmark_smoke``'s."""
    pytest.importorskip("torchtitan", reason="torchtitan is an optional extra: pip install '.[torchtitan]'")
    returncode, out, err = torchrun_job("examples/train_titan_moe.py", "--layers", "2", "--seq", "32", "--steps", "3",
                                        timeout=180, nproc=2)
    assert returncode == 0, (out + err)[-3000:]
    assert "FSDP 2, EP 2" in out and out.count("step ") == 3, out[-2000:]
    assert re.search(r"^tokens/s per process: [0-9,]+$", out, re.M), out[-2000:]
