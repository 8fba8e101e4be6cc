#!/usr/bin/env bash
# Runs one step of `make test` and says what it is doing while it is
# silent: "== LABEL (started HH:MM:SS)" first, then the command's output,
# and after each PROGRESS_QUIET seconds (30) without any, a line that says
# what runs under it: the packages go test is testing (a test binary runs
# in its package's directory), the packages being compiled, a link, go
# vet, golangci-lint, apt-get. Last, "== LABEL: done in 2m05s" (or
# "failed").
#
# Usage: scripts/progress.sh [-p] LABEL COMMAND [ARG...]
#   The command's standard error is merged into standard output, in order.
#   -p: the command's output passes untouched (tools.sh prints the tools'
#   directory on its standard output, for make to read); this script's
#   lines go to standard error, the progress line every PROGRESS_QUIET
#   seconds.
set -uo pipefail
passthrough=
if [ "${1:-}" = -p ]; then
  passthrough=1
  shift
fi
if [ $# -lt 2 ]; then
  echo "usage: $0 [-p] LABEL COMMAND [ARG...]" >&2
  exit 2
fi
label=$1
shift
quiet=${PROGRESS_QUIET:-30}
root=$(cd "$(dirname "$0")/.." && pwd)
self=$$

# dur SECONDS: 45s, 2m05s.
dur() {
  if (($1 < 60)); then printf '%ds' "$1"; else printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); fi
}

# doing: what the processes under this script are doing, in one line.
doing() {
  local pid etime args what=() testing=() compiling=() others=() seen=" " first cwd rel
  while read -r pid etime args; do
    first=${args%% *}
    case $first in
    *.test)
      # A test binary in its package's directory; helpers that a test
      # starts from its own binary run elsewhere, or under it.
      cwd=$(readlink "/proc/$pid/cwd" 2>/dev/null) || continue
      case $cwd in "$root" | "$root"/*) ;; *) continue ;; esac
      rel=.${cwd#"$root"}
      case $seen in *" $rel "*) continue ;; esac
      seen+="$rel "
      testing+=("$rel ($(dur "$etime"))")
      ;;
    */compile | compile)
      local a p=
      for a in $args; do
        if [ "$p" = -p ]; then compiling+=("$a"); break; fi
        p=$a
      done
      ;;
    */link | link) what+=("linking a binary") ;;
    */vet | vet) what+=("go vet") ;;
    */golangci-lint | golangci-lint) what+=("golangci-lint (${args#* })") ;;
    */apt-get | apt-get | */dpkg | dpkg) what+=("${first##*/} (Debian packages)") ;;
    */cc1 | cc1 | */gcc | gcc) what+=("gcc (cgo)") ;;
    # This script's own, and the shells and go commands around the rest.
    ps | awk | sort | readlink | date | sleep | */bash | bash | */sh | sh | go | */go | make | */make) ;;
    *) others+=("${first##*/}") ;;
    esac
  done < <(ps -e -o pid=,ppid=,etimes=,args= 2>/dev/null | awk -v root="$self" '
    { pid = $1; parent[pid] = $2; et[pid] = $3; $1 = $2 = $3 = ""; args[pid] = substr($0, 4) }
    END {
      for (p in parent) {
        q = parent[p]
        while (q in parent && q != root && q > 1) q = parent[q]
        if (q == root) print p, et[p], args[p]
      }
    }' | sort -n)
  if ((${#testing[@]})); then what+=("testing ${testing[*]}"); fi
  if ((${#compiling[@]})); then
    local n=${#compiling[@]} list=("${compiling[@]:0:3}")
    ((n > 3)) && list+=("and $((n - 3)) more")
    what+=("compiling ${list[*]}")
  fi
  # What else runs, when nothing above does.
  if ((${#what[@]} == 0 && ${#others[@]})); then
    what+=("running ${others[*]:0:5}")
  fi
  # Deduplicated, in order.
  local out="" w
  for w in "${what[@]}"; do
    case "; $out; " in *"; $w; "*) ;; *) out+="${out:+; }$w" ;; esac
  done
  printf '%s' "${out:-waiting}"
}

# beat [SILENT]: the progress line.
beat() {
  local silent=
  [ -n "${1:-}" ] && silent=", nothing printed for $(dur "$1")"
  printf '== %s %s: %s in%s; %s\n' "$(date +%H:%M:%S)" "$label" \
    "$(dur $((SECONDS - start)))" "$silent" "$(doing)"
}

# say: this script's own lines, to standard error with -p.
say() {
  if [ -n "$passthrough" ]; then printf "$@" >&2; else printf "$@"; fi
}

start=$SECONDS
say '== %s (started %s)\n' "$label" "$(date +%H:%M:%S)"

if [ -n "$passthrough" ]; then
  (
    # sleep's descriptors are not the terminal's: a sleep outliving this
    # script must not keep a pipe that make's output goes into open.
    while sleep "$quiet" </dev/null >/dev/null 2>&1; do
      kill -0 "$self" 2>/dev/null || exit 0
      beat >&2
    done
  ) &
  beater=$!
  "$@"
  rc=$?
  kill "$beater" 2>/dev/null
  wait "$beater" 2>/dev/null
else
  # relay copies the command's output line by line, and speaks when it
  # has been silent for quiet seconds (a partial line counts as output).
  relay() {
    local line said=$SECONDS beaten=$SECONDS r
    while :; do
      IFS= read -r -t 2 line
      r=$?
      if ((r == 0)); then
        printf '%s\n' "$line"
        said=$SECONDS
      elif ((r > 128)); then
        if [ -n "$line" ]; then
          printf '%s' "$line"
          said=$SECONDS
        fi
        if ((SECONDS - said >= quiet && SECONDS - beaten >= quiet)); then
          beat $((SECONDS - said))
          beaten=$SECONDS
        fi
      else
        [ -n "$line" ] && printf '%s' "$line"
        return 0
      fi
    done
  }
  # A pipeline, not a background job: a background job of a script
  # ignores SIGINT, and Ctrl+C must stop the tests.
  "$@" 2>&1 | relay
  rc=${PIPESTATUS[0]}
fi

if ((rc == 0)); then
  say '== %s: done in %s\n' "$label" "$(dur $((SECONDS - start)))"
else
  say '== %s: failed (exit status %d) after %s\n' "$label" "$rc" "$(dur $((SECONDS - start)))"
fi
exit "$rc"
