#!/usr/bin/env bash
# Installs what the tests and `make run` need beyond Go modules: Debian's
# prometheus (promtool), prometheus-alertmanager (amtool), psmisc (fuser,
# the benchmarks' baseline), chromium (the /actions page's test), and a
# real Slurm for the prolog and epilog tests (cmd/gpu-orphan/slurmtest):
# slurmctld, slurmd, slurm-client (sbatch, srun, scontrol, sinfo) and munge.
set -euo pipefail
missing=()
command -v promtool >/dev/null || missing+=(prometheus)
# Debian installs Alertmanager as /usr/bin/prometheus-alertmanager.
command -v prometheus-alertmanager >/dev/null || command -v alertmanager >/dev/null || missing+=(prometheus-alertmanager)
command -v fuser >/dev/null || missing+=(psmisc)
# The /actions page is tested in a real headless browser.
command -v chromium >/dev/null || missing+=(chromium)
# The Slurm tests start a one-node cluster of their own (as root).
command -v slurmctld >/dev/null || missing+=(slurmctld)
command -v slurmd >/dev/null || missing+=(slurmd)
command -v sbatch >/dev/null || missing+=(slurm-client)
command -v munged >/dev/null || missing+=(munge)
[ ${#missing[@]} -eq 0 ] && exit 0
echo "deps: installing ${missing[*]} (Debian packages)"
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
