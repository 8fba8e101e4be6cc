#!/usr/bin/env bash
# Proves the fleet path on a real GPU node: the exporter and the node agent on
# their default ports (10835, 10836), a dispatcher in front with an allow-list
# (--dispatch.targets-file) and a custom UUID label on both sides. A fork
# orphan's alert goes through the dispatcher twice (as two HA replicas' copies
# would reach one agent); an alert naming a node on no list must reach no host.
#
# Usage: scripts/hardware-fleet.sh BIN_DIR FORK_ORPHAN_PY OUT_DIR
set -uo pipefail
. "$(dirname "$0")/hardware-lib.sh"
bin=$1 py=$2 out=$3
mkdir -p "$out"
exec > >(tee "$out/hardware-fleet.log") 2>&1
work=$(mktemp -d)
new_token "$work/agent.token"
new_token "$work/dispatcher.token"
echo '{"h200": "http://127.0.0.1:10836"}' > "$work/targets.json"
api() { curl -s -H "Authorization: Bearer $(cat "$work/$1.token")" "$2"; }

section "machine"
nvidia-smi -L; nvidia-smi --query-gpu=driver_version --format=csv,noheader; "$bin/gpu-orphan-exporter" --version | head -1

section "start: exporter and agent on their default ports, dispatcher on 10837"
"$bin/gpu-orphan-exporter" --backend=nvml --collector.interval=500ms > "$out/exporter.log" 2>&1 & pids+=($!)
"$bin/gpu-orphan-remediator" --backend=nvml --node.name=h200 --act --alert.uuid-label=gpu_uuid \
  --auth.token-file="$work/agent.token" --store.path="$work/agent.db" --collector.interval=500ms \
  --remediate.min-age=1s --remediate.grace=3s > "$out/agent.log" 2>&1 & pids+=($!)
"$bin/gpu-orphan-dispatcher" --web.listen-address=127.0.0.1:10837 --alert.uuid-label=gpu_uuid \
  --auth.token-file="$work/dispatcher.token" --dispatch.token-file="$work/agent.token" \
  --dispatch.targets-file="$work/targets.json" --store.path="$work/dispatcher.db" > "$out/dispatcher.log" 2>&1 & pids+=($!)
sleep 3
for p in 10835 10836 10837; do curl -s -o /dev/null -w "port $p: HTTP %{http_code}\n" "localhost:$p/metrics"; done

section "fork_orphan.py: 4 GiB, 2 forked workers; kill -9 of the parent"
fifo=$(mktemp -u); mkfifo "$fifo"
setsid python3 "$py" --gib 4 --children 2 > "$fifo" 2>"$out/fork_orphan.err" & pids+=($!)
read -r _ parent c1 c2 < "$fifo"
echo "parent=$parent children=$c1 $c2"
sleep 1; kill -9 "$parent"; sleep 2.5
nvidia-smi --query-gpu=memory.used --format=csv,noheader; nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader
curl -s localhost:10835/metrics | grep -E '^gpu_orphan_(unowned_memory_bytes|holder_info|dead_owner_info)' | grep 'gpu="0"'
uuid=$(nvidia-smi --query-gpu=uuid --format=csv,noheader -i 0)

alert() { # node startsAt fingerprint
  printf '{"version":"4","groupKey":"k","truncatedAlerts":0,"status":"firing","receiver":"r","groupLabels":{},"commonLabels":{},"commonAnnotations":{},"externalURL":"http://am","alerts":[{"status":"firing","labels":{"alertname":"GPUOrphanMemory","node":"%s","gpu_uuid":"%s","gpu":"0"},"annotations":{},"startsAt":"%s","endsAt":"0001-01-01T00:00:00Z","generatorURL":"","fingerprint":"%s"}]}' "$1" "$uuid" "$2" "$3"
}
post() { curl -s -w ' HTTP %{http_code}' -H "Authorization: Bearer $(cat "$work/dispatcher.token")" -H 'Content-Type: application/json' -d "$1" localhost:10837/api/v1/alerts; echo; }

# The agent listens on every address, so 127.0.0.3:10836 reaches it: had the
# dispatcher forwarded this alert, the agent would show a second action.
section "an alert naming node 127.0.0.3 (on no list)"
post "$(alert 127.0.0.3 "$(date -u +%Y-%m-%dT%H:%M:%SZ)" 00000000000000b1)"

section "the orphan's alert through the dispatcher, twice (the same notification, as two replicas would forward it)"
now=$(date -u +%Y-%m-%dT%H:%M:%S.%NZ)
t0=$(date +%s.%N)
post "$(alert h200 "$now" 00000000000000a1)" & post "$(alert h200 "$now" 00000000000000a1)"; wait %%
state=""
for i in $(seq 1 300); do
  state=$(api agent localhost:10836/api/v1/actions | python3 -c 'import json,sys; a=json.load(sys.stdin); print(a[0]["state"] if a else "")')
  case "$state" in succeeded|failed|skipped|dry_run) break;; esac
  sleep 0.1
done
echo "agent's action: $state, $(python3 -c "print(round($(date +%s.%N)-$t0,2))") s after the webhook"
sleep 2
api agent localhost:10836/api/v1/actions > "$out/agent-actions.json"
api dispatcher localhost:10837/api/v1/actions > "$out/dispatcher-actions.json"
python3 - "$out/agent-actions.json" "$out/dispatcher-actions.json" <<'PY'
import json,sys
ag=json.load(open(sys.argv[1])); di=json.load(open(sys.argv[2]))
print("agent actions:", len(ag))
for a in ag:
    print(" ", a.get("state"), "freed MiB", (a.get("freed_bytes") or 0)>>20, "verify_seconds", a.get("verify_seconds"))
    for t in a.get("targets") or []: print("   target", t.get("pid"), t.get("comm"), t.get("reason"), t.get("outcome"))
print("dispatcher records:", len(di))
for a in di:
    print(" ", {k: a.get(k) for k in ("node", "state", "reason", "skip_reason", "detail") if a.get(k) is not None})
PY
nvidia-smi --query-gpu=memory.used --format=csv,noheader
grep -iE 'reject|duplicate|forward' "$out/dispatcher.log" | head -10
section "done"
