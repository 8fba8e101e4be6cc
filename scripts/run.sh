#!/usr/bin/env bash
# `make run`: the whole loop on this machine, narrated as it happens.
#
#   make run                  # a simulated node: no GPU needed
#   make run BACKEND=nvml     # a GPU node: the real driver
#   RUN_ONCE=1 make run       # exit 0 once the memory is back (CI smoke)
#
# It starts gpu-orphan-exporter (:9835), gpu-orphan-remediator with --act
# (:9836), Prometheus (:9090, or :19090 if busy) with the project's own
# alerts/gpu-orphan.rules.yml (in a copy whose GPUOrphanMemory time
# thresholds are shortened to seconds), and Alertmanager (:9093, or :19093)
# that sends GPUOrphanMemory to the remediator's webhook with a bearer
# token. Everything lives under .run/ (RUN_DIR). With the simulated node it
# then starts a workload whose two forked children keep its GPU memory,
# kills the workload's parent with SIGKILL, and tells what each part of the
# loop does about it. Ctrl+C stops everything it started.
#
# Environment: RUN_DIR (.run), RUN_ONCE (0), ACT (1; 0 runs the remediator
# in dry-run), NODE_NAME (this host's name), RUN_TIMEOUT (120: seconds to
# wait for the memory to come back), SIM_GPU (1), SIM_MIB (4096), BIN_DIR
# (bin), and the ports EXPORTER_PORT, REMEDIATOR_PORT, PROMETHEUS_PORT,
# ALERTMANAGER_PORT (a port that is set is used or fails, without fallback).
set -euo pipefail

BACKEND=${1:-${BACKEND:-sim}}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RUN_DIR=${RUN_DIR:-$ROOT/.run}
RUN_ONCE=${RUN_ONCE:-0}
ACT=${ACT:-1}
NODE_NAME=${NODE_NAME:-$(hostname -s 2>/dev/null || hostname)}
RUN_TIMEOUT=${RUN_TIMEOUT:-120}
SIM_GPU=${SIM_GPU:-1}
SIM_MIB=${SIM_MIB:-4096}
BIN=${BIN_DIR:-$ROOT/bin}
CONF=$ROOT/scripts/e2e-config
# The shortened thresholds of the rules' copy; the remediator's own
# minimum age must stay below the age threshold.
AGE_THRESHOLD=3
FOR_DURATION=2s

case $BACKEND in
  sim | nvml) ;;
  *) echo "run.sh: BACKEND must be sim or nvml, not '$BACKEND'" >&2; exit 2 ;;
esac

# --- output ----------------------------------------------------------------

if [ -t 1 ]; then
  B=$'\e[1m' G=$'\e[32m' Y=$'\e[33m' R=$'\e[31m' N=$'\e[0m'
else
  B='' G='' Y='' R='' N=''
fi
T0=
now() { if [ -n "${EPOCHREALTIME:-}" ]; then echo "${EPOCHREALTIME/,/.}"; else date +%s.%N; fi; }
# stamp [EPOCH]: the time since T0 (the parent's SIGKILL; on a GPU node,
# when the orphan was first seen), of now or of EPOCH.
stamp() {
  local at=${1:-$(now)}
  if [ -n "$T0" ]; then awk -v a="$at" -v b="$T0" 'BEGIN { printf "+%5.1fs", a - b }'; else printf '%7s' ''; fi
}
# epoch RFC3339: seconds since the epoch (GNU date), or now if it is empty.
epoch() { { [ -n "$1" ] && date -d "$1" +%s.%N 2>/dev/null; } || now; }
say() { printf '%s %s%-22s%s %s\n' "$(stamp)" "$B" "$1" "$N" "$2"; }
# say_at RFC3339 LABEL TEXT: say, stamped with when it happened (the
# remediator's own record) rather than when the narrator saw it.
say_at() { printf '%s %s%-22s%s %s\n' "$(stamp "$(epoch "$1")")" "$B" "$2" "$N" "$3"; }
info() { printf '%7s %s\n' '' "$*"; }
warn() { printf '%s%s%s\n' "$Y" "$*" "$N" >&2; }
die() { printf '%srun.sh: %s%s\n' "$R" "$*" "$N" >&2; exit 1; }

need() { command -v "$1" >/dev/null || die "$1 not found: $2"; }
need curl "install curl"
need awk "install awk"
PROMETHEUS=$(command -v prometheus || true)
ALERTMANAGER=$(command -v alertmanager || command -v prometheus-alertmanager || true)
[ -n "$PROMETHEUS" ] || die "prometheus not found: run scripts/deps.sh (make deps)"
[ -n "$ALERTMANAGER" ] || die "alertmanager not found: run scripts/deps.sh (make deps)"
for b in gpu-orphan-exporter gpu-orphan-remediator gpu-orphan-sim; do
  if [ ! -x "$BIN/$b" ] && [ -z "${BIN_DIR:-}" ]; then
    echo "run.sh: building (make build)"
    make -s -C "$ROOT" build >/dev/null
  fi
  [ -x "$BIN/$b" ] || die "$BIN/$b not found: run make build"
done
# JSON: jq if there is one, else python3.
if command -v jq >/dev/null; then JSON=jq
elif command -v python3 >/dev/null; then JSON=python3
else die "neither jq nor python3 found: install one of them to read the JSON APIs"; fi

# --- ports -----------------------------------------------------------------

busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
# port NAME DEFAULT FALLBACK: the port to use, or an error.
port() {
  local p
  for p in "$2" ${3:+"$3"}; do
    if ! busy "$p"; then echo "$p"; return; fi
  done
  die "$1: port ${2}${3:+ and $3} in use (another gpu-orphan, or a make run still running?): ss -ltnp 'sport = :$2'"
}
EXP_PORT=$(port exporter "${EXPORTER_PORT:-9835}")
REM_PORT=$(port remediator "${REMEDIATOR_PORT:-9836}")
if [ -n "${PROMETHEUS_PORT:-}" ]; then PROM_PORT=$(port Prometheus "$PROMETHEUS_PORT")
else PROM_PORT=$(port Prometheus 9090 19090); fi
if [ -n "${ALERTMANAGER_PORT:-}" ]; then AM_PORT=$(port Alertmanager "$ALERTMANAGER_PORT")
else AM_PORT=$(port Alertmanager 9093 19093); fi
EXPORTER=127.0.0.1:$EXP_PORT
REMEDIATOR=127.0.0.1:$REM_PORT
PROM=127.0.0.1:$PROM_PORT
AM=127.0.0.1:$AM_PORT

# --- processes -------------------------------------------------------------

mkdir -p "$RUN_DIR"
LOCK=$RUN_DIR/run.pid
other=$(cat "$LOCK" 2>/dev/null || true)
if [ -n "$other" ] && grep -qs run.sh "/proc/$other/cmdline"; then
  die "another make run (pid $other) uses $RUN_DIR"
fi
echo $$ >"$LOCK"

# Each daemon runs in its own session, so Ctrl+C reaches only this script,
# which then stops them in order; setpriv's parent-death signal kills them
# even if this script is killed with SIGKILL.
PDEATH=()
if command -v setpriv >/dev/null && setpriv --pdeathsig KILL true 2>/dev/null; then
  PDEATH=(setpriv --pdeathsig KILL --)
fi
DAEMONS=() # "name pid", in start order
WORKLOAD_PGID=
CHILDREN=()

start() { # name logfile cmd...
  local name=$1 log=$2
  shift 2
  setsid ${PDEATH[@]+"${PDEATH[@]}"} "$@" >"$log" 2>&1 </dev/null &
  DAEMONS+=("$name $!")
}

stopped=0
cleanup() {
  local rc=$?
  [ "$stopped" = 1 ] && return
  stopped=1
  trap '' INT TERM
  echo
  if [ -n "$WORKLOAD_PGID" ]; then
    kill -KILL -- "-$WORKLOAD_PGID" 2>/dev/null || true
    for c in ${CHILDREN[@]+"${CHILDREN[@]}"}; do kill -KILL "$c" 2>/dev/null || true; done
  fi
  local i name pid
  for ((i = ${#DAEMONS[@]} - 1; i >= 0; i--)); do
    read -r name pid <<<"${DAEMONS[$i]}"
    kill -TERM -- "-$pid" 2>/dev/null || true
  done
  for ((i = ${#DAEMONS[@]} - 1; i >= 0; i--)); do
    read -r name pid <<<"${DAEMONS[$i]}"
    local n=0
    while kill -0 "$pid" 2>/dev/null && [ $n -lt 100 ]; do sleep 0.1; n=$((n + 1)); done
    if kill -0 "$pid" 2>/dev/null; then
      warn "$name (pid $pid) did not stop within 10s of SIGTERM: killing it"
      kill -KILL -- "-$pid" 2>/dev/null || true
    fi
    { wait "$pid"; } 2>/dev/null || true
    kill -KILL -- "-$pid" 2>/dev/null || true # anything left in its group
    info "stopped $name (pid $pid)"
  done
  rm -f "$LOCK"
  [ ${#DAEMONS[@]} -gt 0 ] && info "logs are in $RUN_DIR/logs"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Fresh state for each run; the logs of the previous one are replaced.
rm -rf "$RUN_DIR/node" "$RUN_DIR/prometheus-data" "$RUN_DIR/alertmanager-data" "$RUN_DIR/logs" \
  "$RUN_DIR"/remediator.db*
mkdir -p "$RUN_DIR/logs"
LOGS=$RUN_DIR/logs

TOKEN_FILE=$RUN_DIR/token
(umask 077 && od -An -N24 -tx1 /dev/urandom | tr -d ' \n' >"$TOKEN_FILE")
TOKEN=$(cat "$TOKEN_FILE")

awk -v age=$AGE_THRESHOLD -v for_=$FOR_DURATION -f "$CONF/shorten-rules.awk" \
  "$ROOT/alerts/gpu-orphan.rules.yml" >"$RUN_DIR/gpu-orphan.rules.yml"
fill() { # template destination: replaces @KEY@ placeholders
  sed -e "s|@RULES@|$RUN_DIR/gpu-orphan.rules.yml|g" -e "s|@ALERTMANAGER@|$AM|g" \
    -e "s|@EXPORTER@|$EXPORTER|g" -e "s|@REMEDIATOR@|$REMEDIATOR|g" -e "s|@NODE@|$NODE_NAME|g" \
    -e "s|@TOKEN_FILE@|$TOKEN_FILE|g" "$CONF/$1" >"$2"
  if grep -q '@[A-Z_]*@' "$2"; then die "$2: a placeholder is left"; fi
}
fill prometheus.yml.tmpl "$RUN_DIR/prometheus.yml"
fill alertmanager.yml.tmpl "$RUN_DIR/alertmanager.yml"

SOURCE=(--backend=nvml)
if [ "$BACKEND" = sim ]; then
  "$BIN/gpu-orphan-sim" init --root "$RUN_DIR/node" --gpus 2 >/dev/null
  SOURCE=(--backend=sim "--sim.root=$RUN_DIR/node")
fi
ACT_FLAG=(--act)
[ "$ACT" = 1 ] || ACT_FLAG=()

echo "${B}gpu-orphan: the whole loop on node '$NODE_NAME' ($BACKEND backend)${N}"
info "configs, token, logs and data: $RUN_DIR"
start gpu-orphan-exporter "$LOGS/exporter.log" "$BIN/gpu-orphan-exporter" "${SOURCE[@]}" \
  --web.listen-address=$EXPORTER --collector.interval=500ms
start gpu-orphan-remediator "$LOGS/remediator.log" "$BIN/gpu-orphan-remediator" --role=node ${ACT_FLAG[@]+"${ACT_FLAG[@]}"} \
  "--node.name=$NODE_NAME" "${SOURCE[@]}" "--auth.token-file=$TOKEN_FILE" \
  "--store.path=$RUN_DIR/remediator.db" --web.listen-address=$REMEDIATOR --collector.interval=500ms \
  --remediate.min-age=2s --remediate.grace=2s --remediate.verify-timeout=15s
start alertmanager "$LOGS/alertmanager.log" "$ALERTMANAGER" "--config.file=$RUN_DIR/alertmanager.yml" \
  "--storage.path=$RUN_DIR/alertmanager-data" --web.listen-address=$AM --cluster.listen-address= \
  "--web.external-url=http://$AM"
start prometheus "$LOGS/prometheus.log" "$PROMETHEUS" "--config.file=$RUN_DIR/prometheus.yml" \
  "--storage.tsdb.path=$RUN_DIR/prometheus-data" --web.listen-address=$PROM "--web.external-url=http://$PROM"

alive_or_die() {
  local name pid
  for d in ${DAEMONS[@]+"${DAEMONS[@]}"}; do
    read -r name pid <<<"$d"
    if ! kill -0 "$pid" 2>/dev/null; then
      warn "$name exited; the end of its log:"
      tail -n 20 "$LOGS/${name#gpu-orphan-}.log" >&2 || true
      exit 1
    fi
  done
}
wait_http() { # url what
  local n=0
  until curl -fsS -o /dev/null --max-time 2 "$1" 2>/dev/null; do
    alive_or_die
    n=$((n + 1))
    [ $n -lt 300 ] || die "$2 did not answer $1 within 30s"
    sleep 0.1
  done
}
wait_http "http://$EXPORTER/metrics" "the exporter"
wait_http "http://$REMEDIATOR/-/ready" "the remediator"
wait_http "http://$AM/-/ready" "Alertmanager"
wait_http "http://$PROM/-/ready" "Prometheus"

echo
echo "${B}Running${N} (Ctrl+C stops everything):"
info "exporter      http://$EXPORTER/metrics"
mode="acts (--act)"
[ "$ACT" = 1 ] || mode="dry run (ACT=0)"
info "remediator    http://$REMEDIATOR/   $mode"
# Debian's Prometheus serves only its classic UI, and Debian's Alertmanager
# none at all.
ui=""
[ "$(curl -s -o /dev/null -w '%{http_code}' "http://$PROM/alerts")" = 200 ] || ui=/classic
info "Prometheus    http://$PROM$ui/alerts   http://$PROM$ui/graph?g0.expr=gpu_orphan_unowned_memory_bytes"
if curl -s "http://$AM/" | grep -q 'does not include a web'; then
  info "Alertmanager  http://$AM/api/v2/alerts   (no web UI in this package; or: amtool --alertmanager.url=http://$AM alert query)"
else
  info "Alertmanager  http://$AM/#/alerts"
fi
info "actions       curl -sH \"Authorization: Bearer \$(cat $TOKEN_FILE)\" http://$REMEDIATOR/api/v1/actions"
info "rules         $RUN_DIR/gpu-orphan.rules.yml: GPUOrphanMemory after ${AGE_THRESHOLD}s with no live owner, for: $FOR_DURATION"
echo

# --- reading the APIs --------------------------------------------------------

# metric NAME GPU: the value of a per-GPU metric in the exporter's scrape.
scrape() { curl -fsS --max-time 2 "http://$EXPORTER/metrics" 2>/dev/null || true; }
metric() { awk -v n="$1" -v g="gpu=\"$2\"" 'index($1, n "{") == 1 && index($1, g) { print $2; exit }'; }
mib() { awk -v b="${1:-0}" 'BEGIN { printf "%d", b / 1048576 }'; }

# GPUOrphanMemory for GPU $1 in Prometheus: "STATE ACTIVE_AT" (pending or
# firing, and when it became pending), or nothing.
alert_state() {
  local body
  body=$(curl -fsS --max-time 2 "http://$PROM/api/v1/alerts" 2>/dev/null) || return 0
  case $JSON in
    jq) jq -r --arg g "$1" 'first(.data.alerts[] | select(.labels.alertname == "GPUOrphanMemory" and .labels.gpu == $g)
      | "\(.state) \(.activeAt)") // empty' <<<"$body" ;;
    python3) python3 -c '
import json, sys
for a in json.load(sys.stdin)["data"]["alerts"]:
    if a["labels"].get("alertname") == "GPUOrphanMemory" and a["labels"].get("gpu") == sys.argv[1]:
        print(a["state"], a["activeAt"]); break' "$1" <<<"$body" ;;
  esac
}

# GPUOrphanMemory for GPU $1 in Alertmanager: "STARTS_AT RECEIVERS", or
# nothing. Prometheus sets startsAt to when the alert fired.
am_alert() {
  local body
  body=$(curl -fsS --max-time 2 "http://$AM/api/v2/alerts" 2>/dev/null) || return 0
  case $JSON in
    jq) jq -r --arg g "$1" 'first(.[] | select(.labels.alertname == "GPUOrphanMemory" and .labels.gpu == $g)
      | "\(.startsAt) \([.receivers[].name] | join(","))") // empty' <<<"$body" ;;
    python3) python3 -c '
import json, sys
for a in json.load(sys.stdin):
    if a["labels"].get("alertname") == "GPUOrphanMemory" and a["labels"].get("gpu") == sys.argv[1]:
        print(a["startsAt"], ",".join(r["name"] for r in a["receivers"])); break' "$1" <<<"$body" ;;
  esac
}

api() { curl -fsS --max-time 2 -H "Authorization: Bearer $TOKEN" "http://$REMEDIATOR$1" 2>/dev/null; }

# The newest action for GPU index $1: "ID STATE STARTED_AT".
latest_action() {
  local body
  body=$(api "/api/v1/actions?limit=20") || return 0
  case $JSON in
    jq) jq -r --argjson g "$1" '[.[] | select(.gpu_index == $g)][0] // empty | "\(.id) \(.state) \(.started_at)"' <<<"$body" ;;
    python3) python3 -c '
import json, sys
for a in json.load(sys.stdin):
    if a["gpu_index"] == int(sys.argv[1]):
        print(a["id"], a["state"], a["started_at"]); break' "$1" <<<"$body" ;;
  esac
}

# One action with its events, as tab-separated lines:
#   state STATE REASON          plan PID COMM REASON WHOLE_GROUP PGID
#   event KIND AT               signal AT PID SIGNAL
#   outcome PID OUTCOME SIGNALS
#   result FREED_BYTES VERIFY_SECONDS BEFORE_USED AFTER_USED NEXT_STEP
action_lines() {
  local body
  body=$(api "/api/v1/actions/$1") || return 0
  case $JSON in
    jq) jq -r '
      ["state", .state, (.reason // "")],
      (.targets[]? | ["plan", .pid, .comm, .reason, .whole_group, .pgid]),
      (.events[]? | ["event", .kind, .at]),
      (.events[]? | select(.kind == "signal") | ["signal", .at, .detail.pid, .detail.signal]),
      (.targets[]? | select(.outcome) | ["outcome", .pid, .outcome, ((.signals // []) | join(","))]),
      ["result", .freed_bytes, (.verify_seconds // 0), (.before.used_bytes // 0), (.after.used_bytes // 0), (.next_step // "")]
      | map(tostring) | join("\t")' <<<"$body" ;;
    python3) python3 -c '
import json, sys
a = json.load(sys.stdin)
rows = [["state", a["state"], a.get("reason", "")]]
rows += [["plan", t["pid"], t["comm"], t["reason"], str(t["whole_group"]).lower(), t["pgid"]] for t in a.get("targets") or []]
rows += [["event", e["kind"], e["at"]] for e in a.get("events") or []]
rows += [["signal", e["at"], e["detail"]["pid"], e["detail"]["signal"]] for e in a.get("events") or [] if e["kind"] == "signal"]
rows += [["outcome", t["pid"], t["outcome"], ",".join(t.get("signals") or [])] for t in a.get("targets") or [] if t.get("outcome")]
rows.append(["result", a["freed_bytes"], a.get("verify_seconds", 0), (a.get("before") or {}).get("used_bytes", 0),
             (a.get("after") or {}).get("used_bytes", 0), a.get("next_step", "")])
for r in rows:
    print("\t".join(map(str, r)))' <<<"$body" ;;
  esac
}

# --- the workload ------------------------------------------------------------

if [ "$BACKEND" = sim ]; then
  say "workload" "gpu-orphan-sim run --gpu $SIM_GPU --mib $SIM_MIB --children 2 (its own session, like a scheduler's job)"
  setsid ${PDEATH[@]+"${PDEATH[@]}"} "$BIN/gpu-orphan-sim" run --root "$RUN_DIR/node" --gpu "$SIM_GPU" --mib "$SIM_MIB" \
    --children 2 >"$LOGS/workload.out" 2>"$LOGS/workload.log" </dev/null &
  OWNER=$!
  WORKLOAD_PGID=$OWNER
  n=0
  until grep -q '^ready' "$LOGS/workload.out" 2>/dev/null; do
    kill -0 "$OWNER" 2>/dev/null || die "the workload exited: $(cat "$LOGS/workload.log")"
    n=$((n + 1)); [ $n -lt 100 ] || die "the workload did not get ready within 10s"
    sleep 0.1
  done
  read -r _ OWNER CHILDREN_LINE <"$LOGS/workload.out"
  read -r -a CHILDREN <<<"$CHILDREN_LINE"
  info "parent $OWNER allocated $SIM_MIB MiB on GPU $SIM_GPU and forked ${CHILDREN[*]}, which inherited its context"
  sleep 1.5 # let the exporter see the live owner first
  T0=$(now)
  kill -KILL "$OWNER"
  { wait "$OWNER"; } 2>/dev/null || true
  say "kill -9 $OWNER" "the parent is dead; its children ${CHILDREN[*]} still hold its GPU memory"
else
  warn "The remediator runs with --act on this GPU node: it kills processes that hold GPU memory whose"
  warn "creator is dead (policy dead-owner). ACT=0 makes it a dry run."
  info "Make an orphan on a GPU (PyTorch needed), then kill its parent:"
  info "  python3 shared/gpu/fork_orphan.py --gib 6 --children 2 --device 0 &   # prints: ready PARENT CHILD..."
  info "  kill -9 PARENT"
  info "Waiting for GPU memory with no live owner (> 1 GiB); the times below count from when it is seen."
fi

# --- the narrator --------------------------------------------------------------
#
# One stage after the other: detected (the exporter), alert pending and
# firing (Prometheus, Alertmanager), notification received, plan, signals
# and memory back (the remediator's actions). Each line is stamped with
# when it happened by the source's own clock where it has one (the alert's
# activeAt and startsAt, the action's events), else when it was seen.

GPU=
[ "$BACKEND" = sim ] && GPU=$SIM_GPU
stage=detect action= 
# A deadline for the simulated loop, and for RUN_ONCE=1 on a GPU node.
deadline=
if [ "$BACKEND" = sim ] || [ "$RUN_ONCE" = 1 ]; then deadline=$(($(date +%s) + RUN_TIMEOUT)); fi
declare -A printed=()

while [ "$stage" != done ]; do
  alive_or_die
  if [ -n "$deadline" ] && [ "$(date +%s)" -gt "$deadline" ]; then
    warn "the loop did not finish within ${RUN_TIMEOUT}s (stuck at: $stage); the logs are in $LOGS"
    [ "$RUN_ONCE" = 1 ] && exit 1
    deadline=
  fi

  if [ "$stage" = detect ]; then
    body=$(scrape)
    if [ -z "$GPU" ]; then # nvml: the first GPU with > 1 GiB and no live owner
      GPU=$(awk 'index($1, "gpu_orphan_unowned_memory_bytes{") == 1 && $2 > 1073741824 {
        match($1, /gpu="[^"]*"/); print substr($1, RSTART + 5, RLENGTH - 6); exit }' <<<"$body")
    fi
    if [ -n "$GPU" ]; then
      unowned=$(metric gpu_orphan_unowned_memory_bytes "$GPU" <<<"$body")
      if awk -v u="${unowned:-0}" 'BEGIN { exit !(u > 1073741824) }'; then
        dead=$(awk -v g="gpu=\"$GPU\"" 'index($1, "gpu_orphan_process_memory_bytes{") == 1 && index($1, g) && index($1, "alive=\"false\"") {
          match($1, /pid="[^"]*"/); printf "%s%s", sep, substr($1, RSTART + 5, RLENGTH - 6); sep = " " }' <<<"$body")
        holders=$(awk -v g="gpu=\"$GPU\"" 'index($1, "gpu_orphan_holder_info{") == 1 && index($1, g) {
          match($1, /pid="[^"]*"/); p = substr($1, RSTART + 5, RLENGTH - 6)
          match($1, /comm="[^"]*"/); c = substr($1, RSTART + 6, RLENGTH - 7)
          match($1, /reason="[^"]*"/); r = substr($1, RSTART + 8, RLENGTH - 9)
          printf "%s%s (%s, %s)", sep, p, c, r; sep = ", " }' <<<"$body")
        [ -n "$T0" ] || T0=$(now) # a GPU node: the times count from here
        say "detected" "exporter: GPU $GPU has $(mib "$unowned") MiB with no live owner; NVML still names dead PID ${dead:-?}"
        info "suspect holders: ${holders:-none yet}"
        stage=pending
      fi
    fi
  fi

  if [ "$stage" = pending ]; then
    read -r state active <<<"$(alert_state "$GPU")" || true
    if [ -n "${state:-}" ]; then
      say_at "$active" "alert pending" "Prometheus: GPUOrphanMemory{node=\"$NODE_NAME\",gpu=\"$GPU\"} (age > ${AGE_THRESHOLD}s; fires after $FOR_DURATION)"
      stage=firing
    fi
  fi

  if [ "$stage" = firing ]; then
    read -r starts receivers <<<"$(am_alert "$GPU")" || true
    if [ -n "${starts:-}" ]; then
      say_at "$starts" "alert firing" "Prometheus sent it to Alertmanager, which routes it to: ${receivers:-?}"
      stage=notified
    fi
  fi

  if [ "$stage" = notified ]; then
    line=$(latest_action "$GPU")
    if [ -n "$line" ]; then
      read -r action _ started <<<"$line"
      say_at "$started" "notification received" "remediator: the webhook delivered the alert; action $action"
      info "details: curl -sH \"Authorization: Bearer \$(cat $TOKEN_FILE)\" http://$REMEDIATOR/api/v1/actions/$action"
      stage=plan
    fi
  fi

  if [ "$stage" = plan ] || [ "$stage" = acting ]; then
    lines=$(action_lines "$action")
    state=$(awk -F'\t' '$1 == "state" { print $2 }' <<<"$lines")
    if [ "$stage" = plan ] && grep -q '^plan' <<<"$lines"; then
      say_at "$(awk -F'\t' '$1 == "event" && $2 == "plan" { print $3; exit }' <<<"$lines")" \
        "plan" "policy dead-owner, from a fresh snapshot:"
      while IFS=$'\t' read -r _ pid comm reason whole pgid; do
        group=""
        [ "$whole" = true ] && group=", with its whole process group $pgid"
        info "kill $pid ($comm): $reason$group"
      done < <(grep '^plan' <<<"$lines")
      stage=acting
    fi
    if [ "$stage" = acting ]; then
      while IFS=$'\t' read -r _ at pid sig; do
        [ -n "${printed["$pid $sig $at"]:-}" ] && continue
        printed["$pid $sig $at"]=1
        say_at "$at" "signal" "$sig → $pid"
      done < <(grep '^signal' <<<"$lines" || true)
    fi
    case $state in
      succeeded | failed | skipped | dry_run | interrupted)
        while IFS=$'\t' read -r _ pid outcome sigs; do
          info "$pid: $outcome${sigs:+ (${sigs//,/, })}"
        done < <(grep '^outcome' <<<"$lines" || true)
        IFS=$'\t' read -r _ freed verify before after next < <(grep '^result' <<<"$lines") || true
        reason=$(awk -F'\t' '$1 == "state" { print $3 }' <<<"$lines")
        if [ "$state" = succeeded ]; then
          now_used=$(scrape | metric gpu_orphan_memory_used_bytes "$GPU")
          say_at "$(awk -F'\t' '$1 == "event" && $2 == "verify" { print $3; exit }' <<<"$lines")" \
            "memory back" "${G}freed $(mib "$freed") MiB${N}, verified $(awk -v v="$verify" 'BEGIN { printf "%.2f", v }') s after the first signal ($(mib "$before") → $(mib "$after") MiB used; exporter now: $(mib "$now_used") MiB)"
        elif [ "$state" = dry_run ]; then
          say "dry run" "the plan is recorded, nothing was signalled (ACT=0); the memory stays"
        else
          say "action $state" "${R}${reason}${N}${next:+ — next step: $next}"
          [ "$RUN_ONCE" = 1 ] && exit 1
        fi
        stage=done
        ;;
    esac
  fi
  [ "$stage" = done ] || sleep 0.5
done

if [ "$RUN_ONCE" = 1 ]; then
  info "RUN_ONCE=1: stopping."
  exit 0
fi
echo
echo "${B}The loop is done; the stack keeps running.${N} Look around (the addresses above), then Ctrl+C to stop."
if [ "$BACKEND" = sim ]; then
  info "Another orphan (GPU 0; GPU $GPU has a 10m cooldown), from another terminal:"
  info "  $BIN/gpu-orphan-sim run --root $RUN_DIR/node --gpu 0 --mib 2048 --children 2 & sleep 1; kill -9 \$!"
fi
while :; do
  alive_or_die
  sleep 1
done
