#!/usr/bin/env bash
# Issue 17 on a real GPU node with PyTorch: the real `gpu-orphan epilog` and
# `gpu-orphan prolog`, run as slurmd runs them (as root, from a session of
# their own, with the job in an environment of Slurm's: SLURM_JOB_ID,
# SLURM_JOB_UID, SLURM_JOB_GPUS, SLURMD_NODENAME, and no PATH), on jobs whose
# cgroups are made by hand where slurmd's proctrack/cgroup puts them (cgroup
# v1: freezer:/slurm_<node>/uid_0/job_<id>/step_batch; v2:
# /system.slice/slurmstepd.scope/job_<id>/step_batch/user/task_0).
#
# A job's batch script (a session leader, as slurmstepd starts it) runs
# scripts/gpu/safety_workloads.py fork (4 GiB, two forked workers that
# inherit the CUDA descriptors); the trainer is killed with -9, the workers
# keep its context. The trainer led no process group, so nothing but the
# job's cgroup proves whose the workers are. Another job's healthy trainer,
# with a worker, runs on the same GPU. Then:
#   1. the epilog of a third job, given the same GPU: it must signal
#      nothing (exit 1: the GPU holds memory with no owner);
#   2. the epilog of the job: it signals the job's workers only; exit 0.
#      Timed from its start to the memory back: NVML polled every 10 ms,
#      and the action's record;
#   3. the prolog of the next job on that GPU: clean, exit 0; the healthy
#      job's trainer and worker alive.
# The actions go to OUT_DIR/hardware-epilog-actions.json, the log to
# OUT_DIR/hardware-epilog.log.
#
# Usage: scripts/hardware-epilog.sh BIN_DIR OUT_DIR   (as root; GPU=N for
# another GPU than 0; BACKEND=sim runs the same on a simulated node, with
# gpu-orphan-sim's workloads instead of PyTorch, to check the script on a
# machine without a GPU)
set -uo pipefail
bin=$(cd "$1" && pwd) out=$2
gpu=${GPU:-0} backend=${BACKEND:-nvml}
dir="$(cd "$(dirname "$0")" && pwd)"
py="$dir/gpu/safety_workloads.py"
mkdir -p "$out"
out=$(cd "$out" && pwd)
exec > >(tee "$out/hardware-epilog.log") 2>&1
# shellcheck source=scripts/hardware-lib.sh
. "$dir/hardware-lib.sh"
[ "$(id -u)" -eq 0 ] || { echo "run it as root, as slurmd runs the epilog"; exit 2; }

db="$out/remediator.db"; rm -f "$db" "$db-wal" "$db-shm"
node=$(hostname -s)
base=$((800000 + RANDOM)); job=$base other=$((base + 1)) third=$((base + 2)) next=$((base + 3))
cli=("$bin/gpu-orphan" --backend="$backend")
if [ "$backend" = sim ]; then
  root="$out/node"; rm -rf "$root"
  "$bin/gpu-orphan-sim" init --root "$root" --gpus 2 >/dev/null
  cli+=(--sim.root="$root")
fi

used_mib() { # the GPU's used memory, as NVML (or the simulator) says
  if [ "$backend" = sim ]; then
    "$bin/gpu-orphan-sim" status --root "$root" | awk -v g="GPU $gpu" '$0 ~ "^"g" " {f=1} f && /used/ {sub(",", "", $8); print $8; exit}'
  else
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i "$gpu"
  fi
}
workload() { # GIB CHILDREN: the job's GPU process, in the foreground
  if [ "$backend" = sim ]; then
    exec "$bin/gpu-orphan-sim" run --root "$root" --gpu "$gpu" --mib $(($1 * 1024)) --children "$2"
  else
    exec python3 "$py" fork --gib "$1" --children "$2" --device "$gpu"
  fi
}
cgroup_of() { # JOB: the job's batch step cgroup, as slurmd makes it
  if [ -d /sys/fs/cgroup/freezer ]; then
    echo "/sys/fs/cgroup/freezer/slurm_$node/uid_0/job_$1/step_batch"
  elif [ -f /sys/fs/cgroup/cgroup.controllers ]; then
    echo "/sys/fs/cgroup/system.slice/slurmstepd.scope/job_$1/step_batch/user/task_0"
  else
    echo "/sys/fs/cgroup/unified/system.slice/slurmstepd.scope/job_$1/step_batch/user/task_0"
  fi
}
cgroups=()
remove_cgroups() {
  for c in "${cgroups[@]}"; do
    d=$c
    while [ "$d" != /sys/fs/cgroup ] && [ "${d#/sys/fs/cgroup/}" != "$d" ] && rmdir "$d" 2>/dev/null; do d=$(dirname "$d"); done
  done
}
trap 'kill_started; sleep 0.5; remove_cgroups' EXIT
start_job() { # JOB GIB CHILDREN OUTFILE: a batch script in the job's cgroup, leading its session, runs the workload
  local cg; cg=$(cgroup_of "$1")
  mkdir -p "$cg" || { echo "cannot make the job's cgroup $cg"; exit 1; }
  cgroups+=("$cg")
  export -f workload; export bin root gpu backend py
  setsid bash -c 'echo $$ > "'"$cg"'/cgroup.procs"; ( workload '"$2 $3"' ) & wait' > "$4" 2>&1 &
  pids+=($!)
}
ready() { # FILE: wait for the "ready ..." line and print it
  for _ in $(seq 1 600); do grep -m1 '^ready' "$1" 2>/dev/null && return; sleep 0.1; done
  echo "no ready line in $1" >&2; cat "$1" >&2; return 1
}
alive() { # WHAT PID...
  local what=$1; shift
  for p in "$@"; do
    if [ -d /proc/$p ] && [ "$(awk '{print $3}' /proc/$p/stat)" != Z ]; then echo "  alive: $what $p"; else echo "  GONE: $what $p"; fi
  done
}
hook() { # HOOK JOB: run it as slurmd does; prints its line and exit status
  env -i SLURM_JOB_ID="$2" SLURM_JOB_UID=0 SLURM_JOB_GPUS="$gpu" SLURMD_NODENAME="$node" SLURM_SCRIPT_CONTEXT="$1_slurmd" \
    setsid -w "${cli[@]}" "$1" --store.path="$db" --log.syslog-socket=
  echo "  exit status $?"
}

section "machine"
if [ "$backend" = nvml ]; then nvidia-smi -L; nvidia-smi --query-gpu=driver_version --format=csv,noheader; fi
uname -r; nproc; echo "a job's cgroup: $(cgroup_of ID)"
idle=$(used_mib); echo "GPU $gpu used before: $idle MiB"

section "job $other: a healthy trainer (2 GiB) and its worker, on GPU $gpu"
start_job "$other" 2 1 "$out/healthy.out"
read -r _ htr hc < <(ready "$out/healthy.out")
echo "trainer $htr, worker $hc, in $(grep -E 'freezer|^0::' /proc/$htr/cgroup | tr '\n' ' ')"

section "job $job: a trainer (4 GiB) with 2 forked workers; the trainer is killed -9"
start_job "$job" 4 2 "$out/job.out"
read -r _ tr c1 c2 < <(ready "$out/job.out")
echo "trainer $tr (pgid $(awk '{print $5}' /proc/$tr/stat), sid $(awk '{print $6}' /proc/$tr/stat)), workers $c1 $c2"
kill -9 "$tr"; sleep 1
echo "GPU $gpu used: $(used_mib) MiB"
"${cli[@]}" ps --exporter.url= | sed -n '1,12p'

section "1. the epilog of job $third, given GPU $gpu: nothing of it holds the GPU"
hook epilog "$third"
alive "job $job's worker" "$c1" "$c2"; alive "job $other's" "$htr" "$hc"

section "2. the epilog of job $job"
before=$(used_mib)
( t0=$(date +%s.%N)
  while :; do u=$(used_mib); [ "$u" -le $((before - 4000)) ] && break; sleep 0.01; done
  t1=$(date +%s.%N); python3 -c "print('memory back (%s -> %s MiB) %.3f s after the epilog started, as polled' % ($before, $u, $t1 - $t0))" ) &
poller=$!
hook epilog "$job"
wait "$poller"
alive "job $job's worker" "$c1" "$c2"; alive "job $other's" "$htr" "$hc"
echo "GPU $gpu used: $(used_mib) MiB"

section "3. the prolog of job $next on GPU $gpu"
hook prolog "$next"
alive "job $other's" "$htr" "$hc"

section "the record"
python3 - "$db" "$out/hardware-epilog-actions.json" <<'PY'
import json, sqlite3, sys
from datetime import datetime
db, path = sys.argv[1], sys.argv[2]
c = sqlite3.connect(db)
c.row_factory = sqlite3.Row
rows = [dict(r) for r in c.execute("SELECT * FROM actions ORDER BY started_at")]
events = {r["id"]: [dict(e) for e in c.execute("SELECT at, kind, detail FROM events WHERE action_id = ? ORDER BY id", (r["id"],))] for r in rows}
json.dump({"actions": rows, "events": events}, open(path, "w"), indent=1, default=str)
t = lambda s: datetime.fromisoformat(s.replace("Z", "+00:00"))
for r in rows:
    job = next((json.loads(e["detail"])["job_id"] for e in events[r["id"]] if e["kind"] == "slurm_job"), "?")
    print("action", r["id"], "source", r["source"], "job", job, "policy", r["policy"], "state", r["state"], "freed MiB", r["freed_bytes"] >> 20, r["reason"])
    for tg in json.loads(r["targets_json"] or "null") or []:
        print("  target", tg["pid"], tg["comm"], tg["reason"], tg.get("signals"), tg.get("outcome"))
    after = json.loads(r["after_json"] or "null")
    if after and r["source"] == "epilog" and r["state"] == "succeeded":
        print("  from the epilog's start to the memory back, as recorded: %.3f s; from the first signal: %.3f s"
              % ((t(after["at"]) - t(r["started_at"])).total_seconds(), r["verify_seconds"]))
PY
