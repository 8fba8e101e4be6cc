// Package dashboards tests gpu-orphan's Grafana dashboards, the JSON
// files of the repository's dashboards/:
//
//   - gpu-orphan-fleet.json: memory with no live owner across the fleet,
//     the top offenders, and what the remediators did about it.
//   - gpu-orphan-node.json: one node, each GPU's used memory split by
//     owner, the processes that hold it, and the remediator's history.
//
// The package has no code, only a test: every query of every dashboard
// must parse as PromQL and name only metrics that docs/metrics.md lists.
// Grafana (docker-compose.yml, deploy/compose/grafana) provisions the
// files straight from dashboards/. The test lives in the module test/
// because Prometheus's PromQL parser is not a dependency of the binaries.
package dashboards
