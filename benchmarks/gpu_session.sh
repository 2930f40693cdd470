#!/usr/bin/env bash
# One device-machine call: environment facts, GPU tests, the NCCL distributed suite, the main job
# on NCCL, the benchmarks; a short summary last.
#   bash benchmarks/gpu_session.sh [part]   part: tests | bench | peer | fp8 | fp8peer | syncfree | overlap | all (default all)
set -uo pipefail
PART=${1:-all}
# everything is written under a scratch folder and packed into ONE archive in $OUT at the end (the device
# tool returns a handful of files at most)
DEST=${OUT:-/tmp/out}; OUT=/tmp/gpu_session; rm -rf "$OUT"; mkdir -p "$OUT" "$DEST"
trap 'tar czf "$DEST/gpu_session.tgz" -C /tmp gpu_session' EXIT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count(), torch.cuda.get_device_name())' | tee "$OUT/env.txt"
if [ "$PART" = tests ] || [ "$PART" = all ]; then
  echo "== single-process GPU tests (kernels, compile, the MoE layer, cuda-marked)"
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_fp8_kernels.py tests/test_fp8.py \
    tests/test_moe.py tests/test_agreement.py tests/test_compile_moe.py > "$OUT/tests_single.txt" 2>&1; tail -15 "$OUT/tests_single.txt"
  [ "$NGPU" -gt 1 ] && echo "== distributed tests on NCCL, $NGPU ranks"
  [ "$NGPU" -gt 1 ] &&
  timeout 360 torchrun --nproc-per-node "$NGPU" -m pytest -q -p no:cacheprovider tests/distributed 2>&1 | grep -v "^W1" > "$OUT/tests_nccl.txt"; tail -6 "$OUT/tests_nccl.txt"
  echo "== main job on NCCL"
  timeout 200 torchrun --nproc-per-node "$NGPU" examples/train_moe.py --device cuda 2>&1 | grep -v "^W1" > "$OUT/train_moe_cuda.txt"; tail -3 "$OUT/train_moe_cuda.txt"
fi
if [ "$PART" = bench ] || [ "$PART" = all ]; then
  echo "== benchmarks"
  timeout 200 python3 benchmarks/kernels.py --sweep --out "$OUT/bench_kernels.md" 2>&1 | tail -12
  timeout 200 torchrun --nproc-per-node 1 benchmarks/moe_layer.py --out "$OUT/bench_moe.md" --profile "$OUT/profile_moe_1gpu.txt" 2>&1 | grep -v "^W1" | tail -3
  [ "$NGPU" -gt 1 ] && timeout 200 torchrun --nproc-per-node "$NGPU" benchmarks/moe_layer.py --out "$OUT/bench_moe.md" --profile "$OUT/profile_moe_ep.txt" 2>&1 | grep -v "^W1" | tail -3
fi
if [ "$PART" = peer ] || [ "$PART" = all ]; then
  echo "== side by side with torchtitan"
  python3 -m pip install -q --no-deps .whl/*.whl 2>&1 | grep -v WARNING | tail -2
  for T in 16384 65536; do
    timeout 240 torchrun --nproc-per-node 1 benchmarks/vs_torchtitan.py --tokens $T --out "$OUT/bench_peer.md" 2>&1 | grep -v "^W1" | tail -4
    [ "$NGPU" -gt 1 ] && timeout 240 torchrun --nproc-per-node "$NGPU" benchmarks/vs_torchtitan.py --tokens $T --out "$OUT/bench_peer.md" 2>&1 | grep -v "^W1" | tail -4
  done
fi
if [ "$PART" = fp8 ] || [ "$PART" = all ]; then
  echo "== FP8: GPU tests (compile on aot_eager and inductor), kernels (swept), the layer (bf16 vs fp8_rowwise, profiled)"
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_kernels.py tests/test_fp8.py -rs -s > "$OUT/tests_fp8.txt" 2>&1; grep SQNR "$OUT/tests_fp8.txt"
  tail -4 "$OUT/tests_fp8.txt"
  FP8_TEST_BACKEND=inductor timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_fp8.py -k compiled \
    > "$OUT/tests_fp8_inductor.txt" 2>&1; tail -2 "$OUT/tests_fp8_inductor.txt"
  python3 -m pip install -q --no-deps .whl/*.whl 2>&1 | grep -v WARNING | tail -2
  timeout 240 python3 benchmarks/kernels.py --sweep --out "$OUT/bench_kernels.md" > "$OUT/log_kernels.txt" 2>&1; tail -4 "$OUT/log_kernels.txt"
  for P in bf16 fp8_rowwise; do
    timeout 150 torchrun --nproc-per-node 1 benchmarks/moe_layer.py --precision $P --out "$OUT/bench_moe.md" \
      --profile "$OUT/profile_moe_$P.txt" > "$OUT/log_moe_$P.txt" 2>&1; tail -2 "$OUT/log_moe_$P.txt"
  done
fi
if [ "$PART" = fp8peer ] || [ "$PART" = all ]; then
  echo "== FP8 side by side with torchtitan's FP8 and bf16 layers"
  python3 -m pip install -q --no-deps .whl/*.whl 2>&1 | grep -v WARNING | tail -2
  for T in 16384 65536; do
    timeout 280 torchrun --nproc-per-node 1 benchmarks/vs_torchtitan.py --fp8 --tokens $T --out "$OUT/bench_peer_fp8.md" \
      > "$OUT/log_peer_fp8_$T.txt" 2>&1; tail -3 "$OUT/log_peer_fp8_$T.txt"
  done
fi
if [ "$PART" = syncfree ] || [ "$PART" = all ]; then
  if [ "$NGPU" -gt 1 ]; then
    echo "== sync-free EP: a 4-layer stack, sync eager vs sync-free eager and graphed (issue 13)"
    for T in 4096 16384; do
      timeout 240 torchrun --nproc-per-node "$NGPU" benchmarks/sync_free.py --tokens $T --out "$OUT/bench_sync_free.md" \
        > "$OUT/log_sync_free_$T.txt" 2>&1; tail -2 "$OUT/log_sync_free_$T.txt"
    done
  fi
fi
if [ "$PART" = overlap ] || [ "$PART" = all ]; then
  echo "== SP gradient sums: CUDA check on one GPU (gloo, 2 ranks on cuda:0), exposed communication on NCCL (issue 14)"
  timeout 200 torchrun --nproc-per-node 2 benchmarks/sp_grad_overlap.py --same-gpu > "$OUT/log_overlap_same_gpu.txt" 2>&1
  grep -h "OK\|Error" "$OUT/log_overlap_same_gpu.txt" | head -5
  if [ "$NGPU" -gt 1 ]; then
    timeout 240 torchrun --nproc-per-node "$NGPU" benchmarks/sp_grad_overlap.py --out "$OUT/bench_sp_grad_overlap.md" \
      > "$OUT/log_overlap.txt" 2>&1; tail -2 "$OUT/log_overlap.txt"
  fi
fi
echo "== summary"
cat "$OUT"/bench_*.md 2>/dev/null
