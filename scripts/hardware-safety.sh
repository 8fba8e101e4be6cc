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
# shellcheck source=scripts/hardware-webhook.sh
. "$(dirname "$0")/hardware-webhook.sh"

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
