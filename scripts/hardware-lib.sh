# Shared by the scripts/hardware-*.sh runs on a GPU node; sourced, not run.
# Each PID appended to pids is killed with its process group on exit.
pids=()
kill_started() { for p in "${pids[@]}"; do kill -9 -- -"$p" "$p" 2>/dev/null; done; }
trap kill_started EXIT
section() { echo; echo "=== $* ($(date +%T.%3N))"; }
new_token() { head -c 24 /dev/urandom | base64 | tr -d '/+=' > "$1"; } # FILE
