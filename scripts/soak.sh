#!/usr/bin/env bash
# `make soak`: the exporter's hardening tests (exporter/hardening_test.go)
# run long, and their figures.
#
#   TestHardeningScrapeUnderChurn  50 clients scrape the real exporter together,
#       round after round, while ~2,000 processes come and go and a
#       fork-orphan makes every snapshot scan /proc/*/fd; every scrape must
#       answer 200 and add up, p99 must not trend up, VmRSS stays < 100 MiB.
#       It runs for 2/3 of SOAK_DURATION.
#   TestHardeningDriverFaults  the simulated NVML fails for one GPU, fails as a
#       whole, and hangs past --nvml.timeout, each cleared again, in cycles
#       for 1/3 of SOAK_DURATION.
#
# Both tests are the same as in `make unit`, where they run once (~30 s and
# ~20 s); GPU_ORPHAN_SOAK_DURATION makes them run for their share of it.
# Then the remediator's TestLoadIntakeBurst, with 10,000 notifications
# (2,500 in `make unit`).
#
# Environment: SOAK_DURATION (10m; whole h, m and s, e.g. 1h, 2m, 90s), GO
# (go), SOAK_REPORT (.run/soak.txt: the figures of every soak are appended).
set -euo pipefail
cd "$(dirname "$0")/.."

GO=${GO:-go}
SOAK_DURATION=${SOAK_DURATION:-10m}
SOAK_REPORT=${SOAK_REPORT:-.run/soak.txt}

# seconds DURATION: a duration of whole hours, minutes and seconds in seconds.
seconds() {
  local d=$1 total=0
  [[ $d =~ ^([0-9]+[hms])+$ ]] || return 1
  while [[ $d =~ ^([0-9]+)([hms])(.*)$ ]]; do
    case ${BASH_REMATCH[2]} in
      h) total=$(( total + 10#${BASH_REMATCH[1]} * 3600 )) ;;
      m) total=$(( total + 10#${BASH_REMATCH[1]} * 60 )) ;;
      s) total=$(( total + 10#${BASH_REMATCH[1]} )) ;;
    esac
    d=${BASH_REMATCH[3]}
  done
  (( total > 0 )) && echo "$total"
}
secs=$(seconds "$SOAK_DURATION") || { echo "soak: SOAK_DURATION=$SOAK_DURATION: want whole h, m and s, such as 10m or 1h30m" >&2; exit 2; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
figures=$work/figures.txt
mkdir -p "$(dirname "$SOAK_REPORT")"

echo "soak: $SOAK_DURATION of TestHardeningScrapeUnderChurn then TestHardeningDriverFaults (load $(cut -d' ' -f1-3 /proc/loadavg))" >&2
t0=$(date +%s)
status=0
# The tests' own setup (building the binaries, starting 2,000 processes)
# comes on top of the soak; the timeout leaves it 10 minutes.
GPU_ORPHAN_SOAK_DURATION=$SOAK_DURATION GPU_ORPHAN_REPORT=$figures \
  "$GO" test -count=1 -run '^TestHardening(ScrapeUnderChurn|DriverFaults)$' -v -timeout "$(( secs + 600 ))s" ./exporter/ \
  >"$work/test.log" 2>&1 || status=$?
if (( status == 0 )); then
  GPU_ORPHAN_BURST_NOTIFICATIONS=10000 "$GO" test -count=1 -run '^TestLoadIntakeBurst$' -v -timeout 15m ./remediate/ \
    >>"$work/test.log" 2>&1 || status=$?
fi
elapsed=$(( $(date +%s) - t0 ))

if (( status != 0 )); then
  cat "$work/test.log"
  echo "soak: FAILED after ${elapsed}s (exit $status)" >&2
fi
{
  echo "# soak $(date -u '+%Y-%m-%d %H:%M UTC') duration=$SOAK_DURATION elapsed=${elapsed}s status=$status load=$(cut -d' ' -f1-3 /proc/loadavg) cpus=$(nproc)"
  cat "$figures" 2>/dev/null || true
} | tee -a "$SOAK_REPORT"
grep -E '^(--- |ok|FAIL|PASS)' "$work/test.log" >&2 || true
exit "$status"
