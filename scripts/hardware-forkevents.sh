#!/usr/bin/env bash
# Issue 22 on a real GPU node with PyTorch: jobs whose trainer is killed
# (SIGKILL) as soon as its DataLoader workers have forked, long before the
# daemons' next snapshot at their default interval (5 s):
#   1. a batch script: a non-GPU helper and the trainer in the background;
#   2. a torchrun-like launcher of two ranks, one of which dies;
# each alerted through the remediator's webhook with --act on NVML: the
# memory must come back and every bystander live. The exporter's time from
# the death to the orphan in /metrics is measured. Then what following the
# kernel's process events costs: a 60 s fork storm (short-lived processes,
# as fast as 8 loops start them, or STORM_RATE a second from
# scripts/gpu/forkstorm.py) beside the exporter and the remediator,
# their CPU, RSS, lost events and the fork record's size; and the exporter
# idle on a healthy node.
#
# Usage: [STORM_RATE=5000] scripts/hardware-forkevents.sh BIN_DIR OUT_DIR FORK_ORPHAN_PY   (as root, GPU 0)
set -uo pipefail
bin=$1 out=$2 py=$3
dir="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$out"
exec > >(tee "$out/hardware-forkevents.log") 2>&1
# shellcheck source=scripts/hardware-webhook.sh
. "$dir/hardware-webhook.sh"
exporter=127.0.0.1:19845

alive() { # WHAT PID...
  local what=$1; shift
  for p in "$@"; do
    if [ -d /proc/$p ] && [ "$(awk '{print $3}' /proc/$p/stat)" != Z ]; then echo "  alive: $what $p"; else echo "  KILLED: $what $p"; fi
  done
}
cpu_ns() { cat /proc/"$1"/task/*/schedstat 2>/dev/null | awk '{s+=$1} END {print s}'; }
rss_kib() { awk '/^VmRSS/ {print $2}' /proc/"$1"/status; }
metric() { curl -s "$exporter/metrics" | grep -E "^$1( |\{)" ; }
# orphan_seen PID...: seconds from now until the exporter lists each PID as
# a suspect holder inherited from a dead owner.
orphan_seen() {
  python3 - "$exporter" "$@" <<'PY'
import re, sys, time, urllib.request
url, pids = sys.argv[1], set(sys.argv[2:])
t0 = time.monotonic()
while time.monotonic() - t0 < 30:
    body = urllib.request.urlopen("http://%s/metrics" % url).read().decode()
    seen = {m.group(1) for m in re.finditer(r'^gpu_orphan_holder_info\{[^}]*[{,]pid="(\d+)"[^}]*reason="inherited_from_dead_owner"', body, re.M)}
    if pids <= seen:
        proofs = set(re.findall(r'^gpu_orphan_holder_info\{[^}]*proof="([^"]*)"', body, re.M))
        print("orphan in /metrics %.3f s after the death (proof %s)" % (time.monotonic() - t0, ",".join(sorted(proofs))))
        sys.exit(0)
    time.sleep(0.01)
print("orphan NOT in /metrics within 30 s")
PY
}

section "machine"
nvidia-smi -L; nvidia-smi --query-gpu=driver_version --format=csv,noheader; uname -r; nproc

section "daemons at their default interval (5 s)"
"$bin/gpu-orphan-exporter" --backend=nvml --web.listen-address=$exporter > "$out/exporter.log" 2>&1 &
exp=$!; kills+=($exp)
"$bin/gpu-orphan-remediator" --backend=nvml --node.name=h200 --auth.token-file="$tokfile" --act \
  --remediate.min-age=1s --remediate.grace=2s --remediate.verify-timeout=20s --limit.cooldown=0s \
  --limit.rate=100 --limit.burst=10 --store.path="$(mktemp -d)/r.db" \
  --web.listen-address="127.0.0.1:$port" > "$out/remediator.log" 2>&1 &
rem=$!; kills+=($rem)
sleep 3
grep -h "process events" "$out/exporter.log" "$out/remediator.log" | cut -c1-200
metric gpu_orphan_process_events_up

section "1. a batch script: helper and trainer in the background; the trainer killed -9 as soon as its workers forked"
setsid bash -c 'sleep 100001 & echo helper $!; python3 "$0" --gib 4 --children 2 & wait' "$py" > "$out/batch.out" 2>&1 &
script=$!; kills+=($script)
read -r _ tr w1 w2 < <(ready "$out/batch.out")
kill -9 "$tr"
echo "trainer $tr killed -9 right after 'ready' (workers $w1 $w2)"
orphan_seen "$w1" "$w2"
helper=$(awk '/^helper/ {print $2}' "$out/batch.out")
smi
post 00000000000c0001; action 00000000000c0001
alive "the batch script" "$script"; alive "its non-GPU helper" "$helper"; alive "worker" "$w1" "$w2"
memory_back
kill -9 -- -"$script" 2>/dev/null

section "2. a launcher of two ranks; one rank killed -9 as soon as its workers forked"
setsid bash -c 'python3 "$0" --gib 2 --children 1 > "$1/rank0.out" & python3 "$0" --gib 4 --children 2 > "$1/rank1.out" & wait' "$py" "$out" &
launcher=$!; kills+=($launcher)
read -r _ r0 r0w < <(ready "$out/rank0.out")
read -r _ r1 r1w1 r1w2 < <(ready "$out/rank1.out")
kill -9 "$r1"
echo "rank $r1 killed -9 right after 'ready' (workers $r1w1 $r1w2); rank $r0 (worker $r0w) lives"
orphan_seen "$r1w1" "$r1w2"
smi
post 00000000000c0002; action 00000000000c0002
alive launcher "$launcher"; alive "the other rank" "$r0"; alive "its worker" "$r0w"; alive "dead rank's worker" "$r1w1" "$r1w2"
smi
kill -9 -- -"$launcher" 2>/dev/null; memory_back

section "3. idle on a healthy node (a trainer with 2 forked workers alive), 60 s"
setsid python3 "$py" --gib 2 --children 2 > "$out/healthy.out" 2>&1 &
kills+=($!)
ready "$out/healthy.out" > /dev/null
sleep 6
e0=$(cpu_ns $exp); r0c=$(cpu_ns $rem); t0=$(date +%s.%N)
sleep 60
e1=$(cpu_ns $exp); r1c=$(cpu_ns $rem); t1=$(date +%s.%N)
python3 -c "print('exporter idle: %.4f%% of a core; remediator idle: %.4f%%' % (($e1-$e0)/1e9/($t1-$t0)*100, ($r1c-$r0c)/1e9/($t1-$t0)*100))"
[ -f "$dir/gpu/scrape_latency.py" ] && echo "scrape: $(python3 "$dir/gpu/scrape_latency.py" http://$exporter/metrics 2000)"

section "4. a 60 s fork storm beside the daemons"
echo "before: exporter RSS $(rss_kib $exp) KiB, remediator RSS $(rss_kib $rem) KiB; $(metric gpu_orphan_fork_record_processes); live processes $(ls -d /proc/[0-9]* | wc -l)"
p0=$(awk '/^processes/ {print $2}' /proc/stat)
e0=$(cpu_ns $exp); r0c=$(cpu_ns $rem); t0=$(date +%s.%N)
storm=()
if [ -n "${STORM_RATE:-}" ]; then
  python3 "$dir/gpu/forkstorm.py" "$STORM_RATE" 60 & storm+=($!)
else
  for _ in $(seq 8); do (end=$((SECONDS+60)); while [ $SECONDS -lt $end ]; do /bin/true; done) & storm+=($!); done
fi
sleep 30
echo "mid-storm: $(metric gpu_orphan_fork_record_processes); exporter RSS $(rss_kib $exp) KiB"
wait "${storm[@]}"
e1=$(cpu_ns $exp); r1c=$(cpu_ns $rem); t1=$(date +%s.%N)
p1=$(awk '/^processes/ {print $2}' /proc/stat)
python3 -c "print('storm: %.0f processes/s; exporter %.3f%% of a core, remediator %.3f%%' % (($p1-$p0)/($t1-$t0), ($e1-$e0)/1e9/($t1-$t0)*100, ($r1c-$r0c)/1e9/($t1-$t0)*100))"
sleep 2
echo "after: exporter RSS $(rss_kib $exp) KiB, remediator RSS $(rss_kib $rem) KiB; $(metric gpu_orphan_fork_record_processes); live processes $(ls -d /proc/[0-9]* | wc -l)"
metric gpu_orphan_process_events_lost_total

section "logs"
grep -E 'signalled|Plan|Action finished|lost' "$out/remediator.log" | cut -c1-300
grep -E 'lost|Warn|WARN' "$out/exporter.log" | cut -c1-300
