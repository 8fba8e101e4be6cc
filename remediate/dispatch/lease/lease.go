// Package lease keeps the dispatcher's fleet limit in a Kubernetes Lease
// (coordination.k8s.io/v1), so that several dispatcher replicas never
// exceed it together.
//
// The fleet window (limits.FleetWindow: each node's latest turn, and the
// line of nodes waiting for one) is an annotation of the Lease. A replica
// decides on an alert by reading the Lease, deciding on its window
// (limits.Fleet.AllowIn), and writing the window back with the
// resourceVersion it read: the API server refuses the write (409) if any
// other replica wrote in between, and the replica then reads again and
// decides again. A node is forwarded only after a write that counted it
// went through, so the turns held never exceed the cap, whichever replica
// Alertmanager reaches, however the replicas' clocks or the network
// behave. Nothing elects a leader: no replica waits for a lease to expire
// after another one stopped, and neither answers Alertmanager with an
// error because it is not the leader.
//
// The dispatcher's RBAC needs get, create and update on leases in its
// namespace. Whoever else can write that Lease can change the window
// (hold every node back, or free the turns): the same people who could
// change the dispatcher's Deployment in that namespace.
package lease

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	coordinationclient "k8s.io/client-go/kubernetes/typed/coordination/v1"
	"k8s.io/client-go/rest"

	"github.com/gpu-orphan/gpu-orphan/remediate/limits"
)

// Annotation holds the fleet window on the Lease, as JSON.
const Annotation = "gpu-orphan.io/fleet-window"

// maxAttempts bounds the reads and writes of one decision when other
// replicas keep writing in between.
const maxAttempts = 20

// Config configures a Window.
type Config struct {
	// Namespace and Name are the Lease's; it is created when missing.
	Namespace, Name string
	// Identity names this replica in the Lease's holderIdentity, the last
	// writer, for a human (kubectl get lease).
	Identity string
	// RESTConfig reaches the API server (discovery.ClientConfig).
	RESTConfig *rest.Config
	// Fleet decides, on the shared window; its breaker stays this
	// replica's.
	Fleet *limits.Fleet
	// Timeout bounds one decision, all its requests together (10 s when
	// zero).
	Timeout time.Duration
	Logger  *slog.Logger
}

// Window is the fleet window that the dispatcher replicas share. It is
// safe for concurrent use, and implements dispatch.SharedWindow.
type Window struct {
	cfg    Config
	leases coordinationclient.LeaseInterface
	// mu orders this replica's decisions; other replicas are ordered by
	// the Lease's resourceVersion.
	mu sync.Mutex
}

// New checks cfg and returns a Window; it does not contact the API server
// (Check does).
func New(cfg Config) (*Window, error) {
	if cfg.Name == "" || cfg.Namespace == "" {
		return nil, errors.New("the fleet window's Lease needs a name and a namespace")
	}
	if cfg.Fleet == nil || cfg.RESTConfig == nil {
		return nil, errors.New("the fleet window's Lease needs a Fleet and the API server's configuration")
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 10 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	rc := rest.CopyConfig(cfg.RESTConfig)
	// JSON, which every API server (and the test one) speaks.
	rc.ContentType, rc.AcceptContentTypes = "application/json", "application/json"
	// Two requests a decision; client-go's default of 5 a second would
	// make a burst of alerts wait on this side.
	rc.QPS, rc.Burst = 20, 40
	client, err := coordinationclient.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("the fleet window's Lease: %w", err)
	}
	return &Window{cfg: cfg, leases: client.Leases(cfg.Namespace)}, nil
}

func (w *Window) where() string {
	return "Lease " + w.cfg.Namespace + "/" + w.cfg.Name
}

// Check reads the Lease, creating it if need be, so that a start without
// the RBAC for it fails at once, saying which it needs.
func (w *Window) Check(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, w.cfg.Timeout)
	defer cancel()
	_, err := w.leases.Get(ctx, w.cfg.Name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		_, err = w.leases.Create(ctx, w.newLease(nil), metav1.CreateOptions{})
		if apierrors.IsAlreadyExists(err) {
			err = nil
		}
	}
	return w.explain(err)
}

// explain says what an API error means for the dispatcher.
func (w *Window) explain(err error) error {
	switch {
	case err == nil:
		return nil
	case apierrors.IsForbidden(err):
		return fmt.Errorf("the fleet limit's shared window, %s: forbidden: the dispatcher's service account needs RBAC verbs get, create and update on leases (API group coordination.k8s.io) in namespace %s: %w",
			w.where(), w.cfg.Namespace, err)
	case apierrors.IsUnauthorized(err):
		return fmt.Errorf("the fleet limit's shared window, %s: the API server refused the dispatcher's credentials: %w", w.where(), err)
	}
	return fmt.Errorf("the fleet limit's shared window, %s: %w", w.where(), err)
}

func (w *Window) newLease(annotations map[string]string) *coordinationv1.Lease {
	return &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: w.cfg.Name, Namespace: w.cfg.Namespace, Annotations: annotations,
		Labels: map[string]string{"app.kubernetes.io/name": "gpu-orphan", "app.kubernetes.io/component": "dispatcher"}}}
}

// Allow is limits.Fleet.Allow on the window the replicas share: it
// returns nil when node may be served now, a *limits.Limited when a limit
// holds it back, or another error when the window could not be read or
// written (then nothing was counted, and the node must not be served).
func (w *Window) Allow(ctx context.Context, node string, knownNodes int) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	ctx, cancel := context.WithTimeout(ctx, w.cfg.Timeout)
	defer cancel()
	for attempt := 1; attempt <= maxAttempts; attempt++ {
		lease, err := w.leases.Get(ctx, w.cfg.Name, metav1.GetOptions{})
		create := apierrors.IsNotFound(err)
		if create {
			lease, err = w.newLease(nil), nil
		}
		if err != nil {
			return w.explain(err)
		}
		raw := lease.Annotations[Annotation]
		var win limits.FleetWindow
		if raw != "" {
			if err := json.Unmarshal([]byte(raw), &win); err != nil {
				// Fail closed: a window that cannot be read counts
				// nobody, and serving would count nobody either.
				return fmt.Errorf("the fleet limit's shared window, annotation %s of %s, cannot be read (delete the Lease to start an empty window): %w",
					Annotation, w.where(), err)
			}
		}
		decision := w.cfg.Fleet.AllowIn(&win, node, knownNodes)
		if _, limit, ok := limits.Retry(decision); decision != nil && (!ok || limit == limits.LimitBreaker) {
			// This replica's breaker: nothing was decided on the window.
			return decision
		}
		b, err := json.Marshal(win)
		if err != nil {
			return err
		}
		if string(b) == raw && !create {
			return decision
		}
		if lease.Annotations == nil {
			lease.Annotations = map[string]string{}
		}
		lease.Annotations[Annotation] = string(b)
		now := metav1.NowMicro()
		lease.Spec.HolderIdentity, lease.Spec.RenewTime = &w.cfg.Identity, &now
		if create {
			_, err = w.leases.Create(ctx, lease, metav1.CreateOptions{})
		} else {
			_, err = w.leases.Update(ctx, lease, metav1.UpdateOptions{})
		}
		switch {
		case err == nil:
			return decision
		case apierrors.IsConflict(err) || apierrors.IsAlreadyExists(err):
			// Another replica wrote first: read its window, decide again.
			w.cfg.Logger.Debug("The fleet window changed meanwhile; deciding again", "lease", w.where(), "node", node, "attempt", attempt)
			continue
		default:
			return w.explain(err)
		}
	}
	return fmt.Errorf("the fleet limit's shared window, %s: other replicas wrote it %d times while this one decided; will retry", w.where(), maxAttempts)
}
