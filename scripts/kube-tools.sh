#!/usr/bin/env bash
# Builds the Kubernetes control plane of the real-API tests (make
# e2e-kubernetes, internal/testenv/kubereal): kube-apiserver from the
# k8s.io/kubernetes module at the version of the client-go that gpu-orphan
# links (go.mod: client-go v0.MM.P is Kubernetes v1.MM.P), and etcd from the
# etcd server module that it links, started by its embed package
# (scripts/kube-etcd/main.go). Into TOOLS/kubernetes-VERSION, once (about
# 8 minutes on 2 idle cores with the module download, 24 on busy ones),
# then nothing. Prints that directory.
#
# `go install k8s.io/kubernetes/cmd/kube-apiserver@VERSION` cannot work: the
# module's go.mod replaces its staging modules (k8s.io/api, client-go,
# apiserver, ...) with ./staging/src/k8s.io/... directories that its module
# archive does not contain. So it is built in a copy of the module whose
# go.mod replaces each of them with the published k8s.io/* module of the
# same release (v0.MM.P); the two that are not published (sample-cli-plugin
# and sample-controller, which kube-apiserver does not import) are dropped.
# Nothing of this reaches gpu-orphan's binaries: the copy is a module of its
# own, outside the repository.
#
# VERSION (the second argument, or KUBE_VERSION) builds another release of
# Kubernetes instead, v1.MM.P, with the etcd of that release's module graph:
# `make oldest` builds the oldest that the chart supports (its kubeVersion)
# and runs the same tests against it.
#
# Usage: scripts/kube-tools.sh TOOLS_DIR [VERSION]
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
GO=${GO:-go}
tools=$1
version=${2:-${KUBE_VERSION:-}}
mkdir -p "$tools"
tools=$(cd "$tools" && pwd)
if [ -z "$version" ]; then
  client=$("$GO" list -m -f '{{.Version}}' k8s.io/client-go)
  client=${client%%-*}          # v0.37.2
  version=v1.${client#v0.}      # v1.37.2
fi
case $version in
  v1.[0-9]*.[0-9]*) ;;
  *) echo "kube-tools: $version is not a Kubernetes release (v1.MM.P)" >&2; exit 2 ;;
esac
staging=v0.${version#v1.}       # the staging modules' version: v0.37.2
bin=$tools/kubernetes-$version

# The prometheus-operator CRDs that the chart's objects use (PodMonitor,
# ServiceMonitor, PrometheusRule, AlertmanagerConfig), from the
# prometheus-operator module's example/prometheus-operator-crd, into
# BIN/prometheus-operator-crds: test/kubernetes installs the chart with them.
prometheus_operator=v0.85.0
crds=$bin/prometheus-operator-crds
if [ "$(cat "$crds/VERSION" 2>/dev/null)" != "$prometheus_operator" ]; then
  echo "tools: the prometheus-operator $prometheus_operator CRDs from its module into $crds" >&2
  dir=$(cd / && GOFLAGS=-mod=mod "$GO" mod download -json "github.com/prometheus-operator/prometheus-operator@$prometheus_operator" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
  rm -rf "$crds.tmp"
  mkdir -p "$crds.tmp"
  for r in podmonitors servicemonitors prometheusrules alertmanagerconfigs; do
    cp "$dir/example/prometheus-operator-crd/monitoring.coreos.com_$r.yaml" "$crds.tmp/"
  done
  chmod -R u+w "$crds.tmp"
  echo "$prometheus_operator" > "$crds.tmp/VERSION"
  rm -rf "$crds"
  mv "$crds.tmp" "$crds"
fi

# kube-apiserver reports the release it was built from (/version): a
# build without Kubernetes' version flags says v0.0.0-master, and Helm then
# refuses a chart's kubeVersion. An older build of this script's is linked
# again (the packages are in Go's build cache: about a minute).
if [ -x "$bin/kube-apiserver" ] && [ -x "$bin/etcd" ] && "$bin/kube-apiserver" --version 2>/dev/null | grep -qx "Kubernetes $version"; then
  echo "$bin"
  exit 0
fi
mkdir -p "$bin" "$tools/src"
echo "tools: building kube-apiserver $version and its etcd from their modules into $bin, once (8 to 24 minutes on 2 cores, with the modules' download)" >&2
copy=$tools/src/kubernetes-$version
if [ ! -d "$copy" ]; then
  dir=$(GOFLAGS=-mod=mod "$GO" mod download -json "k8s.io/kubernetes@$version" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
  rm -rf "$copy.tmp"
  cp -r "$dir" "$copy.tmp"
  chmod -R u+w "$copy.tmp"
  (
    cd "$copy.tmp"
    for m in $(sed -n 's#^[[:space:]]*\(k8s.io/[a-z0-9-]*\) => \./staging/.*#\1#p' go.mod); do
      # Outside the copy: its go.mod, until fixed, names missing directories.
      if (cd / && GOFLAGS=-mod=mod "$GO" mod download "$m@$staging" 2>/dev/null); then
        "$GO" mod edit -replace "$m=$m@$staging"
      else
        "$GO" mod edit -dropreplace "$m" -droprequire "$m"
      fi
    done
  )
  mv "$copy.tmp" "$copy"
fi
mkdir -p "$copy/cmd/gpu-orphan-etcd"
cp "$repo/scripts/kube-etcd/main.go" "$copy/cmd/gpu-orphan-etcd/main.go"
(
  cd "$copy"
  export GOWORK=off GOFLAGS=-mod=mod
  # As Kubernetes' hack/lib/version.sh sets them for a release.
  minor=${version#v1.}
  minor=${minor%%.*}
  ldflags=""
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $pkg.gitVersion=$version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
  done
  "$GO" build -ldflags "$ldflags" -o "$bin/kube-apiserver" ./cmd/kube-apiserver
  "$GO" build -o "$bin/etcd" ./cmd/gpu-orphan-etcd/main.go
)
echo "$bin"
