#!/usr/bin/env bash
# Proves the NVML path on a real GPU node: runs shared/gpu/fork_orphan.py,
# and records what nvidia-smi, `gpu-orphan ps` and the exporter report
# before killing the parent, after killing it, and after killing the
# children; then has the remediator clean a second orphan through its
# webhook and times webhook receipt to memory verified back.
#
# Usage: scripts/hardware-check.sh BIN_DIR FORK_ORPHAN_PY OUT_DIR
set -uo pipefail
. "$(dirname "$0")/hardware-lib.sh"
bin=$1 py=$2 out=$3
mkdir -p "$out"
log="$out/hardware-check.log"
exec > >(tee "$log") 2>&1
port_exp=19835 port_rem=19836
tokfile=$(mktemp); new_token "$tokfile"; token=$(cat "$tokfile")

smi() {
  nvidia-smi --query-gpu=index,uuid,memory.used,memory.reserved,memory.total --format=csv
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv
}
gps() { "$bin/gpu-orphan" ps; "$bin/gpu-orphan" ps -o json > "$out/ps-$1.json"; }
scrape() { curl -s "localhost:$port_exp/metrics" | grep -E '^gpu_orphan_(unowned|memory_(used|owned|unattributed)|holder_info|suspect|process_memory|host_pids|source_success)' | grep -E 'gpu="0"|source|host_pids'; }
ready_line() { # start fork_orphan.py in its own session; print "ready PARENT CHILD..."
  local fifo; fifo=$(mktemp -u); mkfifo "$fifo"
  setsid python3 "$py" --gib 4 --children 2 "$@" > "$fifo" 2>"$out/fork_orphan.err" &
  pids+=($!)
  head -n1 < "$fifo"
}

section "machine"
nvidia-smi -L; uname -r; nproc
section "idle"
smi; gps idle

"$bin/gpu-orphan-exporter" --backend=nvml --web.listen-address=":$port_exp" --collector.interval=1s > "$out/exporter.log" 2>&1 &
pids+=($!)
sleep 2

section "fork_orphan.py running (parent alive)"
read -r _ parent c1 c2 < <(ready_line)
echo "parent=$parent children=$c1 $c2"
sleep 1; smi; gps alive; scrape

section "after kill -9 of the parent"
t0=$(date +%s.%N)
kill -9 "$parent"
sleep 1.5
smi; gps parent-killed; scrape
echo "kill(pid $parent): $(kill -0 "$parent" 2>&1 || true)"
echo "device nodes held by child $c1: $(ls -l /proc/$c1/fd 2>/dev/null | grep -o '/dev/nvidia[^ ]*' | sort -u | tr '\n' ' ')"
exp_pid=$(pgrep -f gpu-orphan-exporter | head -1)
echo "device nodes held by the exporter (NVML only): $(ls -l /proc/$exp_pid/fd 2>/dev/null | grep -o '/dev/nvidia[^ ]*' | sort -u | tr '\n' ' ')"
echo "child $c1 maps /dev/nvidia0: $(grep -c ' /dev/nvidia0$' /proc/$c1/maps) times; the exporter: $(grep -c ' /dev/nvidia0$' /proc/$exp_pid/maps) times"
echo "fuser -v /dev/nvidia0:"; fuser -v /dev/nvidia0 2>&1 | head -8
/usr/bin/time -f "fuser /dev/nvidia0: %e s" fuser /dev/nvidia0 >/dev/null 2>&1 || true
/usr/bin/time -f "gpu-orphan ps (NVML + full holder scan): %e s" "$bin/gpu-orphan" ps >/dev/null 2>&1 || true

section "after kill -9 of the children"
kill -9 "$c1" "$c2"
for i in $(seq 1 50); do
  used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0)
  [ "$used" -lt 1000 ] && break; sleep 0.1
done
sleep 1.5
smi; gps children-killed; scrape

section "remediator: webhook -> verified cleanup"
store=$(mktemp -d)
"$bin/gpu-orphan-remediator" --backend=nvml --node.name=h200 --auth.token-file="$tokfile" --act \
  --remediate.min-age=1s --remediate.grace=3s --store.path="$store/r.db" --collector.interval=500ms \
  --web.listen-address=":$port_rem" > "$out/remediator.log" 2>&1 &
pids+=($!)
read -r _ parent c1 c2 < <(ready_line --ignore-sigterm)
echo "parent=$parent children=$c1 $c2 (children ignore SIGTERM)"
kill -9 "$parent"; sleep 2.5
uuid=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["gpus"][0]["uuid"])' "$out/ps-idle.json")
"$bin/gpu-orphan" clean --gpu 0 | tee "$out/clean-dry-run.txt"
now=$(date -u +%Y-%m-%dT%H:%M:%S.%NZ)
body=$(printf '{"version":"4","groupKey":"k","truncatedAlerts":0,"status":"firing","receiver":"r","groupLabels":{},"commonLabels":{},"commonAnnotations":{},"externalURL":"http://am","alerts":[{"status":"firing","labels":{"alertname":"GPUOrphanMemory","node":"h200","uuid":"%s","gpu":"0"},"annotations":{},"startsAt":"%s","endsAt":"0001-01-01T00:00:00Z","generatorURL":"","fingerprint":"00000000000000a1"}]}' "$uuid" "$now")
t0=$(date +%s.%N)
curl -s -H "Authorization: Bearer $token" -H 'Content-Type: application/json' -d "$body" "localhost:$port_rem/api/v1/alerts"; echo
state=""
for i in $(seq 1 300); do
  state=$(curl -s -H "Authorization: Bearer $token" "localhost:$port_rem/api/v1/actions" | python3 -c 'import json,sys; a=json.load(sys.stdin); print(a[0]["state"] if a else "")')
  case "$state" in succeeded|failed|skipped|dry_run) break;; esac
  sleep 0.1
done
t1=$(date +%s.%N)
echo "action state: $state; webhook receipt to final state: $(python3 -c "print(round($t1-$t0,2))") s"
curl -s -H "Authorization: Bearer $token" "localhost:$port_rem/api/v1/actions" > "$out/actions.json"
python3 - "$out/actions.json" <<'PY'
import json,sys
a=json.load(open(sys.argv[1]))[0]
print("freed MiB:", a["freed_bytes"]>>20, "verify_seconds:", a.get("verify_seconds"))
print("before:", {k:a["before"][k] for k in ("used_bytes","unowned_bytes","dead_owner_pids")})
print("after:", {k:a["after"][k] for k in ("used_bytes","unowned_bytes")} if a.get("after") else None)
for t in a["targets"]: print("target", t["pid"], t["comm"], t["reason"], t["outcome"], t.get("signals"))
PY
smi
section "done"
