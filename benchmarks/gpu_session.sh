#!/usr/bin/env bash
# One device-machine call: environment facts, GPU tests, the NCCL distributed suite, the main job
# on NCCL, the benchmarks; a short summary last.
#   bash benchmarks/gpu_session.sh [part]   part: tests (dist: its NCCL suite only; WORLDS="2", FILES="torchtitan sync_free"; single: the single-process suite only) | suite4 | suite2 | files4 | files2 | compile4 | exits | titan | bench | profile | peer | fp8 | numerics | syncfree | overlap | hf | whole | host | ab (these four not in all: ab is a change's A/B, see its part) | all (default all)
#   SHAPES="dsmoe16b qwen3-30b" bash benchmarks/gpu_session.sh peer      # the peer part at some shapes only
# The tests, a part per call (device time is scarce: each fits one call; `timeout 590 bash ...` around it):
#   single     the whole single-process suite (`pytest`: tests/ and the package's doctests; the training runs too)
#              on one GPU, pytest-xdist with SINGLE_JOBS workers (default 8: 185 s on one H200; 34 min serially)
#              (SINGLE_TESTS="tests/test_cuda_graphs.py tests/test_torchtitan.py": those only; SINGLE_TIMEOUT, default 540 s)
#   suite4     the whole distributed suite in ONE torchrun at 4 ranks, as the README runs it (`torchrun
#   suite2     --nproc-per-node 4 -m pytest tests/distributed`, pyproject's default markers: no compile_matrix case,
#              which compile4 and files4 run; SUITE_MARKS="not bench": those too); suite2: 2 ranks on GPUs 0,1
#              (SUITE_TIMEOUT, default 540 s; SUITE_TESTS="tests/distributed/test_x.py": those only)
#   files4     the distributed suite, a torchrun per test file, at 4 ranks (files2: 2 ranks; FILE_TIMEOUT per file, default 300 s)
#   compile4   every distributed test file that compiles or captures CUDA graphs (test_compile_moe, test_compile_ep,
#              test_grad_overlap, test_cuda_graphs, test_symmetric, test_torchtitan: found by grep), a torchrun per file at 4 ranks
#   (`tests` runs single, the per-file suites at 4 and 2 ranks, the main job, then suite4 and suite2: SUITES="" leaves those out)
# Each writes a table (file | passed | failed | errors | skipped | s) to $OUT/gpu_session_PART.md beside the archive;
# a run past its limit is killed with every process it started (its own session), and the table says where it was.
# DRY_CPU=1: these parts without a GPU (gloo, CUDA tests skip), to check the script itself, e.g.
#   DRY_CPU=1 SINGLE_TESTS=tests/test_chunk_rule.py PATH=$PWD/.venv/bin:$PATH bash benchmarks/gpu_session.sh single
# The rule: every compile test file runs at 4 NCCL ranks after any change to the data path
# (`benchmarks/gpu_session.sh compile4`), before the change is called done. The distributed runs here pass
# `-m "not bench"` (suite4 / suite2 excepted: the README's command), so they include the compile_matrix cases that
# plain pytest (CPU, 2 cores) leaves out.
set -uo pipefail
PART=${1:-all}
# everything is written under a scratch folder and packed into ONE archive in $OUT at the end (the device
# tool returns a handful of files at most)
# (a folder per part, so two parts can run at once)
# (TAG: a suffix for a second run of one part in the same call, e.g. the titan part's 4-GPU layouts after its 2-GPU ones)
NAME=gpu_session_$PART${TAG:-}; DEST=${OUT:-/tmp/out}; OUT=/tmp/$NAME; rm -rf "$OUT"; mkdir -p "$OUT" "$DEST"
trap 'cat "$OUT"/tests_*.md > "$DEST/$NAME.md" 2>/dev/null; tar czf "$DEST/$NAME.tgz" -C /tmp "$NAME"' EXIT
# killed from outside (a plain `timeout 560 bash ...`, which signals this whole process group): stop what it started (a hung NCCL job holds its GPUs), its own
# descendants only (not by name: that would kill other people's runs on a shared machine), and still pack
# (the suite's jobs by their sessions, the rest by walking this script's children)
kill_tree() { local p; for p in $(pgrep -P "$1"); do kill_tree "$p"; kill -9 "$p" 2>/dev/null; done; }
trap 'kill_tree $$; for f in "$OUT"/*/*.sid; do [ -f "$f" ] && pkill -9 -s "$(cat "$f")"; done; cut_short; exit 124' TERM
# (every inner `timeout` runs with --foreground: a plain one moves its command into a process group of its own,
# which the outer `timeout` does not signal, and bash runs the trap above only after its foreground command
# ends (checked: `timeout 2 bash -c 'trap ... TERM; timeout 6 sleep 30'` ends after 6 s, with --foreground after 2):
# a 4x H100 call whose outer limit fell inside a benchmark's run returned nothing that way, issue 42)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
# GPU0: the first GPU this call uses (default 0): two parts at once on one host, each on its own GPUs
# (`GPU0=2 WORLDS=2 gpu_session.sh dist` on GPUs 2,3 beside `gpu_session.sh syncfree` on 0,1); NGPU counts from it.
# Honoured by the dist, titan, syncfree and hf parts and the main job; the other parts take the first GPUs
GPU0=${GPU0:-0}; NGPU=$((NGPU - GPU0))
if [ "${DRY_CPU:-0}" = 1 ]; then  # a check of the script on a machine without GPUs: the test parts on gloo
  case "$PART" in single|suite4|suite2|files4|files2|compile4) NGPU=4 ;; *) echo "DRY_CPU: test parts only"; exit 2 ;; esac
fi
[ "$NGPU" -ge 1 ] || { echo "GPU0=$GPU0: this host has $((NGPU + GPU0)) GPUs"; exit 2; }
gpus() { seq -s, "$GPU0" $((GPU0 + $1 - 1)); }  # CUDA_VISIBLE_DEVICES for this call's first $1 GPUs
peer_wheels() {  # torchtitan, torchao and their pins from the carried .whl/ (../shared/tools/peer_wheels.sh)
  [ ! -d .whl ] || python3 -m pip install -q --no-deps .whl/*.whl 2>&1 | grep -v WARNING | tail -2
}
# The NCCL suite, a torchrun per test file, JOBS of them at once (default 4; each job's ranks on the GPUs of one
# lane, lanes = GPUs / ranks, several jobs a lane when JOBS is larger). A torchrun per file isolates failures: with
# TORCH_NCCL_ASYNC_ERROR_HANDLING's default an NCCL timeout kills the process, and a mismatched collective can
# poison its communicator, so one file's failure must not take other files down. Heaviest files first.
FIRST="compile_moe compile_ep data_parallel agreement grad_overlap moe_training torchtitan collectives cuda_graphs sync_free"
in_session() {  # $1 a file for the session's id, $2 seconds, then a command: run under `timeout` in a session of its
  # own (setsid; the shell inside writes the session's id), then kill what is left of that session (torchrun's
  # workers after a timeout): this job's processes alone. Returns the command's exit status (124: timed out).
  # Waited for as a background job: a TERM from outside then runs the trap at once (bash runs it only after a
  # foreground command ends, and the outer `timeout` does not reach the new session)
  local sid=$1 limit=$2 rc; shift 2
  setsid -w bash -c 'echo $$ > "$0"; exec "$@"' "$sid" timeout -k 5 "$limit" "$@" &
  wait $!
  rc=$?
  pkill -9 -s "$(cat "$sid")" 2>/dev/null
  return $rc
}
run_file() {  # $1 ranks, $2 test file, $3 CUDA_VISIBLE_DEVICES: one torchrun, its log and rows under $OUT/nccl_$1/
  local n=$1 f=$2 name dir t0 rc r
  name=$(basename "$f" .py); dir="$OUT/nccl_$n"; t0=$(date +%s)
  SPMDMOE_FILE_TABLE="$dir/$name.md" CUDA_VISIBLE_DEVICES=$3 TORCH_FR_BUFFER_SIZE=2000 \
    TORCH_NCCL_DUMP_ON_TIMEOUT=1 TORCH_FR_DUMP_TEMP_FILE="$dir/fr_${name}_" \
    in_session "$dir/$name.sid" "${FILE_TIMEOUT:-300}" \
    torchrun --standalone --nproc-per-node "$n" -m pytest -q -p no:cacheprovider -m "not bench" -rs "$f" > "$dir/$name.txt" 2>&1
  rc=$?
  [ -s "$dir/$name.md" ] || printf '| %s | | | | | |\n' "$name" > "$dir/$name.md"
  printf '| %s | %s | %s |' "$name" "$(( $(date +%s) - t0 ))" "$([ "$rc" = 124 ] && echo timeout || echo "$rc")" > "$dir/$name.run"
  if [ "$rc" != 0 ]; then  # where each rank was when it ended (tests/distributed/conftest.py)
    for r in $(seq 0 $((n - 1))); do printf ' rank %s: %s;' "$r" "$(cat "$dir/$name.md.rank$r.now" 2>/dev/null)"; done >> "$dir/$name.run"
  fi
  echo >> "$dir/$name.run"
}
dist_suite() {  # $1 ranks: $OUT/tests_nccl_$1.md, a row per file, a total, a row per torchrun, the skip reasons
  local n=$1 table="$OUT/tests_nccl_$1.md" lanes i=0 f first t0
  lanes=$(( NGPU / n )); [ "$lanes" -ge 1 ] || lanes=1; mkdir -p "$OUT/nccl_$n"; t0=$(date +%s)
  first=$(for f in ${FILES:-$FIRST}; do echo "tests/distributed/test_$f.py"; done)  # FILES="torchtitan": those only
  for f in $first $([ -n "${FILES:-}" ] || ls tests/distributed/test_*.py | grep -vxF "$first"); do
    while [ "$(jobs -rp | wc -l)" -ge "${JOBS:-4}" ]; do wait -n; done
    run_file "$n" "$f" "$(seq -s, $(( GPU0 + (i % lanes) * n )) $(( GPU0 + (i % lanes) * n + n - 1 )))" &
    i=$((i + 1))
  done
  wait
  { printf '| file (%s ranks, NCCL) | passed | failed | errors | skipped | s |\n|---|---|---|---|---|---|\n' "$n"
    cat "$OUT/nccl_$n"/*.md
    cat "$OUT/nccl_$n"/*.md | awk -F'|' '{for (k = 3; k <= 6; k++) t[k] += $k} END {printf "| all | %d | %d | %d | %d |", t[3], t[4], t[5], t[6]}'
    printf ' %s s wall, %s jobs at once |\n\n| torchrun (%s ranks) | s | exit |\n|---|---|---|\n' "$(( $(date +%s) - t0 ))" "${JOBS:-4}" "$n"
    cat "$OUT/nccl_$n"/*.run
    printf '\nskipped (%s ranks):\n' "$n"; grep -h "^SKIPPED" "$OUT/nccl_$n"/*.txt | sort | uniq
  } > "$table"
  cat "$table"
}
compile_files() {  # every distributed test file that compiles or captures a CUDA graph, by grep (dist_suite's FILES)
  grep -lE 'torch\.compile|\.compile\(|capture_scalar_outputs|capture_training_step|CUDAGraph' tests/distributed/test_*.py \
    | sed 's#.*/test_##; s#\.py$##' | tr '\n' ' '
}
totals() {  # $1 rows (| file | passed | failed | errors | skipped | s |), $2 what ends the total's row
  awk -F'|' '{for (k = 3; k <= 6; k++) t[k] += $k} END {printf "| all | %d | %d | %d | %d |", t[3], t[4], t[5], t[6]}' "$1"
  printf ' %s |\n' "$2"
}
single_suite() {  # the whole single-process suite (`pytest`: tests/ and the package's doctests; SINGLE_TESTS: those
  # only) on the first GPU, a row per file as it goes (benchmarks/file_table.py): $OUT/tests_single.md
  local dir="$OUT/single" t0 rc
  mkdir -p "$dir"; t0=$(date +%s)
  FILE_TABLE="$dir/rows.md" CUDA_VISIBLE_DEVICES=$GPU0 in_session "$dir/single.sid" "${SINGLE_TIMEOUT:-540}" \
    python3 -m pytest -n "${SINGLE_JOBS:-8}" -m "not bench and not compile_matrix" -v --durations=20 --timeout="${TEST_TIMEOUT:-200}" -p no:cacheprovider -p benchmarks.file_table -rs \
    --deselect "$CPU_CASE" ${SINGLE_TESTS:-} > "$OUT/tests_single.txt" 2>&1
  rc=$?
  touch "$dir/rows.md"
  { printf '| file (one process, GPU %s) | passed | failed | errors | skipped | s |\n|---|---|---|---|---|---|\n' "$GPU0"
    cat "$dir/rows.md"
    totals "$dir/rows.md" "$(( $(date +%s) - t0 )) s wall, exit $([ "$rc" = 124 ] && echo "timeout ($(cat "$dir/rows.md.now" 2>/dev/null))" || echo "$rc")"
    printf '\n'
  } > "$OUT/tests_single.md"
  cat "$OUT/tests_single.md"
}
one_torchrun() {  # $1 ranks: the whole distributed suite (SUITE_TESTS: those files only) in ONE torchrun, as the
  # README runs it, on this call's first $1 GPUs; a row per file as it goes: $OUT/tests_suite_$1.md
  local n=$1 dir="$OUT/suite_$1" t0 rc r
  [ "$NGPU" -ge "$n" ] || { echo "suite at $n ranks: $NGPU GPUs here, skipped" | tee "$OUT/tests_suite_$n.md"; return; }
  mkdir -p "$dir"; t0=$(date +%s)
  FILE_TABLE="$dir/rows.md" SPMDMOE_FILE_TABLE="$dir/end.md" CUDA_VISIBLE_DEVICES=$(gpus "$n") TORCH_FR_BUFFER_SIZE=2000 \
    TORCH_NCCL_DUMP_ON_TIMEOUT=1 TORCH_FR_DUMP_TEMP_FILE="$dir/fr_" in_session "$dir/suite.sid" "${SUITE_TIMEOUT:-540}" \
    torchrun --standalone --nproc-per-node "$n" -m pytest -q -p no:cacheprovider -m "${SUITE_MARKS:-not bench and not compile_matrix and not training_run}" -p benchmarks.file_table -rs \
    ${SUITE_TESTS:-tests/distributed} > "$dir/suite.txt" 2>&1
  rc=$?
  touch "$dir/rows.md"
  { printf '| file (%s ranks, NCCL, one torchrun) | passed | failed | errors | skipped | s |\n|---|---|---|---|---|---|\n' "$n"
    cat "$dir/rows.md"
    totals "$dir/rows.md" "$(( $(date +%s) - t0 )) s wall, exit $([ "$rc" = 124 ] && echo timeout || echo "$rc")"
    if [ "$rc" != 0 ]; then  # where each rank was when it ended (tests/distributed/conftest.py)
      for r in $(seq 0 $((n - 1))); do printf 'rank %s: %s\n' "$r" "$(cat "$dir/end.md.rank$r.now" 2>/dev/null)"; done
    fi
    printf '\nskipped (%s ranks, one torchrun):\n' "$n"; grep -h "^SKIPPED" "$dir/suite.txt" | sort | uniq
    printf '\n'
  } > "$OUT/tests_suite_$n.md"
  cat "$OUT/tests_suite_$n.md"
}
cut_short() {  # after a TERM from outside: the tables of the suites it cut short, from their rows so far
  local d t
  for d in "$OUT"/single "$OUT"/suite_*; do
    t="$OUT/tests_${d##*/}.md"  # single: tests_single.md; suite_4: tests_suite_4.md
    [ -d "$d" ] && [ ! -f "$t" ] || continue
    touch "$d/rows.md"
    { printf '| file (%s, cut short) | passed | failed | errors | skipped | s |\n|---|---|---|---|---|---|\n' "${d##*/}"
      cat "$d/rows.md"; totals "$d/rows.md" "killed from outside ($(cat "$d/rows.md.now" 2>/dev/null))"; } > "$t"
  done
}
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count(), torch.cuda.get_device_name() if torch.cuda.is_available() else "(none)")' | tee "$OUT/env.txt"
case "$PART" in tests|dist|all|single|suite4|suite2|files4|files2|compile4) peer_wheels ;; esac  # torchtitan's tests need it
CPU_CASE="tests/test_compile_moe.py::test_compiled_block_matches_eager[inductor-True-False-2.5]"  # CPU_CASE_RUN=0: skipped
if [ "$PART" = tests ] || [ "$PART" = single ] || [ "$PART" = all ]; then
  # the whole single-process suite (single_suite), on the first visible GPU while the NCCL suites run; waited for
  # below. A test past --timeout gets its stacks dumped (pytest-timeout) and fails. The one case of
  # inductor on the CPU device runs after the suites (CPU_CASE), beside the main job: on these hosts inductor's C++
  # builds are slow (61-94 s to compile `x.sin() + 1`, the probe below), and beside 6 NCCL torchruns the case ran
  # into the part's 480 s limit (issue 41)
  # a probe: does inductor compile for the CPU in this image at all (the C++ toolchain, its worker pool)?
  { { command -v g++ c++ gcc; timeout --foreground -k 10 120 python3 -c 'import time, torch; t = time.time()
print("inductor on the CPU:", torch.compile(lambda x: x.sin() + 1)(torch.ones(8))[0].item(), f"{time.time() - t:.1f} s")'
      echo "probe exit $?"; } > "$OUT/inductor_cpu_probe.txt" 2>&1 &
    single_suite > /dev/null  # the whole single-process suite: its table is printed below
    wait; } &
  SINGLE=$!
fi
case "$PART" in
  files4|files2)  # the distributed suite, a torchrun per file, at 4 or 2 ranks
    n=${PART#files}
    if [ "$NGPU" -ge "$n" ]; then echo "== distributed tests on NCCL, $n ranks, a torchrun per file"; dist_suite "$n"
    else echo "$PART: $NGPU GPUs here" | tee "$OUT/tests_nccl_$n.md"; fi ;;
  compile4)  # every compile test file at 4 ranks: the rule after a change to the data path (header)
    if [ "$NGPU" -ge 4 ]; then
      echo "== compile test files on NCCL, 4 ranks, a torchrun per file: $(compile_files)"; FILES="$(compile_files)" dist_suite 4
    else echo "compile4: $NGPU GPUs here, 4 needed" | tee "$OUT/tests_nccl_4.md"; fi ;;
  suite4|suite2)  # the whole distributed suite in one torchrun
    echo "== distributed tests on NCCL, ${PART#suite} ranks, one torchrun"; one_torchrun "${PART#suite}" ;;
esac
if [ "$PART" = tests ] || [ "$PART" = dist ] || [ "$PART" = all ]; then
  # every world size at once (JOBS torchruns each); each prints its table when done
  for n in ${WORLDS:-$([ "$NGPU" -ge 4 ] && echo 4) $([ "$NGPU" -ge 2 ] && echo 2)}; do
    { echo "== distributed tests on NCCL, $n ranks, a torchrun per file"; dist_suite "$n"; } > "$OUT/dist_$n.log" 2>&1 &
  done
  wait $(jobs -rp | grep -vx "${SINGLE:-none}")
  cat "$OUT"/dist_*.log
fi
if [ -n "${SINGLE:-}" ] && [ "${CPU_CASE_RUN:-1}" = 1 ]; then
  wait "$SINGLE"
  timeout --foreground -k 10 300 python3 -m pytest -v -m "" --timeout=280 -p no:cacheprovider "$CPU_CASE" > "$OUT/tests_single_cpu_inductor.txt" 2>&1 &
  CPU_RUN=$!
fi
if [ "$PART" = tests ] || [ "$PART" = dist ] || [ "$PART" = all ]; then
  echo "== main job on NCCL"
  CUDA_VISIBLE_DEVICES=$(gpus "$NGPU") timeout --foreground -k 10 200 torchrun --standalone --nproc-per-node "$NGPU" examples/train_moe.py --device cuda 2>&1 | grep -v "^W1" > "$OUT/train_moe_cuda.txt"; tail -3 "$OUT/train_moe_cuda.txt"
fi
if [ -n "${SINGLE:-}" ]; then
  wait "${CPU_RUN:-$SINGLE}"
  echo "== the single-process suite on one GPU, then the CPU inductor case"
  tail -4 "$OUT/inductor_cpu_probe.txt"; cat "$OUT/tests_single.md"; tail -3 "$OUT/tests_single.txt"
  tail -1 "$OUT/tests_single_cpu_inductor.txt" 2>/dev/null
fi
if [ "$PART" = tests ] || [ "$PART" = all ]; then  # then the whole distributed suite in one torchrun per world size
  for n in ${SUITES-4 2}; do echo "== distributed tests on NCCL, $n ranks, one torchrun"; one_torchrun "$n"; done
fi
exits() {  # $1 name, $2 GPUs, $3 the run numbers, then the command: a row per run (exit, s, s from the last line to the exit)
  local name=$1 gpus=$2 runs=$3 i t0 rc; shift 3
  for i in $runs; do
    t0=$(date +%s.%N)
    CUDA_VISIBLE_DEVICES=$gpus timeout --foreground -k 10 300 "$@" 2>&1 | grep -v "^W1" | while IFS= read -r line; do
      printf '%s %s\n' "$(date +%s.%N)" "$line"; done > "$OUT/exit_${name}_$i.txt"
    rc=${PIPESTATUS[0]}
    awk -v n="$name" -v i="$i" -v rc="$rc" -v t0="$t0" -v t1="$(date +%s.%N)" 'END {
      printf "| %s | %d | %s | %.1f | %.2f |\n", n, i, (rc == 124 ? "timeout" : rc), t1 - t0, t1 - $1 }' \
      "$OUT/exit_${name}_$i.txt" >> "$OUT/exits.md"
  done
}
if [ "$PART" = exits ] || [ "$PART" = all ]; then
  # every example and benchmark must return 0 within seconds of its last line (issue 41): the main job and the
  # sync-free benchmark (CUDA graphs that captured NCCL work) EXIT_RUNS times each, on two GPU pairs at once
  echo "== clean exits on NCCL, ${EXIT_RUNS:-10} runs each; the main job's losses compared bit for bit across runs"
  printf '| program (2 GPUs, NCCL) | run | exit | s | s after its last line |\n|---|---|---|---|---|\n' > "$OUT/exits.md"
  # EXITS: the programs (default both); one program alone on a 4-GPU host takes both pairs, half the runs each
  programs=(${EXITS:-train_moe sync_free}); pairs=(0,1 $([ "$NGPU" -ge 4 ] && echo 2,3)); runs=$(seq 1 "${EXIT_RUNS:-10}")
  declare -A cmd=([train_moe]="examples/train_moe.py --device cuda"
                  [sync_free]="benchmarks/sync_free.py --tokens 1024 --layers 1 --reps 2 --iters 1")  # small: the exit is measured
  for p in "${programs[@]}"; do [ -n "${cmd[$p]:-}" ] || { echo "EXITS: no program '$p' (train_moe, sync_free)" | tee -a "$OUT/exits.md"; exit 2; }; done
  if [ ${#programs[@]} = 1 ] && [ ${#pairs[@]} = 2 ]; then
    exits "${programs[0]}" 0,1 "$(seq 1 2 "${EXIT_RUNS:-10}")" torchrun --standalone --nproc-per-node 2 ${cmd[${programs[0]}]} &
    exits "${programs[0]}" 2,3 "$(seq 2 2 "${EXIT_RUNS:-10}")" torchrun --standalone --nproc-per-node 2 ${cmd[${programs[0]}]} &
  else
    for k in "${!programs[@]}"; do
      exits "${programs[$k]}" "${pairs[$((k % ${#pairs[@]}))]}" "$runs" torchrun --standalone --nproc-per-node 2 ${cmd[${programs[$k]}]} &
    done
  fi
  wait
  for i in $runs; do grep -hs "parallel losses, exact" "$OUT/exit_train_moe_$i.txt" | cut -d' ' -f5-; done \
    | sort | uniq -c | awk '{printf "main job: %d run(s) with losses %s\n", $1, substr($0, index($0, $2))}' >> "$OUT/exits.md"
  cat "$OUT/exits.md"
fi
if [ "$PART" = titan ] || [ "$PART" = all ]; then
  # torchtitan's own parallelize with EP on NCCL (swapped vs its MoE, 20 steps, then tokens/s), and the layer side
  # by side at EP 2 and 4 (vs_torchtitan: a failing candidate is a row, the run goes on)
  echo "== torchtitan with EP on NCCL: its parallelize (EP = GPUs, dp 2 x ep 2), and the layer at EP 2 / 4"
  peer_wheels
  # LAYOUTS: "GPUs EP [--compile]" entries (--compile: torchtitan's per-block compile, with EP + FSDP on torch >= 2.13
  # only: torchtitan_model.py says why); PEER_EPS: vs_torchtitan's EP degrees (`LAYOUTS="2 2" PEER_EPS=2
  # gpu_session.sh titan` on GPUs 0,1 beside another part on 2,3); PEER_ARGS: more vs_torchtitan options
  # (`--precision bf16`); PEER_PROFILE=1: each spmdmoe candidate's top CUDA ops (eager against compiled)
  compiled=$(python3 -c 'import sys; sys.path.insert(0, "benchmarks"); from titan_expert_fsdp import fsdp_meshes_per_parameter
print(",4 4 --compile" if fsdp_meshes_per_parameter() else "")')  # the benchmark's own test of that torch
  IFS=, read -ra layouts <<< "${LAYOUTS:-2 2,4 4,4 2$compiled}"
  for layout in "${layouts[@]}"; do
    set -- $layout; [ $# -ge 2 ] || continue  # an empty entry (a trailing comma)
    [ "$NGPU" -ge "$1" ] || continue
    CUDA_VISIBLE_DEVICES=$(gpus "$1") timeout --foreground -k 10 300 torchrun --standalone --nproc-per-node "$1" \
      benchmarks/torchtitan_model.py --part ep --ep "$2" --steps 20 ${3:-} --out "$OUT/bench_titan_ep.md" \
      > "$OUT/log_titan_ep_$1_$2${3:-}.txt" 2>&1
    echo "torchtitan parallelize, $1 GPUs, EP $2 ${3:-}: exit $?"
  done
  # PEER_TOKENS: tokens a GPU, one run each (`PEER_TOKENS="16384 4096"`; default the shape's own)
  for n in ${PEER_EPS:-2 4}; do
    [ "$NGPU" -ge "$n" ] || continue
    for T in ${PEER_TOKENS:-shape}; do
      CUDA_VISIBLE_DEVICES=$(gpus "$n") timeout --foreground -k 10 480 torchrun --standalone --nproc-per-node "$n" \
        benchmarks/vs_torchtitan.py --shape "${SHAPE:-dsmoe16b}" --out "$OUT/bench_peer_ep$n.md" ${PEER_ARGS:-} \
        $([ "$T" = shape ] || echo --tokens "$T") $([ "${PEER_PROFILE:-0}" = 1 ] && echo --profile \
        "$OUT/profile_peer_ep${n}_$T.txt") > "$OUT/log_peer_ep${n}_$T.txt" 2>&1
      echo "vs_torchtitan, EP $n, $T tokens: exit $?"; grep "^| spmdmoe\|^| torchtitan" "$OUT/log_peer_ep${n}_$T.txt"
    done
  done
fi
if [ "$PART" = whole ]; then  # not in all: minutes per row
  # the whole-model table (torchtitan_model.py --part ep): torchtitan's DeepSeek-MoE-16B flavour cut to WHOLE_LAYERS
  # blocks (default 12: both models resident with FSDP on 4 H200s; 8 for H100s), through its parallelize with full
  # activation checkpointing, at each of WHOLE_LAYOUTS ("GPUs EP" entries), ours as each of WHOLE_OURS (options,
  # comma-separated; default sync, sync-free and FP8); then both examples (WHOLE_HF_LAYERS blocks of Qwen3-30B-A3B),
  # the torchtitan one also under torchtitan's CP 2 with either MoE (the losses step by step)
  echo "== whole models: torchtitan's 16B flavour through its parallelize, then the examples"
  peer_wheels
  IFS=, read -ra layouts <<< "${WHOLE_LAYOUTS:-4 4,4 2}"
  for layout in "${layouts[@]}"; do
    set -- $layout; [ "$NGPU" -ge "$1" ] || continue
    IFS=, read -ra variants <<< "${WHOLE_OURS-,--ep-mode sync_free,--expert-precision fp8_rowwise}"
    [ ${#variants[@]} -gt 0 ] || variants=("")
    for ours in "${variants[@]}"; do
      CUDA_VISIBLE_DEVICES=$(gpus "$1") timeout --foreground -k 10 400 torchrun --standalone --nproc-per-node "$1" \
        benchmarks/torchtitan_model.py --part ep --ep "$2" --flavor 16B --layers "${WHOLE_LAYERS:-12}" --seq 4096 \
        --batch 2 --steps 20 --ac full --lr 3e-4 $ours --out "$OUT/bench_whole.md" > "$OUT/log_whole_$1_$2${ours// /}.txt" 2>&1
      echo "whole model, $1 GPUs, EP $2 $ours: exit $?"
    done
  done
  CUDA_VISIBLE_DEVICES=$(gpus "$NGPU") timeout --foreground -k 10 300 torchrun --standalone --nproc-per-node "$NGPU" \
    examples/train_titan_moe.py --device cuda --layers "${WHOLE_LAYERS:-12}" --batch 2 --ac full \
    > "$OUT/titan_example.txt" 2>&1
  echo "examples/train_titan_moe.py: exit $?"; tail -1 "$OUT/titan_example.txt"
  for moe in spmdmoe torchtitan; do  # torchtitan's context parallelism with the swap, and without (docs/torchtitan.md)
    CUDA_VISIBLE_DEVICES=$(gpus "$NGPU") timeout --foreground -k 10 300 torchrun --standalone --nproc-per-node "$NGPU" \
      examples/train_titan_moe.py --device cuda --layers "${WHOLE_LAYERS:-12}" --batch 2 --ac full --cp 2 --moe "$moe" \
      > "$OUT/titan_example_cp_$moe.txt" 2>&1
    echo "examples/train_titan_moe.py --cp 2 --moe $moe: exit $?"; grep -E "^step |^tokens/s" "$OUT/titan_example_cp_$moe.txt"
  done
  CUDA_VISIBLE_DEVICES=$(gpus "$NGPU") timeout --foreground -k 10 300 torchrun --standalone --nproc-per-node "$NGPU" \
    examples/train_hf_moe.py --device cuda --layers "${WHOLE_HF_LAYERS:-8}" --batch 4 > "$OUT/hf_example.txt" 2>&1
  echo "examples/train_hf_moe.py: exit $?"; tail -1 "$OUT/hf_example.txt"
  cat "$OUT/bench_whole.md"
fi
if [ "$PART" = bench ] || [ "$PART" = all ]; then
  echo "== benchmarks"
  timeout --foreground -k 10 200 python3 benchmarks/kernels.py --sweep --out "$OUT/bench_kernels.md" 2>&1 | tail -12
  timeout --foreground -k 10 200 torchrun --nproc-per-node 1 benchmarks/moe_layer.py --out "$OUT/bench_moe.md" --profile "$OUT/profile_moe_1gpu.txt" 2>&1 | grep -v "^W1" | tail -3
  [ "$NGPU" -gt 1 ] && timeout --foreground -k 10 200 torchrun --nproc-per-node "$NGPU" benchmarks/moe_layer.py --out "$OUT/bench_moe.md" --profile "$OUT/profile_moe_ep.txt" 2>&1 | grep -v "^W1" | tail -3
fi
if [ -n "${BASE_TAR:-}" ]; then  # an older spmdmoe beside this one (vs_torchtitan.py --base): BASE_TAR=`git archive REV spmdmoe`
  bash benchmarks/base_copy.sh "$BASE_TAR" /tmp/base_copy && export BASE=/tmp/base_copy
fi
if [ "$PART" = profile ] || [ "$PART" = all ]; then
  echo "== where one step's time and memory go, bf16 and FP8 (benchmarks/profile_step.py)"
  for S in ${SHAPES:-dsmoe16b qwen3-30b}; do
    timeout --foreground -k 10 200 python3 benchmarks/profile_step.py --shape "$S" --out "$OUT/profile_step.md" > "$OUT/log_profile_$S.txt" 2>&1; echo "$S: exit $?"
  done
fi
if [ "$PART" = peer ] || [ "$PART" = all ]; then
  # one run per model shape (benchmarks/shapes.py): bf16 and FP8, eager and compiled, both FP8 weight policies,
  # step memory, the ceiling table; all five shapes, or those in SHAPES (`SHAPES="dsmoe16b" gpu_session.sh peer`)
  echo "== side by side with torchtitan, bf16 and FP8, per model shape"
  peer_wheels
  for S in ${SHAPES:-dsmoe16b dsmoe16b-64k qwen3-30b qwen3-235b dsv3-ep8}; do
    timeout --foreground -k 10 480 torchrun --nproc-per-node 1 benchmarks/vs_torchtitan.py --shape "$S" --out "$OUT/bench_peer.md" ${BASE:+--base "$BASE"} \
      > "$OUT/log_peer_$S.txt" 2>&1; echo "$S: exit $?"; grep -v "^W1" "$OUT/log_peer_$S.txt" | tail -3
  done
fi
if [ "$PART" = fp8 ] || [ "$PART" = all ]; then
  echo "== FP8: GPU tests (compile on aot_eager and inductor, CUDA graphs), the weight cache's kernels, numerics"
  timeout --foreground -k 10 240 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_kernels.py tests/test_fp8.py tests/test_cuda_graphs.py \
    -rs -s > "$OUT/tests_fp8.txt" 2>&1; grep SQNR "$OUT/tests_fp8.txt"; tail -4 "$OUT/tests_fp8.txt"
  FP8_TEST_BACKEND=inductor timeout --foreground -k 10 200 python3 -m pytest -q -p no:cacheprovider tests/test_fp8.py -k compiled \
    > "$OUT/tests_fp8_inductor.txt" 2>&1; tail -2 "$OUT/tests_fp8_inductor.txt"
  if [ -d .old/spmdmoe ]; then  # the same CUDA-graph test against the code before the weight cache's check
    (cd .old && PYTHONPATH=$PWD timeout --foreground -k 10 120 python3 -m pytest -q -p no:cacheprovider ../tests/test_cuda_graphs.py \
      -k optimizer_steps > "$OUT/tests_cuda_graphs_old.txt" 2>&1); grep -E "passed|failed|AssertionError: \(" "$OUT/tests_cuda_graphs_old.txt" | tail -3
  fi
  peer_wheels
  timeout --foreground -k 10 200 python3 benchmarks/kernels.py --sweep-only fingerprint --only "fingerprint,weight cache,FP8 weights" \
    --out "$OUT/bench_kernels.md" > "$OUT/log_kernels.txt" 2>&1; tail -9 "$OUT/log_kernels.txt"
fi
if [ "$PART" = numerics ] || [ "$PART" = all ]; then
  echo "== FP8 numerics: each GEMM with fast accumulation on and off, the layer's gates per setting"
  timeout --foreground -k 10 270 python3 benchmarks/fp8_numerics.py --out "$OUT/bench_fp8_numerics.md" > "$OUT/log_numerics.txt" 2>&1
  tail -3 "$OUT/log_numerics.txt"
fi
if [ "$PART" = syncfree ] || [ "$PART" = all ]; then
  if [ "$NGPU" -gt 1 ]; then
    # EP (default 2) on the first EP GPUs; each candidate's top CUDA ops in profile_sync_free_T.txt, where the
    # eager steps' host time goes in host_sync_free_T.txt; TOKENS (default 4096 16384); GRAPH_ORDER: the order
    # the graphs are captured in (sync_free.py --graph-order); SHAPE (default dsmoe16b): the model's D, F, E, K;
    # SF_ARGS: more sync_free.py options (--graphs-together, --no-residual)
    ep=${EP:-2}; [ "$ep" -le "$NGPU" ] || ep=$NGPU
    echo "== sync-free EP $ep: a 4-layer stack, sync eager vs sync-free eager and graphed (issues 13, 42)"
    for T in ${TOKENS:-4096 16384}; do
      CUDA_VISIBLE_DEVICES=$(gpus "$ep") timeout --foreground -k 10 300 torchrun --standalone --nproc-per-node "$ep" \
        benchmarks/sync_free.py --tokens $T --shape "${SHAPE:-dsmoe16b}" --dump-after 270 --out "$OUT/bench_sync_free.md" --profile "$OUT/profile_sync_free_$T.txt" \
        --host-profile "$OUT/host_sync_free_$T.txt" ${GRAPH_ORDER:+--graph-order "$GRAPH_ORDER"} ${SF_ARGS:-} \
        > "$OUT/log_sync_free_$T.txt" 2>&1; tail -2 "$OUT/log_sync_free_$T.txt"
    done
  fi
fi
if [ "$PART" = overlap ] || [ "$PART" = all ]; then
  echo "== SP gradient sums: CUDA check on one GPU (gloo, 2 ranks on cuda:0), exposed communication on NCCL (issue 14)"
  timeout --foreground -k 10 200 torchrun --nproc-per-node 2 benchmarks/sp_grad_overlap.py --same-gpu > "$OUT/log_overlap_same_gpu.txt" 2>&1
  grep -h "OK\|Error" "$OUT/log_overlap_same_gpu.txt" | head -5
  if [ "$NGPU" -gt 1 ]; then
    timeout --foreground -k 10 240 torchrun --nproc-per-node "$NGPU" benchmarks/sp_grad_overlap.py --out "$OUT/bench_sp_grad_overlap.md" \
      > "$OUT/log_overlap.txt" 2>&1; tail -2 "$OUT/log_overlap.txt"
  fi
fi
if [ "$PART" = host ]; then
  # issue 61's host-cost table: benchmarks/host_cost.py (ours against torchtitan's MoE, eager; with --ops, where each
  # stage's host time goes, op by op) at each EP in HOST_EPS (default 1 2 4: those this host has) and each
  # shape:tokens in HOST_SHAPES (default the debug model's at 1k and 4k, DeepSeek-MoE-16B's at 4k and 16k): about a
  # minute a run, so a call of 600 s takes one EP size (HOST_EPS=2)
  peer_wheels
  for ep in ${HOST_EPS:-1 2 4}; do
    [ "$ep" -le "$NGPU" ] || continue
    for st in ${HOST_SHAPES:-dsv3-debug:1024,4096 dsmoe16b:4096,16384}; do
      echo "== host cost, EP $ep, ${st%%:*} at ${st#*:} tokens a GPU"
      CUDA_VISIBLE_DEVICES=$(gpus "$ep") timeout --foreground -k 10 240 torchrun --standalone --nproc-per-node "$ep" \
        benchmarks/host_cost.py --shape "${st%%:*}" --tokens "${st#*:}" --ops --out "$OUT/bench_host_cost.md" \
        > "$OUT/log_host_cost_${ep}_${st%%:*}.txt" 2>&1; grep "host vs torchtitan\|^| ours\|^| torchtitan" \
        "$OUT/log_host_cost_${ep}_${st%%:*}.txt" | head -4
    done
  done
fi
if [ "$PART" = ab ]; then
  # a change's A/B against the code before it, in one process each (not in all): make the older package here with
  # `git archive REV spmdmoe > base.tar` (untracked: it travels with the tree), then on the GPU host `gpu_session.sh ab`:
  # benchmarks/kernels.py --base (AB_KERNELS: its --only names, default every kernel) on one GPU, then the layer's
  # vs_torchtitan.py --base at AB_TOKENS (default 16384 4096) tokens a GPU on AB_EP GPUs (default 2), bf16 eager
  peer_wheels
  bash benchmarks/base_copy.sh "${BASE_TAR:-base.tar}" /tmp/ab_base > /dev/null || exit 2
  CUDA_VISIBLE_DEVICES=$GPU0 timeout --foreground -k 10 240 python3 benchmarks/kernels.py --base /tmp/ab_base \
    ${AB_KERNELS:+--only "$AB_KERNELS"} --out "$OUT/bench_ab_kernels.md" > "$OUT/log_ab_kernels.txt" 2>&1
  echo "kernels.py --base: exit $?"; grep "vs the base copy" "$OUT/log_ab_kernels.txt"
  for T in ${AB_TOKENS:-16384 4096}; do
    CUDA_VISIBLE_DEVICES=$(gpus "${AB_EP:-2}") timeout --foreground -k 10 240 torchrun --standalone --nproc-per-node \
      "${AB_EP:-2}" benchmarks/vs_torchtitan.py --tokens "$T" --precision bf16 --eager-only --base /tmp/ab_base \
      --out "$OUT/bench_ab_layer.md" > "$OUT/log_ab_layer_$T.txt" 2>&1
    echo "vs_torchtitan --base, $T tokens: exit $?"; grep "^| spmdmoe\|^| base\|^| torchtitan" "$OUT/log_ab_layer_$T.txt"
  done
fi
if [ "$PART" = hf ]; then
  # transformers' Qwen3-MoE, swapped vs unswapped (issue 45); transformers from the carried .whl/ (hf_wheels.sh)
  peer_wheels
  echo "== transformers Qwen3-30B-A3B-shaped blocks: swap_moe vs transformers' own MoE (issue 45)"
  CUDA_VISIBLE_DEVICES=$GPU0 timeout --foreground -k 10 300 python3 benchmarks/hf_model.py --out "$OUT/bench_hf_model.md" > "$OUT/log_hf_model.txt" 2>&1
  tail -3 "$OUT/log_hf_model.txt"
fi
echo "== summary"
cat "$OUT"/bench_*.md 2>/dev/null || true  # (a tests part writes no benchmark table: not a failure)
