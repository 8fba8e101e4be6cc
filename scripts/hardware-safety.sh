#!/usr/bin/env bash
# The single-GPU scenarios of docs/safety.md on a real GPU node with PyTorch,
# each end to end through the remediator's webhook with --act on NVML:
#   1. a zombie leader: the trainer's main thread exited, another thread
#      holds the context, forked workers;
#   2. a dead trainer's PID reused by an unrelated process;
#   3. a job script with a non-GPU helper in its process group.
# For each it records what NVML and /proc show and what was signalled.
#
# Usage: scripts/hardware-safety.sh BIN_DIR OUT_DIR   (as root, GPU 0)
set -uo pipefail
bin=$1 out=$2
py="$(cd "$(dirname "$0")" && pwd)/gpu/safety_workloads.py"
mkdir -p "$out"
exec > >(tee "$out/hardware-safety.log") 2>&1
port=19837
token=$(head -c 24 /dev/urandom | base64 | tr -d '/+=')
tokfile=$(mktemp); echo "$token" > "$tokfile"
uuid=$(nvidia-smi --query-gpu=uuid --format=csv,noheader -i 0)
kills=()
cleanup() { for p in "${kills[@]}"; do kill -9 -- -"$p" "$p" 2>/dev/null; done; }
trap cleanup EXIT

section() { echo; echo "=== $* ($(date +%T.%3N))"; }
smi() {
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader
  echo "NVML lists: $(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ';')"
}
state() { # PID: what /proc says
  local p=$1
  if [ ! -d /proc/$p ]; then echo "$p: no such process"; return; fi
  echo "$p: $(tr '\0' ' ' < /proc/$p/cmdline | cut -c1-60) | $(grep -E '^(State|Threads|PPid)' /proc/$p/status | tr '\t\n' ' ')| pgid $(awk '{print $5}' /proc/$p/stat 2>/dev/null) | fds $(ls /proc/$p/fd | wc -l)"
}
devices() { # PID: how it holds /dev/nvidia0, through any live thread
  local p=$1 t fd n=0 ids
  for t in /proc/$p/task/*; do
    for fd in $t/fd/*; do
      [ "$(stat -L -c '%t:%T' "$fd" 2>/dev/null)" = "c3:0" ] || continue
      n=$((n+1)); ids=$(stat -L -c 'st_rdev %t:%T (hex) st_dev %D st_ino %i' "$fd")
    done
    [ $n -gt 0 ] && { echo "  $p holds 195:0 through $n descriptors of task ${t##*/} ($ids); maps lines: $(grep -c ' /dev/nvidia0' $t/maps)"; return; }
  done
  echo "  $p holds no descriptor of 195:0"
}
ready() { # FILE: wait for a "ready ..." line in it and print it
  for _ in $(seq 1 600); do grep -m1 '^ready' "$1" 2>/dev/null && return; sleep 0.1; done
  echo "no ready line in $1" >&2; cat "$1" >&2; return 1
}
post() { # FINGERPRINT
  curl -s -H "Authorization: Bearer $token" -H 'Content-Type: application/json' "localhost:$port/api/v1/alerts" -d '{
    "version":"4","groupKey":"{}:{alertname=\"GPUOrphanMemory\"}","truncatedAlerts":0,"status":"firing",
    "receiver":"gpu-orphan","groupLabels":{},"commonLabels":{},"commonAnnotations":{},"externalURL":"http://am",
    "alerts":[{"status":"firing","labels":{"alertname":"GPUOrphanMemory","node":"h200","gpu":"0","uuid":"'"$uuid"'"},
    "annotations":{},"startsAt":"'"$(date -u +%FT%TZ)"'","endsAt":"0001-01-01T00:00:00Z","generatorURL":"","fingerprint":"'"$1"'"}]}'
  echo
}
action() { # FINGERPRINT: wait for its action to finish and print it
  for _ in $(seq 1 300); do
    curl -s -H "Authorization: Bearer $token" "localhost:$port/api/v1/actions?limit=100" > "$out/actions.json"
    python3 - "$1" "$out/actions.json" <<'PY' && return
import json, sys
fp, path = sys.argv[1], sys.argv[2]
for a in json.load(open(path)):
    if a.get("alert_fingerprint") == fp and a["state"] not in ("queued", "running"):
        print("action:", a["state"], "|", a.get("reason", ""), "| freed MiB:", a.get("freed_bytes", 0) >> 20,
              "| verify s:", a.get("verify_seconds"))
        for t in a.get("targets") or []:
            print("  target", t["pid"], t["comm"], t["reason"], "whole group" if t.get("whole_group") else "", t.get("signals"), t.get("outcome"))
        for e in a.get("excluded") or []:
            print("  excluded", e["pid"], e["comm"], e["why"])
        sys.exit(0)
sys.exit(1)
PY
    sleep 0.2
  done
  echo "action $1 never finished"
}
memory_back() {
  for _ in $(seq 1 100); do
    [ "$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0)" -lt 100 ] && break; sleep 0.1
  done
  smi
}

section "machine"
nvidia-smi -L; nvidia-smi --query-gpu=driver_version --format=csv,noheader; uname -r
"$bin/gpu-orphan-remediator" --backend=nvml --node.name=h200 --auth.token-file="$tokfile" --act \
  --remediate.min-age=1s --remediate.grace=2s --remediate.verify-timeout=20s --limit.cooldown=0s \
  --limit.rate=100 --limit.burst=10 --store.path="$(mktemp -d)/r.db" --collector.interval=200ms \
  --web.listen-address="127.0.0.1:$port" --log.level=debug > "$out/remediator.log" 2>&1 &
kills+=($!)
sleep 2

section "1. zombie leader: main thread exited (pthread_exit), another thread holds the context, 2 forked workers"
setsid python3 "$py" zombie --gib 4 --children 2 > "$out/zombie.out" 2>&1 &
kills+=($!)
read -r _ z c1 c2 < <(ready "$out/zombie.out")
sleep 2
state "$z"; state "$c1"; state "$c2"
echo "  /proc/$z/fd lists $(ls /proc/$z/fd | wc -l) descriptors, /proc/$z/maps $(wc -l < /proc/$z/maps) lines; tasks: $(ls /proc/$z/task | tr '\n' ' ')"
devices "$z"; devices "$c1"
smi; "$bin/gpu-orphan" ps
post 00000000000a0001; action 00000000000a0001
echo "afterwards:"; state "$z"; state "$c1"; state "$c2"; smi
kill -9 "$z" "$c1" "$c2"; memory_back

section "2. a dead trainer's PID reused by an unrelated process (trainer not a group leader)"
setsid bash -c "python3 '$py' fork --gib 4 --children 2 & wait" > "$out/reuse.out" 2>&1 &
script=$!; kills+=($script)
read -r _ tr c1 c2 < <(ready "$out/reuse.out")
state "$script"; state "$tr"; state "$c1"
kill -9 "$tr"
for _ in $(seq 1 100); do [ -d /proc/$tr ] || break; sleep 0.05; done
newcomer=""
for _ in $(seq 1 200); do
  echo $((tr - 1)) > /proc/sys/kernel/ns_last_pid
  sleep 300 & p=$!
  [ "$p" = "$tr" ] && { newcomer=$p; break; }
  kill "$p"
done
kills+=($newcomer)
echo "PID $tr recreated for an unrelated process: $(state "$newcomer")"
devices "$newcomer"; devices "$c1"
smi; "$bin/gpu-orphan" ps
post 00000000000a0002; action 00000000000a0002
echo "afterwards:"; state "$newcomer"; state "$c1"; state "$c2"
kill -9 "$c1" "$c2" 2>/dev/null; memory_back

section "3. a job script (setsid) with the trainer and a non-GPU helper in its group; trainer killed -9"
setsid bash -c "sleep 300 & echo helper \$!; python3 '$py' fork --gib 4 --children 2 & wait" > "$out/script.out" 2>&1 &
script=$!; kills+=($script)
read -r _ tr c1 c2 < <(ready "$out/script.out")
helper=$(awk '/^helper/ {print $2}' "$out/script.out")
state "$script"; state "$helper"; state "$tr"; state "$c1"
kill -9 "$tr"; sleep 1
smi; "$bin/gpu-orphan" ps
post 00000000000a0003; action 00000000000a0003
echo "afterwards:"; state "$script"; state "$helper"; state "$c1"; state "$c2"
kill -9 "$c1" "$c2" 2>/dev/null; memory_back

section "remediator log (signals)"
grep -E 'signalled|Plan|Action finished' "$out/remediator.log" | cut -c1-300
