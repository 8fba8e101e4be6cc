# gpu-orphan's front door. `make run` shows the loop; `make test` runs every test.
GO        ?= go
BIN       := bin
BINARIES  := gpu-orphan-exporter gpu-orphan-sim gpu-orphan gpu-orphan-remediator gpu-orphan-dispatcher
VERSION   ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
BUILD_USER ?= $(shell id -un 2>/dev/null || echo unknown)@$(shell hostname 2>/dev/null || echo unknown)
BUILD_DATE ?= $(shell date -u +%Y%m%d-%H:%M:%S)
LDFLAGS   := -X github.com/prometheus/common/version.Version=$(VERSION) \
             -X github.com/prometheus/common/version.Revision=$(shell git rev-parse --short HEAD 2>/dev/null) \
             -X github.com/prometheus/common/version.Branch=$(shell git rev-parse --abbrev-ref HEAD 2>/dev/null) \
             -X github.com/prometheus/common/version.BuildUser=$(BUILD_USER) \
             -X github.com/prometheus/common/version.BuildDate=$(BUILD_DATE)
# --version's "tags" line shows the build tags; netgo (Go's own DNS
# resolver) as promu builds the Prometheus binaries. BUILD_TAGS= for none.
BUILD_TAGS ?= netgo
# go-nvml's cgo calls NVML functions that nvml.h marks deprecated: 29 gcc
# warnings that look like errors. Silence exactly that one warning.
CGO_CFLAGS ?= -O2 -g -Wno-deprecated-declarations
export CGO_CFLAGS
# The Go tests, and the binaries they start (internal/testenv), run with the
# race detector. RACE= for a quicker run without it.
RACE      ?= -race
BACKEND   ?= sim
RUN_DIR   ?= $(CURDIR)/.run
# The long steps of `make test` run under scripts/progress.sh: a line when
# each starts, and one after each 30 s of silence that says what it is
# doing (the packages being tested or compiled, the tool being built).
PROGRESS  := $(CURDIR)/scripts/progress.sh

.PHONY: all build deps deps-run tools kube-tools e2e-kubernetes kubernetes-skipped test oldest unit lint checkmetrics rules e2e bench run demo fuzz soak release clean

all: build

# -trimpath, as `make release` builds: no paths of this machine in the
# binaries, and the release's amd64 build reuses this one's compiled
# packages from Go's build cache.
build:
	@mkdir -p $(BIN)
	@$(PROGRESS) 'go build into $(BIN)/' $(GO) build -trimpath $(if $(BUILD_TAGS),-tags '$(BUILD_TAGS)') -ldflags '$(LDFLAGS)' -o $(BIN)/ $(addprefix ./cmd/,$(filter $(BINARIES),$(notdir $(wildcard cmd/*))))

# Debian's packages that the tests use (scripts/deps.sh test): Prometheus
# and Alertmanager (the oldest supported), fuser, chromium, Slurm and munge.
# `make run` and `make oldest` install only Prometheus and Alertmanager
# (deps-run).
deps:
	@./scripts/deps.sh test

deps-run:
	@./scripts/deps.sh run

# The release's arm64 cross-build and its run under qemu test the packaging,
# not the code: .ci/run runs `make release` after `make test`.
test: deps build lint unit rules fuzz e2e kubernetes-skipped

# Prometheus and Alertmanager, built from their Go modules at the versions
# the code links (scripts/tools.sh: once, about 6 minutes on 2 cores, then
# cached in .tools/): the loop, the rule tests and every test that runs
# promtool or amtool use them. OLDEST=1 uses Debian's instead (Prometheus
# 2.42, Alertmanager 0.25, which `make deps` installs): `make oldest` runs
# the rule tests and the loop against them, as .ci/run does. The README's
# table says which versions are supported.
TOOLS     := $(CURDIR)/.tools
ifeq ($(OLDEST),)
TOOLS_DEP  := tools
WITH_TOOLS = PATH="$$(cat '$(TOOLS)/current'):$$PATH"
else
TOOLS_DEP  :=
WITH_TOOLS = PATH="$$PATH"
endif

# scripts/tools.sh writes the directory of the built tools to
# .tools/current; a failed build stops make.
tools:
	@mkdir -p '$(TOOLS)'
	@GO='$(GO)' $(PROGRESS) -p 'tools: Prometheus and Alertmanager (scripts/tools.sh)' ./scripts/tools.sh '$(TOOLS)' > '$(TOOLS)/current.tmp' && mv '$(TOOLS)/current.tmp' '$(TOOLS)/current'

# The dispatcher and the chart against a real kube-apiserver and etcd
# (test/kubernetes, on internal/testenv/kubereal; docs/kubernetes.md): the
# control plane is built from its Go modules into .tools/kubernetes-VERSION
# by scripts/kube-tools.sh, once (22 minutes on 2 busy cores, 8 idle), then
# cached. .ci/run runs it after `make test`, which leaves it out for time.
# The tests against it that need a package's insides stay in the package,
# with the build tag kubernetes, and run first, by name.
KUBE_PACKAGE_TESTS := '^(TestControlPlane|TestRetryStopsWithDiscovery)$$'
KUBE_PACKAGES      := ./internal/testenv/kubereal/ ./remediate/discovery/
# KUBE_VERSION=v1.MM.P builds and tests that release instead of client-go's;
# `make oldest` sets it to KUBE_OLDEST, the oldest release that the chart
# supports (its kubeVersion, >=1.30.0-0: the newest patch of 1.30 that the
# module proxy serves). Each release is built once into
# .tools/kubernetes-VERSION (the same 8 to 22 minutes); .tools/kubernetes
# (or .tools/kubernetes.VERSION) names the directory the tests use.
KUBE_VERSION ?=
KUBE_OLDEST  ?= v1.30.14
KUBE_DIR_FILE := $(TOOLS)/kubernetes$(if $(KUBE_VERSION),.$(KUBE_VERSION))
kube-tools:
	@mkdir -p '$(TOOLS)'
	@GO='$(GO)' $(PROGRESS) -p 'tools: kube-apiserver and etcd $(if $(KUBE_VERSION),$(KUBE_VERSION) )(scripts/kube-tools.sh)' ./scripts/kube-tools.sh '$(TOOLS)' $(KUBE_VERSION) > '$(KUBE_DIR_FILE).tmp' && mv '$(KUBE_DIR_FILE).tmp' '$(KUBE_DIR_FILE)'

# -z lazy: Helm's packages link Go's plugin package (through kustomize), and
# the linker then binds every symbol at start-up, go-nvml's too, which it
# resolves only once libnvidia-ml is loaded (the test would not start).
e2e-kubernetes: kube-tools
	@GPU_ORPHAN_KUBE_TOOLS="$$(cat '$(KUBE_DIR_FILE)')" $(PROGRESS) 'go test -tags kubernetes $(KUBE_PACKAGES) (a real control plane$(if $(KUBE_VERSION),: Kubernetes $(KUBE_VERSION)))' $(GO) test -tags kubernetes -count=1 -v -run $(KUBE_PACKAGE_TESTS) $(KUBE_PACKAGES)
	@cd test && GPU_ORPHAN_KUBE_TOOLS="$$(cat '$(KUBE_DIR_FILE)')" $(PROGRESS) 'go test -tags kubernetes ./kubernetes/ (the dispatcher and the chart against kube-apiserver$(if $(KUBE_VERSION), $(KUBE_VERSION)))' $(GO) test -tags kubernetes -ldflags=-extldflags=-Wl,-z,lazy -count=1 -v -timeout 15m ./kubernetes/

kubernetes-skipped:
	@echo 'make test: the tests against a real kube-apiserver (test/kubernetes, and those tagged kubernetes in their packages) are not part of it: `make e2e-kubernetes` builds the control plane once and runs them (.ci/run does)'

# The oldest supported: the rule tests and the loop against Debian's
# Prometheus and Alertmanager, then the dispatcher and the chart against the
# oldest Kubernetes the chart supports (KUBE_OLDEST, built once).
oldest: build deps-run
	@$(MAKE) --no-print-directory rules e2e OLDEST=1
	@$(MAKE) --no-print-directory e2e-kubernetes KUBE_VERSION=$(KUBE_OLDEST)

# The release (scripts/release.sh): every binary for linux/amd64 and
# linux/arm64 (Grace Hopper nodes), with cgo and -trimpath and the version
# of `make build`, cross-compiled with Debian's gcc-aarch64-linux-gnu
# (installed when missing); a tarball per architecture and SHA256SUMS in
# dist/, each binary's architecture checked with `go version -m` and `file`,
# and each run with --version (arm64's under qemu-user). docs/release.md
# says how to cut one.
DIST      ?= dist
release:
	@GO='$(GO)' VERSION='$(VERSION)' LDFLAGS='$(LDFLAGS)' BUILD_TAGS='$(BUILD_TAGS)' \
	  BINARIES='$(BINARIES)' DIST='$(DIST)' ./scripts/release.sh

# Two modules: the root (the binaries and their tests) and test/ (the tests
# of deploy/, dashboards/ and the end-to-end loop, whose parsers -- compose-go,
# the Kubernetes API types, Prometheus's PromQL -- the binaries do not link).
MODULES   := . test

# The integration tests (remediate/, exporter/, cmd/...) start real daemons
# and wait on them (grace periods, min-ages, verification): most of their
# time is waiting, not CPU. Those that share nothing run in parallel, up to
# PARALLEL at once in a package (Go's default is the number of cores, 2 on
# CI): remediate/ takes 98 s instead of 378 s on 2 cores, using no more CPU.
# The race detector runs on the root module, whose daemons and packages have
# goroutines (the daemons the tests start are built with it too); test/
# parses files (deploy/, dashboards/) and needs none.
PARALLEL  ?= 8
unit: $(TOOLS_DEP)
	@$(WITH_TOOLS) $(PROGRESS) 'go test $(RACE) ./... (the root module)' $(GO) test $(RACE) -count=1 -parallel $(PARALLEL) -timeout 15m ./...
	@cd test && $(WITH_TOOLS) $(PROGRESS) 'go test ./... (test/: deploy/, dashboards/)' $(GO) test -count=1 -parallel $(PARALLEL) -timeout 15m ./...

# golangci-lint, pinned: errcheck, govet, ineffassign, staticcheck
# (honnef.co/go/tools v0.8.2, as v2.15.0 links it) and unused, configured in
# .golangci.yml. `make lint` builds it into .tools/ the first time (about 3
# minutes on 2 cores with the module download; Go's build cache makes it
# seconds after that); a new version goes to a new directory.
GOLANGCI_LINT_VERSION := v2.15.0
GOLANGCI_LINT         := $(CURDIR)/.tools/golangci-lint-$(GOLANGCI_LINT_VERSION)/golangci-lint

$(GOLANGCI_LINT):
	@GOBIN='$(dir $(GOLANGCI_LINT))' $(PROGRESS) 'golangci-lint $(GOLANGCI_LINT_VERSION): go install, once' $(GO) install github.com/golangci/golangci-lint/v2/cmd/golangci-lint@$(GOLANGCI_LINT_VERSION)

# gofmt; go.mod and go.sum as `go mod tidy` keeps them; go vet; golangci-lint.
# Each in both modules.
lint: $(GOLANGCI_LINT)
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); if [ -n "$$out" ]; then echo "gofmt needed: $$out"; exit 1; fi
	@for m in $(MODULES); do (cd $$m && $(GO) mod tidy -diff) || { echo "go mod tidy needed in $$m"; exit 1; }; done
	@$(PROGRESS) 'go vet -tags kubernetes ./...' $(GO) vet -tags kubernetes ./...
	@cd test && $(PROGRESS) 'go vet -tags e2e,kubernetes ./... (test/)' $(GO) vet -tags e2e,kubernetes ./...
	@$(PROGRESS) 'golangci-lint run ./...' $(GOLANGCI_LINT) run --allow-parallel-runners ./...
	@cd test && $(PROGRESS) 'golangci-lint run ./... (test/)' $(GOLANGCI_LINT) run --allow-parallel-runners ./...

# A whole-binary scrape of the simulated fork-orphan case, diffed against
# the golden file and linted by promtool (also part of `unit`).
checkmetrics: deps $(TOOLS_DEP)
	$(WITH_TOOLS) $(GO) test -count=1 -run TestSimForkOrphan -v ./exporter/

rules: $(TOOLS_DEP)
	@if [ -d alerts ] && ls alerts/*.rules.yml >/dev/null 2>&1; then export $(WITH_TOOLS); \
	  echo "rules: $$(promtool --version 2>&1 | head -1)"; \
	  promtool check rules alerts/*.rules.yml && promtool test rules alerts/*_test.yml; fi

# The whole loop with real processes, the stack of `make run`
# (internal/stack): a simulated node, the exporter, Prometheus with
# alerts/, Alertmanager and the remediator; test/e2e/ asserts the stages that
# `make run` narrates, and runs gpu-orphan-demo itself. GPU_ORPHAN_E2E_REQUIRED
# makes a missing Prometheus or Alertmanager a failure instead of a skip;
# the stage timings go to .run/e2e-summary.txt, and are printed at the end.
e2e: build deps $(TOOLS_DEP)
	@if [ -d test/e2e ]; then rm -f '$(RUN_DIR)/e2e-summary.txt'; \
	  export $(WITH_TOOLS); echo "e2e: $$(prometheus --version 2>&1 | head -1); $$( (command -v alertmanager >/dev/null && alertmanager --version || prometheus-alertmanager --version) 2>&1 | head -1)"; \
	  cd test && GPU_ORPHAN_E2E_REQUIRED=1 GPU_ORPHAN_E2E_SUMMARY='$(RUN_DIR)/e2e-summary.txt' \
	  $(PROGRESS) 'go test -tags e2e ./e2e/ (the whole loop)' $(GO) test -count=1 -tags e2e -timeout 10m -v ./e2e/; rc=$$?; \
	  cat '$(RUN_DIR)/e2e-summary.txt' 2>/dev/null; exit $$rc; fi

# Each figure against its target (scripts/bench.sh); exits 1 on a miss, so
# `make test` does not run it. Results go to .run/bench/; docs/benchmarks.md
# is updated by hand, from .run/bench/benchmarks.md, on purpose.
bench: build
	@RUN_DIR='$(RUN_DIR)' GPU_ORPHAN_BENCH_BIN='$(CURDIR)/$(BIN)' ./scripts/bench.sh

fuzz:
	@RUN_DIR='$(RUN_DIR)' $(PROGRESS) 'fuzz (scripts/fuzz.sh)' ./scripts/fuzz.sh

# The exporter's hardening tests run long (scripts/soak.sh): 50 clients
# scraping under ~2,000 processes of churn, then NVML faults in cycles, for
# SOAK_DURATION in all; the figures are printed and appended to .run/soak.txt.
SOAK_DURATION ?= 10m
soak:
	@SOAK_DURATION='$(SOAK_DURATION)' SOAK_REPORT='$(RUN_DIR)/soak.txt' ./scripts/soak.sh

# The loop on this machine, narrated by cmd/gpu-orphan-demo (a developer's
# tool, so not in BINARIES) on internal/stack; Ctrl+C stops it. RUN_ONCE=1
# exits 0 once the memory is back (a smoke test). ACT=0, NODE_NAME,
# RUN_TIMEOUT, SIM_GPU, SIM_MIB and EXPORTER_PORT etc. are read as well:
# bin/gpu-orphan-demo --help.
run: build deps-run
	@$(GO) build -ldflags '$(LDFLAGS)' -o $(BIN)/ ./cmd/gpu-orphan-demo
	@RUN_ONCE='$(RUN_ONCE)' $(BIN)/gpu-orphan-demo --backend='$(BACKEND)' --run.dir='$(RUN_DIR)' \
	  --rules.file=alerts/gpu-orphan.rules.yml

demo: run

clean:
	rm -rf $(BIN) $(RUN_DIR) $(DIST)
