package dispatcher

import (
	"context"
	"fmt"
	"log/slog"
	"os"

	"github.com/gpu-orphan/gpu-orphan/remediate/app"
	"github.com/gpu-orphan/gpu-orphan/remediate/discovery"
	"github.com/gpu-orphan/gpu-orphan/remediate/dispatch"
	"github.com/gpu-orphan/gpu-orphan/remediate/dispatch/lease"
	"github.com/gpu-orphan/gpu-orphan/remediate/limits"
)

// sharedWindow is the fleet limit's window that the dispatcher replicas
// keep together in a Lease (--dispatch.kubernetes.lease), checked before
// the store is created; nil without it, when each replica keeps its own.
func sharedWindow(ctx context.Context, o app.Options, fleet *limits.Fleet, logger *slog.Logger) (dispatch.SharedWindow, error) {
	k := o.Dispatch.Kubernetes
	if k.Lease == "" {
		return nil, nil
	}
	ns, err := discovery.Namespace(k.Namespace, "")
	if err != nil {
		return nil, err
	}
	rc, err := discovery.ClientConfig(k.Kubeconfig)
	if err != nil {
		return nil, err
	}
	identity, err := os.Hostname() // the pod's name
	if err != nil {
		identity = "unknown"
	}
	w, err := lease.New(lease.Config{Namespace: ns, Name: k.Lease, Identity: identity, RESTConfig: rc, Fleet: fleet,
		Timeout: o.Dispatch.Timeout, Logger: logger})
	if err != nil {
		return nil, err
	}
	if err := w.Check(ctx); err != nil {
		return nil, err
	}
	logger.Info("The fleet limit's window is shared with the other dispatcher replicas", "lease", ns+"/"+k.Lease, "identity", identity)
	return w, nil
}

// newTaints is the dispatcher's hand on the nodes' taints
// (--escalate.taint), through the API server as --dispatch.kubernetes.kubeconfig
// or the pod's service account reach it.
func newTaints(o app.Options, logger *slog.Logger) (*dispatch.Taints, error) {
	rc, err := discovery.ClientConfig(o.Dispatch.Kubernetes.Kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("--escalate.taint: %w", err)
	}
	identity, err := os.Hostname()
	if err != nil {
		identity = "gpu-orphan-dispatcher"
	}
	logger.Info("Nodes whose GPU memory cannot be brought back are taken out of scheduling", "taint", dispatch.TaintKey+"=<GPU UUID>:NoSchedule",
		"max_fraction", o.Dispatch.MaxFraction, "events_namespace", dispatch.EventNamespace)
	return dispatch.NewTaints(dispatch.TaintConfig{RESTConfig: rc, MaxFraction: o.Dispatch.MaxFraction, Identity: identity, Timeout: o.Dispatch.Timeout})
}
