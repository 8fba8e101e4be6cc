// Command gpu-orphan-dispatcher is the single webhook target of a fleet:
// it receives Alertmanager's notifications and routes each alert to the
// node agent (gpu-orphan-remediator) of the node it names, under
// fleet-wide limits, with the agents found in a targets file and through
// Kubernetes. It is its own binary so that the node agent, on every GPU
// node, does not link the Kubernetes client. The flags are parsed here;
// the dispatcher itself is package remediate/app/dispatcher.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/alecthomas/kingpin/v2"
	"github.com/prometheus/common/version"
	"github.com/prometheus/exporter-toolkit/web/kingpinflag"
	"k8s.io/klog/v2"

	"github.com/gpu-orphan/gpu-orphan/internal/cli"
	"github.com/gpu-orphan/gpu-orphan/remediate/app"
	"github.com/gpu-orphan/gpu-orphan/remediate/app/dispatcher"
	"github.com/gpu-orphan/gpu-orphan/remediate/remediateflag"
)

func main() { os.Exit(run()) }

func run() int {
	a := kingpin.New("gpu-orphan-dispatcher", `Receives Alertmanager's webhook notifications (POST /api/v1/alerts, payload version 4) for a fleet of GPU nodes and routes each alert to the node agent (gpu-orphan-remediator) of the node that its `+"`node`"+` label names, under fleet-wide limits. The agents come from --dispatch.targets-file and from Kubernetes discovery (--dispatch.kubernetes.service); an alert for a node on neither allow-list is rejected. The agents' results come back into --store.path.`)
	var o app.Options
	o.Web = kingpinflag.AddFlags(a, ":10836")
	server := remediateflag.AddServerFlags(a, &o)
	a.Flag("dispatch.url-template", "Node agent base URL, with {{.Node}} for the node label, e.g. https://{{.Node}}:10836; it fills only the nodes that --dispatch.targets-file names with an empty URL.").StringVar(&o.Dispatch.URLTemplate)
	a.Flag("dispatch.targets-file", `The allow-list of node agents, a JSON file mapping node names to base URLs, e.g. {"gpu-a": "https://10.0.0.5:10836", "gpu-b": ""} ("" for --dispatch.url-template's URL); read again when it changes. An alert for a node that neither it nor Kubernetes discovery names is rejected, and nothing is sent. With discovery too, this file wins for the nodes it names.`).StringVar(&o.Dispatch.TargetsFile)
	a.Flag("dispatch.kubernetes.service", "The node agents' Service (the DaemonSet's); setting it turns on Kubernetes discovery, a second allow-list: each ready endpoint of the Service's EndpointSlices (label kubernetes.io/service-name) that is a pod of --dispatch.kubernetes.daemonset on its node is the agent of its nodeName, watched through the API server. Needs RBAC list and watch on endpointslices (API group discovery.k8s.io), and get on pods and on the DaemonSet, in --dispatch.kubernetes.namespace.").StringVar(&o.Dispatch.Kubernetes.Service)
	a.Flag("dispatch.kubernetes.namespace", "The namespace of --dispatch.kubernetes.service and --dispatch.kubernetes.lease; empty means the dispatcher pod's own (from its service account).").StringVar(&o.Dispatch.Kubernetes.Namespace)
	a.Flag("dispatch.kubernetes.port-name", "The name of the EndpointSlice port on which the agents serve; a discovered agent's URL is --dispatch.kubernetes.scheme://ADDRESS:PORT.").Default("remediator").StringVar(&o.Dispatch.Kubernetes.PortName)
	a.Flag("dispatch.kubernetes.daemonset", "The node agents' DaemonSet in --dispatch.kubernetes.namespace: a discovered endpoint is an agent only if its targetRef names a pod that exists, that this DaemonSet controls (by name and UID), on the endpoint's node, at the endpoint's address and port; any other endpoint (a hand-made EndpointSlice with copied labels and owner) is ignored and logged. Needs RBAC get on pods and on this DaemonSet (API group apps). Empty means the name of --dispatch.kubernetes.service.").StringVar(&o.Dispatch.Kubernetes.DaemonSet)
	cli.EnumVar(a.Flag("dispatch.kubernetes.scheme", "http, or https when the discovered agents serve TLS.").Default("http"), &o.Dispatch.Kubernetes.Scheme, "http", "https")
	a.Flag("dispatch.kubernetes.kubeconfig", "A kubeconfig file, for running outside the cluster; empty means the in-cluster configuration (the pod's service account).").StringVar(&o.Dispatch.Kubernetes.Kubeconfig)
	cli.DurationVar(a.Flag("dispatch.kubernetes.sync-timeout", "How long to wait at start-up for the first list of the agents' EndpointSlices; the dispatcher does not start without it (no node is rejected only because the list is not in yet).").Default("30s"), &o.Dispatch.Kubernetes.SyncTimeout)
	a.Flag("dispatch.kubernetes.lease", "A Lease (coordination.k8s.io) in --dispatch.kubernetes.namespace in which every dispatcher replica keeps the fleet limit's window (which nodes hold a turn, which wait): each decision is written back with the resourceVersion it read, so that the replicas never exceed --dispatch.max-nodes and --dispatch.max-fraction together, whichever one Alertmanager reaches, and the window survives a restart. Created when missing; needs RBAC get, create and update on leases. Without it each replica keeps its own window, in memory. Needs no --dispatch.kubernetes.service.").StringVar(&o.Dispatch.Kubernetes.Lease)
	a.Flag("dispatch.token-file", "The fleet's secret, the node agents' --auth.token-file: each request to a node's agent is signed (HMAC-SHA256, with a time and a nonce) with a key derived from it for that node, which the agent checks against its --node.name. The token itself is never sent to agents: whoever holds an agent's port learns nothing that works on another node, later, or twice.").StringVar(&o.Dispatch.TokenFile)
	cli.IntVar(a.Flag("dispatch.max-nodes", "Most nodes that hold a turn at once. A node's turn lasts --dispatch.window from its first remediation, however often it alerts meanwhile; a free turn goes first to the nodes that had none lately, in the order they were held back.").Default("5"), &o.Dispatch.MaxNodes)
	cli.Float64Var(a.Flag("dispatch.max-fraction", "Most nodes that hold a turn at once, as a fraction of the known nodes, rounded down but at least 1 (the stricter of this and --dispatch.max-nodes wins).").Default("0.1"), &o.Dispatch.MaxFraction)
	cli.DurationVar(a.Flag("dispatch.window", "How long a node's turn under the fleet limit lasts, from its first remediation.").Default("1h"), &o.Dispatch.Window)
	cli.DurationVar(a.Flag("dispatch.timeout", "Timeout of one request to a node agent.").Default("10s"), &o.Dispatch.Timeout)
	cli.IntVar(a.Flag("dispatch.max-attempts", "Attempts to reach a node agent that is unreachable or answers 5xx (with backoff of 2s, 4s, ... up to 64s between them) before the alert's action is recorded as failed.").Default("8"), &o.Dispatch.MaxAttempts)
	goRuntime := cli.AddRuntimeFlags(a)
	var esc dispatcher.Escalate
	a.Flag("escalate.taint", "Take a node out of scheduling when its GPU memory cannot be brought back: when the node agent's cleanup ends failed with an escalation (memory that no visible process holds), or an alert's last attempt ends with the memory held, the node gets the taint gpu-orphan.io/unreclaimable-memory=<GPU UUID>:NoSchedule and an Event (namespace default); the taint goes when a later cleanup of that GPU brings the memory back or the alert resolves. Never more than --dispatch.max-fraction of the known nodes carry it at once. Needs RBAC get and patch on nodes and create on events in namespace default; without it the refusal is logged and recorded, and the dispatcher goes on.").BoolVar(&esc.Taint)
	a.Version(version.Print("gpu-orphan-dispatcher"))
	cli.HelpOnStdout(a)
	if _, err := a.Parse(os.Args[1:]); err != nil {
		fmt.Fprintf(os.Stderr, "gpu-orphan-dispatcher: %s\n", cli.ParseError(a, err))
		return 2
	}
	if err := server.Finish(); err != nil {
		fmt.Fprintf(os.Stderr, "gpu-orphan-dispatcher: %s\n", err)
		return 2
	}
	goRuntime.Apply()
	// client-go's informers log through klog: into the same log.
	klog.SetSlogLogger(o.Logger)

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	err := dispatcher.Run(ctx, o, esc)
	if err != nil {
		o.Logger.Error("Dispatcher failed", "err", err)
		// The log line is for log pipelines; the person who started it
		// reads a plain last line.
		fmt.Fprintf(os.Stderr, "gpu-orphan-dispatcher: %v\n", err)
	}
	return cli.ExitCode(err)
}
