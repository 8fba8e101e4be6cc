#!/usr/bin/env bash
# Issue 16, §1 on a real GPU node with PyTorch: workers that ignore SIGTERM
# hold a dead trainer's 2.6 GiB; the alert comes, the remediator (--act,
# NVML) sends SIGTERM and is killed with kill -9 one second into its grace;
# restarted on the same store, it takes the action up again from a fresh
# snapshot (attempt 2), and Alertmanager's re-sent notification (the same
# fingerprint and startsAt) is a duplicate. The memory must come back, only
# the workers be signalled, and the record link the attempts.
#
# Usage: scripts/hardware-crash.sh BIN_DIR OUT_DIR   (as root, GPU 0)
set -uo pipefail
bin=$1 out=$2
dir="$(cd "$(dirname "$0")" && pwd)"
py="$dir/gpu/safety_workloads.py"
mkdir -p "$out"
exec > >(tee "$out/hardware-crash.log") 2>&1
# shellcheck source=scripts/hardware-webhook.sh
. "$dir/hardware-webhook.sh"
store="$(mktemp -d)/remediator.db"

start() { # GRACE: the remediator on the store, until it is ready
  "$bin/gpu-orphan-remediator" --backend=nvml --node.name=h200 --auth.token-file="$tokfile" --act \
    --remediate.min-age=1s --remediate.grace="$1" --remediate.verify-timeout=20s --store.path="$store" \
    --collector.interval=200ms --web.listen-address="127.0.0.1:$port" --log.level=debug >> "$out/remediator.log" 2>&1 &
  rem=$!; kills+=($rem)
  for _ in $(seq 1 100); do curl -sf "localhost:$port/-/ready" > /dev/null && return; sleep 0.1; done
  echo "the remediator never got ready"; exit 1
}
send() { # FINGERPRINT STARTS_AT: one firing alert, as Alertmanager sends it every repeat_interval
  curl -s -H "Authorization: Bearer $token" -H 'Content-Type: application/json' "localhost:$port/api/v1/alerts" -d '{
    "version":"4","groupKey":"{}:{alertname=\"GPUOrphanMemory\"}","truncatedAlerts":0,"status":"firing",
    "receiver":"gpu-orphan","groupLabels":{},"commonLabels":{},"commonAnnotations":{},"externalURL":"http://am",
    "alerts":[{"status":"firing","labels":{"alertname":"GPUOrphanMemory","node":"h200","gpu":"0","uuid":"'"$uuid"'"},
    "annotations":{},"startsAt":"'"$2"'","endsAt":"0001-01-01T00:00:00Z","generatorURL":"","fingerprint":"'"$1"'"}]}'
  echo
}
api() { curl -s -H "Authorization: Bearer $token" "localhost:$port/api/v1/$1"; }
sigconts() { # ACTION: how many SIGCONTs its record shows (each recorded before it is sent, after SIGTERM)
  api "actions/$1" | python3 -c 'import json,sys; print(sum(1 for e in json.load(sys.stdin)["events"] if e["kind"]=="signal" and e["detail"]["signal"]=="SIGCONT"))'
}
story() { # FINGERPRINT: every attempt of the alert, with its events
  api "actions?limit=100" > "$out/crash-actions.json"
  python3 - "$1" "$out/crash-actions.json" <<'PY'
import json, sys
fp, path = sys.argv[1], sys.argv[2]
for a in sorted((a for a in json.load(open(path)) if a.get("alert_fingerprint") == fp), key=lambda a: a["attempt"]):
    print(f'attempt {a["attempt"]} {a["id"]}: {a["state"]} | {a.get("reason", "")} | retry_of {a.get("retry_of", "-")} | '
          f'first {a.get("first_action_id", "-")} | freed MiB {a.get("freed_bytes", 0) >> 20}')
    for t in a.get("targets") or []:
        print("  target", t["pid"], t["comm"], t["reason"], t.get("signals"), t.get("outcome"))
PY
  for id in $(python3 -c 'import json,sys; [print(a["id"]) for a in json.load(open(sys.argv[2])) if a.get("alert_fingerprint")==sys.argv[1]]' "$1" "$out/crash-actions.json"); do
    echo "events of $id:"
    api "actions/$id" | python3 -c 'import json,sys; [print("  ", e["at"], e["kind"], json.dumps(e["detail"])) for e in json.load(sys.stdin)["events"]]'
  done
}

section "machine"
nvidia-smi -L; nvidia-smi --query-gpu=driver_version --format=csv,noheader; uname -r
start 30s

section "a trainer with 2.6 GiB and two forked workers that ignore SIGTERM; the trainer is killed with -9"
setsid python3 "$py" fork --gib 2.6 --children 2 --ignore-sigterm > "$out/crash.out" 2>&1 &
kills+=($!)
read -r _ tr c1 c2 < <(ready "$out/crash.out")
kill -9 "$tr"
sleep 1.5 # the orphan older than --remediate.min-age
smi; "$bin/gpu-orphan" ps

section "the alert; the remediator is killed with -9 one second into its 30 s grace"
fp=00000000000c0001 starts=$(date -u +%FT%TZ)
send "$fp" "$starts"
id=""
for _ in $(seq 1 300); do
  id=$(api "actions?limit=10" | python3 -c 'import json,sys; print(next((a["id"] for a in json.load(sys.stdin) if a["state"]=="running"), ""))')
  [ -n "$id" ] && [ "$(sigconts "$id")" = 2 ] && break
  sleep 0.1
done
echo "action $id: SIGTERM sent to both workers ($(date +%T.%3N))"
sleep 1
kill -9 "$rem"; wait "$rem" 2>/dev/null
echo "remediator killed with -9 at $(date +%T.%3N)"
state "$c1"; state "$c2"; smi

section "restarted on the same store"
restarted=$(date +%s.%N)
start 2s
for _ in $(seq 1 300); do
  [ "$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0)" -lt 100 ] && break; sleep 0.1
done
echo "memory back $(python3 -c "import time; print(round(time.time()-$restarted, 2))") s after the restart began"
sleep 1
story "$fp"

section "Alertmanager re-sends the alert (same fingerprint and startsAt)"
send "$fp" "$starts"
state "$c1"; state "$c2"; smi
