// Package deploy tests the ways to run gpu-orphan, which live in the
// repository's deploy/ (README.md there says how to deploy each way); it
// has no code of its own.
//
//   - docker-compose.yml with deploy/compose/ and deploy/docker/: one node,
//     with Prometheus, Alertmanager and Grafana, on a real GPU (profile
//     gpu) or a simulated one (profile sim).
//   - charts/gpu-orphan/: the Helm chart, rendered with Helm's Go packages
//     for its defaults and the value sets of testdata/helm/ (helm_test.go):
//     a DaemonSet of node agents (exporter and remediator), a dispatcher
//     with Kubernetes discovery, monitors, the PrometheusRule, dashboards
//     and an AlertmanagerConfig.
//   - deploy/kubernetes/: the chart rendered with its values.yaml, for
//     kubectl apply -k.
//   - deploy/systemd/: units for bare-metal nodes.
//
// The tests load each with the parser of the tool that runs it
// (compose-go, the Kubernetes API types, Alertmanager's and Prometheus's
// configuration) and check what ties the pieces together: service names
// and ports, mounted files, the `node` label, flag names, capabilities.
// Those parsers are why these tests live in the module test/, not in the
// root module: the binaries do not link them. Run them from test/:
//
//	cd test && go test ./deploy/
package deploy
