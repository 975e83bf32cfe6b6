#!/usr/bin/env bash
# A whole GPU session in one call (~9.5 minutes): what a task lent 15 device-minutes can afford.
#   phase 0, first and alone: the Hopper probes (gpu_report.sh probe, < 1 min; PROBE=0 skips it)
#   phase 1, side by side (correctness only, so they may share the GPU): CORRECT (default:
#            every gpu-marked test, then the kernel tests again with CUATTN_KERNELS=mma (an
#            H100/H200 runs the wgmma forward by default), then the opt-in kernels (the wgmma
#            backward, the tensor-core decode) with their tests and sanitizers, then the score
#            modifiers);
#            beside them compute-sanitizer memcheck, racecheck and synccheck on every family
#   phase 2, alone (timings): TIMED (default: the quick sweep's dense causal cases at 64- and
#            128-blocks), then TIMED_MMA with CUATTN_KERNELS=mma (default: the same quick
#            sweep), then TIMED_REST (default: Nsight counters and warp stall reasons of every
#            kernel at d=128 and d=64, decode at the sizes earlier runs did not reach, the
#            dynamic-layout benchmark)
# Then everything under $OUT/report.tgz (the device tool brings back 8 files at most) and the
# summaries on stdout. Run from the repository root on the GPU machine:
#   CUATTN_COMMIT=<the tree's commit> PYTHONPATH=. PYTHON=python3 bash scripts/gpu_session.sh
# Every step's limit is gpu_report.sh's, overridable from the environment; phase 2 is cut at
# SESSION_S seconds from the start whatever is left, so the archive is always written.
set -u
cd "$(dirname "$0")/.."
SESSION_S="${SESSION_S:-565}"
RESULTS="${TMPDIR:-/tmp}/cuattn-gpu-session"
ARCHIVE_DIR="${OUT:-bench/results/gpu-session-$(date -u +%Y-%m-%d)}"
CORRECT="${CORRECT:-tests mma optin modifiers}"
TIMED="${TIMED-quick}"  # set empty to skip; likewise TIMED_MMA and TIMED_REST
TIMED_MMA="${TIMED_MMA-quick}"
TIMED_REST="${TIMED_REST-counters decode dynamic}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
export CUATTN_BENCH_ARGS="${CUATTN_BENCH_ARGS:---blocksizes 64,128 --patterns dense-causal}"
start=$SECONDS
rm -rf "$RESULTS" && mkdir -p "$RESULTS"/{probe,correct,sanitize,timed,timed-mma,timed-rest} \
  "$ARCHIVE_DIR"

if [ "${PROBE:-1}" != 0 ]; then
  OUT="$RESULTS/probe" bash scripts/gpu_report.sh probe > "$RESULTS/probe.txt" 2>&1
  echo "phase 0 (probes) done at $((SECONDS - start)) s"
fi

# The warm step compiled 1946 of 2601 instantiations in 90 s beside the sanitizers (23e0a72 run)
# shellcheck disable=SC2086  # CORRECT is a list of steps on purpose
(OUT="$RESULTS/correct" WARM_S="${WARM_S:-150}" TESTS_S="${TESTS_S:-200}" \
  bash scripts/gpu_report.sh $CORRECT > "$RESULTS/correct.txt" 2>&1) &
(sleep 15; OUT="$RESULTS/sanitize" bash scripts/gpu_report.sh sanitize \
  > "$RESULTS/sanitize.txt" 2>&1) &
wait
echo "phase 1 done at $((SECONDS - start)) s"

timed() {  # timed DIR STEPS...: gpu_report.sh's STEPS, cut at SESSION_S
  local dir="$1" left=$((SESSION_S - (SECONDS - start)))
  shift
  [ "$left" -gt 10 ] || { echo "no time left for: $*"; return; }
  OUT="$RESULTS/$dir" COUNTERS_S="${COUNTERS_S:-60}" BENCH_S="${BENCH_S:-110}" \
    QUICK_BUDGET_S="${QUICK_BUDGET_S:-80}" DECODE_S="${DECODE_S:-90}" DYNAMIC_S="${DYNAMIC_S:-80}" \
    DECODE_ARGS="${DECODE_ARGS:---cases 64x32768,1x131072 --policies full h2o quest}" \
    timeout -k 5 "$left" bash scripts/gpu_report.sh "$@" > "$RESULTS/$dir.txt" 2>&1
  echo "$dir ($*) done at $((SECONDS - start)) s"
}
# shellcheck disable=SC2086  # the step lists are lists of words on purpose
{
  [ -z "$TIMED" ] || timed timed $TIMED
  [ -z "$TIMED_MMA" ] || CUATTN_KERNELS=mma timed timed-mma $TIMED_MMA
  [ -z "$TIMED_REST" ] || timed timed-rest $TIMED_REST
}

tar czf "$ARCHIVE_DIR/report.tgz" -C "$RESULTS" .
[ ! -f "$RESULTS/probe/hopper-probe.log" ] ||
  grep -h '^FAIL\| probes agree' "$RESULTS/probe/hopper-probe.log"
grep -h '^|' "$RESULTS"/*/summary.md
grep -h " passed\| failed" "$RESULTS"/correct/gpu-tests*.log | tail -n 4
grep -h "ALL OK\|FAILURES" "$RESULTS/correct/modifiers.log"
grep -h "ERROR SUMMARY\|RACECHECK SUMMARY" "$RESULTS"/sanitize/*.log
grep -h "^| dense\|^forward kernels" "$RESULTS"/timed/*-quick.md "$RESULTS"/timed-mma/*-quick-mma.md
