package app

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/gpu-orphan/gpu-orphan/internal/cli"
	"github.com/gpu-orphan/gpu-orphan/internal/snapshot"
	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/cleanup"
	"github.com/gpu-orphan/gpu-orphan/remediate/discovery"
	"github.com/gpu-orphan/gpu-orphan/remediate/dispatch"
	"github.com/gpu-orphan/gpu-orphan/remediate/intake"
	"github.com/gpu-orphan/gpu-orphan/remediate/kill"
	"github.com/gpu-orphan/gpu-orphan/remediate/limits"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

// lineageState names the node collector's memory in the store.
const lineageState = "lineage"

// nodeRole opens the backend, and returns what wires the node's cleanup to
// the store, and what closes the backend. The snapshot loop starts only
// once wired, under ctx.
func nodeRole(ctx context.Context, o Options, m *remediate.Metrics, logger *slog.Logger) (func(*store.Store) (role, error), func(), error) {
	opened, err := o.Backend.Open(logger)
	if err != nil {
		return nil, nil, err
	}
	closeDriver := func() { opened.Driver.Close() }
	if err := checkPIDNamespace(opened.Proc, o.Act, logger); err != nil {
		closeDriver()
		return nil, nil, err
	}
	return func(st *store.Store) (role, error) {
		var r role
		fs := opened.Proc
		loop := snapshot.NewLoop(opened.Taker, o.Interval, o.Decide.MinBytes)
		// What the loop remembers (owners, descent) outlives a restart in
		// the store: a remediator restarted after an owner died still
		// knows who it was and who inherited its context.
		cli.KeepLineage(logger, loop, fs, "the store",
			func() ([]byte, bool, error) { return st.GetState(ctx, lineageState) },
			func(b []byte) error { return st.PutState(ctx, lineageState, b) })
		loop.Refresh(ctx, false)
		go loop.Run(ctx)
		go func() {
			for {
				select {
				case <-ctx.Done():
					return
				case <-loop.Next():
					m.RecordedDescendants.Set(float64(loop.Lineage().RecordedDescendants()))
				}
			}
		}()

		limiter := limits.New(o.Limits, limits.RealClock{})
		if err := persistBreaker(ctx, st, limiter, &limiter.OnBreakerChange, m, logger); err != nil {
			return r, err
		}
		r.exec = cleanup.New(cleanup.Config{
			Snapshots: loop, Proc: fs,
			Decide: o.Decide,
			Ladder: &kill.Ladder{Grace: o.Grace, Proc: fs, Logger: logger,
				Groups: fs, Exclude: o.Decide.Rules().Why},
			Limiter: limiter, Act: o.Act, VerifyTimeout: o.VerifyTimeout,
			Recorder: st, Metrics: m, Logger: logger,
		})
		if !o.Act {
			logger.Warn("Dry run: plans are recorded, nothing is signalled. Start with --act to clean up.")
		}
		r.breaker = limiter
		r.classify = nodeClassifier(o.NodeLabel, o.UUIDLabel, o.NodeName, newGPUSet(loop))
		r.ready = func() error {
			if s := loop.Latest(); s == nil || !s.Healthy() {
				return errors.New("no healthy snapshot of the GPUs yet")
			}
			return nil
		}
		return r, nil
	}, closeDriver, nil
}

// dispatcherRole reads the dispatcher's routes and token, lists its
// discovered agents, and returns what wires the dispatcher to the store.
func dispatcherRole(ctx context.Context, o Options, m *remediate.Metrics, reg prometheus.Registerer, logger *slog.Logger) (func(*store.Store) (role, error), error) {
	token := ""
	if o.Dispatch.TokenFile != "" {
		b, err := os.ReadFile(o.Dispatch.TokenFile)
		if err != nil {
			return nil, fmt.Errorf("reading --dispatch.token-file: %w", err)
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
			Kubeconfig: k.Kubeconfig, SyncTimeout: k.SyncTimeout, Registerer: reg, Logger: logger})
		if err != nil {
			return nil, err
		}
		found = kube
	}
	shared, err := sharedWindow(ctx, o, fleet, logger)
	if err != nil {
		return nil, err
	}
	// The store opens after the checks; the dispatcher reads the alerts'
	// labels from it, to forward them as received.
	var labelStore *store.Store
	d, err := dispatch.New(dispatch.Config{
		URLTemplate: o.Dispatch.URLTemplate, TargetsFile: o.Dispatch.TargetsFile, Discovery: found, Token: token,
		Client: &http.Client{Timeout: o.Dispatch.Timeout}, Fleet: fleet, Shared: shared, NodeLabel: o.NodeLabel,
		MaxAttempts: o.Dispatch.MaxAttempts, Metrics: m, Logger: logger,
		Labels: func(ctx context.Context, fingerprint string, startsAt time.Time) (map[string]string, error) {
			return labelStore.AlertLabels(ctx, fingerprint, startsAt)
		},
	})
	if err != nil {
		return nil, err
	}
	if kube != nil {
		// Before serving: until the first list is in, every discovered
		// node would be rejected as unknown.
		if err := kube.Start(ctx); err != nil {
			return nil, err
		}
	}
	return func(st *store.Store) (role, error) {
		labelStore = st
		if err := persistBreaker(ctx, st, fleet, &fleet.OnBreakerChange, m, logger); err != nil {
			return role{}, err
		}
		// The agents' results come back into this store, for the fleet's
		// audit record and `gpu-orphan report --url`.
		go d.Follow(ctx, st)
		return role{
			exec: d, breaker: fleet,
			classify: dispatchClassifier(o.NodeLabel, o.UUIDLabel),
			reject: func(labels map[string]string) string {
				if node := labels[o.NodeLabel]; !d.Known(node) {
					return "node " + strconv.Quote(node) + " is on no allow-list (--dispatch.targets-file, Kubernetes discovery): never contacted"
				}
				return ""
			},
			// Resolved alerts go on to the node, to cancel its queued work.
			resolved: func(a store.Alert) {
				go func() {
					ctx, cancel := context.WithTimeout(context.Background(), o.Dispatch.Timeout)
					defer cancel()
					d.ForwardResolved(ctx, a.Node, a.Labels, a.Fingerprint, a.StartsAt)
				}()
			},
		}, nil
	}, nil
}

// gpuSet answers whether a UUID names one of this node's GPUs. It keeps
// the GPUs of the last snapshot that listed any, so that alerts arriving
// while the driver fails are still recorded (the decision later refuses to
// act on the failing snapshot, and retries).
type gpuSet struct {
	loop *snapshot.Loop
	mu   *sync.Mutex
	last map[string]bool
}

func newGPUSet(loop *snapshot.Loop) gpuSet {
	g := gpuSet{loop: loop, mu: &sync.Mutex{}, last: map[string]bool{}}
	g.update()
	return g
}

// update remembers the GPUs of the latest snapshot, if it listed any.
func (g gpuSet) update() {
	if s := g.loop.Latest(); s != nil && len(s.GPUs) > 0 {
		clear(g.last)
		for _, gp := range s.GPUs {
			g.last[gp.Device.UUID] = true
		}
	}
}

func (g gpuSet) KnownGPU(uuid string) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.update()
	return g.last[uuid]
}

// nodeClassifier accepts alerts for this node and one of its GPUs.
func nodeClassifier(nodeLabel, uuidLabel, nodeName string, gpus interface {
	KnownGPU(uuid string) bool
}) intake.Classifier {
	return func(labels map[string]string) (string, string, string) {
		node, uuid := labels[nodeLabel], labels[uuidLabel]
		switch {
		case uuid == "":
			return node, uuid, "no " + uuidLabel + " label"
		case node == "":
			return node, uuid, "no " + nodeLabel + " label"
		case node != nodeName:
			return node, uuid, "for another node"
		case !gpus.KnownGPU(uuid):
			return node, uuid, "uuid names no GPU of this node"
		}
		return node, uuid, ""
	}
}

// dispatchClassifier accepts alerts that name a GPU; nodes on no
// allow-list are rejected before (role.reject).
func dispatchClassifier(nodeLabel, uuidLabel string) intake.Classifier {
	return func(labels map[string]string) (string, string, string) {
		node, uuid := labels[nodeLabel], labels[uuidLabel]
		if uuid == "" || !strings.HasPrefix(uuid, "GPU-") && !strings.HasPrefix(uuid, "MIG-") {
			return node, uuid, "no valid " + uuidLabel + " label"
		}
		return node, uuid, ""
	}
}

// breaker is what the node's limiter and the dispatcher's fleet share.
type breaker interface {
	BreakerOpen() bool
	OpenBreaker(reason string)
}

// persistBreaker restores the breaker's state from the store (an open
// breaker stays open across restarts until a human resets it) and writes
// every change back, with a metric and a log line.
func persistBreaker(ctx context.Context, st *store.Store, b breaker, hook *func(open bool, reason string), m *remediate.Metrics, logger *slog.Logger) error {
	open, reason, _, err := st.Breaker(ctx)
	if err != nil {
		return fmt.Errorf("reading the breaker's state: %w", err)
	}
	if open {
		b.OpenBreaker(reason)
		logger.Warn("Circuit breaker is open from before the restart: nothing acts until POST /api/v1/breaker/reset", "reason", reason)
	}
	m.BreakerOpen.Set(boolFloat(b.BreakerOpen()))
	*hook = func(open bool, reason string) {
		m.BreakerOpen.Set(boolFloat(open))
		if open {
			logger.Error("Circuit breaker opened: no more cleanups until a human resets it", "reason", reason)
		} else {
			logger.Warn("Circuit breaker closed")
		}
		if err := st.SetBreaker(context.Background(), open, reason, time.Now()); err != nil {
			logger.Error("Persisting the breaker's state failed", "err", err)
		}
	}
	return nil
}

func boolFloat(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
