package limits

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestDefaultFleetConfigIsValid(t *testing.T) {
	if err := DefaultFleetConfig().Validate(); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []FleetConfig{
		{MaxNodes: -1},
		{MaxFraction: 1.5},
		{MaxFraction: -0.1},
		{MaxFraction: math.NaN()},
		{Window: -time.Second},
		{BreakerFailures: -1},
		{BreakerWindow: -time.Second},
	} {
		if err := bad.Validate(); err == nil {
			t.Errorf("%+v passed Validate", bad)
		}
	}
}

func TestMaxNodesFor(t *testing.T) {
	const none = math.MaxInt
	for _, tc := range []struct {
		maxNodes int
		fraction float64
		// want for 1, 3, 10 and 100 known nodes
		want [4]int
	}{
		// The fraction rounds down, but never below one node.
		{0, 0.1, [4]int{1, 1, 1, 10}},
		{0, 0.5, [4]int{1, 1, 5, 50}},
		{0, 0.34, [4]int{1, 1, 3, 34}},
		{0, 1, [4]int{1, 3, 10, 100}},
		// Float error must not round 28.999… down to 28.
		{0, 0.29, [4]int{1, 1, 2, 29}},
		{0, 0.07, [4]int{1, 1, 1, 7}},
		// The stricter cap wins.
		{5, 0.1, [4]int{1, 1, 1, 5}},
		{5, 0.5, [4]int{1, 1, 5, 5}},
		{2, 1, [4]int{1, 2, 2, 2}},
		{5, 0, [4]int{5, 5, 5, 5}},
		{0, 0, [4]int{none, none, none, none}},
	} {
		cfg := FleetConfig{MaxNodes: tc.maxNodes, MaxFraction: tc.fraction, Window: time.Hour}
		for i, known := range []int{1, 3, 10, 100} {
			if got := cfg.MaxNodesFor(known); got != tc.want[i] {
				t.Errorf("MaxNodes %d, MaxFraction %v: MaxNodesFor(%d) = %d, want %d", tc.maxNodes, tc.fraction, known, got, tc.want[i])
			}
		}
	}
	if got := (FleetConfig{MaxNodes: 5, MaxFraction: 0.1}).MaxNodesFor(100); got != none {
		t.Errorf("with no window, MaxNodesFor = %d, want no cap", got)
	}
	if got := (FleetConfig{MaxFraction: 0.5, Window: time.Hour}).MaxNodesFor(0); got != 1 {
		t.Errorf("with no known nodes, MaxNodesFor = %d, want 1", got)
	}
}

// allowAll asks for each node in turn and returns what held each back.
func allowAll(t *testing.T, f *Fleet, known int, nodes ...string) []string {
	t.Helper()
	var got []string
	for _, n := range nodes {
		err := f.Allow(n, known)
		got = append(got, limitOf(t, err))
	}
	return got
}

func TestFleetAllow(t *testing.T) {
	for _, tc := range []struct {
		name  string
		cfg   FleetConfig
		known int
		nodes []string
		want  []string
	}{
		{
			name:  "absolute cap",
			cfg:   FleetConfig{MaxNodes: 2, Window: time.Hour},
			known: 100,
			nodes: []string{"a", "b", "c", "a", "b", "d"},
			want:  []string{"", "", LimitFleetRate, "", "", LimitFleetRate},
		},
		{
			name:  "fraction of 10",
			cfg:   FleetConfig{MaxFraction: 0.2, Window: time.Hour},
			known: 10,
			nodes: []string{"a", "a", "b", "c"},
			want:  []string{"", "", "", LimitFleetRate},
		},
		{
			name:  "fraction rounds to one",
			cfg:   FleetConfig{MaxFraction: 0.1, Window: time.Hour},
			known: 3,
			nodes: []string{"a", "b", "a"},
			want:  []string{"", LimitFleetRate, ""},
		},
		{
			name:  "stricter wins",
			cfg:   FleetConfig{MaxNodes: 10, MaxFraction: 0.1, Window: time.Hour},
			known: 20,
			nodes: []string{"a", "b", "c"},
			want:  []string{"", "", LimitFleetRate},
		},
		{
			name:  "no window, no cap",
			cfg:   FleetConfig{MaxNodes: 1},
			known: 10,
			nodes: []string{"a", "b", "c"},
			want:  []string{"", "", ""},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := NewFleet(tc.cfg, NewFakeClock(t0))
			if got := allowAll(t, f, tc.known, tc.nodes...); fmt.Sprint(got) != fmt.Sprint(tc.want) {
				t.Fatalf("Allow(%v) = %q, want %q", tc.nodes, got, tc.want)
			}
		})
	}
}

func TestFleetSlidingWindow(t *testing.T) {
	clock := NewFakeClock(t0)
	f := NewFleet(FleetConfig{MaxNodes: 2, Window: time.Hour}, clock)
	if err := f.Allow("a", 10); err != nil {
		t.Fatal(err)
	}
	clock.Advance(20 * time.Minute)
	if err := f.Allow("b", 10); err != nil {
		t.Fatal(err)
	}
	clock.Advance(20 * time.Minute)

	err := f.Allow("c", 10)
	var lim *Limited
	if !errors.As(err, &lim) || lim.Limit != LimitFleetRate {
		t.Fatalf("third node = %v, want fleet_rate", err)
	}
	if lim.RetryAfter != 20*time.Minute {
		t.Fatalf("RetryAfter = %s, want 20m, when a leaves the window", lim.RetryAfter)
	}
	if !strings.Contains(lim.Reason, "2 nodes") {
		t.Fatalf("reason = %q", lim.Reason)
	}
	// A node counts from its latest remediation: b again moves b's time,
	// not a's.
	if err := f.Allow("b", 10); err != nil {
		t.Fatal(err)
	}
	clock.Advance(20 * time.Minute)
	if err := f.Allow("c", 10); err != nil {
		t.Fatalf("after a left the window: %v", err)
	}
	if err := f.Allow("d", 10); limitOf(t, err) != LimitFleetRate {
		t.Fatalf("with b and c in the window, d = %v, want fleet_rate", err)
	}
	if got := f.State().Nodes; len(got) != 2 || !got["b"].Equal(t0.Add(40*time.Minute)) || !got["c"].Equal(t0.Add(60*time.Minute)) {
		t.Fatalf("State().Nodes = %v", got)
	}
}

func TestFleetShrinks(t *testing.T) {
	// When the fleet shrinks, the window may hold more nodes than the new
	// cap; wait until enough have left it.
	clock := NewFakeClock(t0)
	f := NewFleet(FleetConfig{MaxFraction: 0.5, Window: time.Hour}, clock)
	for i, n := range []string{"a", "b", "c", "d"} {
		clock.Set(t0.Add(time.Duration(i) * time.Minute))
		if err := f.Allow(n, 10); err != nil {
			t.Fatal(err)
		}
	}
	err := f.Allow("e", 4) // cap 2, 4 in the window: a, b and c must leave
	var lim *Limited
	if !errors.As(err, &lim) || lim.Limit != LimitFleetRate || lim.RetryAfter != 62*time.Minute-3*time.Minute {
		t.Fatalf("Allow = %#v, want fleet_rate, retry when c leaves at 62m", err)
	}
	clock.Set(t0.Add(62 * time.Minute))
	if err := f.Allow("e", 4); err != nil {
		t.Fatalf("after c left: %v", err)
	}
}

func TestFleetBreaker(t *testing.T) {
	clock := NewFakeClock(t0)
	f := NewFleet(FleetConfig{BreakerFailures: 2, BreakerWindow: time.Hour}, clock)
	var changes []string
	f.OnBreakerChange = func(open bool, reason string) {
		_ = f.State()
		changes = append(changes, fmt.Sprint(open, " ", reason))
	}

	f.Report("n1", Failed)
	f.Report("n2", Succeeded)
	f.Report("n2", NoSignals)
	clock.Advance(61 * time.Minute)
	f.Report("n2", Failed)
	if f.BreakerOpen() {
		t.Fatal("2 failures more than the window apart opened the breaker")
	}
	f.Report("n3", Failed)
	if !f.BreakerOpen() {
		t.Fatal("2 failures within the window did not open the breaker")
	}
	clock.Advance(48 * time.Hour)
	if err := f.Allow("n4", 100); limitOf(t, err) != LimitBreaker {
		t.Fatalf("Allow = %v, want breaker", err)
	}
	f.Reset()
	if err := f.Allow("n4", 100); err != nil {
		t.Fatalf("after Reset: %v", err)
	}
	f.OpenBreaker("restored")
	if st := f.State(); !st.Breaker.Open || st.Breaker.Reason != "restored" {
		t.Fatalf("State().Breaker = %+v", st.Breaker)
	}
	want := []string{
		"true 2 failed cleanups within 1h0m0s, the last on node n3",
		"false ",
		"true restored",
	}
	if fmt.Sprint(changes) != fmt.Sprint(want) {
		t.Fatalf("OnBreakerChange calls = %q, want %q", changes, want)
	}
}

func TestFleetConcurrent(t *testing.T) {
	clock := NewFakeClock(t0)
	f := NewFleet(FleetConfig{MaxNodes: 5, Window: time.Hour, BreakerFailures: 1000, BreakerWindow: time.Hour}, clock)
	var wg sync.WaitGroup
	for g := range 50 {
		wg.Go(func() {
			for i := range 50 {
				node := fmt.Sprintf("node-%d", (g*7+i)%40)
				if f.Allow(node, 40) == nil {
					f.Report(node, Result(1+i%3))
				}
				_ = f.State()
			}
		})
	}
	wg.Wait()
	if got := len(f.State().Nodes); got != 5 {
		t.Fatalf("%d nodes counted in the window, want the cap, 5", got)
	}
}
