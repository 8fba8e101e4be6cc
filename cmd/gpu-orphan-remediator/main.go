// Command gpu-orphan-remediator receives Alertmanager's webhook
// notifications and gives orphaned GPU memory back: on a node it kills the
// holders (verified, rate-limited, audited); as a dispatcher it routes each
// alert to the agent of the node it names. The flags are parsed here; the
// remediator itself is package remediate/app.
package main

import (
	"context"
	"fmt"
	"math"
	"net/url"
	"os"
	"os/signal"
	"syscall"

	"github.com/alecthomas/kingpin/v2"
	"github.com/prometheus/common/promslog"
	promslogflag "github.com/prometheus/common/promslog/flag"
	"github.com/prometheus/common/version"
	"github.com/prometheus/exporter-toolkit/web/kingpinflag"
	"k8s.io/klog/v2"

	"github.com/gpu-orphan/gpu-orphan/internal/cli"
	"github.com/gpu-orphan/gpu-orphan/remediate/app"
	"github.com/gpu-orphan/gpu-orphan/remediate/limits"
	"github.com/gpu-orphan/gpu-orphan/remediate/remediateflag"
)

func main() { os.Exit(run()) }

func run() int {
	hostname, _ := os.Hostname()
	a := kingpin.New("gpu-orphan-remediator", `Receives Alertmanager's webhook notifications (POST /api/v1/alerts, payload version 4) and gives orphaned GPU memory back.

--role=node (default) acts on this node: for each firing alert whose `+"`node`"+` label is --node.name and whose `+"`uuid`"+` label names one of this node's GPUs, it takes a fresh snapshot, and if memory with no live owner is still there and older than --remediate.min-age, it kills the suspect holders (SIGTERM, then SIGKILL after --remediate.grace, through pidfds), verifies that the memory came back, and records everything in --store.path. Without --act it only records the plan (dry run).

--role=dispatcher is the single webhook target of a fleet: it routes each alert to the agent of the node it names, under fleet-wide limits.`)
	var o app.Options
	var maxBody uint64
	o.Web = kingpinflag.AddFlags(a, ":10836")
	a.Flag("auth.token-file", "File holding the bearer token that callers must send (Authorization: Bearer ...). Client certificates verified through --web.config.file are accepted too.").StringVar(&o.Auth.TokenFile)
	a.Flag("auth.insecure-none", "Accept requests without any authentication. Only for local experiments.").BoolVar(&o.Auth.InsecureNone)
	cli.Float64Var(a.Flag("auth.failures-per-minute", "Failed authentications allowed per source and minute before it gets 429.").Default("10"), &o.Auth.FailuresPerMinute)
	cli.BytesVar(a.Flag("web.max-body-bytes", "Largest webhook body accepted; larger ones get 413. Bytes, or a size with a unit: 1MiB.").Default("1MiB"), &maxBody)
	cli.EnumVar(a.Flag("role", "node: act on this node. dispatcher: route alerts to node agents.").Default(string(app.RoleNode)), &o.Role, app.RoleNode, app.RoleDispatcher)
	a.Flag("node.name", "This node's name, as alerts carry it in the node label.").Default(hostname).StringVar(&o.NodeName)
	a.Flag("alert.node-label", "The alert label that names the node.").Default("node").StringVar(&o.NodeLabel)
	a.Flag("alert.uuid-label", "The alert label that names the GPU by UUID.").Default("uuid").StringVar(&o.UUIDLabel)
	a.Flag("store.path", "The audit database (SQLite, WAL). Every decision is written here before it is acknowledged.").Default("/var/lib/gpu-orphan/remediator.db").StringVar(&o.StorePath)
	var externalURL string
	a.Flag("web.external-url", "The URL under which browsers reach the remediator, when it is not the listen address (a proxy, a DNS name), e.g. https://gpu-17.example.com:10836. State-changing requests (the webhook, the breaker reset) from a browser page are accepted from this origin and the request's own only; with --web.ui.open, /actions is served under this name, the listen address's, IP addresses and localhost only (a defence against DNS rebinding).").StringVar(&externalURL)
	a.Flag("web.ui.open", "Serve the /actions page (who leaks most, the latest actions, the breaker) without authentication, for a trusted network. Without it the page needs the API's bearer token or client certificate.").BoolVar(&o.UIOpen)
	cli.DurationVar(a.Flag("collector.interval", "How often to take a background snapshot, which measures how long memory has had no live owner.").Default("5s"), &o.Interval)
	backend := cli.AddBackendFlags(a)
	remediation := remediateflag.AddRemediatorFlags(a)
	def := limits.DefaultConfig()
	cli.DurationVar(a.Flag("limit.cooldown", "Per-GPU pause after a cleanup that sent signals.").Default(def.Cooldown.String()), &o.Limits.Cooldown)
	cli.Float64Var(a.Flag("limit.rate", "Cleanups per hour on this node (token bucket).").Default(fmt.Sprint(def.Rate)), &o.Limits.Rate)
	cli.IntVar(a.Flag("limit.burst", "Token bucket size.").Default(fmt.Sprint(def.Burst)), &o.Limits.Burst)
	cli.IntVar(a.Flag("limit.concurrency", "Cleanups running at once on this node.").Default(fmt.Sprint(def.MaxConcurrent)), &o.Limits.MaxConcurrent)
	cli.IntVar(a.Flag("limit.breaker-failures", "Failed cleanups within --limit.breaker-window that open the circuit breaker (then nothing acts until POST /api/v1/breaker/reset).").Default(fmt.Sprint(def.BreakerFailures)), &o.Limits.BreakerFailures)
	cli.DurationVar(a.Flag("limit.breaker-window", "Window for --limit.breaker-failures.").Default(def.BreakerWindow.String()), &o.Limits.BreakerWindow)
	a.Flag("dispatch.url-template", "Dispatcher: node agent base URL, with {{.Node}} for the node label, e.g. https://{{.Node}}:10836; it fills only the nodes that --dispatch.targets-file names with an empty URL.").StringVar(&o.Dispatch.URLTemplate)
	a.Flag("dispatch.targets-file", `Dispatcher: the allow-list of node agents, a JSON file mapping node names to base URLs, e.g. {"gpu-a": "https://10.0.0.5:10836", "gpu-b": ""} ("" for --dispatch.url-template's URL); read again when it changes. An alert for a node that neither it nor Kubernetes discovery names is rejected, and nothing is sent. With discovery too, this file wins for the nodes it names.`).StringVar(&o.Dispatch.TargetsFile)
	a.Flag("dispatch.kubernetes.service", "Dispatcher: the node agents' Service (the DaemonSet's); setting it turns on Kubernetes discovery, a second allow-list: each ready endpoint of the Service's EndpointSlices (label kubernetes.io/service-name) is the agent of its nodeName, watched through the API server. Needs RBAC list and watch on endpointslices (API group discovery.k8s.io) in --dispatch.kubernetes.namespace, nothing more.").StringVar(&o.Dispatch.Kubernetes.Service)
	a.Flag("dispatch.kubernetes.namespace", "Dispatcher: the namespace of --dispatch.kubernetes.service and --dispatch.kubernetes.lease; empty means the dispatcher pod's own (from its service account).").StringVar(&o.Dispatch.Kubernetes.Namespace)
	a.Flag("dispatch.kubernetes.port-name", "Dispatcher: the name of the EndpointSlice port on which the agents serve; a discovered agent's URL is --dispatch.kubernetes.scheme://ADDRESS:PORT.").Default("remediator").StringVar(&o.Dispatch.Kubernetes.PortName)
	cli.EnumVar(a.Flag("dispatch.kubernetes.scheme", "Dispatcher: http, or https when the discovered agents serve TLS.").Default("http"), &o.Dispatch.Kubernetes.Scheme, "http", "https")
	a.Flag("dispatch.kubernetes.kubeconfig", "Dispatcher: a kubeconfig file, for running outside the cluster; empty means the in-cluster configuration (the pod's service account).").StringVar(&o.Dispatch.Kubernetes.Kubeconfig)
	cli.DurationVar(a.Flag("dispatch.kubernetes.sync-timeout", "Dispatcher: how long to wait at start-up for the first list of the agents' EndpointSlices; the dispatcher does not start without it (no node is rejected only because the list is not in yet).").Default("30s"), &o.Dispatch.Kubernetes.SyncTimeout)
	a.Flag("dispatch.kubernetes.lease", "Dispatcher: a Lease (coordination.k8s.io) in --dispatch.kubernetes.namespace in which every dispatcher replica keeps the fleet limit's window (which nodes hold a turn, which wait): each decision is written back with the resourceVersion it read, so that the replicas never exceed --dispatch.max-nodes and --dispatch.max-fraction together, whichever one Alertmanager reaches, and the window survives a restart. Created when missing; needs RBAC get, create and update on leases. Without it each replica keeps its own window, in memory. Needs no --dispatch.kubernetes.service.").StringVar(&o.Dispatch.Kubernetes.Lease)
	a.Flag("dispatch.token-file", "Dispatcher: bearer token sent to node agents.").StringVar(&o.Dispatch.TokenFile)
	cli.IntVar(a.Flag("dispatch.max-nodes", "Dispatcher: most nodes that hold a turn at once. A node's turn lasts --dispatch.window from its first remediation, however often it alerts meanwhile; a free turn goes first to the nodes that had none lately, in the order they were held back.").Default("5"), &o.Dispatch.MaxNodes)
	cli.Float64Var(a.Flag("dispatch.max-fraction", "Dispatcher: most nodes that hold a turn at once, as a fraction of the known nodes, rounded down but at least 1 (the stricter of this and --dispatch.max-nodes wins).").Default("0.1"), &o.Dispatch.MaxFraction)
	cli.DurationVar(a.Flag("dispatch.window", "Dispatcher: how long a node's turn under the fleet limit lasts, from its first remediation.").Default("1h"), &o.Dispatch.Window)
	cli.DurationVar(a.Flag("dispatch.timeout", "Dispatcher: timeout of one request to a node agent.").Default("10s"), &o.Dispatch.Timeout)
	cli.IntVar(a.Flag("dispatch.max-attempts", "Dispatcher: attempts to reach a node agent that is unreachable or answers 5xx (with backoff of 2s, 4s, ... up to 64s between them) before the alert's action is recorded as failed.").Default("8"), &o.Dispatch.MaxAttempts)
	logConfig := &promslog.Config{}
	promslogflag.AddFlags(a, logConfig)
	a.Version(version.Print("gpu-orphan-remediator"))
	a.HelpFlag.Short('h')
	if _, err := a.Parse(os.Args[1:]); err != nil {
		fmt.Fprintf(os.Stderr, "gpu-orphan-remediator: %s\n", cli.ParseError(a, err))
		return 2
	}
	o.MaxBodyBytes = int64(min(maxBody, math.MaxInt64))
	if externalURL != "" {
		u, err := url.Parse(externalURL)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			fmt.Fprintf(os.Stderr, "gpu-orphan-remediator: invalid --web.external-url %q: want an absolute http or https URL, e.g. https://gpu-17.example.com:10836\n", externalURL)
			return 2
		}
		o.ExternalURL = u
	}
	o.Backend = *backend
	o.Decide = remediation.DecideConfig()
	o.Act, o.Grace, o.VerifyTimeout = remediation.Act, remediation.Grace, remediation.VerifyTimeout
	o.Logger = promslog.New(logConfig)
	// client-go's informers log through klog: into the same log.
	klog.SetSlogLogger(o.Logger)

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := app.Run(ctx, o); err != nil {
		o.Logger.Error("Remediator failed", "err", err)
		return 1
	}
	return 0
}
