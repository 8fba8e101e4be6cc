#!/usr/bin/env bash
# Installs what the tests and `make run` need beyond Go modules: Debian's
# prometheus (promtool), prometheus-alertmanager (amtool), psmisc (fuser,
# the benchmarks' baseline), chromium (the /actions page's test), and a
# real Slurm for the prolog and epilog tests (cmd/gpu-orphan/slurmtest):
# slurmctld, slurmd, slurm-client (sbatch, srun, scontrol, sinfo) and munge.
set -euo pipefail
missing=()
why=()
need() { missing+=("$1"); why+=("  $1: $2"); }
command -v promtool >/dev/null || need prometheus "promtool and Prometheus 2.42, the oldest supported (make oldest, make run)"
# Debian installs Alertmanager as /usr/bin/prometheus-alertmanager.
command -v prometheus-alertmanager >/dev/null || command -v alertmanager >/dev/null ||
  need prometheus-alertmanager "Alertmanager 0.25, the oldest supported (make oldest, make run)"
command -v fuser >/dev/null || need psmisc "fuser, the benchmarks' baseline"
# The /actions page is tested in a real headless browser.
command -v chromium >/dev/null || need chromium "a headless browser for the /actions page's tests"
# The Slurm tests start a one-node cluster of their own (as root).
command -v slurmctld >/dev/null || need slurmctld "a real Slurm controller for the prolog and epilog tests"
command -v slurmd >/dev/null || need slurmd "a real Slurm node daemon for the prolog and epilog tests"
command -v sbatch >/dev/null || need slurm-client "sbatch, scontrol, sinfo for the Slurm tests"
command -v munged >/dev/null || need munge "Slurm's authentication, for the Slurm tests"
[ ${#missing[@]} -eq 0 ] && exit 0
echo "deps: installing ${missing[*]} (Debian packages, with apt-get), for:"
printf '%s\n' "${why[@]}"
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
# policy-rc.d keeps the packages from starting their own daemons.
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' | $sudo tee /usr/sbin/policy-rc.d >/dev/null
  $sudo chmod +x /usr/sbin/policy-rc.d
  trap '$sudo rm -f /usr/sbin/policy-rc.d' EXIT
fi
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
command -v promtool
