package app

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/gpu-orphan/gpu-orphan/internal/cli"
	"github.com/gpu-orphan/gpu-orphan/internal/snapshot"
	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/api"
	"github.com/gpu-orphan/gpu-orphan/remediate/cleanup"
	"github.com/gpu-orphan/gpu-orphan/remediate/engine"
	"github.com/gpu-orphan/gpu-orphan/remediate/intake"
	"github.com/gpu-orphan/gpu-orphan/remediate/kill"
	"github.com/gpu-orphan/gpu-orphan/remediate/limits"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

// Wiring is one role, wired: what executes claimed actions, which alerts to
// accept, the breaker the API resets, and when the remediator is ready.
type Wiring struct {
	Exec     engine.Executor
	Classify intake.Classifier
	// Reject, when set, refuses an accepted alert before it is recorded
	// as work.
	Reject  intake.Rejecter
	Breaker api.Breaker
	// Resolved, when set, hears of each resolved alert.
	Resolved func(store.Alert)
	// Ready, when set, says why the role cannot serve yet.
	Ready func() error
}

// RoleFunc checks a role's configuration before the audit store exists,
// and returns what wires the role to the store once it does, and what to
// release when Run returns (nil for nothing). The node's is nodeRole; the
// dispatcher's is in package remediate/app/dispatcher.
type RoleFunc func(ctx context.Context, o Options, m *remediate.Metrics, reg prometheus.Registerer, logger *slog.Logger) (wire func(*store.Store) (Wiring, error), release func(), err error)

// lineageState names the node collector's memory in the store.
const lineageState = "lineage"

// nodeRole opens the backend, and returns what wires the node's cleanup to
// the store, and what closes the backend. The snapshot loop starts only
// once wired, under ctx.
func nodeRole(ctx context.Context, o Options, m *remediate.Metrics, reg prometheus.Registerer, logger *slog.Logger) (func(*store.Store) (Wiring, error), func(), error) {
	opened, err := o.Backend.Open(logger)
	if err != nil {
		return nil, nil, err
	}
	closeDriver := func() { opened.Driver.Close() }
	if err := checkPIDNamespace(opened.Proc, o.Act, logger); err != nil {
		closeDriver()
		return nil, nil, err
	}
	return func(st *store.Store) (Wiring, error) {
		var r Wiring
		fs := opened.Proc
		loop := snapshot.NewLoop(opened.Taker, o.Interval, o.Decide.MinBytes)
		// What the loop remembers (owners, descent) outlives a restart in
		// the store: a remediator restarted after an owner died still
		// knows who it was and who inherited its context.
		cli.KeepLineage(logger, loop, fs, "the store",
			func() ([]byte, bool, error) { return st.GetState(ctx, lineageState) },
			func(b []byte) error { return st.PutState(ctx, lineageState, b) })
		followed := cli.FollowForks(ctx, logger, loop, fs, o.ProcessEvents)
		reg.MustRegister(followed)
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
		if err := PersistBreaker(ctx, st, limiter, &limiter.OnBreakerChange, m, logger); err != nil {
			return r, err
		}
		r.Exec = cleanup.New(cleanup.Config{
			Snapshots: loop, Proc: fs,
			Decide: o.Decide,
			Ladder: &kill.Ladder{Grace: o.Grace, Proc: fs, Logger: logger,
				Groups: fs, Exclude: o.Decide.Rules().Why, ForkedFrom: kill.ForkedFromRecord(followed.Record)},
			Limiter: limiter, Act: o.Act, VerifyTimeout: o.VerifyTimeout,
			Recorder: st, Metrics: m, Logger: logger,
		})
		if !o.Act {
			logger.Warn("Dry run: plans are recorded, nothing is signalled. Start with --act to clean up.")
		}
		r.Breaker = limiter
		r.Classify = nodeClassifier(o.NodeLabel, o.UUIDLabel, o.NodeName, newGPUSet(loop))
		r.Ready = func() error {
			if s := loop.Latest(); s == nil || !s.Healthy() {
				return errors.New("no healthy snapshot of the GPUs yet")
			}
			return nil
		}
		return r, nil
	}, closeDriver, nil
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

// Breaker is what the node's limiter and the dispatcher's fleet share.
type Breaker interface {
	BreakerOpen() bool
	OpenBreaker(reason string)
}

// PersistBreaker restores the breaker's state from the store (an open
// breaker stays open across restarts until a human resets it) and writes
// every change back, with a metric and a log line.
func PersistBreaker(ctx context.Context, st *store.Store, b Breaker, hook *func(open bool, reason string), m *remediate.Metrics, logger *slog.Logger) error {
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
