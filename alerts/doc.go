// Package alerts holds the Prometheus alert rules for gpu-orphan
// (gpu-orphan.rules.yml), their `promtool test rules` tests
// (gpu-orphan_test.yml), and a Go test that keeps the rules consistent with
// docs/metrics.md and docs/runbook.md. It has no code of its own.
package alerts
