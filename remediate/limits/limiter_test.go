package limits

import (
	"errors"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// limitOf returns the limit that err names, "" for nil.
func limitOf(t *testing.T, err error) string {
	t.Helper()
	if err == nil {
		return ""
	}
	var l *Limited
	if !errors.As(err, &l) {
		t.Fatalf("error %v is not a *Limited", err)
	}
	return l.Limit
}

func mustAcquire(t *testing.T, l *Limiter, gpu string) Permit {
	t.Helper()
	p, err := l.Acquire(gpu)
	if err != nil {
		t.Fatalf("Acquire(%q): %v", gpu, err)
	}
	return p
}

// only returns a Config with every limit off but the ones set by f.
func only(f func(*Config)) Config {
	var c Config
	f(&c)
	return c
}

func TestDefaultConfigIsValid(t *testing.T) {
	if err := DefaultConfig().Validate(); err != nil {
		t.Fatal(err)
	}
	if err := (Config{}).Validate(); err != nil {
		t.Fatalf("all limits off: %v", err)
	}
	bad := Config{Cooldown: -1, Rate: 1, Burst: 0, MaxConcurrent: -1, BreakerFailures: -1, BreakerWindow: -1}
	if err := bad.Validate(); err == nil {
		t.Fatal("a bad config passed Validate")
	}
	if err := (Config{Rate: math.NaN(), Burst: 1}).Validate(); err == nil {
		t.Fatal("a NaN rate passed Validate")
	}
}

func TestCooldown(t *testing.T) {
	for _, tc := range []struct {
		result    Result
		cooldown  time.Duration
		wantLimit string
	}{
		{Succeeded, 10 * time.Minute, LimitCooldown},
		{Failed, 10 * time.Minute, LimitCooldown},
		{NoSignals, 10 * time.Minute, ""},
		{Escalated, 10 * time.Minute, LimitCooldown},
		{Succeeded, 0, ""},
		{Result(0), 10 * time.Minute, LimitCooldown}, // not a Result: treated as Failed
	} {
		t.Run(fmt.Sprintf("%s/%s", tc.result, tc.cooldown), func(t *testing.T) {
			clock := NewFakeClock(t0)
			l := New(only(func(c *Config) { c.Cooldown = tc.cooldown }), clock)
			mustAcquire(t, l, "GPU-a").Done(tc.result)

			clock.Advance(time.Minute)
			p, err := l.Acquire("GPU-a")
			if got := limitOf(t, err); got != tc.wantLimit {
				t.Fatalf("Acquire = %v, want limit %q", err, tc.wantLimit)
			}
			if err == nil {
				p.Done(NoSignals)
				return
			}
			var lim *Limited
			errors.As(err, &lim)
			if lim.RetryAfter != tc.cooldown-time.Minute {
				t.Fatalf("RetryAfter = %s, want %s", lim.RetryAfter, tc.cooldown-time.Minute)
			}
			if got := l.State().Cooldowns; !got["GPU-a"].Equal(t0.Add(tc.cooldown)) || len(got) != 1 {
				t.Fatalf("State().Cooldowns = %v", got)
			}

			// Other GPUs are not held back.
			mustAcquire(t, l, "GPU-b").Done(NoSignals)

			clock.Advance(tc.cooldown - time.Minute)
			mustAcquire(t, l, "GPU-a").Done(NoSignals)
			if got := l.State().Cooldowns; len(got) != 0 {
				t.Fatalf("cooldowns left after expiry: %v", got)
			}
		})
	}
}

func TestCooldownStartsWhenActionEnds(t *testing.T) {
	clock := NewFakeClock(t0)
	l := New(only(func(c *Config) { c.Cooldown = 10 * time.Minute }), clock)
	p := mustAcquire(t, l, "GPU-a")
	clock.Advance(3 * time.Minute) // the kill ladder and verification take time
	p.Done(Succeeded)
	clock.Advance(9 * time.Minute)
	if _, err := l.Acquire("GPU-a"); limitOf(t, err) != LimitCooldown {
		t.Fatalf("Acquire 9m after the end = %v, want cooldown", err)
	}
}

func TestGPUBusy(t *testing.T) {
	l := New(Config{}, NewFakeClock(t0))
	p := mustAcquire(t, l, "GPU-a")
	if _, err := l.Acquire("GPU-a"); limitOf(t, err) != LimitGPUBusy {
		t.Fatalf("second Acquire on a busy GPU = %v, want gpu_busy", err)
	}
	mustAcquire(t, l, "GPU-b").Done(NoSignals)
	p.Done(NoSignals)
	mustAcquire(t, l, "GPU-a").Done(NoSignals)
}

func TestConcurrency(t *testing.T) {
	for _, result := range []Result{Succeeded, Failed, NoSignals} {
		t.Run(result.String(), func(t *testing.T) {
			l := New(only(func(c *Config) { c.MaxConcurrent = 2 }), NewFakeClock(t0))
			p1 := mustAcquire(t, l, "GPU-1")
			p2 := mustAcquire(t, l, "GPU-2")
			if _, err := l.Acquire("GPU-3"); limitOf(t, err) != LimitConcurrency {
				t.Fatalf("third Acquire = %v, want concurrency", err)
			}
			if got := l.State().InFlight; got != 2 {
				t.Fatalf("InFlight = %d, want 2", got)
			}
			p1.Done(result)
			p3 := mustAcquire(t, l, "GPU-3")
			if _, err := l.Acquire("GPU-4"); limitOf(t, err) != LimitConcurrency {
				t.Fatalf("Acquire with 2 running again = %v, want concurrency", err)
			}
			p2.Done(result)
			p3.Done(result)
			if got := l.State().InFlight; got != 0 {
				t.Fatalf("InFlight = %d after all Done, want 0", got)
			}
		})
	}
}

func TestNodeRate(t *testing.T) {
	clock := NewFakeClock(t0)
	l := New(only(func(c *Config) { c.Rate, c.Burst = 6, 3 }), clock)
	for i := range 3 {
		mustAcquire(t, l, fmt.Sprintf("GPU-%d", i)).Done(Succeeded)
	}
	_, err := l.Acquire("GPU-3")
	var lim *Limited
	if !errors.As(err, &lim) || lim.Limit != LimitNodeRate {
		t.Fatalf("fourth Acquire = %v, want node_rate", err)
	}
	if lim.RetryAfter != 10*time.Minute {
		t.Fatalf("RetryAfter = %s, want 10m (6 an hour)", lim.RetryAfter)
	}
	clock.Advance(10*time.Minute - time.Second)
	if _, err := l.Acquire("GPU-3"); limitOf(t, err) != LimitNodeRate {
		t.Fatalf("Acquire a second early = %v, want node_rate", err)
	}
	clock.Advance(time.Second)
	mustAcquire(t, l, "GPU-3").Done(Failed)
	if got := l.State().Tokens; got != 0 {
		t.Fatalf("Tokens = %v, want 0", got)
	}
}

func TestNodeRateRunningActionsHoldTokens(t *testing.T) {
	l := New(only(func(c *Config) { c.Rate, c.Burst = 6, 2 }), NewFakeClock(t0))
	p1 := mustAcquire(t, l, "GPU-1")
	p2 := mustAcquire(t, l, "GPU-2")
	if got := l.State().Tokens; got != 0 {
		t.Fatalf("Tokens with 2 running = %v, want 0", got)
	}
	if _, err := l.Acquire("GPU-3"); limitOf(t, err) != LimitNodeRate {
		t.Fatalf("third Acquire = %v, want node_rate", err)
	}
	p1.Done(Succeeded)
	if _, err := l.Acquire("GPU-3"); limitOf(t, err) != LimitNodeRate {
		t.Fatalf("Acquire after one signalled = %v, want node_rate", err)
	}
	// A dry run gives its token back.
	p2.Done(NoSignals)
	mustAcquire(t, l, "GPU-3").Done(Succeeded)
}

func TestNoSignalsCostsNoToken(t *testing.T) {
	l := New(only(func(c *Config) { c.Rate, c.Burst = 1, 1 }), NewFakeClock(t0))
	for range 100 {
		mustAcquire(t, l, "GPU-a").Done(NoSignals)
	}
	if got := l.State().Tokens; got != 1 {
		t.Fatalf("Tokens after dry runs = %v, want 1", got)
	}
}

func TestTokenOnlyTakenWhenOtherChecksPass(t *testing.T) {
	clock := NewFakeClock(t0)
	l := New(Config{Cooldown: time.Hour, Rate: 1, Burst: 2, MaxConcurrent: 1}, clock)
	mustAcquire(t, l, "GPU-a").Done(Succeeded) // GPU-a cools down; 1 token left
	busy := mustAcquire(t, l, "GPU-b")         // takes the concurrency slot and the last token
	busy.Done(NoSignals)                       // and gives the token back

	busy = mustAcquire(t, l, "GPU-b")
	for range 10 {
		if _, err := l.Acquire("GPU-a"); limitOf(t, err) != LimitCooldown {
			t.Fatalf("Acquire = %v, want cooldown", err)
		}
		if _, err := l.Acquire("GPU-c"); limitOf(t, err) != LimitConcurrency {
			t.Fatalf("Acquire = %v, want concurrency", err)
		}
	}
	busy.Done(NoSignals)
	mustAcquire(t, l, "GPU-c").Done(Succeeded)
}

func TestCheckOrder(t *testing.T) {
	// Every limit holds GPU-a back at once; each step lifts the one that
	// should have been reported, and the next one shows.
	clock := NewFakeClock(t0)
	l := New(Config{Cooldown: 2 * time.Hour, Rate: 1, Burst: 1, MaxConcurrent: 1, BreakerFailures: 1, BreakerWindow: time.Hour}, clock)
	mustAcquire(t, l, "GPU-a").Done(Failed) // cooldown on GPU-a, bucket empty, breaker open
	l.Reset()
	clock.Advance(time.Hour) // bucket refilled, cooldown still on

	running := mustAcquire(t, l, "GPU-b") // concurrency full; the only token claimed
	l.OpenBreaker("test")

	for _, step := range []struct {
		want string
		lift func()
	}{
		{LimitBreaker, l.Reset},
		{LimitCooldown, func() { clock.Advance(time.Hour) }},
		{LimitConcurrency, func() { running.Done(Succeeded) }},
		{LimitNodeRate, func() { clock.Advance(time.Hour) }},
		{"", nil},
	} {
		p, err := l.Acquire("GPU-a")
		if got := limitOf(t, err); got != step.want {
			t.Fatalf("Acquire = %v, want limit %q", err, step.want)
		}
		if step.lift != nil {
			step.lift()
		} else {
			p.Done(NoSignals)
		}
	}

	// gpu_busy comes after cooldown and before concurrency.
	l = New(Config{Cooldown: time.Hour, MaxConcurrent: 1}, clock)
	p := mustAcquire(t, l, "GPU-a")
	if _, err := l.Acquire("GPU-a"); limitOf(t, err) != LimitGPUBusy {
		t.Fatalf("Acquire on the running GPU with concurrency full = %v, want gpu_busy", err)
	}
	p.Done(Succeeded)
	p = mustAcquire(t, l, "GPU-b")
	if _, err := l.Acquire("GPU-a"); limitOf(t, err) != LimitCooldown {
		t.Fatalf("Acquire = %v, want cooldown", err)
	}
	p.Done(NoSignals)
}

func TestLimiterBreaker(t *testing.T) {
	clock := NewFakeClock(t0)
	l := New(only(func(c *Config) { c.BreakerFailures, c.BreakerWindow = 3, time.Hour }), clock)
	var changes []bool
	l.OnBreakerChange = func(open bool, reason string) {
		_ = l.State() // the hook may read the state, for persistence
		changes = append(changes, open)
	}

	// Failures spread over more than the window do not open it.
	for i := range 6 {
		mustAcquire(t, l, "GPU-a").Done(Failed)
		mustAcquire(t, l, "GPU-b").Done(Succeeded)
		mustAcquire(t, l, "GPU-c").Done(NoSignals)
		if l.BreakerOpen() {
			t.Fatalf("opened after %d failures 31m apart", i+1)
		}
		clock.Advance(31 * time.Minute)
	}

	clock.Advance(time.Hour) // the last of those leaves the window
	for i := range 3 {
		if l.BreakerOpen() {
			t.Fatalf("opened after %d failures", i)
		}
		mustAcquire(t, l, fmt.Sprintf("GPU-%d", i)).Done(Failed)
		clock.Advance(time.Minute)
	}
	if !l.BreakerOpen() {
		t.Fatal("3 failures within the window did not open the breaker")
	}
	clock.Advance(7 * 24 * time.Hour)
	_, err := l.Acquire("GPU-z")
	var lim *Limited
	if !errors.As(err, &lim) || lim.Limit != LimitBreaker || lim.Reason == "" || lim.RetryAfter != 0 {
		t.Fatalf("Acquire a week later = %#v, want breaker with a reason", err)
	}
	if st := l.State(); !st.Breaker.Open || st.Breaker.Reason != lim.Reason {
		t.Fatalf("State().Breaker = %+v", st.Breaker)
	}

	l.Reset()
	mustAcquire(t, l, "GPU-z").Done(Failed)
	if l.BreakerOpen() {
		t.Fatal("one failure after Reset opened the breaker")
	}
	if want := []bool{true, false}; fmt.Sprint(changes) != fmt.Sprint(want) {
		t.Fatalf("OnBreakerChange calls = %v, want %v", changes, want)
	}
}

// TestEscalationsNeverOpenTheBreaker: any number of escalations (targets
// gone, memory held by what the remediator cannot see) leave the breaker
// closed and cost their token; one failure of our own still counts.
func TestEscalationsNeverOpenTheBreaker(t *testing.T) {
	clock := NewFakeClock(t0)
	l := New(only(func(c *Config) { c.BreakerFailures, c.BreakerWindow, c.Rate, c.Burst = 1, time.Hour, 100, 10 }), clock)
	for i := range 5 {
		mustAcquire(t, l, fmt.Sprintf("GPU-%d", i)).Done(Escalated)
	}
	if st := l.State(); st.Breaker.Open || st.Breaker.Failures != 0 || st.Tokens > 5.01 {
		t.Fatalf("after 5 escalations: %+v", st)
	}
	mustAcquire(t, l, "GPU-x").Done(Failed)
	if !l.BreakerOpen() {
		t.Fatal("a failure of our own with BreakerFailures=1 left the breaker closed")
	}
}

func TestOpenBreakerRestoresState(t *testing.T) {
	l := New(DefaultConfig(), NewFakeClock(t0))
	l.OpenBreaker("persisted: 3 failed cleanups")
	if _, err := l.Acquire("GPU-a"); limitOf(t, err) != LimitBreaker {
		t.Fatalf("Acquire = %v, want breaker", err)
	}
	if got := l.State().Breaker.Reason; got != "persisted: 3 failed cleanups" {
		t.Fatalf("reason = %q", got)
	}
}

func TestDoneTwiceIsHarmless(t *testing.T) {
	clock := NewFakeClock(t0)
	l := New(Config{Rate: 6, Burst: 3, MaxConcurrent: 2, BreakerFailures: 2, BreakerWindow: time.Hour}, clock)
	p := mustAcquire(t, l, "GPU-a")
	q := mustAcquire(t, l, "GPU-b")
	p.Done(Failed)
	p.Done(Failed)
	p.Done(Succeeded)
	copied := p
	copied.Done(Failed)
	Permit{}.Done(Failed)

	st := l.State()
	if st.InFlight != 1 || st.Breaker.Failures != 1 || st.Breaker.Open || st.Tokens != 1 {
		t.Fatalf("after Done many times, state = %+v", st)
	}
	q.Done(NoSignals)
}

func TestStateRateOff(t *testing.T) {
	l := New(Config{}, NewFakeClock(t0))
	if got := l.State().Tokens; !math.IsInf(got, 1) {
		t.Fatalf("Tokens with the rate off = %v, want +Inf", got)
	}
}

func TestLimitedError(t *testing.T) {
	err := error(&Limited{Limit: LimitCooldown, RetryAfter: time.Minute, Reason: "GPU-a is cooling down"})
	if got, want := err.Error(), "held back by the cooldown limit: GPU-a is cooling down (retry after 1m0s)"; got != want {
		t.Fatalf("Error() = %q, want %q", got, want)
	}
	wrapped := fmt.Errorf("remediate: %w", err)
	var lim *Limited
	if !errors.As(wrapped, &lim) || lim.Limit != LimitCooldown {
		t.Fatal("errors.As does not find a wrapped *Limited")
	}
}

// TestConcurrentAcquire has 50 goroutines race for permits; no more than
// MaxConcurrent may hold one at once. Run it with -race.
func TestConcurrentAcquire(t *testing.T) {
	const maxConcurrent = 3
	clock := NewFakeClock(t0)
	l := New(Config{MaxConcurrent: maxConcurrent, Cooldown: time.Millisecond, Rate: 1e9, Burst: 10}, clock)

	var holding, peak, granted atomic.Int64
	limited := make(map[string]*atomic.Int64)
	for _, name := range []string{LimitCooldown, LimitGPUBusy, LimitConcurrency, LimitNodeRate} {
		limited[name] = new(atomic.Int64)
	}
	var wg sync.WaitGroup
	for g := range 50 {
		wg.Go(func() {
			for i := range 100 {
				// Ten GPUs for fifty workers: some contend for a GPU too.
				p, err := l.Acquire(fmt.Sprintf("GPU-%d", (g+i)%10))
				if err != nil {
					var lim *Limited
					if !errors.As(err, &lim) || limited[lim.Limit] == nil {
						t.Errorf("Acquire: unexpected error %v", err)
						return
					}
					limited[lim.Limit].Add(1)
					continue
				}
				granted.Add(1)
				n := holding.Add(1)
				for {
					old := peak.Load()
					if n <= old || peak.CompareAndSwap(old, n) {
						break
					}
				}
				_ = l.State()
				time.Sleep(50 * time.Microsecond) // hold it while others try
				holding.Add(-1)
				p.Done(Result(1 + i%3))
				p.Done(Failed) // harmless
			}
		})
	}
	// Time moves while they race, so that cooldowns end and tokens refill.
	stop := make(chan struct{})
	ticked := make(chan struct{})
	go func() {
		defer close(ticked)
		for {
			select {
			case <-stop:
				return
			case <-time.After(100 * time.Microsecond):
				clock.Advance(time.Millisecond)
				_ = l.State()
			}
		}
	}()
	wg.Wait()
	close(stop)
	<-ticked

	t.Logf("granted %d, peak %d; held back by cooldown %d, gpu_busy %d, concurrency %d, node_rate %d",
		granted.Load(), peak.Load(), limited[LimitCooldown].Load(), limited[LimitGPUBusy].Load(),
		limited[LimitConcurrency].Load(), limited[LimitNodeRate].Load())
	if got := peak.Load(); got > maxConcurrent {
		t.Fatalf("%d permits held at once, want at most %d", got, maxConcurrent)
	}
	if granted.Load() == 0 || limited[LimitConcurrency].Load() == 0 {
		t.Fatalf("granted %d, held back by concurrency %d: the test did not contend", granted.Load(), limited[LimitConcurrency].Load())
	}
	if st := l.State(); st.InFlight != 0 {
		t.Fatalf("InFlight = %d after all Done, want 0", st.InFlight)
	}
}
