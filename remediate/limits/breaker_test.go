package limits

import (
	"strings"
	"testing"
	"time"
)

func TestBreakerOpensOnFailuresWithinWindow(t *testing.T) {
	for _, tc := range []struct {
		name     string
		cfg      BreakerConfig
		gaps     []time.Duration // before each failure
		wantOpen bool
	}{
		{"three at once", BreakerConfig{3, time.Hour}, []time.Duration{0, 0, 0}, true},
		{"three within the hour", BreakerConfig{3, time.Hour}, []time.Duration{0, 29 * time.Minute, 30 * time.Minute}, true},
		{"two are not enough", BreakerConfig{3, time.Hour}, []time.Duration{0, 0}, false},
		{"spread out", BreakerConfig{3, time.Hour}, []time.Duration{0, 40 * time.Minute, 40 * time.Minute, 40 * time.Minute, 40 * time.Minute}, false},
		// The first failure is exactly one window old when the third comes.
		{"edge of the window", BreakerConfig{3, time.Hour}, []time.Duration{0, 30 * time.Minute, 30 * time.Minute}, false},
		{"no window counts since reset", BreakerConfig{3, 0}, []time.Duration{0, 24 * time.Hour, 24 * time.Hour}, true},
		{"off", BreakerConfig{0, time.Hour}, []time.Duration{0, 0, 0, 0, 0}, false},
		{"one is enough", BreakerConfig{1, time.Hour}, []time.Duration{0}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clock := NewFakeClock(t0)
			b := NewBreaker(tc.cfg, clock)
			opened := 0
			for i, gap := range tc.gaps {
				clock.Advance(gap)
				if b.RecordFailure("GPU-" + string(rune('a'+i))) {
					opened++
				}
			}
			if got := b.IsOpen(); got != tc.wantOpen {
				t.Fatalf("IsOpen() = %v, want %v (state %+v)", got, tc.wantOpen, b.State())
			}
			if want := map[bool]int{true: 1}[tc.wantOpen]; opened != want {
				t.Fatalf("RecordFailure reported opening %d times, want %d", opened, want)
			}
		})
	}
}

func TestBreakerStaysOpenUntilReset(t *testing.T) {
	clock := NewFakeClock(t0)
	b := NewBreaker(BreakerConfig{Failures: 2, Window: time.Hour}, clock)
	b.RecordFailure("GPU-a")
	b.RecordFailure("GPU-b")
	clock.Advance(30 * 24 * time.Hour)
	st := b.State()
	if !st.Open {
		t.Fatal("the breaker closed by itself")
	}
	if !st.OpenedAt.Equal(t0) || !strings.Contains(st.Reason, "2 failed cleanups within 1h0m0s") || !strings.Contains(st.Reason, "GPU-b") {
		t.Fatalf("state = %+v", st)
	}

	b.Reset()
	if st := b.State(); st.Open || st.Reason != "" || !st.OpenedAt.IsZero() || st.Failures != 0 {
		t.Fatalf("after Reset, state = %+v", st)
	}
	// The failures before the reset are forgotten.
	if b.RecordFailure("GPU-c") || b.IsOpen() {
		t.Fatal("one failure after Reset opened the breaker")
	}
}

func TestBreakerFailuresFallOutOfWindow(t *testing.T) {
	clock := NewFakeClock(t0)
	b := NewBreaker(BreakerConfig{Failures: 3, Window: time.Hour}, clock)
	b.RecordFailure("a")
	clock.Advance(10 * time.Minute)
	b.RecordFailure("b")
	if got := b.State().Failures; got != 2 {
		t.Fatalf("Failures = %d, want 2", got)
	}
	clock.Advance(55 * time.Minute)
	if got := b.State().Failures; got != 1 {
		t.Fatalf("after the first left the window, Failures = %d, want 1", got)
	}
}

func TestBreakerOnChange(t *testing.T) {
	type change struct {
		open   bool
		reason string
	}
	clock := NewFakeClock(t0)
	b := NewBreaker(BreakerConfig{Failures: 1, Window: time.Hour}, clock)
	var got []change
	b.OnChange = func(open bool, reason string) {
		_ = b.State() // the hook may read the state
		got = append(got, change{open, reason})
	}

	b.Open("restored: operator said so")
	b.Open("a second reason is ignored")
	b.RecordFailure("GPU-a") // already open: no change
	b.Reset()
	b.Reset() // already closed: no change
	b.RecordFailure("GPU-b")

	want := []change{
		{true, "restored: operator said so"},
		{false, ""},
		{true, "1 failed cleanups within 1h0m0s, the last on GPU-b"},
	}
	if len(got) != len(want) {
		t.Fatalf("changes = %+v, want %+v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("change %d = %+v, want %+v", i, got[i], want[i])
		}
	}
}
