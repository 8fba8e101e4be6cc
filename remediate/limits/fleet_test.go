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
		t.Fatalf("RetryAfter = %s, want 20m, when a's turn ends", lim.RetryAfter)
	}
	if !strings.Contains(lim.Reason, "2 nodes") {
		t.Fatalf("reason = %q", lim.Reason)
	}
	// A node counts from its first remediation in its turn: b again is
	// allowed, and does not move b's turn.
	if err := f.Allow("b", 10); err != nil {
		t.Fatal(err)
	}
	clock.Advance(20 * time.Minute)
	if err := f.Allow("c", 10); err != nil {
		t.Fatalf("after a's turn ended: %v", err)
	}
	err = f.Allow("d", 10)
	if !errors.As(err, &lim) || lim.Limit != LimitFleetRate || lim.RetryAfter != 20*time.Minute {
		t.Fatalf("with b and c holding turns, d = %v, want fleet_rate until b's turn ends at 80m", err)
	}
	if got := f.State().Nodes; len(got) != 2 || !got["b"].Equal(t0.Add(20*time.Minute)) || !got["c"].Equal(t0.Add(60*time.Minute)) {
		t.Fatalf("State().Nodes = %v, want b from 20m (its first remediation) and c from 60m", got)
	}
}

// ask is one alert in simulate: a node's, at a time from t0.
type ask struct {
	node string
	at   time.Duration
}

// simulate drives f as the dispatcher's queue does, on a fake clock, a
// second at a time: each alert asks at its time, and one held back asks
// again when the limit said (limits.Retry, at least a second), until it is
// allowed. It returns, per alert, when it was allowed (-1: never, before
// end).
func simulate(t *testing.T, f *Fleet, clock *FakeClock, known int, alerts []ask, end time.Duration) []time.Duration {
	t.Helper()
	next := make([]time.Duration, len(alerts))
	got := make([]time.Duration, len(alerts))
	for i, a := range alerts {
		next[i], got[i] = a.at, -1
	}
	for now := time.Duration(0); now <= end; now += time.Second {
		clock.Set(t0.Add(now))
		for i, a := range alerts {
			if got[i] >= 0 || next[i] > now {
				continue
			}
			err := f.Allow(a.node, known)
			if err == nil {
				got[i] = now
				continue
			}
			retry, limit, ok := Retry(err)
			if !ok || limit != LimitFleetRate {
				t.Fatalf("%s at %s: %v", a.node, now, err)
			}
			next[i] = now + retry.Round(time.Second)
		}
	}
	return got
}

// TestFleetNoisyNodeHoldsNoSlot: issue 16. With the default max fraction
// of 0.1, a fleet of 10 known nodes gets one turn at a time. A node that
// alerts every 10 s used to renew its place on every alert, and another
// node's alert at 15 s waited until the noisy one stopped (89 s on the
// simulated node, with a 20 s window). Counted from its first
// remediation, the noisy node's turn ends at 20 s, and the node that had
// no turn goes first: it waits 5 s. The noisy node is not starved either:
// each of its alerts waits at most a window.
func TestFleetNoisyNodeHoldsNoSlot(t *testing.T) {
	const window = 20 * time.Second
	clock := NewFakeClock(t0)
	f := NewFleet(FleetConfig{MaxFraction: 0.1, Window: window}, clock)
	var alerts []ask
	for at := time.Duration(0); at <= 80*time.Second; at += 10 * time.Second {
		alerts = append(alerts, ask{"noisy", at})
	}
	alerts = append(alerts, ask{"quiet", 15 * time.Second})
	got := simulate(t, f, clock, 10, alerts, 200*time.Second)
	if q := got[len(got)-1]; q != 20*time.Second {
		t.Errorf("the quiet node's alert at 15s was allowed at %s, want 20s (when the noisy node's first turn ends)", q)
	}
	for i, a := range alerts[:len(alerts)-1] {
		if got[i] < 0 || got[i]-a.at > window {
			t.Errorf("the noisy node's alert at %s was allowed at %s: waited more than a window", a.at, got[i])
		}
	}
	t.Logf("allowed at %v", got)
}

// TestFleetLine: when a turn frees, nodes that had no turn lately go
// first, in the order they were held back; a node that had its turn waits
// behind them, however early it asks; with two turns, two nodes go.
func TestFleetLine(t *testing.T) {
	clock := NewFakeClock(t0)
	f := NewFleet(FleetConfig{MaxNodes: 1, Window: time.Minute}, clock)
	if err := f.Allow("a", 10); err != nil {
		t.Fatal(err)
	}
	clock.Advance(10 * time.Second)
	if err := f.Allow("c", 10); limitOf(t, err) != LimitFleetRate {
		t.Fatalf("c = %v", err)
	}
	clock.Advance(time.Second)
	if err := f.Allow("b", 10); limitOf(t, err) != LimitFleetRate {
		t.Fatalf("b = %v", err)
	}
	if w := f.State().Waiting; len(w) != 2 || !w["c"].Since.Equal(t0.Add(10*time.Second)) {
		t.Fatalf("Waiting = %v", w)
	}
	// a's turn ends at 60s; a asks first, then b, then c.
	clock.Set(t0.Add(60 * time.Second))
	err := f.Allow("a", 10)
	var lim *Limited
	if !errors.As(err, &lim) || lim.Limit != LimitFleetRate || lim.RetryAfter != waitingGrace || !strings.Contains(lim.Reason, "2 waiting nodes are ahead") {
		t.Fatalf("a, after its turn, with b and c waiting = %#v", err)
	}
	if err := f.Allow("b", 10); limitOf(t, err) != LimitFleetRate {
		t.Fatalf("b before c, who waits longer = %v", err)
	}
	if err := f.Allow("c", 10); err != nil {
		t.Fatalf("c, first in line: %v", err)
	}
	// b asks again when told, and is told to come back when c's turn ends.
	clock.Set(t0.Add(70 * time.Second))
	if err := f.Allow("b", 10); !errors.As(err, &lim) || lim.RetryAfter != 50*time.Second {
		t.Fatalf("b during c's turn = %#v", err)
	}
	clock.Set(t0.Add(120 * time.Second))
	if err := f.Allow("a", 10); limitOf(t, err) != LimitFleetRate {
		t.Fatalf("a before b = %v", err)
	}
	if err := f.Allow("b", 10); err != nil {
		t.Fatalf("b, who had no turn: %v", err)
	}
	clock.Set(t0.Add(180 * time.Second))
	if err := f.Allow("a", 10); err != nil {
		t.Fatalf("a, alone in line: %v", err)
	}
}

// TestFleetLineLapses: a node held back that does not ask again (its
// alert resolved) loses its place once the time it was told, plus a grace,
// has passed; the free turn then goes to the next.
func TestFleetLineLapses(t *testing.T) {
	clock := NewFakeClock(t0)
	f := NewFleet(FleetConfig{MaxNodes: 1, Window: time.Minute}, clock)
	_ = f.Allow("a", 10)
	clock.Set(t0.Add(30 * time.Second))
	err := f.Allow("gone", 10)
	var lim *Limited
	if !errors.As(err, &lim) || lim.RetryAfter != 30*time.Second {
		t.Fatalf("gone = %#v, want fleet_rate for 30s", err)
	}
	clock.Set(t0.Add(60 * time.Second))
	if err := f.Allow("a", 10); limitOf(t, err) != LimitFleetRate {
		t.Fatalf("a, while gone keeps its place = %v", err)
	}
	clock.Set(t0.Add(60*time.Second + waitingGrace + time.Second))
	if err := f.Allow("a", 10); err != nil {
		t.Fatalf("a, after gone lost its place: %v", err)
	}
	if w := f.State().Waiting; len(w) != 0 {
		t.Errorf("Waiting = %v", w)
	}
}

// TestFleetAllowInSharedWindow: AllowIn decides on a window kept
// elsewhere, and two Fleets deciding on one window never hold more turns
// than the cap together.
func TestFleetAllowInSharedWindow(t *testing.T) {
	clock := NewFakeClock(t0)
	cfg := FleetConfig{MaxNodes: 1, Window: time.Hour}
	one, two := NewFleet(cfg, clock), NewFleet(cfg, clock)
	var shared FleetWindow
	if err := one.AllowIn(&shared, "a", 10); err != nil {
		t.Fatal(err)
	}
	if err := two.AllowIn(&shared, "b", 10); limitOf(t, err) != LimitFleetRate {
		t.Fatalf("b on the other replica = %v", err)
	}
	if err := two.AllowIn(&shared, "a", 10); err != nil {
		t.Fatalf("a on the other replica, in its turn: %v", err)
	}
	if got := two.State(); len(got.Nodes) != 1 || len(got.Waiting) != 1 {
		t.Errorf("the other replica's State = %+v, want the shared window", got)
	}
}

// TestFleetUnavailableNodeNotTheBreaker: issue 16. An agent that answers
// 503 (a full disk on its node) or cannot be reached is counted against
// its node, however often, and never opens the fleet's breaker; failures
// reported as failed still do.
func TestFleetUnavailableNodeNotTheBreaker(t *testing.T) {
	clock := NewFakeClock(t0)
	f := NewFleet(FleetConfig{BreakerFailures: 3, BreakerWindow: time.Hour}, clock)
	for i := range 10 {
		if n := f.ReportUnavailable("full"); n != i+1 {
			t.Fatalf("ReportUnavailable = %d, want %d", n, i+1)
		}
	}
	if f.BreakerOpen() {
		t.Fatal("a node's unavailable agent opened the fleet breaker")
	}
	if err := f.Allow("healthy", 10); err != nil {
		t.Fatalf("a healthy node: %v", err)
	}
	if got := f.State().Unavailable; got["full"] != 10 || len(got) != 1 {
		t.Errorf("State().Unavailable = %v", got)
	}
	clock.Advance(61 * time.Minute)
	if got := f.State().Unavailable; len(got) != 0 {
		t.Errorf("after the window, State().Unavailable = %v", got)
	}
	for range 3 {
		f.Report("n", Failed)
	}
	if !f.BreakerOpen() {
		t.Error("3 failures did not open the breaker")
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
