package main

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/cli"
	"github.com/gpu-orphan/gpu-orphan/internal/snapshot"
	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/cleanup"
	"github.com/gpu-orphan/gpu-orphan/remediate/dispatch"
	"github.com/gpu-orphan/gpu-orphan/remediate/kill"
	"github.com/gpu-orphan/gpu-orphan/remediate/limits"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

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

// nodeRole wires the node's cleanup over an opened backend, whose driver
// the caller closes once running actions are done.
func nodeRole(ctx context.Context, f *flags, opened *cli.Node, st *store.Store, m *remediate.Metrics, logger *slog.Logger) (*cleanup.Node, gpuSet, *limits.Limiter, error) {
	fs := opened.Proc
	loop := snapshot.NewLoop(opened.Taker, *f.interval, f.remediation.MinBytes)
	loop.Refresh(ctx, false)
	go loop.Run(ctx)

	limiter := limits.New(f.limits, limits.RealClock{})
	if err := persistBreaker(ctx, st, limiter, &limiter.OnBreakerChange, m, logger); err != nil {
		return nil, gpuSet{}, nil, err
	}

	decideCfg := f.remediation.DecideConfig()
	node := cleanup.New(cleanup.Config{
		Snapshots: loop, Proc: fs,
		Decide: decideCfg,
		Ladder: &kill.Ladder{Grace: f.remediation.Grace, Proc: fs, Logger: logger,
			Groups: fs, Exclude: decideCfg.Rules().Why},
		Limiter: limiter, Act: f.remediation.Act, VerifyTimeout: f.remediation.VerifyTimeout,
		Recorder: st, Metrics: m, Logger: logger,
	})
	if !f.remediation.Act {
		logger.Warn("Dry run: plans are recorded, nothing is signalled. Start with --act to clean up.")
	}
	return node, newGPUSet(loop), limiter, nil
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

func dispatcherRole(ctx context.Context, f *flags, st *store.Store, m *remediate.Metrics, logger *slog.Logger) (*dispatch.Dispatcher, *limits.Fleet, error) {
	var targets map[string]string
	if *f.dispatch.targetsFile != "" {
		t, err := dispatch.LoadTargets(*f.dispatch.targetsFile)
		if err != nil {
			return nil, nil, err
		}
		targets = t
	}
	token := ""
	if *f.dispatch.tokenFile != "" {
		b, err := os.ReadFile(*f.dispatch.tokenFile)
		if err != nil {
			return nil, nil, fmt.Errorf("reading --dispatch.token-file: %w", err)
		}
		token = strings.TrimSpace(string(b))
	}
	fleet := limits.NewFleet(limits.FleetConfig{MaxNodes: *f.dispatch.maxNodes, MaxFraction: *f.dispatch.maxFraction, Window: *f.dispatch.window,
		BreakerFailures: f.limits.BreakerFailures, BreakerWindow: f.limits.BreakerWindow}, limits.RealClock{})
	if err := persistBreaker(ctx, st, fleet, &fleet.OnBreakerChange, m, logger); err != nil {
		return nil, nil, err
	}
	d, err := dispatch.New(dispatch.Config{
		URLTemplate: *f.dispatch.urlTemplate, Targets: targets, Token: token,
		Client: &http.Client{Timeout: *f.dispatch.timeout}, Fleet: fleet, NodeLabel: *f.nodeLabel,
		MaxAttempts: *f.dispatch.maxAttempts, Metrics: m, Logger: logger,
	})
	if err != nil {
		return nil, nil, err
	}
	return d, fleet, nil
}

func boolFloat(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
