package limits

import (
	"fmt"
	"sync"
	"time"
)

// BreakerConfig says how many failures open a Breaker.
type BreakerConfig struct {
	// Failures failed cleanups within Window open the breaker. Zero or less
	// means failures never open it; Open still does.
	Failures int
	// Window is the sliding window the failures are counted in. Zero or
	// less counts every failure since the last Reset.
	Window time.Duration
}

// BreakerState is a snapshot of a Breaker.
type BreakerState struct {
	Open   bool
	Reason string
	// OpenedAt is when it opened; zero while it is closed.
	OpenedAt time.Time
	// Failures is the number of failures inside the window now, counted up
	// to BreakerConfig.Failures.
	Failures int
}

// Breaker stops all remediation after too many failed cleanups within a
// sliding window. A failed cleanup means something the remediator does not
// understand (a target that survived SIGKILL in D state), and repeating it
// will not help, so once open it stays open until a human calls Reset: it
// never closes by itself. The node Limiter and the Fleet each hold one.
// Only failures of the remediator's own doing count: memory that a
// holder nobody can see keeps after every target exited, or a tracer
// holds its targets at their exit, is an escalation (Escalated), which
// any user could cause at will, and it must not switch
// remediation off for everyone.
//
// A Breaker is safe for concurrent use.
type Breaker struct {
	// OnChange, if set, is called on every change between open and closed,
	// in the order of the changes, so that the state can be persisted. Set
	// it before the breaker is used. It may read State but must not change
	// the breaker.
	OnChange func(open bool, reason string)

	cfg   BreakerConfig
	clock Clock

	// changeMu serializes changes and their OnChange calls, so that a
	// persisted state is never older than the live one. mu alone guards the
	// fields, so that OnChange may read State.
	changeMu sync.Mutex
	mu       sync.Mutex
	failures []time.Time // inside the window, oldest first
	open     bool
	reason   string
	openedAt time.Time
}

// NewBreaker returns a closed breaker.
func NewBreaker(cfg BreakerConfig, clock Clock) *Breaker {
	return &Breaker{cfg: cfg, clock: clock}
}

// IsOpen reports whether the breaker holds all work back.
func (b *Breaker) IsOpen() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.open
}

// RecordFailure counts one failed cleanup; what names it (a GPU, a node)
// for the reason. It reports whether this failure opened the breaker.
func (b *Breaker) RecordFailure(what string) (opened bool) {
	if b.cfg.Failures <= 0 {
		return false
	}
	b.changeMu.Lock()
	defer b.changeMu.Unlock()

	b.mu.Lock()
	now := b.clock.Now()
	b.failures = append(b.failures, now)
	b.pruneLocked(now)
	// Only the last Failures failures can decide, so keep no more: without
	// a window the list would otherwise grow forever.
	if extra := len(b.failures) - b.cfg.Failures; extra > 0 {
		b.failures = b.failures[extra:]
	}
	n := len(b.failures)
	if !b.open && n >= b.cfg.Failures {
		within := "since the last reset"
		if b.cfg.Window > 0 {
			within = "within " + b.cfg.Window.String()
		}
		b.openLocked(now, fmt.Sprintf("%d failed cleanups %s, the last on %s", n, within, what))
		opened = true
	}
	reason := b.reason
	b.mu.Unlock()

	if opened {
		b.notify(true, reason)
	}
	return opened
}

// Open opens the breaker, as at startup to restore a persisted open state.
// Opening an open breaker keeps its first reason: that is the one a human
// needs to see.
func (b *Breaker) Open(reason string) {
	b.changeMu.Lock()
	defer b.changeMu.Unlock()

	b.mu.Lock()
	if b.open {
		b.mu.Unlock()
		return
	}
	b.openLocked(b.clock.Now(), reason)
	b.mu.Unlock()

	b.notify(true, reason)
}

// Reset closes the breaker and forgets past failures, so that one more
// failure right after a human's reset does not open it again. Only a human
// should call it, through an authenticated API.
func (b *Breaker) Reset() {
	b.changeMu.Lock()
	defer b.changeMu.Unlock()

	b.mu.Lock()
	wasOpen := b.open
	b.open, b.reason, b.openedAt = false, "", time.Time{}
	b.failures = nil
	b.mu.Unlock()

	if wasOpen {
		b.notify(false, "")
	}
}

// State returns a snapshot of the breaker.
func (b *Breaker) State() BreakerState {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.pruneLocked(b.clock.Now())
	return BreakerState{
		Open:     b.open,
		Reason:   b.reason,
		OpenedAt: b.openedAt,
		Failures: len(b.failures),
	}
}

func (b *Breaker) openLocked(now time.Time, reason string) {
	b.open, b.reason, b.openedAt = true, reason, now
}

// pruneLocked drops the failures that have left the window.
func (b *Breaker) pruneLocked(now time.Time) {
	if b.cfg.Window <= 0 {
		return
	}
	cutoff := now.Add(-b.cfg.Window)
	i := 0
	for i < len(b.failures) && !b.failures[i].After(cutoff) {
		i++
	}
	b.failures = b.failures[i:]
}

// notify must be called with changeMu held and mu released.
func (b *Breaker) notify(open bool, reason string) {
	if b.OnChange != nil {
		b.OnChange(open, reason)
	}
}
