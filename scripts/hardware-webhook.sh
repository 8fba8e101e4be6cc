# The webhook helpers of the scripts/hardware-*.sh runs that alert a
# remediator on GPU 0 and read its actions; sourced, not run. The caller sets
# out (a directory) and starts the remediator on $port with $tokfile.
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

