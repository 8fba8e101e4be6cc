#!/usr/bin/env bash
# Idle memory of the node's daemons on NVML (issue 18, §2): the exporter and
# the node agent (gpu-orphan-remediator), each started on a GPU node with
# nothing running, VmRSS and VmHWM read after 60 s, and where each one's
# resident memory lies (/proc/PID/smaps): its own binary, NVML's zeroed
# data (the BSS of libnvidia-ml), libcuda (which nvmlInit loads),
# libnvidia-ml, libc, and the rest (Go's heap and runtime).
#
# The daemons run as shipped (--nvml.release-zero-pages off, its default
# since issue 24, item 10) and, beside them, with it (exporter-zero-pages,
# agent-zero-pages: NVML's zeroed BSS handed back); each one's log says
# whether it handed anything back.
#
# Beside them, when BIN_DIR holds them, the same daemons on every CPU
# (--runtime.gomaxprocs=0, as before issue 18's last changes) and the
# floor programs of
# scripts/rssfloor (floor-nvml, floor-promhttp, floor-promhttp_nvml: go
# build -o BIN_DIR/floor-NAME scripts/rssfloor/NAME.go), the least that a
# Go program reading NVML, serving promhttp, or both, holds on this node.
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
nvidia-smi -L; nvidia-smi --query-gpu=driver_version,memory.used --format=csv,noheader; uname -r; nproc

declare -A started port
next_port=19850
start() { # NAME BINARY ARGS...: started in the background, on the next port where {PORT} says
  local name=$1 b=$2; shift 2
  [ -x "$bin/$b" ] || return 0
  port[$name]=$next_port
  "$bin/$b" "${@//\{PORT\}/$next_port}" > "$out/$name.log" 2>&1 &
  started[$name]=$!; pids+=($!); next_port=$((next_port + 1))
}
agent_args=(--backend=nvml --node.name=h200 --auth.token-file="$tok" --web.listen-address=127.0.0.1:{PORT})
section "starting the exporter and the node agent on NVML, and what is beside them"
start exporter gpu-orphan-exporter --backend=nvml --web.listen-address=127.0.0.1:{PORT}
start agent gpu-orphan-remediator "${agent_args[@]}" --store.path="$(mktemp -d)/r.db"
start exporter-zero-pages gpu-orphan-exporter --backend=nvml --web.listen-address=127.0.0.1:{PORT} --nvml.release-zero-pages
start agent-zero-pages gpu-orphan-remediator "${agent_args[@]}" --store.path="$(mktemp -d)/r.db" --nvml.release-zero-pages
if [ -x "$bin/floor-nvml" ]; then
  before=(--runtime.gomaxprocs=0)
  start exporter-before gpu-orphan-exporter --backend=nvml --web.listen-address=127.0.0.1:{PORT} "${before[@]}"
  start agent-before gpu-orphan-remediator "${agent_args[@]}" --store.path="$(mktemp -d)/r.db" "${before[@]}"
  start floor-nvml floor-nvml
  start floor-promhttp floor-promhttp 127.0.0.1:{PORT}
  start floor-promhttp_nvml floor-promhttp_nvml 127.0.0.1:{PORT}
fi
# Scraped every 5 s, as Prometheus would, so that the serving path is warm.
for _ in $(seq 12); do
  sleep 5
  for n in "${!port[@]}"; do curl -s -o /dev/null "http://127.0.0.1:${port[$n]}/metrics"; done
done

section "after 60 s idle: MiB resident, and where"
split() { # PID: resident MiB by what maps it
  awk -v exe="$(readlink "/proc/$1/exe")" '
    /^[0-9a-f]+-[0-9a-f]+ / {
      name = $6
      if (name == "" && prev ~ /libnvidia-ml/) c = "nvml_bss"
      else if (name ~ /libcuda/) c = "libcuda"
      else if (name ~ /libnvidia-ml/) c = "libnvidia-ml"
      else if (name ~ /\/lib(c|m)\.so|ld-linux/) c = "libc"
      else if (name == exe) c = "binary"
      else c = "rest"
      prev = name
    }
    /^Rss:/ { r[c] += $2 }
    END { for (c in r) printf "%s=%.1f ", c, r[c] / 1024 }' "/proc/$1/smaps"
}
for n in exporter agent exporter-zero-pages agent-zero-pages exporter-before agent-before floor-nvml floor-promhttp floor-promhttp_nvml; do
  p=${started[$n]:-}
  [ -n "$p" ] || continue
  if [ ! -d "/proc/$p" ]; then echo "$n: exited"; tail -3 "$out/$n.log"; continue; fi
  printf '%-20s %s| %s\n' "$n" "$(grep -E '^(VmRSS|VmHWM)' "/proc/$p/status" | tr -s ' \t\n' ' ')" "$(split "$p")"
done
echo "NVML's zeroed memory, as the daemons logged it (nothing from exporter and agent: the flag is off by default):"
for n in exporter agent exporter-zero-pages agent-zero-pages; do
  printf '%-20s %s\n' "$n" "$(grep -h "zero" "$out/$n.log" || echo "(nothing handed back)")"
done
section "the binaries"
for b in gpu-orphan-exporter gpu-orphan-remediator floor-nvml floor-promhttp floor-promhttp_nvml; do
  [ -x "$bin/$b" ] && echo "$b: $(stat -c %s "$bin/$b") bytes"
done
