package limits

import (
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"sync"
	"time"
)

// FleetConfig holds the dispatcher's limits across nodes. A zero field
// turns its limit off.
type FleetConfig struct {
	// At most MaxNodes distinct nodes, and at most MaxFraction of the known
	// nodes, hold a turn at once; the stricter cap wins. A node's turn
	// starts at its first remediation and lasts Window, however often it
	// alerts meanwhile; it is then counted again from its next one. The
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

// waitingGrace is how long a node held back keeps its place in the line
// after the time it was told to come back: the queue retries within a
// second or two, and a node whose alert resolved meanwhile must not hold a
// free turn for long.
const waitingGrace = 10 * time.Second

// maxWaiting bounds the line, so that the window stays small enough to
// share (a Kubernetes annotation). A node beyond it is still held back,
// only without a place in the line.
const maxWaiting = 1000

// FleetWindow is what the fleet limit remembers: each node's latest turn,
// and the nodes waiting for one. A Fleet keeps its own; dispatcher replicas
// keep one together (Fleet.AllowIn). It encodes as JSON.
type FleetWindow struct {
	// Turns maps a node to the start of its latest turn, its first
	// remediation then. It holds a turn until Turn+Window, and is
	// remembered as having had one until Turn+2×Window.
	Turns map[string]time.Time `json:"turns,omitempty"`
	// Waiting maps the nodes that the cap held back to their place.
	Waiting map[string]Waiter `json:"waiting,omitempty"`
}

// Waiter is a node's place in the line for a turn.
type Waiter struct {
	// Since is when the node was first held back: first come, first
	// served among nodes that had no turn lately.
	Since time.Time `json:"since"`
	// Until is when it loses its place unless it asks again: the time it
	// was told to retry, plus a grace.
	Until time.Time `json:"until"`
}

// Clone returns a deep copy of w.
func (w FleetWindow) Clone() FleetWindow {
	return FleetWindow{Turns: maps.Clone(w.Turns), Waiting: maps.Clone(w.Waiting)}
}

// prune forgets turns that no longer matter for fairness and places that
// were not claimed in time.
func (w *FleetWindow) prune(now time.Time, window time.Duration) {
	if w.Turns == nil {
		w.Turns = map[string]time.Time{}
	}
	if w.Waiting == nil {
		w.Waiting = map[string]Waiter{}
	}
	forget := now.Add(-2 * window)
	for n, t := range w.Turns {
		if !t.After(forget) {
			delete(w.Turns, n)
		}
	}
	for n, p := range w.Waiting {
		if p.Until.Before(now) {
			delete(w.Waiting, n)
		}
	}
}

// before orders nodes for a free turn: a node that had no turn lately
// (zero) before one that had, an older turn before a newer, then first
// held back first, then by name so that every replica agrees.
func before(turnA, sinceA time.Time, a string, turnB, sinceB time.Time, b string) bool {
	if !turnA.Equal(turnB) {
		return turnA.Before(turnB)
	}
	if !sinceA.Equal(sinceB) {
		return sinceA.Before(sinceB)
	}
	return a < b
}

// allow decides whether node may be remediated at now, and records it in
// w: a node holding a turn may, and is not counted again; otherwise it
// takes a free turn unless nodes ahead of it in line (nodes that had no
// turn lately, or an older one) are waiting for that turn; a node held
// back takes its place in line.
func (c FleetConfig) allow(w *FleetWindow, node string, knownNodes int, now time.Time) error {
	if c.Window <= 0 {
		return nil
	}
	limit := c.MaxNodesFor(knownNodes)
	w.prune(now, c.Window)
	start := now.Add(-c.Window)
	if t, ok := w.Turns[node]; ok && t.After(start) {
		delete(w.Waiting, node)
		return nil
	}
	var ends []time.Time // when the turns held now end
	for _, t := range w.Turns {
		if t.After(start) {
			ends = append(ends, t.Add(c.Window))
		}
	}
	free := limit - len(ends)
	mine, waiting := w.Waiting[node]
	since := now
	if waiting {
		since = mine.Since
	}
	ahead := 0
	for n, p := range w.Waiting {
		if n != node && before(w.Turns[n], p.Since, n, w.Turns[node], since, node) {
			ahead++
		}
	}
	if ahead < free {
		w.Turns[node] = now
		delete(w.Waiting, node)
		return nil
	}

	var retry time.Duration
	if free > 0 {
		// A turn is free, but a node ahead in line is due to claim it:
		// ask again once it has, or has lost its place.
		retry = min(waitingGrace, c.Window)
	} else {
		// Wait for as many turns to end as there are nodes ahead, and
		// for the window to hold fewer nodes than the cap if the fleet
		// shrank.
		slices.SortFunc(ends, time.Time.Compare)
		retry = ends[min(ahead-free, len(ends)-1)].Sub(now)
	}
	if waiting || len(w.Waiting) < maxWaiting {
		w.Waiting[node] = Waiter{Since: since, Until: now.Add(retry + min(waitingGrace, c.Window))}
	}
	reason := fmt.Sprintf("%d nodes hold a turn of %s, the cap with %d known nodes is %d", len(ends), c.Window, knownNodes, limit)
	if ahead > 0 {
		reason += fmt.Sprintf("; %d waiting nodes are ahead in line", ahead)
	}
	return &Limited{Limit: LimitFleetRate, RetryAfter: retry, Reason: reason}
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

	mu     sync.Mutex
	window FleetWindow
	// unavailable is, per node, when its agent could not take an alert
	// (5xx, no connection): counted against that node, never the fleet.
	unavailable map[string][]time.Time
}

// NewFleet returns a Fleet with cfg's limits.
func NewFleet(cfg FleetConfig, clock Clock) *Fleet {
	f := &Fleet{cfg: cfg, clock: clock, unavailable: map[string][]time.Time{},
		window: FleetWindow{Turns: map[string]time.Time{}, Waiting: map[string]Waiter{}}}
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
// or "fleet_rate" when the cap's turns are all held, or the free one is
// due to a node ahead in line. A node holding a turn is allowed again and
// not counted twice; its turn is not extended.
func (f *Fleet) Allow(node string, knownNodes int) error {
	if st := f.breaker.State(); st.Open {
		return &Limited{Limit: LimitBreaker, Reason: st.Reason}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.cfg.allow(&f.window, node, knownNodes, f.clock.Now())
}

// AllowIn is Allow on a window kept elsewhere, as dispatcher replicas keep
// one together: it decides on w, and records the decision in w, which the
// caller then stores. The breaker is this Fleet's. State shows w
// afterwards.
func (f *Fleet) AllowIn(w *FleetWindow, node string, knownNodes int) error {
	if st := f.breaker.State(); st.Open {
		return &Limited{Limit: LimitBreaker, Reason: st.Reason}
	}
	err := f.cfg.allow(w, node, knownNodes, f.clock.Now())
	f.mu.Lock()
	defer f.mu.Unlock()
	f.window = w.Clone()
	return err
}

// Report records how an action on node ended; Failed counts toward the
// fleet's breaker.
func (f *Fleet) Report(node string, result Result) {
	if result != Succeeded && result != NoSignals {
		f.breaker.RecordFailure("node " + node)
	}
}

// ReportUnavailable records that node's agent could not take an alert (it
// answered 5xx, or could not be reached). It counts against that node
// only: what one node's user can cause (a full disk on the node) must not
// hold back the other nodes' cleanups. It returns how often that happened
// within the breaker's window (the last hour if it has none).
func (f *Fleet) ReportUnavailable(node string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	now := f.clock.Now()
	f.pruneUnavailableLocked(now)
	f.unavailable[node] = append(f.unavailable[node], now)
	return len(f.unavailable[node])
}

func (f *Fleet) pruneUnavailableLocked(now time.Time) {
	window := f.cfg.BreakerWindow
	if window <= 0 {
		window = time.Hour
	}
	for n, ts := range f.unavailable {
		ts = slices.DeleteFunc(ts, func(t time.Time) bool { return !t.After(now.Add(-window)) })
		if len(ts) == 0 {
			delete(f.unavailable, n)
		} else {
			f.unavailable[n] = ts
		}
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
	// Nodes maps each node holding a turn to the turn's start, its first
	// remediation in the turn.
	Nodes map[string]time.Time
	// Waiting is the line for a turn.
	Waiting map[string]Waiter
	// Unavailable counts, per node, its agent's 5xx answers and
	// unreachable attempts within the breaker's window.
	Unavailable map[string]int
}

// State returns a snapshot of the fleet's limits: with a shared window,
// as this replica last saw it.
func (f *Fleet) State() FleetState {
	st := FleetState{Breaker: f.breaker.State()}

	f.mu.Lock()
	defer f.mu.Unlock()
	now := f.clock.Now()
	w := f.window.Clone()
	w.prune(now, f.cfg.Window)
	st.Nodes = make(map[string]time.Time, len(w.Turns))
	for n, t := range w.Turns {
		if t.After(now.Add(-f.cfg.Window)) {
			st.Nodes[n] = t
		}
	}
	st.Waiting = w.Waiting
	f.pruneUnavailableLocked(now)
	st.Unavailable = make(map[string]int, len(f.unavailable))
	for n, ts := range f.unavailable {
		st.Unavailable[n] = len(ts)
	}
	return st
}
