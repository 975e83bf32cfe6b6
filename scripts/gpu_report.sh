#!/usr/bin/env bash
# Everything the GPU machine has to say, in one command that fits one 10-minute call.
# Steps, named on the command line (default: probe tests sanitize quick):
#   probe     the Hopper probes (scripts/hopper_probe.py, < 1 min): wgmma fragments, TMA swizzle
#             bytes and an mbarrier pipeline against what the CPU interpreter emulates, as
#             hopper-probe.json; first, so that an emulator the GPU contradicts is known before
#             anything built on it is judged
#   tests     compile every kernel instantiation for this GPU in parallel (CuPy's disk cache),
#             then every gpu-marked test (tests/backends/test_cuda_kernels.py: every pattern/dtype/block/
#             head dim; the CuPy and torch-on-CUDA tests of the other modules), a line per test
#   modifiers the score modifiers and dropout on the GPU against the float64 reference, out and
#             every gradient (scripts/gpu_modifiers_check.py)
#   sanitize  compute-sanitizer memcheck, racecheck and synccheck on small forward + backward
#   mma       the gpu-marked kernel tests again with CUATTN_KERNELS=mma: on an H100/H200, whose
#             forwards run the wgmma kernel (kernels/attn_fwd_sm90.cu) by default, the mma.sync
#             forward (attn_fwd) that other GPUs and the score modifiers run
#   optin     the kernels no GPU has run yet, which stay opt-in until this step passes them: the
#             gpu-marked kernel and serving tests with CUATTN_KERNELS=sm90a (the wgmma backward,
#             kernels/attn_bwd_sm90.cu), CUATTN_DECODE=gqa (kernels/attn_decode_gqa.cu) and
#             CUATTN_QUEST=kernel (Quest's page choice, kernels/quest_select.cu), then
#             compute-sanitizer memcheck and racecheck on the same launches, and the wgmma
#             backward's dQ reduces ordered against CUATTN_BWD_DQ=unordered, timed side by side
#             (scripts/bwd_dq_order_bench.py, bwd-dq-order.md); then the same with
#             CUATTN_KERNELS=sm90a-persistent (the persistent forward), CUATTN_DECODE_FP8=kernel
#             (fp8 KV pages: attn_decode_split_fp8, attn_decode_gqa_fp8) and
#             CUATTN_SCORE_BIAS=kernel (the score-modifier kernels' dense score bias)
#   optin-fwd the sm_90a forward's opt-in variants on the forward's oracle, GQA and empty-row
#             tests, one pass each: CUATTN_SM90_TILE_N=128 (128-key tiles at 64-blocks),
#             CUATTN_SM90_RESCALE=skip with CUATTN_SM90_EXP2=poly (the rescale skip; the exp2
#             polynomial at d = 64), CUATTN_SM90_D64_CONSUMERS=3 (three consumers at d = 64)
#   profile   Nsight Compute on one dense-causal forward + backward of ours and of SDPA-flash
#             (scripts/profile_kernels.py): throughput, occupancy, warp stalls; then tensor-pipe
#             use and shared-memory bank conflicts as metrics
#   counters  Nsight Compute counters (instructions by pipe, shared wavefronts, L2 bytes) of every
#             kernel in scripts/profile_kernels.py at d=128 and d=64, as CSV: the static model's
#             calibration
#   quick     the quick benchmark (< 2 min)
#   full      the full benchmark sweep, with whatever time the steps before it left
#   decode    the decode benchmark (scripts/decode_bench.py --quick: paged KVCache per policy
#             vs SDPA and FlexAttention over the same kept tokens)
#   dynamic   the dynamic-sparsity benchmark (scripts/dynamic_bench.py --quick: block selection
#             time, attention on the chosen layout vs FlexAttention on the same blocks and SDPA)
# Run from the repository root:
#   PYTHONPATH=. bash scripts/gpu_report.sh                  # probes, tests, sanitizers, quick bench
#   PYTHONPATH=. bash scripts/gpu_report.sh tests sanitize full
#   CUATTN_BENCH_ARGS="--blocksizes 64,128" PYTHONPATH=. bash scripts/gpu_report.sh quick
#                                     # extra benchmark arguments: only 64- and 128-blocks
# Writes logs and summary.md to $OUT (or bench/results/gpu-report-<date>/) and the benchmark's
# json/md/png to bench/results/ and $OUT. Each step has its own time limit so one hang cannot
# eat the others' time; a failing step does not stop the next.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="${PYTHONPATH:-.}"
PY="${PYTHON:-python}"
STAMP="$(date -u +%Y-%m-%d)"
REPORT_DIR="${OUT:-bench/results/gpu-report-$STAMP}"
mkdir -p "$REPORT_DIR" bench/results
STARTED="$(mktemp)"  # its time stamp marks what this run wrote
SUMMARY="$REPORT_DIR/summary.md"
STEPS="${*:-probe tests sanitize quick}"
# Step time limits in seconds, under the 600-second call (each step may take 10 s more to kill).
# Each can be set from the environment, to fit a session's device minutes.
CALL_S=${CALL_S:-580}
PROBE_S=${PROBE_S:-200}  # the probe's own limit per group is 45 s, its 4 groups take ~40 s
WARM_S=${WARM_S:-60}; TESTS_S=${TESTS_S:-190}; MMA_S=${MMA_S:-$TESTS_S}; OPTIN_S=${OPTIN_S:-$TESTS_S}
OPTIN_FWD_S=${OPTIN_FWD_S:-90}
MODIFIERS_S=${MODIFIERS_S:-60}; MEMCHECK_S=${MEMCHECK_S:-60}
RACECHECK_S=${RACECHECK_S:-90}; SYNCCHECK_S=${SYNCCHECK_S:-40}; BENCH_S=${BENCH_S:-110}
PROFILE_S=${PROFILE_S:-100}; PROFILE_METRICS_S=${PROFILE_METRICS_S:-50}
COUNTERS_S=${COUNTERS_S:-50}; DECODE_S=${DECODE_S:-150}; DYNAMIC_S=${DYNAMIC_S:-150}
BWD_DQ_S=${BWD_DQ_S:-45}  # 6 cases x 2 dQ orders x 8 backwards, from the warm step's cubins
NCU_SECTIONS="${NCU_SECTIONS:-SpeedOfLight LaunchStats Occupancy WarpStateStats ComputeWorkloadAnalysis MemoryWorkloadAnalysis}"
# Sections collected with the counters: the warp stall reasons name a latency-bound kernel's
# limiter, which no throughput counter does (what the 2026-11-25 run lacked).
COUNTER_SECTIONS="${COUNTER_SECTIONS:-WarpStateStats}"
NCU_METRICS="sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
NCU_METRICS="$NCU_METRICS,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum"
NCU_METRICS="$NCU_METRICS,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum"
NCU_METRICS="$NCU_METRICS,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum"
NCU_METRICS="$NCU_METRICS,smsp__inst_executed.sum,gpu__time_duration.sum"
# The counters the static performance model predicts (dev/sass_model.py), per kernel:
# instructions by pipe and opcode, shared-memory wavefronts, L2/DRAM bytes. Names this ncu does
# not know are dropped (it refuses a whole run over one unknown name).
COUNTER_NAMES="smsp__inst_executed smsp__inst_executed_pipe_tensor_op_hmma smsp__inst_executed_op_ldsm
 smsp__inst_executed_op_shared_ld smsp__inst_executed_op_shared_st smsp__inst_executed_op_ldgsts
 smsp__inst_executed_pipe_fma smsp__inst_executed_pipe_alu smsp__inst_executed_pipe_xu
 smsp__inst_executed_pipe_uniform smsp__inst_executed_pipe_fmaheavy smsp__inst_executed_pipe_lsu
 l1tex__data_pipe_lsu_wavefronts_mem_shared l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld
 l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld
 lts__t_bytes dram__bytes_read dram__bytes_write gpu__time_duration smsp__cycles_active"
COUNTER_RATES="sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
 sm__warps_active.avg.pct_of_peak_sustained_active sm__cycles_elapsed.avg.per_second"
QUICK_BUDGET_S=${QUICK_BUDGET_S:-70}  # the quick bench starts no new case after this
LAST_CASE_S=60     # room left after a bench's budget for its last case (FlexAttention compiles)
# jax (imported by the adapter tests) would otherwise take 75% of the GPU's memory at import.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# A step killed at its limit keeps what it printed (the 23e0a72 run's decode step left an empty
# log: Python had held its output back).
export PYTHONUNBUFFERED=1

echo "# GPU report $(date -u '+%Y-%m-%d %H:%M UTC'): $STEPS" > "$SUMMARY"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1
  "$PY" -c 'import sys, torch, cupy; rt = cupy.cuda.runtime
print("python", sys.version.split()[0], "torch", torch.__version__, "(CUDA", torch.version.cuda,
      "cuDNN", torch.backends.cudnn.version(), ") cupy", cupy.__version__,
      "CUDA runtime", rt.runtimeGetVersion(), "driver", rt.driverGetVersion(),
      "NVRTC", cupy.cuda.nvrtc.getVersion())' 2>&1
  nvcc --version 2>&1 | tail -n 1
  echo "commit ${CUATTN_COMMIT:-$(git log -1 --format=%H 2>/dev/null) (the device copy's git; set CUATTN_COMMIT to the tree's own)}"
} > "$REPORT_DIR/environment.txt"
sed 's/^/    /' "$REPORT_DIR/environment.txt" >> "$SUMMARY"
echo >> "$SUMMARY"
echo "| step | exit | seconds |" >> "$SUMMARY"
echo "|---|---:|---:|" >> "$SUMMARY"

step() {  # step NAME LIMIT_S COMMAND...: run with a time limit, log, add a summary row
  local name="$1" limit="$2"; shift 2
  local start=$SECONDS
  echo "== $name (limit ${limit}s): $*" >&2
  timeout --kill-after=10 "$limit" "$@" > "$REPORT_DIR/$name.log" 2>&1
  local rc=$?
  echo "| $name | $rc$([ $rc -eq 124 ] && echo ' (timed out)') | $((SECONDS - start)) |" >> "$SUMMARY"
  tail -n 3 "$REPORT_DIR/$name.log" >&2
}

find_sanitizer() {
  command -v compute-sanitizer && return
  for candidate in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer \
      "$("$PY" -c 'import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))' 2>/dev/null)"/nvidia/cuda_sanitizer_api/compute-sanitizer/compute-sanitizer; do
    [ -x "$candidate" ] && { echo "$candidate"; return; }
  done
}

for name in $STEPS; do
  case "$name" in
    probe)
      step hopper-probe "$PROBE_S" "$PY" scripts/hopper_probe.py "$REPORT_DIR/hopper-probe.json"
      ;;
    tests)
      step warm "$WARM_S" "$PY" scripts/warm_kernels.py --jobs "$(nproc)"
      step gpu-tests "$TESTS_S" "$PY" -m pytest -m gpu -v -rfE -p no:cacheprovider \
        --continue-on-collection-errors --junitxml="$REPORT_DIR/gpu-tests.xml" tests
      ;;
    mma)
      CUATTN_KERNELS=mma step gpu-tests-mma "$MMA_S" "$PY" -m pytest -m gpu -v -rfE \
        -p no:cacheprovider --junitxml="$REPORT_DIR/gpu-tests-mma.xml" \
        tests/backends/test_cuda_kernels.py
      ;;
    optin)
      export CUATTN_KERNELS=sm90a CUATTN_DECODE=gqa CUATTN_QUEST=kernel
      step gpu-tests-optin "$OPTIN_S" "$PY" -m pytest -m gpu -v -rfE -p no:cacheprovider \
        --junitxml="$REPORT_DIR/gpu-tests-optin.xml" tests/backends/test_cuda_kernels.py \
        tests/serving
      SANITIZER="$(find_sanitizer)"
      if [ -n "$SANITIZER" ]; then
        step memcheck-optin "$MEMCHECK_S" "$SANITIZER" --tool memcheck \
          --error-exitcode 1 "$PY" scripts/sanitize_launch.py
        step racecheck-optin "$RACECHECK_S" "$SANITIZER" --tool racecheck \
          --racecheck-report all --error-exitcode 1 "$PY" scripts/sanitize_launch.py
      fi
      step bwd-dq-order "$BWD_DQ_S" "$PY" scripts/bwd_dq_order_bench.py \
        --markdown "$REPORT_DIR/bwd-dq-order.md"
      export CUATTN_KERNELS=sm90a-persistent CUATTN_DECODE_FP8=kernel CUATTN_SCORE_BIAS=kernel
      step gpu-tests-optin-persistent-fp8 "$OPTIN_S" "$PY" -m pytest -m gpu -v -rfE \
        -p no:cacheprovider --junitxml="$REPORT_DIR/gpu-tests-optin-persistent-fp8.xml" \
        tests/backends/test_cuda_kernels.py tests/backends/test_attn_fwd_sm90_persistent.py \
        tests/serving/test_decode_fp8.py tests/serving/test_paged_decode.py \
        tests/backends/test_score_bias.py
      if [ -n "$SANITIZER" ]; then
        step memcheck-optin-persistent "$MEMCHECK_S" "$SANITIZER" --tool memcheck \
          --error-exitcode 1 "$PY" scripts/sanitize_launch.py
      fi
      unset CUATTN_KERNELS CUATTN_DECODE CUATTN_DECODE_FP8 CUATTN_SCORE_BIAS CUATTN_QUEST
      ;;
    optin-fwd)
      for variant in "keypairs CUATTN_SM90_TILE_N=128" \
          "skip-poly CUATTN_SM90_RESCALE=skip CUATTN_SM90_EXP2=poly" \
          "wg3 CUATTN_SM90_D64_CONSUMERS=3"; do
        read -r label switches <<< "$variant"
        # shellcheck disable=SC2086  # switches is a list of NAME=VALUE words on purpose
        (export $switches
         step "gpu-tests-optin-fwd-$label" "$OPTIN_FWD_S" "$PY" -m pytest -m gpu -v -rfE \
           -p no:cacheprovider --junitxml="$REPORT_DIR/gpu-tests-optin-fwd-$label.xml" \
           -k "float64_oracle or gqa or fully_masked" tests/backends/test_cuda_kernels.py)
      done
      ;;
    modifiers)
      step modifiers "$MODIFIERS_S" "$PY" scripts/gpu_modifiers_check.py
      ;;
    sanitize)
      SANITIZER="$(find_sanitizer)"
      if [ -z "$SANITIZER" ]; then
        echo "| memcheck, racecheck, synccheck | compute-sanitizer not found | 0 |" >> "$SUMMARY"
        continue
      fi
      step memcheck "$MEMCHECK_S" "$SANITIZER" --tool memcheck \
        --error-exitcode 1 "$PY" scripts/sanitize_launch.py
      step racecheck "$RACECHECK_S" "$SANITIZER" --tool racecheck --racecheck-report all \
        --error-exitcode 1 "$PY" scripts/sanitize_launch.py
      step synccheck "$SYNCCHECK_S" "$SANITIZER" --tool synccheck \
        --error-exitcode 1 "$PY" scripts/sanitize_launch.py
      ;;
    profile)
      NCU="$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)"
      if [ -z "$NCU" ]; then
        echo "| profile | ncu not found | 0 |" >> "$SUMMARY"
        continue
      fi
      # Clocks as found (no locking): the numbers stay comparable with the benchmark's.
      NCU_ARGS=(--clock-control none -k "regex:attn_|flash" --print-summary none)
      section_args=()
      for section in $NCU_SECTIONS; do section_args+=(--section "$section"); done
      step profile "$PROFILE_S" "$NCU" "${NCU_ARGS[@]}" "${section_args[@]}" \
        "$PY" scripts/profile_kernels.py
      step profile-metrics "$PROFILE_METRICS_S" "$NCU" "${NCU_ARGS[@]}" --csv \
        --metrics "$NCU_METRICS" "$PY" scripts/profile_kernels.py
      ;;
    counters)
      NCU="$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)"
      if [ -z "$NCU" ]; then
        echo "| counters | ncu not found | 0 |" >> "$SUMMARY"
        continue
      fi
      "$NCU" --query-metrics --chip gh100 > "$REPORT_DIR/ncu-query.txt" 2>&1
      known="$(awk '{print $1}' "$REPORT_DIR/ncu-query.txt")"
      metrics=""
      for name in $COUNTER_NAMES; do
        grep -qx "$name" <<< "$known" && metrics="$metrics,$name.sum"
      done
      for name in $COUNTER_RATES; do
        grep -qx "${name%%.*}" <<< "$known" && metrics="$metrics,$name"
      done
      [ -n "$metrics" ] || metrics=",$NCU_METRICS"  # the query failed: the proven list
      echo "counters: ${metrics#,}" > "$REPORT_DIR/counters-metrics.txt"
      counter_sections=()
      for section in $COUNTER_SECTIONS; do counter_sections+=(--section "$section"); done
      for head_dim in 128 64; do
        step "counters-d$head_dim" "$COUNTERS_S" "$NCU" --clock-control none -k "regex:attn_|flash" \
          --print-summary none --csv --metrics "${metrics#,}" "${counter_sections[@]}" \
          "$PY" scripts/profile_kernels.py --head-dim "$head_dim"
      done
      ;;
    quick)
      # shellcheck disable=SC2086  # CUATTN_BENCH_ARGS is a list of words on purpose
      step bench-quick "$BENCH_S" "$PY" scripts/bench.py --quick --time-budget "$QUICK_BUDGET_S" \
        --out bench/results ${CUATTN_BENCH_ARGS:-}
      ;;
    full)
      # The bench compiles the few instantiations it launches itself, in parallel; it writes its
      # results after every case, so even a run cut short by the limit leaves them on disk.
      left=$((CALL_S - SECONDS))
      # shellcheck disable=SC2086
      step bench-full "$left" "$PY" scripts/bench.py --time-budget "$((left - LAST_CASE_S))" \
        --out bench/results ${CUATTN_BENCH_ARGS:-}
      ;;
    decode)
      # shellcheck disable=SC2086  # DECODE_ARGS is a list of words on purpose
      step decode-bench "$DECODE_S" "$PY" scripts/decode_bench.py ${DECODE_ARGS:---quick} \
        --markdown "$REPORT_DIR/decode-bench.md"
      ;;
    dynamic)
      step dynamic-bench "$DYNAMIC_S" "$PY" scripts/dynamic_bench.py --quick \
        --markdown "$REPORT_DIR/dynamic-bench.md"
      ;;
    *)
      echo "unknown step '$name': expected probe, tests, mma, modifiers, sanitize, profile, counters, quick," \
        "full, decode or dynamic" >&2
      exit 2
      ;;
  esac
done
# The benchmarks' results of this run: files older than its start (committed results of the
# same day, the static model's reports) stay behind.
find bench/results -maxdepth 1 -newer "$STARTED" \( -name '*.json' -o -name '*.md' -o -name '*.png' \) \
  -exec cp {} "$REPORT_DIR"/ \;
rm -f "$STARTED"
echo >> "$SUMMARY"
for log in "$REPORT_DIR"/*.log; do
  printf '\n## %s (last lines)\n\n```\n' "$(basename "$log")" >> "$SUMMARY"
  tail -n 15 "$log" >> "$SUMMARY"
  printf '```\n' >> "$SUMMARY"
done
cat "$SUMMARY"
