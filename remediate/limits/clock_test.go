package limits

import (
	"sync"
	"testing"
	"time"
)

var t0 = time.Date(2025, 1, 1, 12, 0, 0, 0, time.UTC)

func TestFakeClock(t *testing.T) {
	c := NewFakeClock(t0)
	if got := c.Now(); !got.Equal(t0) {
		t.Fatalf("Now() = %v, want %v", got, t0)
	}
	if got := c.Advance(time.Minute); !got.Equal(t0.Add(time.Minute)) {
		t.Fatalf("Advance returned %v", got)
	}
	c.Set(t0.Add(-time.Hour))
	if got := c.Now(); !got.Equal(t0.Add(-time.Hour)) {
		t.Fatalf("after Set, Now() = %v", got)
	}

	var zero FakeClock
	if !zero.Now().IsZero() {
		t.Fatal("the zero FakeClock does not start at the zero time")
	}
}

func TestFakeClockConcurrent(t *testing.T) {
	c := NewFakeClock(t0)
	var wg sync.WaitGroup
	for range 10 {
		wg.Go(func() {
			for range 100 {
				c.Advance(time.Second)
				_ = c.Now()
			}
		})
	}
	wg.Wait()
	if got, want := c.Now(), t0.Add(1000*time.Second); !got.Equal(want) {
		t.Fatalf("Now() = %v, want %v", got, want)
	}
}

func TestRealClock(t *testing.T) {
	var c Clock = RealClock{}
	if d := time.Since(c.Now()); d < 0 || d > time.Minute {
		t.Fatalf("RealClock is %s off", d)
	}
}
