#!/usr/bin/env bash
# Who left it, on a real GPU node: a PyTorch fork orphan runs under a
# cgroup laid out as Slurm's cgroup/v2 plugin lays out a step
# (.../slurmstepd.scope/job_81234/step_0), the exporter sees it alive, the
# trainer is killed with -9, and gpu_orphan_dead_owner_info and
# `gpu-orphan ps` must name the job.
#
# Usage: scripts/hardware-identity.sh BIN_DIR OUT_DIR   (as root, GPU 0)
set -uo pipefail
bin=$1 out=$2
py="$(cd "$(dirname "$0")" && pwd)/gpu/safety_workloads.py"
mkdir -p "$out"
exec > >(tee "$out/hardware-identity.log") 2>&1
port=19838
kills=()
cg=""
cleanup() {
  for p in "${kills[@]}"; do kill -9 -- -"$p" "$p" 2>/dev/null; done
  sleep 0.5
  [ -n "$cg" ] && for d in "$cg" "$(dirname "$cg")" "$(dirname "$(dirname "$cg")")"; do rmdir "$d" 2>/dev/null; done
}
trap cleanup EXIT
section() { echo; echo "=== $* ($(date +%T.%3N))"; }

section "machine"
nvidia-smi -L; uname -r
mount | grep cgroup
for root in /sys/fs/cgroup/unified /sys/fs/cgroup; do
  if [ -f "$root/cgroup.controllers" ]; then cg="$root/system.slice/slurmstepd.scope/job_81234/step_0"; break; fi
done
if [ -z "$cg" ] || ! mkdir -p "$cg"; then
  echo "no cgroup v2 hierarchy to make a Slurm-like step cgroup in: not run"; exit 0
fi
echo "step cgroup: $cg"

"$bin/gpu-orphan-exporter" --backend=nvml --web.listen-address="127.0.0.1:$port" --collector.interval=500ms \
  > "$out/exporter.log" 2>&1 &
kills+=($!)
sleep 2

section "trainer under the step cgroup, 2 forked workers"
setsid sh -c "echo \$\$ > '$cg/cgroup.procs' && exec python3 '$py' fork --gib 4 --children 2" > "$out/identity.out" 2>&1 &
kills+=($!)
for _ in $(seq 1 600); do grep -q '^ready' "$out/identity.out" && break; sleep 0.1; done
read -r _ tr c1 c2 < <(grep -m1 '^ready' "$out/identity.out")
echo "trainer $tr, workers $c1 $c2"; echo "/proc/$tr/cgroup:"; cat "/proc/$tr/cgroup"
sleep 2
curl -s "127.0.0.1:$port/metrics" | grep -E '^gpu_orphan_process_memory_bytes'

section "after kill -9 of the trainer"
kill -9 "$tr"; sleep 2
nvidia-smi --query-compute-apps=pid,used_memory --format=csv
curl -s "127.0.0.1:$port/metrics" | grep -E '^gpu_orphan_(dead_owner_info|unowned_memory_bytes)'
"$bin/gpu-orphan" ps --exporter.url="http://127.0.0.1:$port/metrics"
"$bin/gpu-orphan" ps -o json --exporter.url="http://127.0.0.1:$port/metrics" | python3 -c '
import json, sys
for g in json.load(sys.stdin)["gpus"]:
    for o in g["owners"]:
        print("owner", o["pid"], "alive" if o["alive"] else "DEAD", json.dumps(o.get("dead_owner")))'

section "an exporter started after the death"
"$bin/gpu-orphan-exporter" --backend=nvml --web.listen-address="127.0.0.1:$((port+1))" --collector.interval=500ms \
  > "$out/exporter-late.log" 2>&1 &
kills+=($!)
sleep 2
curl -s "127.0.0.1:$((port+1))/metrics" | grep -E '^gpu_orphan_dead_owner_info'
"$bin/gpu-orphan" ps --exporter.url="http://127.0.0.1:$((port+1))/metrics" | grep 'left by'

kill -9 "$c1" "$c2"
for _ in $(seq 1 100); do
  [ "$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0)" -lt 100 ] && break; sleep 0.1
done
nvidia-smi --query-gpu=memory.used --format=csv
