#!/usr/bin/env bash
# One device-machine call: environment facts, the NCCL distributed suite, the benchmarks.
#   bash benchmarks/gpu_session.sh        (on a host with 2 or 4 GPUs; writes under $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count(), torch.cuda.get_device_name())' | tee "$OUT/env.txt"
nvidia-smi topo -m >> "$OUT/env.txt" 2>&1 || true
echo "== single-process tests (cuda-marked included)"
python3 -m pytest -q -p no:cacheprovider tests spmdmoe 2>&1 | tail -5 | tee "$OUT/tests_single.txt"
echo "== distributed tests on NCCL, $NGPU ranks"
timeout 400 torchrun --nproc-per-node "$NGPU" -m pytest -q -p no:cacheprovider tests/distributed 2>&1 | tee "$OUT/tests_nccl.txt" | tail -15
echo "== benchmarks"
timeout 300 torchrun --nproc-per-node "$NGPU" benchmarks/collectives.py --out "$OUT/bench_collectives.md" 2>&1 | grep -v "^W" | tail -40
