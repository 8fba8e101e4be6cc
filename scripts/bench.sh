#!/usr/bin/env bash
# `make bench`: the project's figures, measured on this machine, each
# printed against its target. Exits 1 when a target is missed or a
# benchmark fails, 0 only when every target is met.
#
#   1. holder discovery (internal/proc BenchmarkHolders) against psmisc's
#      fuser (BenchmarkFuser), on the same /proc with 2,000 extra processes
#      holding ~24 descriptors each;
#   2. scrape latency (exporter BenchmarkScrape): 8 simulated GPUs, two
#      fork-orphans, the same 2,000 processes, the snapshot loop running;
#   3. the real exporter's memory (exporter BenchmarkExporterRSS): VmRSS and
#      VmHWM after ~15 fd scans and a few thousand scrapes;
#   4. whether the fd scan keeps memory (exporter BenchmarkExporterScanRSS):
#      the real exporter's VmRSS quiet, then after 20 scans of a crowd of
#      6,000 processes;
#   5. what the proof rules of issue 15 cost a healthy node (snapshot
#      BenchmarkHealthySnapshot): a snapshot with the Loop's lineage (a
#      trainer's 8 forked workers recorded) against one without;
#   6. the node's two daemons idle (cmd BenchmarkIdleRSS, issue 18 §2): the
#      real exporter and node agent (gpu-orphan-remediator) on a 2-GPU
#      simulated node, VmRSS after 20 s idle, scraped every 5 s;
#   7. the kernel's process events under a fork storm (internal/forks,
#      issue 22 §4; needs root): shell loops of /bin/true beside the fork
#      record. BenchmarkForkStormBacklog lets the storm's events wait in the
#      socket's buffer, then drains them as the follower does and takes that
#      thread's CPU per process: the guard, 6 µs (issue 22's 3% of a core
#      at 5,000 processes a second), whatever rate this machine forks at.
#      BenchmarkForkStorm runs the follower live for STORM_SECONDS: no
#      event lost, RSS growth, the record's size back afterwards; its CPU
#      per process is reported, not guarded: on a machine that forks a few
#      hundred processes a second (a 2-core VM) the follower's wake-ups,
#      at most 40 a second, dominate it.
#
# Each package starts its own 2,000 processes (~17 s on a 2-core VM), the
# exporter's 4,000 more for the last; the idle daemons take 20 s. The
# whole run takes about 3-4 minutes on 2 cores.
#
# Everything goes under OUT (RUN_DIR/bench, RUN_DIR being .run): raw.txt
# (go test's output), benchmarks.md (the report, in docs/benchmarks.md's
# form) and summary.txt (what is printed at the end). docs/benchmarks.md is
# tracked and changes only on purpose: after a run worth keeping, copy the
# report over it and review the diff.
#
# Environment: GO (go), PROC_BENCHTIME (10x: one op of fuser is ~1 s),
# STORM_SECONDS (20: the live fork storm; the backlog's is 10 s),
# SCRAPE_BENCHTIME (3s), RUN_DIR (.run), OUT (RUN_DIR/bench),
# GPU_ORPHAN_BENCH_BIN (the binaries of `make build`, which `make bench`
# passes; without it BenchmarkIdleRSS builds its own, the same way).
set -euo pipefail
cd "$(dirname "$0")/.."

GO=${GO:-go}
PROC_BENCHTIME=${PROC_BENCHTIME:-10x}
SCRAPE_BENCHTIME=${SCRAPE_BENCHTIME:-3s}
OUT=${OUT:-${RUN_DIR:-.run}/bench}
REPORT=$OUT/benchmarks.md

# The targets.
TARGET_RATIO=5       # holder discovery at least this many times faster than fuser
TARGET_P99_MS=5      # scrape p99
TARGET_RSS_MIB=30    # exporter RSS
TARGET_GROWTH_MIB=2  # exporter RSS growth over repeated scans of 6,000 processes
# The idle daemons (issue 18, §2). The issue's targets are for the H200 on
# NVML, after 60 s idle: exporter <= 32 MiB, node agent <= 35 MiB. The
# simulated node loads no NVML, so no libcuda (3.7 MiB resident on the
# H200) nor libnvidia-ml (1.5 MiB) nor NVML's own heap: on this 2-core VM
# (2026-12-02) the sim figures are 17.7 and 27.0 MiB, well under the H200
# targets, so the guard is the H200 targets themselves; a change that
# pushes the sim past them certainly misses on NVML. The guard follows the
# default: the daemons run with their default flags, so
# --nvml.release-zero-pages is off (opt-in since issue 24; on the sim it
# changes nothing, having no NVML). On the H200 the daemons as shipped hold
# 39.0 and 45.6 MiB, over these targets; only with the flag do they meet
# them (26.0 and 32.7 MiB).
TARGET_IDLE_EXPORTER_MIB=32
TARGET_IDLE_AGENT_MIB=35
# The proof rules may add at most 10% to the exporter's CPU on a healthy
# node, 0.067% of a core on the H200 (issue 15): 0.0067% of a core, 335 us
# per snapshot at the default 5 s interval.
INTERVAL_S=5
TARGET_LINEAGE_US=$(awk "BEGIN { print 0.067 / 100 * 0.10 * $INTERVAL_S * 1e6 }")
# A fork storm (issue 22, §4): each daemon at most 3% of a core while at
# least 5,000 short-lived processes a second start: 6 µs of CPU a process.
# No event lost, RSS growth at most 2 MiB, the record back to the live
# processes (the dead it keeps no more than before, with a little room for
# the other processes of the machine).
STORM_SECONDS=${STORM_SECONDS:-20}
TARGET_STORM_US=$(awk "BEGIN { print 0.03 / 5000 * 1e6 }")
TARGET_STORM_RSS_MIB=2
STORM_KEPT_SLACK=8

command -v fuser >/dev/null || echo "bench: fuser not installed (psmisc; make deps): no baseline for holder discovery" >&2

mkdir -p "$OUT"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
raw=$OUT/raw.txt
: >"$raw"

started=$(date -u '+%Y-%m-%d %H:%M UTC')
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
t0=$(date +%s)

# A failed package still leaves the others' figures in the report (n/a for
# its own); the script then exits 1.
status=0
run() {
  echo "bench: go test -run '^\$' -bench . -benchtime $1 $2" >&2
  # -count=1: never a cached result; the figures must be this machine's now.
  "$GO" test -count=1 -run '^$' -bench . -benchtime "$1" -timeout 10m "$2" | tee -a "$raw" || status=1
}
run "$PROC_BENCHTIME" ./internal/proc/
run "$SCRAPE_BENCHTIME" ./exporter/
# Only BenchmarkHealthySnapshot: the package's other tests need no bench run.
echo "bench: go test -run '^\$' -bench BenchmarkHealthySnapshot -benchtime 300x ./internal/snapshot/" >&2
"$GO" test -count=1 -run '^$' -bench BenchmarkHealthySnapshot -benchtime 300x -timeout 10m ./internal/snapshot/ | tee -a "$raw" || status=1
# One op: the 20 s of idling happen once, before the timed scrapes.
echo "bench: go test -run '^\$' -bench BenchmarkIdleRSS -benchtime 1x ./cmd/" >&2
"$GO" test -count=1 -run '^$' -bench BenchmarkIdleRSS -benchtime 1x -timeout 10m ./cmd/ | tee -a "$raw" || status=1
# Root only (the kernel's process events): skipped otherwise, and the
# figures are then missing, so missed.
echo "bench: go test -run '^\$' -bench 'BenchmarkForkStorm(Backlog)?\$' -benchtime 1x ./internal/forks/ (${STORM_SECONDS} s live)" >&2
FORKSTORM_SECONDS=10 "$GO" test -count=1 -run '^$' -bench 'BenchmarkForkStormBacklog$' -benchtime 1x -timeout 10m ./internal/forks/ | tee -a "$raw" || status=1
FORKSTORM_SECONDS=$STORM_SECONDS "$GO" test -count=1 -run '^$' -bench 'BenchmarkForkStorm$' -benchtime 1x -timeout 10m ./internal/forks/ | tee -a "$raw" || status=1

elapsed=$(( $(date +%s) - t0 ))
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

# "BenchmarkX/sub-2  N  v1 u1  v2 u2 ..." -> "BenchmarkX/sub u1 v1" per pair.
awk '/^Benchmark/ { name = $1; sub(/-[0-9]+$/, "", name)
  for (i = 3; i < NF; i += 2) print name, $(i+1), $i }' "$raw" >"$work/metrics"

# metric BENCHMARK UNIT: the value, or empty.
metric() { awk -v b="$1" -v u="$2" '$1 == b && $2 == u { print $3; exit }' "$work/metrics"; }
# ops BENCHMARK: its op count, or empty.
ops() { awk -v b="$1" '{ n = $1; sub(/-[0-9]+$/, "", n) } n == b { print $2; exit }' "$raw"; }
# calc EXPR: awk arithmetic.
calc() { awk "BEGIN { print $1 }"; }
# f DECIMALS VALUE: the value rounded for the report, or n/a.
f() { if [ -n "$2" ]; then printf "%.${1}f" "$2"; else printf "n/a"; fi; }
# met COND VALUE: yes, **no**, or n/a when VALUE is missing.
met() { if [ -z "$2" ]; then echo "n/a"; elif awk "BEGIN { exit !($1) }"; then echo "yes"; else echo "**no**"; fi; }

h_ns=$(metric BenchmarkHolders ns/op);  h_cpu=$(metric BenchmarkHolders cpu-ns/op)
f_ns=$(metric BenchmarkFuser ns/op);    f_cpu=$(metric BenchmarkFuser cpu-ns/op)
ratio="" cpu_ratio="" bound=""
[ -n "$h_ns" ] && [ -n "$f_ns" ] && ratio=$(calc "$f_ns / $h_ns")
[ -n "$h_cpu" ] && [ -n "$f_cpu" ] && cpu_ratio=$(calc "$f_cpu / $h_cpu")
[ -n "$cpu_ratio" ] && bound=$(calc "$cpu_ratio * $(nproc)")
ms() { if [ -n "$1" ]; then calc "$1 / 1e6"; fi; }
h_ms=$(ms "$h_ns"); f_ms=$(ms "$f_ns"); h_cpu_ms=$(ms "$h_cpu"); f_cpu_ms=$(ms "$f_cpu")

l_p50=$(metric BenchmarkScrape/latest p50-ms);     l_p99=$(metric BenchmarkScrape/latest p99-ms)
l_max=$(metric BenchmarkScrape/latest max-ms);     l_n=$(ops BenchmarkScrape/latest)
r_p50=$(metric BenchmarkScrape/refreshing p50-ms); r_p99=$(metric BenchmarkScrape/refreshing p99-ms)
r_max=$(metric BenchmarkScrape/refreshing max-ms); r_n=$(ops BenchmarkScrape/refreshing)
r_refresh=$(metric BenchmarkScrape/refreshing refreshes); r_scan=$(metric BenchmarkScrape/refreshing scan-ms)
s_p50=$(metric BenchmarkScrape/static p50-ms);     s_p99=$(metric BenchmarkScrape/static p99-ms)
s_bytes=$(metric BenchmarkScrape/static body-bytes)

rss=$(metric BenchmarkExporterRSS rss-MiB);  hwm=$(metric BenchmarkExporterRSS hwm-MiB)
snaps=$(metric BenchmarkExporterRSS snapshots); rss_scan=$(metric BenchmarkExporterRSS scan-ms)
b_p50=$(metric BenchmarkExporterRSS bin-p50-ms); b_p99=$(metric BenchmarkExporterRSS bin-p99-ms)
b_n=$(ops BenchmarkExporterRSS)

g_quiet=$(metric BenchmarkExporterScanRSS rss-quiet-MiB); g_scanned=$(metric BenchmarkExporterScanRSS rss-scanned-MiB)
g_growth=$(metric BenchmarkExporterScanRSS rss-growth-MiB); g_hwm=$(metric BenchmarkExporterScanRSS hwm-MiB)
g_scans=$(metric BenchmarkExporterScanRSS scans); g_scan=$(metric BenchmarkExporterScanRSS scan-ms)
g_p50=$(metric BenchmarkExporterScanRSS bin-p50-ms); g_p99=$(metric BenchmarkExporterScanRSS bin-p99-ms)

l_alone=$(metric BenchmarkHealthySnapshot/alone us/snapshot); l_lineage=$(metric BenchmarkHealthySnapshot/lineage us/snapshot)
l_added="" l_core=""
[ -n "$l_alone" ] && [ -n "$l_lineage" ] && l_added=$(calc "$l_lineage - $l_alone")
[ -n "$l_added" ] && l_core=$(calc "$l_added / ($INTERVAL_S * 1e6) * 100")

i_erss=$(metric BenchmarkIdleRSS exporter-rss-MiB); i_eanon=$(metric BenchmarkIdleRSS exporter-anon-MiB)
i_efile=$(metric BenchmarkIdleRSS exporter-file-MiB)
i_arss=$(metric BenchmarkIdleRSS agent-rss-MiB);    i_aanon=$(metric BenchmarkIdleRSS agent-anon-MiB)
i_afile=$(metric BenchmarkIdleRSS agent-file-MiB)

fb_us=$(metric BenchmarkForkStormBacklog cpu-us/proc); fb_ev=$(metric BenchmarkForkStormBacklog cpu-us/event)
fb_procs=$(metric BenchmarkForkStormBacklog procs); fb_lost=$(metric BenchmarkForkStormBacklog lost)
fs_rate=$(metric BenchmarkForkStorm procs/s); fs_core=$(metric BenchmarkForkStorm cpu-%core)
fs_us=$(metric BenchmarkForkStorm cpu-us/proc); fs_lost=$(metric BenchmarkForkStorm lost)
fs_rss=$(metric BenchmarkForkStorm rss-growth-MiB)
fs_eb=$(metric BenchmarkForkStorm entries-before); fs_ep=$(metric BenchmarkForkStorm entries-peak)
fs_ea=$(metric BenchmarkForkStorm entries-after)
fs_lb=$(metric BenchmarkForkStorm live-before); fs_la=$(metric BenchmarkForkStorm live-after)
# The dead the record keeps after the storm, beyond what it kept before.
fs_kept=""
[ -n "$fs_ea" ] && [ -n "$fs_la" ] && [ -n "$fs_eb" ] && [ -n "$fs_lb" ] && fs_kept=$(calc "($fs_ea - $fs_la) - ($fs_eb - $fs_lb)")

reach="The figure above is what this machine gives."
if [ -n "$bound" ] && awk "BEGIN { exit !($bound < $TARGET_RATIO) }"; then
  reach="So ${TARGET_RATIO}× is out of reach on $(nproc) CPUs without less kernel work
  per descriptor; the figure above is what this machine gives."
fi

cpu_model=$(awk -F': ' '/^model name/ { print $2; exit }' /proc/cpuinfo | sed 's/ *$//')
mem_total=$(awk '/^MemTotal/ { printf "%.1f GiB", $2 / 1048576 }' /proc/meminfo)
fuser_version=$( (fuser -V 2>&1 || true) | head -1)

mkdir -p "$(dirname "$REPORT")"
cat >"$REPORT" <<EOF
# Benchmarks

\`make bench\` (\`scripts/bench.sh\`) measures these figures, prints each against
its target, and exits 1 when one is missed. It writes this report to
\`.run/bench/benchmarks.md\`; this copy in \`docs/\` is from the run below,
copied on purpose. Run it again to measure your machine. Raw \`go test -bench\`
output is at the end.

On a real GPU node the holder scan spreads over more cores: on the 16-core H200
machine (2026-11-30, the same \`BenchmarkHolders\`/\`BenchmarkFuser\` with 2,000
processes × ~24 descriptors) it took **30.0 ms against fuser's 279.8 ms: 9.3×
faster** (189.6 ms of CPU against 277.6 ms). See [hardware-h200.md](hardware-h200.md).

| what | figure | target | met? |
|---|---|---|---|
| holder discovery vs \`fuser\`, wall time: 2,000 extra processes × ~24 fds (BenchmarkHolders, BenchmarkFuser) | $(f 2 "$ratio")× faster ($(f 0 "$h_ms") ms vs $(f 0 "$f_ms") ms per lookup) | ≥ ${TARGET_RATIO}× | $(met "$ratio >= $TARGET_RATIO" "$ratio") |
| holder discovery vs \`fuser\`, CPU time (user + system) | $(f 2 "$cpu_ratio")× less ($(f 0 "$h_cpu_ms") ms vs $(f 0 "$f_cpu_ms") ms) | ≥ ${TARGET_RATIO}× | $(met "$cpu_ratio >= $TARGET_RATIO" "$cpu_ratio") |
| scrape latency, 8 GPUs, 2,000 processes, loop at its 5 s interval (BenchmarkScrape/latest) | p50 $(f 2 "$l_p50") ms, p99 $(f 2 "$l_p99") ms, max $(f 1 "$l_max") ms ($(f 0 "$l_n") scrapes) | p99 < ${TARGET_P99_MS} ms | $(met "$l_p99 < $TARGET_P99_MS" "$l_p99") |
| scrape latency while the loop refreshes back to back (BenchmarkScrape/refreshing) | p50 $(f 2 "$r_p50") ms, p99 $(f 2 "$r_p99") ms, max $(f 1 "$r_max") ms ($(f 0 "$r_n") scrapes, $(f 0 "$r_refresh") refreshes of $(f 0 "$r_scan") ms fd scan) | p99 < ${TARGET_P99_MS} ms | $(met "$r_p99 < $TARGET_P99_MS" "$r_p99") |
| floor: the same $(f 0 "$s_bytes") bytes from a bare handler (BenchmarkScrape/static) | p50 $(f 2 "$s_p50") ms, p99 $(f 2 "$s_p99") ms | — | — |
| \`gpu-orphan-exporter --backend=sim\` (8 GPUs, 64 owners remembered, 2,000 processes) VmRSS after $(f 0 "$snaps") snapshots at 1 s, each scanning /proc/*/fd ($(f 0 "$rss_scan") ms), and $(f 0 "$b_n") more scrapes (BenchmarkExporterRSS) | $(f 1 "$rss") MiB | < ${TARGET_RSS_MIB} MiB | $(met "$rss < $TARGET_RSS_MIB" "$rss") |
| the same process's peak, VmHWM | $(f 1 "$hwm") MiB | < ${TARGET_RSS_MIB} MiB | $(met "$hwm < $TARGET_RSS_MIB" "$hwm") |
| scrape latency of that real binary, back to back (BenchmarkExporterRSS) | p50 $(f 2 "$b_p50") ms, p99 $(f 2 "$b_p99") ms | — | — |
| the fd scan keeps no memory: the real exporter's VmRSS quiet (no scan), then after $(f 0 "$g_scans") scans of 6,000 other processes ($(f 0 "$g_scan") ms each) (BenchmarkExporterScanRSS) | $(f 1 "$g_quiet") MiB quiet, $(f 1 "$g_scanned") MiB after: growth $(f 2 "$g_growth") MiB (VmHWM $(f 1 "$g_hwm") MiB) | growth < ${TARGET_GROWTH_MIB} MiB | $(met "$g_growth < $TARGET_GROWTH_MIB" "$g_growth") |
| scrape latency of that binary among the 6,000, back to back | p50 $(f 2 "$g_p50") ms, p99 $(f 2 "$g_p99") ms | — | — |
| \`gpu-orphan-exporter --backend=sim\`, 2 GPUs, idle 20 s at its default interval, scraped every 5 s (BenchmarkIdleRSS, default flags; no NVML, no libcuda: the H200's figure is higher) | VmRSS $(f 1 "$i_erss") MiB ($(f 1 "$i_eanon") anonymous, $(f 1 "$i_efile") file) | ≤ ${TARGET_IDLE_EXPORTER_MIB} MiB (issue 18's H200 target, which the H200 meets only with \`--nvml.release-zero-pages\`) | $(met "$i_erss <= $TARGET_IDLE_EXPORTER_MIB" "$i_erss") |
| \`gpu-orphan-remediator --backend=sim\`, node agent, beside it, the same way (BenchmarkIdleRSS) | VmRSS $(f 1 "$i_arss") MiB ($(f 1 "$i_aanon") anonymous, $(f 1 "$i_afile") file) | ≤ ${TARGET_IDLE_AGENT_MIB} MiB (issue 18's H200 target, likewise) | $(met "$i_arss <= $TARGET_IDLE_AGENT_MIB" "$i_arss") |
| a fork storm's events, drained in batches as the follower does: its CPU per process, $(f 0 "$fb_procs") processes (BenchmarkForkStormBacklog) | $(f 2 "$fb_us") µs ($(f 2 "$fb_ev") µs an event) | ≤ $(f 0 "$TARGET_STORM_US") µs (issue 22: 3% of a core at 5,000 processes a second) | $(met "$fb_us <= $TARGET_STORM_US" "$fb_us") |
| a live fork storm of ${STORM_SECONDS} s beside the follower (BenchmarkForkStorm): events lost | $(f 0 "$fs_lost") ($(f 0 "$fs_rate") processes a second; the follower $(f 2 "$fs_core")% of a core, $(f 1 "$fs_us") µs a process, its wake-ups included) | 0 | $(met "$fs_lost == 0" "$fs_lost") |
| the same: RSS growth of the process that follows | $(f 2 "$fs_rss") MiB | ≤ ${TARGET_STORM_RSS_MIB} MiB | $(met "$fs_rss <= $TARGET_STORM_RSS_MIB" "$fs_rss") |
| the same: the record back to the live processes (entries before → peak → after; live before, after) | $(f 0 "$fs_eb") → $(f 0 "$fs_ep") → $(f 0 "$fs_ea"); live $(f 0 "$fs_lb"), $(f 0 "$fs_la"): $(f 0 "$fs_kept") more dead kept | ≤ ${STORM_KEPT_SLACK} (other processes come and go) | $(met "$fs_kept <= $STORM_KEPT_SLACK" "$fs_kept") |
| the proof rules on a healthy node: a snapshot recording a live trainer's 8 forked workers, against one without (BenchmarkHealthySnapshot) | $(f 0 "$l_lineage") µs against $(f 0 "$l_alone") µs: $(f 0 "$l_added") µs more per snapshot, $(f 4 "$l_core")% of a core at the ${INTERVAL_S} s interval | ≤ $(f 0 "$TARGET_LINEAGE_US") µs (10% of the exporter's 0.067% of a core on the H200) | $(met "$l_added <= $TARGET_LINEAGE_US" "$l_added") |

## Machine

- date: $started; the run took ${elapsed} s
- CPUs: $(nproc) ($cpu_model), memory $mem_total
- kernel: $(uname -sr)
- $("$GO" version)
- fuser: ${fuser_version:-not installed}
- load average (1, 5, 15 min) before the run: $load_before; after: $load_after.
  Other jobs share this machine: a load above the CPU count shows in the
  wall times and most in the tails (p99, max). CPU times are steadier.

## What is measured

- **Holder discovery.** \`proc.FS.ScanHolders\` finds the PIDs holding one
  device in a pass over \`/proc/*/fd\` (one \`statx\` per descriptor, spread
  over the CPUs; since issue 8 it matches by device number or file
  identity, not by the \`readlink\` path: on a 2-core VM, 2026-12-01, 10 lookups
  × 3 runs, 54–59 ms per lookup against 52–65 ms for the old \`readlinkat\`
  scan, the same cost). \`fuser FILE\` answers the same question on the same \`/proc\` and
  must name the same PIDs; the benchmarks check both answers. The work is
  the kernel's: it builds the path of each of ~48,000 descriptors for
  \`readlink\` at about the cost of \`fuser\`'s \`stat\` of it (one \`statx\` per
  descriptor). What the scan saves is \`fuser\`'s other work per process (its
  cwd, root, exe and maps) and its single thread: in this run it took
  $(f 2 "$cpu_ratio")× less CPU than \`fuser\`, and spread over $(nproc) CPUs against
  \`fuser\`'s one that allows at most about $(f 1 "$bound")× in wall time on an idle
  machine. $reach
- **Scrape latency.** \`exporter.NewHandler\` over \`exporter.NewRegistry\` and
  a \`snapshot.Loop\` on the simulated 8-GPU node, served by \`httptest\`: each
  op is one \`GET /metrics\` (gzip, as Prometheus asks) on a kept-alive
  connection. The node has 6 workloads, 2 of them fork-orphans (creator
  killed, 6 children holding the contexts), so every refresh scans
  \`/proc/*/fd\`. Scrapes read the latest snapshot and never wait for a
  refresh; *refreshing* shows what a running fd scan does to them by
  competing for the CPUs.
- **RSS.** The real binary, \`--backend=sim --collector.interval=1s\`, on the
  same node and processes: scraped every 100 ms for 15 s, then back to back
  for ${SCRAPE_BENCHTIME}; then \`VmRSS\` and \`VmHWM\` from \`/proc/PID/status\`.
- **RSS growth over scans.** The same binary among 6,000 other processes
  (~144,000 descriptors), scraped every 100 ms throughout: first for 10 s
  with the healthy workloads only, so that no snapshot scans \`/proc/*/fd\`
  (quiet); then the two fork-orphans appear and every snapshot scans the
  whole crowd, until $(f 0 "$g_scans") scans have run (after). The scan's buffers must be
  reused, not kept: the growth is after minus quiet. On the 16-core H200
  node, with NVML loaded, it was 36.2 MiB quiet and 42.5 MiB after such scans.
- **Idle daemons.** The binaries of \`make build\` (-trimpath, netgo, the
  Makefile's ldflags): \`gpu-orphan-exporter\` and \`gpu-orphan-remediator\`
  (node role, a token file, its own SQLite store), both \`--backend=sim\` on a
  2-GPU simulated node with nothing running, at their default intervals,
  scraped every 5 s for 20 s; then \`VmRSS\`, \`RssAnon\` and \`RssFile\` from
  \`/proc/PID/status\`. Most of it is the binary's own pages (file): a
  smaller binary is what lowers it. The daemons run with their default
  flags, \`--nvml.release-zero-pages\` off (it changes nothing without NVML).
  The targets are issue 18's for the H200 on NVML, which loads libcuda
  (3.7 MiB resident) and libnvidia-ml (1.5 MiB), fills its 13.2 MiB BSS and
  allocates its own heap: there the same daemons hold 39.0 and 45.6 MiB as
  shipped (26.0 and 32.7 with the opt-in \`--nvml.release-zero-pages\`, which
  alone meets the targets), against about 18 and 27 MiB here. The sim
  stays under the targets with room, so a miss here is certain to be a
  miss there.

## Raw output

\`\`\`
$(cat "$raw")
\`\`\`
EOF

# check NAME FIGURE UNIT OP TARGET: one line of the summary, the figure
# against its target; a missing figure is a miss too.
check() {
  local verdict
  if [ -z "$2" ]; then verdict="MISSED (no figure: the benchmark failed)"
  elif awk "BEGIN { exit !($2 $4 $5) }"; then verdict="met"
  else verdict="MISSED"; fi
  printf '%-40s %8s %-3s  target %-2s %2s %-3s  %s\n' "$1" "$(f 2 "$2")" "$3" "$4" "$5" "$3" "$verdict"
}

{
  echo
  echo "== gpu-orphan benchmarks ($(nproc) CPUs, $(uname -r), load $load_before -> $load_after, ${elapsed} s)"
  check "holder discovery vs fuser, wall time"      "$ratio"     x    ">=" "$TARGET_RATIO"
  check "holder discovery vs fuser, CPU time"       "$cpu_ratio" x    ">=" "$TARGET_RATIO"
  check "scrape p99, loop at 5 s"                   "$l_p99"     ms   "<"  "$TARGET_P99_MS"
  check "scrape p99, loop refreshing"               "$r_p99"     ms   "<"  "$TARGET_P99_MS"
  check "exporter VmRSS after scans of 2,000"       "$rss"       MiB  "<"  "$TARGET_RSS_MIB"
  check "exporter VmHWM"                            "$hwm"       MiB  "<"  "$TARGET_RSS_MIB"
  check "exporter VmRSS growth, 6,000 scanned"      "$g_growth"  MiB  "<"  "$TARGET_GROWTH_MIB"
  check "proof rules, added per snapshot"          "$l_added"   us   "<=" "$TARGET_LINEAGE_US"
  check "exporter VmRSS idle, sim"                  "$i_erss"    MiB  "<=" "$TARGET_IDLE_EXPORTER_MIB"
  check "node agent VmRSS idle, sim"                "$i_arss"    MiB  "<=" "$TARGET_IDLE_AGENT_MIB"
  check "fork storm, follower CPU per process"      "$fb_us"     us   "<=" "$TARGET_STORM_US"
  check "fork storm, events lost"                   "$fs_lost"   ev   "<=" 0
  check "fork storm, follower RSS growth"           "$fs_rss"    MiB  "<=" "$TARGET_STORM_RSS_MIB"
  check "fork storm, dead kept after it"            "$fs_kept"   ent  "<=" "$STORM_KEPT_SLACK"
  echo "  holder discovery: $(f 0 "$h_ms") ms vs fuser $(f 0 "$f_ms") ms per lookup; scrape p50 $(f 2 "$l_p50") ms (floor $(f 2 "$s_p50") ms)"
  echo "  exporter among 6,000: VmRSS $(f 1 "$g_quiet") MiB quiet, $(f 1 "$g_scanned") MiB after $(f 0 "$g_scans") scans of $(f 0 "$g_scan") ms"
  echo "  live fork storm: $(f 0 "$fs_rate") processes/s, follower $(f 2 "$fs_core")% of a core ($(f 1 "$fs_us") us a process, wake-ups included)"
  echo "report: $REPORT (copy it to docs/benchmarks.md on purpose); raw output: $raw"
} | tee "$OUT/summary.txt"
misses=$(grep -c ' MISSED' "$OUT/summary.txt" || true)

if [ "$status" -ne 0 ]; then
  echo "bench: a benchmark failed; see the output above" >&2
fi
if [ "$misses" -gt 0 ]; then
  echo "bench: $misses target(s) missed on this machine" >&2
  status=1
fi
exit "$status"
