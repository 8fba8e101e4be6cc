#!/usr/bin/env bash
# Issue 15 on a real GPU node with PyTorch: holders that map the GPU without
# having inherited a dead owner's context, each beside a fork orphan of
# another job, alerted through the remediator's webhook with --act on NVML:
#   1. a torchrun-like launcher (cuInit alone) that is the parent of a
#      healthy rank;
#   2. a healthy trainer's double-forked helper, holding the trainer's own
#      open files;
#   3. the MPS control daemon, copied under a name on no protected list
#      (gpu-watchd) and started before the job, with its server.
# The orphan's memory must come back and every one of them must live. First
# it measures what the proof rules cost the exporter on a healthy node (a
# trainer with forked workers alive): CPU over 60 s and scrape latency,
# against OLD_BIN_DIR's exporter when given.
#
# Usage: scripts/hardware-proof.sh BIN_DIR OUT_DIR [OLD_BIN_DIR]   (as root, GPU 0)
# ONLY="cost launcher helper mps" runs some of the parts.
set -uo pipefail
bin=$1 out=$2 old=${3:-}
dir="$(cd "$(dirname "$0")" && pwd)"
py="$dir/gpu/safety_workloads.py"
mkdir -p "$out"
exec > >(tee "$out/hardware-proof.log") 2>&1
# shellcheck source=scripts/hardware-webhook.sh
. "$dir/hardware-webhook.sh"

line() { # FILE WORD: wait for a "WORD ..." line in FILE and print it
  for _ in $(seq 1 600); do grep -m1 "^$2 " "$1" 2>/dev/null && return; sleep 0.1; done
  echo "no $2 line in $1" >&2; cat "$1" >&2; return 1
}
cpu_ns() { # PID: CPU time of every thread, in ns (schedstat)
  cat /proc/"$1"/task/*/schedstat 2>/dev/null | awk '{s+=$1} END {print s}'
}
alive() { # WHAT PID...
  local what=$1; shift
  for p in "$@"; do
    if [ -d /proc/$p ] && [ "$(awk '{print $3}' /proc/$p/stat)" != Z ]; then echo "  alive: $what $p"; else echo "  KILLED: $what $p"; fi
  done
}
want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
orphan() { # TAG: a fork orphan of another job: sets op oc1 oc2, kills op
  setsid python3 "$py" fork --gib 4 --children 2 > "$out/$1-orphan.out" 2>&1 &
  kills+=($!)
  read -r _ op oc1 oc2 < <(ready "$out/$1-orphan.out")
  sleep 1 # the collector (200 ms) records the workers' descent
  kill -9 "$op"
  sleep 1.5 # min-age 1s
  echo "orphan: trainer $op killed -9, workers $oc1 $oc2"
}

section "machine"
nvidia-smi -L; nvidia-smi --query-gpu=driver_version --format=csv,noheader; uname -r; nproc

if want cost; then
section "cost on a healthy node: a PyTorch trainer (2 GiB) with 2 forked workers alive"
setsid python3 "$py" fork --gib 2 --children 2 > "$out/healthy.out" 2>&1 &
kills+=($!)
read -r _ htr hc1 hc2 < <(ready "$out/healthy.out")
echo "trainer $htr ($(ls /proc/$htr/task | wc -l) threads), workers $hc1 $hc2"
"$bin/gpu-orphan-exporter" --backend=nvml --web.listen-address=127.0.0.1:19840 > "$out/exporter-new.log" 2>&1 &
new=$!; kills+=($new)
if [ -n "$old" ]; then
  "$old/gpu-orphan-exporter" --backend=nvml --web.listen-address=127.0.0.1:19841 > "$out/exporter-old.log" 2>&1 &
  oldp=$!; kills+=($oldp)
fi
sleep 5
n0=$(cpu_ns $new); o0=$([ -n "$old" ] && cpu_ns $oldp); t0=$(date +%s.%N)
sleep 60
n1=$(cpu_ns $new); o1=$([ -n "$old" ] && cpu_ns $oldp); t1=$(date +%s.%N)
python3 -c "print('new exporter: %.4f%% of a core' % (($n1-$n0)/1e9/($t1-$t0)*100))"
[ -n "$old" ] && python3 -c "print('old exporter: %.4f%% of a core' % (($o1-$o0)/1e9/($t1-$t0)*100))"
echo "new: $(python3 "$dir/gpu/scrape_latency.py" http://127.0.0.1:19840/metrics 2000)"
[ -n "$old" ] && echo "old: $(python3 "$dir/gpu/scrape_latency.py" http://127.0.0.1:19841/metrics 2000)"
grep -E 'gpu_orphan_(unowned_memory_bytes|suspect_holders)\{' < <(curl -s 127.0.0.1:19840/metrics)
kill "$new" ${oldp:-} 2>/dev/null
kill -9 "$htr" "$hc1" "$hc2"; memory_back
fi

section "remediator"
"$bin/gpu-orphan-remediator" --backend=nvml --node.name=h200 --auth.token-file="$tokfile" --act \
  --remediate.min-age=1s --remediate.grace=2s --remediate.verify-timeout=20s --limit.cooldown=0s \
  --limit.rate=100 --limit.burst=10 --store.path="$(mktemp -d)/r.db" --collector.interval=200ms \
  --web.listen-address="127.0.0.1:$port" --log.level=debug > "$out/remediator.log" 2>&1 &
kills+=($!)
sleep 2

if want launcher; then
section "1. a launcher that called cuInit alone, parent of a healthy rank; a fork orphan of another job"
setsid python3 "$py" launcher --gib 1 --children 1 > "$out/launcher.out" 2>&1 &
kills+=($!)
read -r _ launcher < <(line "$out/launcher.out" launcher)
read -r _ rank rc < <(ready "$out/launcher.out")
state "$launcher"; devices "$launcher"; state "$rank"
orphan launcher
smi; "$bin/gpu-orphan" ps
post 00000000000b0001; action 00000000000b0001
alive launcher "$launcher"; alive rank "$rank"; alive "rank's worker" "$rc"; alive "orphan's worker" "$oc1" "$oc2"
smi
kill -9 "$launcher" "$rank" "$rc" "$oc1" "$oc2" 2>/dev/null; memory_back
fi

if want helper; then
section "2. a healthy trainer's double-forked helper (reparented, the trainer's group, its open files); a fork orphan"
setsid python3 "$py" fork --helper --gib 1 --children 1 > "$out/helper.out" 2>&1 &
kills+=($!)
read -r _ tr tc < <(ready "$out/helper.out")
read -r _ helper < <(line "$out/helper.out" helper)
state "$tr"; state "$helper"; devices "$helper"
orphan helper
smi; "$bin/gpu-orphan" ps
post 00000000000b0002; action 00000000000b0002
alive trainer "$tr"; alive "trainer's worker" "$tc"; alive "trainer's helper" "$helper"; alive "orphan's worker" "$oc1" "$oc2"
smi
kill -9 "$tr" "$tc" "$helper" "$oc1" "$oc2" 2>/dev/null; memory_back
fi

if want mps; then
section "3. the MPS control daemon copied as gpu-watchd (no protected name), started first; an MPS client's fork orphan"
mps=$(mktemp -d); mkdir -p "$mps/pipe" "$mps/log"
cp "$(command -v nvidia-cuda-mps-control)" "$mps/gpu-watchd"
cp "$(command -v nvidia-cuda-mps-server)" "$mps/" # in case the daemon looks beside itself
export PATH="$mps:$PATH"
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
"$mps/gpu-watchd" -d
sleep 1
# -d forks the daemon; the process started here exits.
daemon=""
for p in $(pgrep -x gpu-watchd); do [ "$(awk '{print $3}' /proc/$p/stat)" != Z ] && daemon=$p; done
state "$daemon"; devices "$daemon"
setsid python3 "$py" fork --gib 2 --children 2 > "$out/mps-client.out" 2>&1 &
kills+=($!)
read -r _ client mc1 mc2 < <(ready "$out/mps-client.out")
server=$(pgrep -f nvidia-cuda-mps-server | head -1)
echo "control daemon $daemon, server $server, client $client, client's workers $mc1 $mc2"
state "$server"; devices "$server"; state "$daemon"; devices "$daemon"
echo "  the daemon's maps of the nvidia devices: $(grep -c ' /dev/nvidia' /proc/$daemon/maps) lines; NVML lists it: $(nvidia-smi --query-compute-apps=pid --format=csv,noheader | grep -cx "$daemon")"
sleep 1
kill -9 "$client"; sleep 1.5
smi; "$bin/gpu-orphan" ps
post 00000000000b0003; action 00000000000b0003
alive "MPS control (gpu-watchd)" "$daemon"; alive "MPS server" "$server"; alive "client's worker" "$mc1" "$mc2"
smi
echo quit | "$mps/gpu-watchd"; sleep 1
unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
kill -9 "$mc1" "$mc2" 2>/dev/null; memory_back
fi

section "remediator log (plans and signals)"
grep -E 'signalled|Plan|Action finished|Re-planned' "$out/remediator.log" | cut -c1-400
curl -s -H "Authorization: Bearer $token" "localhost:$port/api/v1/actions?limit=100" > "$out/actions.json"
