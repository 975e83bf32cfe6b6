#!/usr/bin/env bash
# Everything the GPU machine has to say, in one command that fits one 10-minute call:
#   1. compile every kernel instantiation for this GPU in parallel (into CuPy's disk cache)
#   2. the gpu-marked tests (tests/test_cuda_kernels.py: every pattern/dtype/block/head dim)
#   3. compute-sanitizer memcheck and racecheck on small forward + backward launches
#   4. the benchmark, --quick by default (--full: the whole sweep and nothing else, < 10 min)
# Run from the repository root:
#   PYTHONPATH=. bash scripts/gpu_report.sh          # or: ... gpu_report.sh --full
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
SUMMARY="$REPORT_DIR/summary.md"
MODE="${1:-}"
# Step time limits in seconds: 540 in all, plus up to 10 s to kill each, under the 600-second call.
WARM_S=120; TESTS_S=140; MEMCHECK_S=60; RACECHECK_S=90; BENCH_S=130; FULL_BENCH_S=570
BENCH_BUDGET_S=90  # the quick bench starts no new case after this

echo "# GPU report $(date -u '+%Y-%m-%d %H:%M UTC')" > "$SUMMARY"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  "$PY" -c 'import sys, torch, cupy; print(sys.version.split()[0], "torch", torch.__version__, "cupy", cupy.__version__)' 2>&1
  git log -1 --oneline 2>/dev/null
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

if [ "$MODE" = "--full" ]; then
  # The bench compiles the few instantiations it launches itself, in parallel; it writes its
  # results after every case, so even a run cut short by the limit leaves them on disk.
  step bench-full "$FULL_BENCH_S" "$PY" scripts/bench.py --out bench/results
else
  step warm "$WARM_S" "$PY" scripts/warm_kernels.py --jobs "$(nproc)"
  step gpu-tests "$TESTS_S" "$PY" -m pytest -m gpu -q -p no:cacheprovider \
    --junitxml="$REPORT_DIR/gpu-tests.xml" tests/test_cuda_kernels.py
  SANITIZER="$(find_sanitizer)"
  if [ -n "$SANITIZER" ]; then
    step memcheck "$MEMCHECK_S" "$SANITIZER" --tool memcheck \
      --error-exitcode 1 "$PY" scripts/sanitize_launch.py
    step racecheck "$RACECHECK_S" "$SANITIZER" --tool racecheck --racecheck-report all \
      --error-exitcode 1 "$PY" scripts/sanitize_launch.py
  else
    echo "| memcheck, racecheck | compute-sanitizer not found | 0 |" >> "$SUMMARY"
  fi
  step bench-quick "$BENCH_S" "$PY" scripts/bench.py --quick --time-budget "$BENCH_BUDGET_S" \
    --out bench/results
fi
cp bench/results/"$STAMP"-*.{json,md,png} "$REPORT_DIR"/ 2>/dev/null
echo >> "$SUMMARY"
for log in "$REPORT_DIR"/*.log; do
  printf '\n## %s (last lines)\n\n```\n' "$(basename "$log")" >> "$SUMMARY"
  tail -n 15 "$log" >> "$SUMMARY"
  printf '```\n' >> "$SUMMARY"
done
cat "$SUMMARY"
