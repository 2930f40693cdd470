#!/usr/bin/env bash
# One device-machine call: environment facts, GPU tests, the NCCL distributed suite, the main job
# on NCCL, the benchmarks; a short summary last.
#   bash benchmarks/gpu_session.sh        (on a host with 1, 2 or 4 GPUs; writes under $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count(), torch.cuda.get_device_name())' | tee "$OUT/env.txt"
echo "== single-process GPU tests (cuda-marked and the MoE layer)"
python3 -m pytest -q -p no:cacheprovider tests/test_moe.py tests/test_agreement.py -m "cuda or not cuda" 2>&1 | tail -3 | tee "$OUT/tests_single.txt"
echo "== distributed tests on NCCL, $NGPU ranks"
timeout 420 torchrun --nproc-per-node "$NGPU" -m pytest -q -p no:cacheprovider tests/distributed 2>&1 | grep -v "^W1" > "$OUT/tests_nccl.txt"; tail -4 "$OUT/tests_nccl.txt"
echo "== main job on NCCL"
timeout 300 torchrun --nproc-per-node "$NGPU" examples/train_moe.py --device cuda 2>&1 | grep -v "^W1" > "$OUT/train_moe_cuda.txt"; tail -4 "$OUT/train_moe_cuda.txt"
echo "== benchmarks"
timeout 240 torchrun --nproc-per-node "$NGPU" benchmarks/collectives.py --out "$OUT/bench_collectives.md" 2>&1 | grep -v "^W1" > "$OUT/bench_collectives.log"
timeout 200 torchrun --nproc-per-node 1 benchmarks/moe_layer.py --out "$OUT/bench_moe.md" --profile "$OUT/profile_moe_1gpu.txt" 2>&1 | grep -v "^W1" | tail -3
[ "$NGPU" -gt 1 ] && timeout 200 torchrun --nproc-per-node "$NGPU" benchmarks/moe_layer.py --out "$OUT/bench_moe.md" --profile "$OUT/profile_moe_ep.txt" 2>&1 | grep -v "^W1" | tail -3
[ "$NGPU" -gt 1 ] && timeout 200 torchrun --nproc-per-node "$NGPU" benchmarks/data_parallel.py --out "$OUT/bench_dp.md" 2>&1 | grep -v "^W1" | tail -3
echo "== summary"
cat "$OUT/bench_collectives.md" "$OUT/bench_moe.md" "$OUT/bench_dp.md" 2>/dev/null
