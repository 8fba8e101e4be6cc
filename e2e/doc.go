// Package e2e holds the end-to-end test of the whole loop, with real
// processes: a simulated GPU node, gpu-orphan-exporter, a real Prometheus
// with the project's own alert rules, a real Alertmanager, and
// gpu-orphan-remediator acting on its webhook, against a fork-orphan
// workload whose parent is killed with SIGKILL.
//
// The test files carry the build tag e2e; `make e2e` runs them:
//
//	go test -count=1 -tags e2e -timeout 10m -v ./e2e/
//
// Prometheus and Alertmanager come from Debian's packages (scripts/deps.sh).
// Without them the test skips, unless GPU_ORPHAN_E2E_REQUIRED is set, as
// `make e2e` does: then it fails. The configurations are those of `make run`:
// scripts/e2e-config.
package e2e
