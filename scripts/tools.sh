#!/usr/bin/env bash
# Builds the Prometheus and Alertmanager that the tests run, from their Go
# modules at the versions the code links (test/go.mod pins Prometheus,
# go.mod Alertmanager), into TOOLS/prometheus-VERSION and
# TOOLS/alertmanager-VERSION, once: about 4 and 2 minutes on 2 cores, then
# nothing. Prints the directory to put first in PATH.
#
# Neither can be built with `go install MODULE@VERSION`: Prometheus's go.mod
# has a replace directive, which only a main module may have. So each is
# built in a copy of its module, as its main module. Alertmanager's web UI
# (ui/app/dist, built with npm and elm by its release process) is not in
# the module: the copy gets a one-page placeholder in its place. Its API,
# which Prometheus and the tests use, is the real one; only the UI pages
# are missing.
#
# Usage: scripts/tools.sh TOOLS_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
GO=${GO:-go}
tools=$1
mkdir -p "$tools"
prom_version=$(cd test && "$GO" list -m -f '{{.Version}}' github.com/prometheus/prometheus)
am_version=$("$GO" list -m -f '{{.Version}}' github.com/prometheus/alertmanager)
bin=$tools/prometheus-$prom_version-alertmanager-$am_version
if [ -x "$bin/prometheus" ] && [ -x "$bin/promtool" ] && [ -x "$bin/alertmanager" ] && [ -x "$bin/amtool" ]; then
  echo "$bin"
  exit 0
fi
mkdir -p "$bin" "$tools/src"
src() { # MODULE VERSION: a writable copy of the module, printed
  local dir
  dir=$(cd test && "$GO" mod download -json "$1@$2" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
  local copy=$tools/src/$(basename "$1")-$2
  if [ ! -d "$copy" ]; then
    rm -rf "$copy.tmp"
    cp -r "$dir" "$copy.tmp"
    chmod -R u+w "$copy.tmp"
    mv "$copy.tmp" "$copy"
  fi
  echo "$copy"
}
echo "tools: building Prometheus $prom_version (prometheus, promtool) from its module into $bin, once (about 4 minutes)" >&2
p=$(src github.com/prometheus/prometheus "$prom_version")
# The module's v0.3MM.P is Prometheus 3.MM.P; --version says so.
minor=${prom_version#v0.}; minor=${minor%%.*}
release="3.$((minor - 300)).${prom_version##*.}"
# remove_all_sd (Prometheus's own build tag) leaves out the cloud service
# discoveries (AWS, Azure, GCE, Kubernetes, ...) and their SDKs: the tests
# scrape static and file targets only, and the compile from an empty build
# cache takes 136 s instead of 262 s on 2 cores (measured 2026-12-02).
(cd "$p" && GOWORK=off "$GO" build -tags remove_all_sd -ldflags "-X github.com/prometheus/common/version.Version=$release" -o "$bin/" ./cmd/prometheus ./cmd/promtool)
echo "tools: building Alertmanager $am_version (alertmanager, amtool) from its module, with a placeholder for its web UI, once (about 2 minutes)" >&2
a=$(src github.com/prometheus/alertmanager "$am_version")
for ui in elm mantine; do
  mkdir -p "$a/ui/app/dist/$ui"
  [ -e "$a/ui/app/dist/$ui/index.html" ] || printf '<!doctype html><title>Alertmanager</title><p>This Alertmanager was built from its Go module for gpu-orphan'"'"'s tests: its web UI is not in the module. The API is at /api/v2/.\n' > "$a/ui/app/dist/$ui/index.html"
done
(cd "$a" && GOWORK=off "$GO" build -ldflags "-X github.com/prometheus/common/version.Version=${am_version#v}" -o "$bin/" ./cmd/alertmanager ./cmd/amtool)
echo "$bin"
