// Package deploy holds the ways to run gpu-orphan, and the tests that keep
// them working; it has no code of its own.
//
//   - ../docker-compose.yml with compose/ and docker/: one node, with
//     Prometheus, Alertmanager and Grafana, on a real GPU (profile gpu) or
//     a simulated one (profile sim).
//   - kubernetes/: a DaemonSet of node agents (exporter and remediator), a
//     dispatcher, a ServiceMonitor and a PrometheusRule.
//   - systemd/: units for bare-metal nodes.
//
// The tests load each with the parser of the tool that runs it
// (compose-go, the Kubernetes API types, Alertmanager's and Prometheus's
// configuration) and check what ties the pieces together: service names
// and ports, mounted files, the `node` label, flag names, capabilities.
// README.md says how to deploy each way.
package deploy
