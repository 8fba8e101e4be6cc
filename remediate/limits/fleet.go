package limits

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
	"time"
)

// FleetConfig holds the dispatcher's limits across nodes. A zero field
// turns its limit off.
type FleetConfig struct {
	// At most MaxNodes distinct nodes, and at most MaxFraction of the known
	// nodes, are remediated per sliding Window; the stricter cap wins. The
	// fraction is rounded down but allows at least 1 node, so that a small
	// fleet is slowed rather than stopped. A zero Window counts nothing.
	MaxNodes    int
	MaxFraction float64
	Window      time.Duration
	// BreakerFailures failed cleanups, on any nodes, within BreakerWindow
	// open the fleet's breaker. A window of zero counts every failure since
	// the last Reset.
	BreakerFailures int
	BreakerWindow   time.Duration
}

// DefaultFleetConfig returns conservative limits: at most 5 nodes, and at
// most a tenth of the fleet, per hour; 5 failures in an hour stop the fleet.
func DefaultFleetConfig() FleetConfig {
	return FleetConfig{
		MaxNodes:        5,
		MaxFraction:     0.1,
		Window:          time.Hour,
		BreakerFailures: 5,
		BreakerWindow:   time.Hour,
	}
}

// Validate reports settings that are surely mistakes.
func (c FleetConfig) Validate() error {
	var errs []error
	if c.MaxNodes < 0 {
		errs = append(errs, fmt.Errorf("max nodes %d is negative", c.MaxNodes))
	}
	if !(c.MaxFraction >= 0 && c.MaxFraction <= 1) {
		errs = append(errs, fmt.Errorf("max fraction %v is not between 0 and 1", c.MaxFraction))
	}
	if c.Window < 0 {
		errs = append(errs, fmt.Errorf("window %s is negative", c.Window))
	}
	if c.BreakerFailures < 0 {
		errs = append(errs, fmt.Errorf("breaker failures %d is negative", c.BreakerFailures))
	}
	if c.BreakerWindow < 0 {
		errs = append(errs, fmt.Errorf("breaker window %s is negative", c.BreakerWindow))
	}
	return errors.Join(errs...)
}

// MaxNodesFor returns how many distinct nodes may be remediated per window
// when knownNodes nodes are known, or math.MaxInt when there is no cap.
func (c FleetConfig) MaxNodesFor(knownNodes int) int {
	n := math.MaxInt
	if c.Window <= 0 {
		return n
	}
	if c.MaxNodes > 0 {
		n = c.MaxNodes
	}
	if c.MaxFraction > 0 && !math.IsNaN(c.MaxFraction) {
		// The epsilon keeps 0.29 × 100 = 28.999… from rounding down to 28.
		f := int(math.Floor(c.MaxFraction*float64(max(knownNodes, 0)) + 1e-9))
		n = min(n, max(f, 1))
	}
	return n
}

// Fleet holds the dispatcher's limits across nodes. It is safe for
// concurrent use.
type Fleet struct {
	// OnBreakerChange, if set, is called on every change of the fleet's
	// breaker between open and closed, in order, so that the state can be
	// persisted. Set it before the Fleet is used. It may call State but
	// must not open or reset the breaker.
	OnBreakerChange func(open bool, reason string)

	cfg     FleetConfig
	clock   Clock
	breaker *Breaker

	mu    sync.Mutex
	nodes map[string]time.Time // node → its last remediation in the window
}

// NewFleet returns a Fleet with cfg's limits.
func NewFleet(cfg FleetConfig, clock Clock) *Fleet {
	f := &Fleet{cfg: cfg, clock: clock, nodes: make(map[string]time.Time)}
	f.breaker = NewBreaker(BreakerConfig{Failures: cfg.BreakerFailures, Window: cfg.BreakerWindow}, clock)
	f.breaker.OnChange = func(open bool, reason string) {
		if f.OnBreakerChange != nil {
			f.OnBreakerChange(open, reason)
		}
	}
	return f
}

// Allow asks to remediate node now, with knownNodes nodes in the fleet. It
// returns a *Limited with Limit "breaker" when the fleet's breaker is open,
// or "fleet_rate" when the window already holds as many distinct nodes as
// the cap allows. A node already counted in the window is allowed again and
// not counted twice; otherwise an allowed node is counted from now on.
func (f *Fleet) Allow(node string, knownNodes int) error {
	if st := f.breaker.State(); st.Open {
		return &Limited{Limit: LimitBreaker, Reason: st.Reason}
	}
	limit := f.cfg.MaxNodesFor(knownNodes)
	if f.cfg.Window <= 0 {
		return nil
	}

	f.mu.Lock()
	defer f.mu.Unlock()
	now := f.clock.Now()
	f.pruneLocked(now)
	if _, ok := f.nodes[node]; ok || len(f.nodes) < limit {
		// Counted from its latest remediation: the window holds the nodes
		// touched in the last Window, however often.
		f.nodes[node] = now
		return nil
	}

	// The window may hold more nodes than the cap if the fleet shrank, so
	// wait for enough of the oldest to leave it.
	times := make([]time.Time, 0, len(f.nodes))
	for _, t := range f.nodes {
		times = append(times, t)
	}
	slices.SortFunc(times, time.Time.Compare)
	retry := times[len(times)-limit].Add(f.cfg.Window).Sub(now)
	return &Limited{
		Limit:      LimitFleetRate,
		RetryAfter: retry,
		Reason:     fmt.Sprintf("%d nodes remediated within %s, the cap with %d known nodes is %d", len(f.nodes), f.cfg.Window, knownNodes, limit),
	}
}

// Report records how an action on node ended; Failed counts toward the
// fleet's breaker.
func (f *Fleet) Report(node string, result Result) {
	if result != Succeeded && result != NoSignals {
		f.breaker.RecordFailure("node " + node)
	}
}

// BreakerOpen reports whether the fleet's breaker holds all work back.
func (f *Fleet) BreakerOpen() bool { return f.breaker.IsOpen() }

// OpenBreaker opens the fleet's breaker, as at startup to restore a
// persisted open state.
func (f *Fleet) OpenBreaker(reason string) { f.breaker.Open(reason) }

// Reset closes the fleet's breaker and forgets past failures. Only a human
// should call it, through an authenticated API. The nodes counted in the
// window stay counted.
func (f *Fleet) Reset() { f.breaker.Reset() }

// FleetState is a snapshot of a Fleet, for metrics and the API.
type FleetState struct {
	Breaker BreakerState
	// Nodes maps each node counted in the window to its latest
	// remediation.
	Nodes map[string]time.Time
}

// State returns a snapshot of the fleet's limits.
func (f *Fleet) State() FleetState {
	st := FleetState{Breaker: f.breaker.State()}

	f.mu.Lock()
	defer f.mu.Unlock()
	f.pruneLocked(f.clock.Now())
	st.Nodes = make(map[string]time.Time, len(f.nodes))
	for n, t := range f.nodes {
		st.Nodes[n] = t
	}
	return st
}

// pruneLocked drops the nodes whose latest remediation left the window.
func (f *Fleet) pruneLocked(now time.Time) {
	cutoff := now.Add(-f.cfg.Window)
	for n, t := range f.nodes {
		if !t.After(cutoff) {
			delete(f.nodes, n)
		}
	}
}
