#!/usr/bin/env bash
# Installs, from Debian's packages, what a make target needs beyond Go
# modules, and only that: the target is the first argument.
#   run:  Prometheus 2.42 and Alertmanager 0.25 (`make run`, `make oldest`)
#   test: those, plus psmisc (fuser, the benchmarks' baseline), chromium
#         (the /actions page's test) and a real Slurm for the prolog and
#         epilog tests (cmd/gpu-orphan/slurmtest): slurmctld, slurmd,
#         slurm-client (sbatch, srun, scontrol, sinfo) and munge.
# It says what it installs and why before apt-get starts, and names each
# package as apt-get sets it up.
set -euo pipefail
purpose=${1:-test}
case $purpose in
run | test) ;;
*)
  echo "usage: $0 run|test" >&2
  exit 2
  ;;
esac
missing=()
why=()
need() { missing+=("$1"); why+=("  $1: $2"); }
command -v promtool >/dev/null || need prometheus "promtool and Prometheus 2.42, the oldest supported (make oldest, make run)"
# Debian installs Alertmanager as /usr/bin/prometheus-alertmanager.
command -v prometheus-alertmanager >/dev/null || command -v alertmanager >/dev/null ||
  need prometheus-alertmanager "Alertmanager 0.25, the oldest supported (make oldest, make run)"
if [ "$purpose" = test ]; then
  command -v fuser >/dev/null || need psmisc "fuser, the benchmarks' baseline"
  # The /actions page is tested in a real headless browser.
  command -v chromium >/dev/null || need chromium "a headless browser for the /actions page's tests"
  # The Slurm tests start a one-node cluster of their own (as root).
  command -v slurmctld >/dev/null || need slurmctld "a real Slurm controller for the prolog and epilog tests"
  command -v slurmd >/dev/null || need slurmd "a real Slurm node daemon for the prolog and epilog tests"
  command -v sbatch >/dev/null || need slurm-client "sbatch, scontrol, sinfo for the Slurm tests"
  command -v munged >/dev/null || need munge "Slurm's authentication, for the Slurm tests"
fi
[ ${#missing[@]} -eq 0 ] && exit 0
echo "deps: installing ${missing[*]} (Debian packages, with apt-get, for make $purpose):"
printf '%s\n' "${why[@]}"
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
echo "deps: apt-get update (Debian's package lists)"
$sudo apt-get update -qq
# policy-rc.d keeps the packages from starting their own daemons.
# GPU_ORPHAN_POLICY_RC_D: the tests point it at a file of their own.
policy=${GPU_ORPHAN_POLICY_RC_D:-/usr/sbin/policy-rc.d}
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
  $sudo chmod +x "$policy"
  trap '$sudo rm -f "$policy"' EXIT
fi
# apt-get's own lines, shortened: how much it downloads, then each package
# as it is set up (chromium brings about 80, for about a minute).
$sudo apt-get install -y -q --no-install-recommends "${missing[@]}" 2>&1 |
  awk '/^Need to get/ { sub(/ of archives\./, ""); print "deps: downloading " substr($0, 13); fflush() }
       /^Setting up / { print "deps: set up " $3; fflush() }
       /^(E|W): / { print; fflush() }'
command -v promtool
