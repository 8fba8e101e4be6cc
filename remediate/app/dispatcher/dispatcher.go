// Package dispatcher is the remediator's dispatcher role, wired: it routes
// each alert to the node agent of the node it names (package
// remediate/dispatch), under fleet-wide limits, with the agents found in a
// targets file and through Kubernetes (package remediate/discovery, which
// links client-go). Only cmd/gpu-orphan-dispatcher imports it, so that the
// node agent, which runs on every GPU node, does not carry the Kubernetes
// client.
package dispatcher

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/gpu-orphan/gpu-orphan/internal/cli"
	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/app"
	"github.com/gpu-orphan/gpu-orphan/remediate/discovery"
	"github.com/gpu-orphan/gpu-orphan/remediate/dispatch"
	"github.com/gpu-orphan/gpu-orphan/remediate/intake"
	"github.com/gpu-orphan/gpu-orphan/remediate/limits"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

// Escalate configures what the dispatcher does beyond forwarding when a
// node's memory cannot be brought back.
type Escalate struct {
	// Taint (--escalate.taint) takes such a node out of scheduling with a
	// taint, and puts it back once its GPU is clean (dispatch.Taints).
	Taint bool
}

// Run serves the dispatcher until ctx ends: app.Run with RoleDispatcher
// and its wiring (o.Dispatch configures it, e its escalation).
func Run(ctx context.Context, o app.Options, e Escalate) error {
	o.Role = app.RoleDispatcher
	o.Dispatcher = func(ctx context.Context, o app.Options, m *remediate.Metrics, reg prometheus.Registerer, logger *slog.Logger) (func(*store.Store) (app.Wiring, error), func(), error) {
		return role(ctx, o, e, m, reg, logger)
	}
	return app.Run(ctx, o)
}

// role reads the dispatcher's routes and token, lists its discovered
// agents, and returns what wires the dispatcher to the store.
func role(ctx context.Context, o app.Options, e Escalate, m *remediate.Metrics, reg prometheus.Registerer, logger *slog.Logger) (func(*store.Store) (app.Wiring, error), func(), error) {
	if o.Dispatch.TargetsFile == "" && o.Dispatch.Kubernetes.Service == "" {
		// dispatch.New refuses it too; here it is a mistake in the
		// command line.
		return nil, nil, cli.Usagef("the dispatcher needs an allow-list of its agents: --dispatch.targets-file (node to URL; " +
			"--dispatch.url-template fills only the nodes it names with an empty URL), Kubernetes discovery (--dispatch.kubernetes.service), or both")
	}
	token := ""
	if o.Dispatch.TokenFile != "" {
		b, err := os.ReadFile(o.Dispatch.TokenFile)
		if err != nil {
			return nil, nil, fmt.Errorf("reading --dispatch.token-file: %w", err)
		}
		token = strings.TrimSpace(string(b))
	}
	fleet := limits.NewFleet(limits.FleetConfig{MaxNodes: o.Dispatch.MaxNodes, MaxFraction: o.Dispatch.MaxFraction, Window: o.Dispatch.Window,
		BreakerFailures: o.Limits.BreakerFailures, BreakerWindow: o.Limits.BreakerWindow}, limits.RealClock{})
	var (
		kube  *discovery.Kubernetes
		found dispatch.AgentSource
	)
	if k := o.Dispatch.Kubernetes; k.Service != "" {
		var err error
		kube, err = discovery.New(discovery.Config{Service: k.Service, Namespace: k.Namespace, PortName: k.PortName, Scheme: k.Scheme,
			Kubeconfig: k.Kubeconfig, SyncTimeout: k.SyncTimeout, DaemonSet: k.DaemonSet, Registerer: reg, Logger: logger})
		if err != nil {
			return nil, nil, err
		}
		found = kube
	}
	shared, err := sharedWindow(ctx, o, fleet, logger)
	if err != nil {
		return nil, nil, err
	}
	var taints *dispatch.Taints
	if e.Taint {
		if taints, err = newTaints(o, logger); err != nil {
			return nil, nil, err
		}
	}
	// The store opens after the checks; the dispatcher reads the alerts'
	// labels from it, to forward them as received.
	var labelStore *store.Store
	d, err := dispatch.New(dispatch.Config{
		URLTemplate: o.Dispatch.URLTemplate, TargetsFile: o.Dispatch.TargetsFile, Discovery: found, Token: token,
		Client: &http.Client{Timeout: o.Dispatch.Timeout}, Fleet: fleet, Shared: shared, NodeLabel: o.NodeLabel,
		MaxAttempts: o.Dispatch.MaxAttempts, Metrics: m, Logger: logger, Taints: taints, AlertAttempts: store.DefaultMaxAttempts,
		Labels: func(ctx context.Context, fingerprint string, startsAt time.Time) (map[string]string, error) {
			return labelStore.AlertLabels(ctx, fingerprint, startsAt)
		},
	})
	if err != nil {
		return nil, nil, err
	}
	if kube != nil {
		// Before serving: until the first list is in, every discovered
		// node would be rejected as unknown.
		if err := kube.Start(ctx); err != nil {
			return nil, nil, err
		}
	}
	return func(st *store.Store) (app.Wiring, error) {
		labelStore = st
		if err := app.PersistBreaker(ctx, st, fleet, &fleet.OnBreakerChange, m, logger); err != nil {
			return app.Wiring{}, err
		}
		// The agents' results come back into this store, for the fleet's
		// audit record and `gpu-orphan report --url`.
		go d.Follow(ctx, st)
		return app.Wiring{
			Exec: d, Breaker: fleet,
			Classify: classifier(o.NodeLabel, o.UUIDLabel),
			Reject: func(labels map[string]string) string {
				if node := labels[o.NodeLabel]; !d.Known(node) {
					return "node " + strconv.Quote(node) + " is on no allow-list (--dispatch.targets-file, Kubernetes discovery): never contacted"
				}
				return ""
			},
			// Resolved alerts go on to the node, to cancel its queued work.
			Resolved: func(a store.Alert) {
				go func() {
					ctx, cancel := context.WithTimeout(context.Background(), o.Dispatch.Timeout)
					defer cancel()
					d.ForwardResolved(ctx, a.Node, a.Labels, a.Fingerprint, a.StartsAt)
					// The memory is back: the node goes back into scheduling.
					d.AlertResolved(ctx, st, a.Node, a.GPUUUID)
				}()
			},
		}, nil
	}, nil, nil
}

// classifier accepts alerts that name a GPU; nodes on no allow-list are
// rejected before (Wiring.Reject).
func classifier(nodeLabel, uuidLabel string) intake.Classifier {
	return func(labels map[string]string) (string, string, string) {
		node, uuid := labels[nodeLabel], labels[uuidLabel]
		if uuid == "" || !strings.HasPrefix(uuid, "GPU-") && !strings.HasPrefix(uuid, "MIG-") {
			return node, uuid, "no valid " + uuidLabel + " label"
		}
		return node, uuid, ""
	}
}
