#!/usr/bin/env bash
# Idle memory of the node's daemons on NVML (issue 18, §2): the exporter and
# the node agent (gpu-orphan-remediator), each started on a GPU node with
# nothing running, VmRSS and VmHWM read after 60 s.
#
# Usage: scripts/hardware-rss.sh BIN_DIR OUT_DIR   (as root)
set -uo pipefail
bin=$1 out=$2
mkdir -p "$out"
exec > >(tee "$out/hardware-rss.log") 2>&1
# shellcheck source=scripts/hardware-lib.sh
. "$(dirname "$0")/hardware-lib.sh"
tok=$(mktemp); new_token "$tok"
section "machine"
nvidia-smi -L; nvidia-smi --query-gpu=driver_version,memory.used --format=csv,noheader; uname -r
section "starting the exporter and the node agent on NVML"
"$bin/gpu-orphan-exporter" --backend=nvml --web.listen-address=127.0.0.1:19850 > "$out/exporter.log" 2>&1 &
exporter=$!; pids+=($exporter)
"$bin/gpu-orphan-remediator" --backend=nvml --node.name=h200 --auth.token-file="$tok" \
  --store.path="$(mktemp -d)/r.db" --web.listen-address=127.0.0.1:19851 > "$out/remediator.log" 2>&1 &
agent=$!; pids+=($agent)
sleep 60
section "after 60 s idle"
for p in "$exporter:gpu-orphan-exporter" "$agent:gpu-orphan-remediator (node agent)"; do
  pid=${p%%:*}
  echo "${p#*:}: $(grep -E '^(VmRSS|VmHWM)' /proc/$pid/status | tr -s ' \t\n' ' ')"
done
for b in gpu-orphan-exporter gpu-orphan-remediator; do
  echo "$b: $(stat -c %s "$bin/$b") bytes"
done
