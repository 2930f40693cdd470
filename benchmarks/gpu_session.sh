#!/usr/bin/env bash
# One device-machine call: environment facts, GPU tests, the NCCL distributed suite, the main job
# on NCCL, the benchmarks; a short summary last.
#   bash benchmarks/gpu_session.sh [part]   part: tests (dist: its NCCL suite only; WORLDS="2") | bench | profile | peer | fp8 | numerics | syncfree | overlap | all (default all)
#   SHAPES="dsmoe16b qwen3-30b" bash benchmarks/gpu_session.sh peer      # the peer part at some shapes only
set -uo pipefail
PART=${1:-all}
# everything is written under a scratch folder and packed into ONE archive in $OUT at the end (the device
# tool returns a handful of files at most)
DEST=${OUT:-/tmp/out}; OUT=/tmp/gpu_session; rm -rf "$OUT"; mkdir -p "$OUT" "$DEST"
trap 'tar czf "$DEST/gpu_session_$PART.tgz" -C /tmp gpu_session' EXIT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
dist_suite() {  # $1 ranks: tests/distributed on NCCL; $OUT/tests_nccl_$1.md, a row per file, then a row per torchrun
  # A file with one_rank_bad tests runs in its own torchrun (an NCCL failure kills its process or poisons its
  # communicator, so it must not take other files down); the other files share one. The rows per file come
  # from tests/distributed/conftest.py (SPMDMOE_FILE_TABLE); a torchrun that timed out wrote none.
  local n=$1 table="$OUT/tests_nccl_$1.md" runs="$OUT/runs_nccl_$1.md" group name log t0 rc
  printf '| file (%s ranks, NCCL) | passed | failed | errors | skipped | s |\n|---|---|---|---|---|---|\n' "$n" > "$table"
  printf '| torchrun (%s ranks) | s | exit |\n|---|---|---|\n' "$n" > "$runs"
  local isolated shared
  isolated=$(grep -l one_rank_bad tests/distributed/test_*.py)
  shared=$(ls tests/distributed/test_*.py | grep -vxF "$isolated" | tr '\n' ' ')
  for group in "$shared" $isolated; do
    name=$(echo "$group" | wc -w); name=$([ "$name" -gt 1 ] && echo "$name files" || basename "$group" .py)
    log="$OUT/nccl_${n}_${name// /_}.txt"; t0=$(date +%s)
    SPMDMOE_FILE_TABLE="$table" CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) \
      timeout "$([ "$group" = "$shared" ] && echo "${GROUP_TIMEOUT:-420}" || echo "${FILE_TIMEOUT:-120}")" \
      torchrun --nproc-per-node "$n" -m pytest -q -p no:cacheprovider -rs $group 2>&1 | grep -v "^W1" > "$log"
    rc=${PIPESTATUS[0]}
    pkill -9 -f "pytest -q -p no:cacheprovider -rs" 2>/dev/null  # what a timeout left holding a GPU
    printf '| %s | %s | %s |\n' "$name" "$(( $(date +%s) - t0 ))" "$([ "$rc" = 124 ] && echo timeout || echo "$rc")" >> "$runs"
  done
  cat "$table" "$runs"
}
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count(), torch.cuda.get_device_name())' | tee "$OUT/env.txt"
if [ "$PART" = tests ] || [ "$PART" = all ]; then
  echo "== single-process GPU tests (kernels, compile, the MoE layer, cuda-marked)"
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_fp8_kernels.py tests/test_fp8.py \
    tests/test_moe.py tests/test_agreement.py tests/test_compile_moe.py > "$OUT/tests_single.txt" 2>&1; tail -15 "$OUT/tests_single.txt"
fi
if [ "$PART" = tests ] || [ "$PART" = dist ] || [ "$PART" = all ]; then
  for n in ${WORLDS:-$([ "$NGPU" -ge 4 ] && echo 4) $([ "$NGPU" -ge 2 ] && echo 2)}; do
    # the distributed suite on NCCL, each file in its own torchrun: an NCCL failure kills its process or poisons
    # its communicator, so one file's failure must not take the rest down; a table per world size
    echo "== distributed tests on NCCL, $n ranks, a torchrun per file"
    dist_suite "$n"
  done
  echo "== main job on NCCL"
  timeout 200 torchrun --nproc-per-node "$NGPU" examples/train_moe.py --device cuda 2>&1 | grep -v "^W1" > "$OUT/train_moe_cuda.txt"; tail -3 "$OUT/train_moe_cuda.txt"
fi
if [ "$PART" = bench ] || [ "$PART" = all ]; then
  echo "== benchmarks"
  timeout 200 python3 benchmarks/kernels.py --sweep --out "$OUT/bench_kernels.md" 2>&1 | tail -12
  timeout 200 torchrun --nproc-per-node 1 benchmarks/moe_layer.py --out "$OUT/bench_moe.md" --profile "$OUT/profile_moe_1gpu.txt" 2>&1 | grep -v "^W1" | tail -3
  [ "$NGPU" -gt 1 ] && timeout 200 torchrun --nproc-per-node "$NGPU" benchmarks/moe_layer.py --out "$OUT/bench_moe.md" --profile "$OUT/profile_moe_ep.txt" 2>&1 | grep -v "^W1" | tail -3
fi
if [ -n "${BASE_TAR:-}" ]; then  # an older spmdmoe beside this one (vs_torchtitan.py --base): BASE_TAR=`git archive REV spmdmoe`
  bash benchmarks/base_copy.sh "$BASE_TAR" /tmp/base_copy && export BASE=/tmp/base_copy
fi
if [ "$PART" = profile ] || [ "$PART" = all ]; then
  echo "== where one step's time and memory go, bf16 and FP8 (benchmarks/profile_step.py)"
  for S in ${SHAPES:-dsmoe16b qwen3-30b}; do
    timeout 200 python3 benchmarks/profile_step.py --shape "$S" --out "$OUT/profile_step.md" > "$OUT/log_profile_$S.txt" 2>&1; echo "$S: exit $?"
  done
fi
if [ "$PART" = peer ] || [ "$PART" = all ]; then
  # one run per model shape (benchmarks/shapes.py): bf16 and FP8, eager and compiled, both FP8 weight policies,
  # step memory, the ceiling table; all five shapes, or those in SHAPES (`SHAPES="dsmoe16b" gpu_session.sh peer`)
  echo "== side by side with torchtitan, bf16 and FP8, per model shape"
  python3 -m pip install -q --no-deps .whl/*.whl 2>&1 | grep -v WARNING | tail -2
  for S in ${SHAPES:-dsmoe16b dsmoe16b-64k qwen3-30b qwen3-235b dsv3-ep8}; do
    timeout 480 torchrun --nproc-per-node 1 benchmarks/vs_torchtitan.py --shape "$S" --out "$OUT/bench_peer.md" ${BASE:+--base "$BASE"} \
      > "$OUT/log_peer_$S.txt" 2>&1; echo "$S: exit $?"; grep -v "^W1" "$OUT/log_peer_$S.txt" | tail -3
  done
fi
if [ "$PART" = fp8 ] || [ "$PART" = all ]; then
  echo "== FP8: GPU tests (compile on aot_eager and inductor, CUDA graphs), the weight cache's kernels, numerics"
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_kernels.py tests/test_fp8.py tests/test_cuda_graphs.py \
    -rs -s > "$OUT/tests_fp8.txt" 2>&1; grep SQNR "$OUT/tests_fp8.txt"; tail -4 "$OUT/tests_fp8.txt"
  FP8_TEST_BACKEND=inductor timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_fp8.py -k compiled \
    > "$OUT/tests_fp8_inductor.txt" 2>&1; tail -2 "$OUT/tests_fp8_inductor.txt"
  if [ -d .old/spmdmoe ]; then  # the same CUDA-graph test against the code before the weight cache's check
    (cd .old && PYTHONPATH=$PWD timeout 120 python3 -m pytest -q -p no:cacheprovider ../tests/test_cuda_graphs.py \
      -k optimizer_steps > "$OUT/tests_cuda_graphs_old.txt" 2>&1); grep -E "passed|failed|AssertionError: \(" "$OUT/tests_cuda_graphs_old.txt" | tail -3
  fi
  python3 -m pip install -q --no-deps .whl/*.whl 2>&1 | grep -v WARNING | tail -2
  timeout 200 python3 benchmarks/kernels.py --sweep-only fingerprint --only "fingerprint,weight cache,FP8 weights" \
    --out "$OUT/bench_kernels.md" > "$OUT/log_kernels.txt" 2>&1; tail -9 "$OUT/log_kernels.txt"
fi
if [ "$PART" = numerics ] || [ "$PART" = all ]; then
  echo "== FP8 numerics: each GEMM with fast accumulation on and off, the layer's gates per setting"
  timeout 270 python3 benchmarks/fp8_numerics.py --out "$OUT/bench_fp8_numerics.md" > "$OUT/log_numerics.txt" 2>&1
  tail -3 "$OUT/log_numerics.txt"
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
