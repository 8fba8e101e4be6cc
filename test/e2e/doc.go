// Package e2e holds the end-to-end tests of the whole loop, with real
// processes: a simulated GPU node, gpu-orphan-exporter, a real Prometheus
// with the project's own alert rules, a real Alertmanager, and
// gpu-orphan-remediator acting on its webhook, against a fork-orphan
// workload whose parent is killed with SIGKILL.
//
// The stack and its stages are those of `make run` (internal/stack):
// TestLoop follows the same stack.Loop that cmd/gpu-orphan-demo narrates,
// and asserts what each stage saw; TestRunOnce and TestRunInterrupt run
// gpu-orphan-demo itself.
//
// The test files carry the build tag e2e; `make e2e` runs them:
//
//	cd test && go test -count=1 -tags e2e -timeout 10m -v ./e2e/
//
// Prometheus and Alertmanager come from Debian's packages (scripts/deps.sh).
// Without them the tests skip, unless GPU_ORPHAN_E2E_REQUIRED is set, as
// `make e2e` does: then they fail.
package e2e
