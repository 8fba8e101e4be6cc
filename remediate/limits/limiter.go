// Package limits says how often the remediator may act, in layers. On a
// node, a Limiter holds a circuit breaker, a cooldown per GPU, a cap on
// concurrent actions and a token bucket. Across the fleet, a Fleet caps the
// distinct nodes remediated per window and holds a breaker of its own.
// Every limit reads the time from a Clock, so that tests drive it with a
// FakeClock instead of sleeping.
package limits

import (
	"errors"
	"fmt"
	"math"
	"sync"
	"time"

	"golang.org/x/time/rate"
)

// Config holds a node's limits. A zero field turns its limit off.
type Config struct {
	// Cooldown is how long a GPU is left alone after an action on it that
	// sent signals, whether the memory came back or not: killing again at
	// once would only kill whatever the scheduler placed there since.
	Cooldown time.Duration
	// Rate is how many actions per hour the node may start, refilled
	// smoothly; Burst is how many may start back to back.
	Rate  float64
	Burst int
	// MaxConcurrent caps the actions that run at once.
	MaxConcurrent int
	// BreakerFailures failed cleanups within BreakerWindow open the
	// breaker. A window of zero counts every failure since the last Reset.
	BreakerFailures int
	BreakerWindow   time.Duration
}

// DefaultConfig returns conservative limits: a node cleans a GPU at most
// every 10 minutes, 6 times an hour with bursts of 3, 2 at a time, and stops
// after 3 failures in an hour.
func DefaultConfig() Config {
	return Config{
		Cooldown:        10 * time.Minute,
		Rate:            6,
		Burst:           3,
		MaxConcurrent:   2,
		BreakerFailures: 3,
		BreakerWindow:   time.Hour,
	}
}

// Validate reports settings that are surely mistakes, such as negative
// values or a rate with no burst, so that they fail at startup rather than
// silently turn a limit off.
func (c Config) Validate() error {
	var errs []error
	if c.Cooldown < 0 {
		errs = append(errs, fmt.Errorf("cooldown %s is negative", c.Cooldown))
	}
	if c.Rate < 0 || math.IsNaN(c.Rate) || math.IsInf(c.Rate, 0) {
		errs = append(errs, fmt.Errorf("rate %v per hour is not a finite number >= 0", c.Rate))
	}
	if c.Burst < 0 {
		errs = append(errs, fmt.Errorf("burst %d is negative", c.Burst))
	}
	if c.Rate > 0 && c.Burst < 1 {
		errs = append(errs, errors.New("a rate needs a burst of at least 1"))
	}
	if c.MaxConcurrent < 0 {
		errs = append(errs, fmt.Errorf("max concurrent %d is negative", c.MaxConcurrent))
	}
	if c.BreakerFailures < 0 {
		errs = append(errs, fmt.Errorf("breaker failures %d is negative", c.BreakerFailures))
	}
	if c.BreakerWindow < 0 {
		errs = append(errs, fmt.Errorf("breaker window %s is negative", c.BreakerWindow))
	}
	return errors.Join(errs...)
}

// Result is how an action ended, as Permit.Done reports it.
type Result int

const (
	// Succeeded: signals were sent and the memory came back.
	Succeeded Result = iota + 1
	// Failed: signals were sent and the memory did not come back. Any
	// value that is not a Result counts as Failed, the safe side.
	Failed
	// NoSignals: nothing was signalled, as in a dry run or a skipped plan.
	NoSignals
	// Escalated: signals were sent and every target is gone, yet the
	// memory did not come back: something the remediator cannot see or
	// prove keeps it (a descriptor in flight in a UNIX socket, another
	// PID namespace, a holder without proof); or every target that
	// outlived its signals is held in a tracing stop by a tracer that is
	// not a target (ptrace, which any user may use on their own
	// processes). Like Failed it starts the
	// cooldown and takes the token, but it never counts toward the
	// breaker: any user can make one, and the breaker would then stop
	// every other user's cleanups.
	Escalated
)

func (r Result) String() string {
	switch r {
	case Succeeded:
		return "succeeded"
	case Failed:
		return "failed"
	case NoSignals:
		return "no_signals"
	case Escalated:
		return "escalated"
	}
	return fmt.Sprintf("Result(%d)", int(r))
}

// Limiter holds a node's limits. It is safe for concurrent use.
type Limiter struct {
	// OnBreakerChange, if set, is called on every change of the breaker
	// between open and closed, in order, so that the state can be
	// persisted. Set it before the Limiter is used. It may call State but
	// must not open or reset the breaker.
	OnBreakerChange func(open bool, reason string)

	cfg     Config
	clock   Clock
	breaker *Breaker
	bucket  *rate.Limiter // nil when Rate is off

	mu       sync.Mutex
	inFlight map[string]bool // GPUs that hold a permit
	// claims counts the permits that hold a token of the bucket but have
	// not taken it yet: the token is taken only when the action sends
	// signals, so that dry runs and skipped plans cost none.
	claims    int
	cooldowns map[string]time.Time // GPU → end of its cooldown
}

// New returns a Limiter with cfg's limits. Settings that Validate rejects
// turn their limit off, except a burst below 1, which becomes 1.
func New(cfg Config, clock Clock) *Limiter {
	l := &Limiter{
		cfg:       cfg,
		clock:     clock,
		inFlight:  make(map[string]bool),
		cooldowns: make(map[string]time.Time),
	}
	l.breaker = NewBreaker(BreakerConfig{Failures: cfg.BreakerFailures, Window: cfg.BreakerWindow}, clock)
	l.breaker.OnChange = func(open bool, reason string) {
		if l.OnBreakerChange != nil {
			l.OnBreakerChange(open, reason)
		}
	}
	if cfg.Rate > 0 && !math.IsInf(cfg.Rate, 0) {
		l.bucket = rate.NewLimiter(rate.Limit(cfg.Rate/3600), max(cfg.Burst, 1))
	}
	return l
}

// Permit is the right to remediate one GPU. Its holder must call Done once
// the action ends; further calls do nothing. The zero Permit's Done does
// nothing.
type Permit struct {
	p *permit
}

type permit struct {
	l       *Limiter
	gpu     string
	claimed bool // holds one of l.claims
	done    bool // guarded by l.mu
}

// Done releases the permit and records how the action ended. Succeeded,
// Failed and Escalated start the GPU's cooldown and take the permit's
// token; Failed alone counts toward the breaker: only a failure that the
// remediator's own targets cause (a target that survived its signals, or
// could not be signalled) says that acting again may do harm. NoSignals (a dry run, a skipped plan) only
// releases the slot: nothing was done to the GPU, so there is nothing to
// cool down from, and a dry run then never holds back the cleanup that a
// later run with --act would do.
func (p Permit) Done(result Result) {
	if p.p != nil {
		p.p.l.done(p.p, result)
	}
}

// Acquire asks to remediate the GPU now. It checks, in order: the breaker,
// the GPU's cooldown, an action already running on the GPU, the cap on
// concurrent actions, and the node's token bucket; the first that holds the
// work back returns a *Limited naming it. A token is only claimed when all
// other checks pass.
func (l *Limiter) Acquire(gpuUUID string) (Permit, error) {
	if st := l.breaker.State(); st.Open {
		return Permit{}, &Limited{Limit: LimitBreaker, Reason: st.Reason}
	}

	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.clock.Now()

	if until, ok := l.cooldowns[gpuUUID]; ok {
		if now.Before(until) {
			return Permit{}, &Limited{Limit: LimitCooldown, RetryAfter: until.Sub(now), Reason: gpuUUID + " is cooling down"}
		}
		delete(l.cooldowns, gpuUUID)
	}
	// Two kill ladders on one GPU would race each other's verification.
	if l.inFlight[gpuUUID] {
		return Permit{}, &Limited{Limit: LimitGPUBusy, Reason: gpuUUID + " has an action running"}
	}
	if l.cfg.MaxConcurrent > 0 && len(l.inFlight) >= l.cfg.MaxConcurrent {
		return Permit{}, &Limited{Limit: LimitConcurrency, Reason: fmt.Sprintf("%d actions running", len(l.inFlight))}
	}
	if l.bucket != nil {
		if avail := l.bucket.TokensAt(now) - float64(l.claims); avail < 1 {
			return Permit{}, &Limited{Limit: LimitNodeRate, RetryAfter: l.refillTime(1 - avail), Reason: fmt.Sprintf("%g actions per hour", l.cfg.Rate)}
		}
		l.claims++
	}

	l.inFlight[gpuUUID] = true
	return Permit{&permit{l: l, gpu: gpuUUID, claimed: l.bucket != nil}}, nil
}

// refillTime is how long the bucket takes to gain tokens, rounded up to a
// millisecond; the epsilon keeps float error from adding one.
func (l *Limiter) refillTime(tokens float64) time.Duration {
	ms := tokens / float64(l.bucket.Limit()) * 1e3
	return time.Duration(math.Ceil(ms-1e-6)) * time.Millisecond
}

func (l *Limiter) done(p *permit, result Result) {
	l.mu.Lock()
	if p.done {
		l.mu.Unlock()
		return
	}
	p.done = true
	now := l.clock.Now()
	delete(l.inFlight, p.gpu)
	signalled := result != NoSignals
	if p.claimed {
		l.claims--
		if signalled {
			// The claim guarantees the token is there; ReserveN would
			// record a debt rather than lose it if it were not.
			l.bucket.ReserveN(now, 1)
		}
	}
	if signalled && l.cfg.Cooldown > 0 {
		l.cooldowns[p.gpu] = now.Add(l.cfg.Cooldown)
	}
	l.mu.Unlock()

	// Outside l.mu, so that OnBreakerChange may call State. An Acquire
	// that slips in meanwhile is no different from one a moment earlier.
	if signalled && result != Succeeded && result != Escalated {
		l.breaker.RecordFailure(p.gpu)
	}
}

// BreakerOpen reports whether the breaker holds all work back.
func (l *Limiter) BreakerOpen() bool { return l.breaker.IsOpen() }

// OpenBreaker opens the breaker, as at startup to restore a persisted open
// state.
func (l *Limiter) OpenBreaker(reason string) { l.breaker.Open(reason) }

// Reset closes the breaker and forgets past failures. Only a human should
// call it, through an authenticated API. Cooldowns and the bucket are left
// as they are: a reset does not make a GPU safe to clean again sooner.
func (l *Limiter) Reset() { l.breaker.Reset() }

// State is a snapshot of a Limiter, for metrics and the API.
type State struct {
	Breaker BreakerState
	// InFlight is the number of permits not yet Done.
	InFlight int
	// Tokens is how many actions the bucket would let start now, net of
	// the tokens running actions hold; +Inf when Rate is off.
	Tokens float64
	// Cooldowns maps each GPU in cooldown to the end of its cooldown.
	Cooldowns map[string]time.Time
}

// State returns a snapshot of the limiter.
func (l *Limiter) State() State {
	st := State{Breaker: l.breaker.State(), Tokens: math.Inf(1)}

	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.clock.Now()
	st.InFlight = len(l.inFlight)
	if l.bucket != nil {
		st.Tokens = l.bucket.TokensAt(now) - float64(l.claims)
	}
	st.Cooldowns = make(map[string]time.Time, len(l.cooldowns))
	for gpu, until := range l.cooldowns {
		if now.Before(until) {
			st.Cooldowns[gpu] = until
		} else {
			delete(l.cooldowns, gpu)
		}
	}
	return st
}
