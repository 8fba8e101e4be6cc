# gpu-orphan's front door. `make run` shows the loop; `make test` runs every test.
GO        ?= go
BIN       := bin
BINARIES  := gpu-orphan-exporter gpu-orphan-sim gpu-orphan gpu-orphan-remediator
VERSION   ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS   := -X github.com/prometheus/common/version.Version=$(VERSION) \
             -X github.com/prometheus/common/version.Revision=$(shell git rev-parse --short HEAD 2>/dev/null) \
             -X github.com/prometheus/common/version.Branch=$(shell git rev-parse --abbrev-ref HEAD 2>/dev/null)
BACKEND   ?= sim
RUN_DIR   ?= $(CURDIR)/.run

.PHONY: all build deps test unit lint checkmetrics rules e2e bench run demo fuzz soak clean

all: build

build:
	@mkdir -p $(BIN)
	$(GO) build -ldflags '$(LDFLAGS)' -o $(BIN)/ $(addprefix ./cmd/,$(filter $(BINARIES),$(notdir $(wildcard cmd/*))))

# Debian's prometheus (promtool) and prometheus-alertmanager (amtool); the
# tests start real ones.
deps:
	@./scripts/deps.sh

test: deps build lint unit checkmetrics rules e2e

unit:
	$(GO) test -count=1 -timeout 15m ./...

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); if [ -n "$$out" ]; then echo "gofmt needed: $$out"; exit 1; fi
	$(GO) vet ./...

# A whole-binary scrape of the simulated fork-orphan case, diffed against
# the golden file and linted by promtool.
checkmetrics: build
	./scripts/checkmetrics.sh

rules:
	@if [ -d alerts ] && ls alerts/*.rules.yml >/dev/null 2>&1; then \
	  promtool check rules alerts/*.rules.yml && promtool test rules alerts/*_test.yml; fi

e2e: build
	@if [ -d e2e ]; then $(GO) test -count=1 -tags e2e -timeout 10m -v ./e2e/; fi

bench: build
	./scripts/bench.sh

fuzz:
	./scripts/fuzz.sh

run: build deps
	./scripts/run.sh $(BACKEND)

demo: run

clean:
	rm -rf $(BIN) $(RUN_DIR)
