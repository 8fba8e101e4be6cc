package lease

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv/kubeapi"
	"github.com/gpu-orphan/gpu-orphan/remediate/discovery"
	"github.com/gpu-orphan/gpu-orphan/remediate/limits"
)

const (
	ns   = "gpu-orphan"
	name = "gpu-orphan-dispatcher"
)

var t0 = time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)

// replica is one dispatcher replica's fleet limits, on the shared window.
func replica(t *testing.T, api *kubeapi.Server, identity string, cfg limits.FleetConfig, clock limits.Clock) *Window {
	t.Helper()
	rc, err := discovery.ClientConfig(api.Kubeconfig(t))
	if err != nil {
		t.Fatal(err)
	}
	w, err := New(Config{Namespace: ns, Name: name, Identity: identity, RESTConfig: rc, Fleet: limits.NewFleet(cfg, clock)})
	if err != nil {
		t.Fatal(err)
	}
	return w
}

func window(t *testing.T, api *kubeapi.Server) limits.FleetWindow {
	t.Helper()
	l := api.Lease(name)
	if l == nil {
		t.Fatal("no Lease")
	}
	var w limits.FleetWindow
	if err := json.Unmarshal([]byte(l.Annotations[Annotation]), &w); err != nil {
		t.Fatalf("the window annotation %q: %v", l.Annotations[Annotation], err)
	}
	return w
}

// TestReplicasNeverExceedTheLimitTogether: issue 16. Two dispatcher
// replicas used to keep a fleet limit each, so that together they served
// twice the cap. On one Lease, 2 replicas × 8 concurrent alerts, for 12
// nodes (each node's alert reaching both replicas, as Alertmanager's HA
// pair and retries deliver it), serve exactly the cap of 2 nodes, both in
// the Lease's window.
func TestReplicasNeverExceedTheLimitTogether(t *testing.T) {
	api := kubeapi.Start(t, ns)
	cfg := limits.FleetConfig{MaxNodes: 2, MaxFraction: 1, Window: time.Hour}
	replicas := []*Window{replica(t, api, "dispatcher-0", cfg, limits.RealClock{}), replica(t, api, "dispatcher-1", cfg, limits.RealClock{})}
	var (
		mu      sync.Mutex
		allowed = map[string]bool{}
		wg      sync.WaitGroup
	)
	for r, w := range replicas {
		for g := range 8 {
			wg.Go(func() {
				for i := range 12 {
					node := fmt.Sprintf("node-%d", (i+g*5+r*3)%12)
					err := w.Allow(t.Context(), node, 100)
					if err == nil {
						mu.Lock()
						allowed[node] = true
						mu.Unlock()
					} else if _, limit, ok := limits.Retry(err); !ok || limit != limits.LimitFleetRate {
						t.Errorf("%s: %v", node, err)
					}
				}
			})
		}
	}
	wg.Wait()
	writes, conflicts := api.LeaseWrites()
	t.Logf("served %v; %d writes of the Lease, %d refused as conflicts", allowed, writes, conflicts)
	if len(allowed) != 2 {
		t.Fatalf("the replicas served %d distinct nodes together, want the cap, 2: %v", len(allowed), allowed)
	}
	w := window(t, api)
	for node := range allowed {
		if _, ok := w.Turns[node]; !ok {
			t.Errorf("%s was served but is not in the Lease's window %v", node, w.Turns)
		}
	}
	if l := api.Lease(name); l.Spec.HolderIdentity == nil || !strings.HasPrefix(*l.Spec.HolderIdentity, "dispatcher-") {
		t.Errorf("holderIdentity %v, want the last writer", l.Spec.HolderIdentity)
	}
}

// TestWindowOutlivesAReplica: the window is the Lease's, not a replica's
// memory. A node served by one replica holds its turn on a replica started
// later (a restart, a new pod); a node held back there waits in the same
// line, and is served when the turn ends.
func TestWindowOutlivesAReplica(t *testing.T) {
	api := kubeapi.Start(t, ns)
	clock := limits.NewFakeClock(t0)
	cfg := limits.FleetConfig{MaxNodes: 1, Window: 20 * time.Second}
	first := replica(t, api, "dispatcher-0", cfg, clock)
	if err := first.Check(t.Context()); err != nil {
		t.Fatal(err)
	}
	if err := first.Allow(t.Context(), "noisy", 10); err != nil {
		t.Fatal(err)
	}
	clock.Advance(15 * time.Second)
	later := replica(t, api, "dispatcher-new", cfg, clock)
	err := later.Allow(t.Context(), "quiet", 10)
	var lim *limits.Limited
	if !errors.As(err, &lim) || lim.Limit != limits.LimitFleetRate || lim.RetryAfter != 5*time.Second {
		t.Fatalf("quiet on a replica started later = %v, want fleet_rate until noisy's turn ends", err)
	}
	if err := later.Allow(t.Context(), "noisy", 10); err != nil {
		t.Fatalf("noisy, in its turn, on the new replica: %v", err)
	}
	clock.Advance(5 * time.Second)
	// noisy asks first on the first replica, but quiet, who had no turn,
	// is ahead in the shared line.
	if err := first.Allow(t.Context(), "noisy", 10); !errors.As(err, &lim) || lim.Limit != limits.LimitFleetRate {
		t.Fatalf("noisy after its turn, with quiet waiting = %v", err)
	}
	if err := later.Allow(t.Context(), "quiet", 10); err != nil {
		t.Fatalf("quiet when noisy's turn ended: %v", err)
	}
	if w := window(t, api); !w.Turns["quiet"].Equal(t0.Add(20*time.Second)) || len(w.Waiting) != 1 {
		t.Errorf("window %+v", w)
	}
}

// TestWindowFailsClosed: without the RBAC for leases the start fails,
// saying which verbs it needs; a window that cannot be read, or an API
// server that refuses, holds every node back with an error that is not a
// limit (the dispatcher keeps the alert queued), never serves it.
func TestWindowFailsClosed(t *testing.T) {
	api := kubeapi.Start(t, ns)
	w := replica(t, api, "dispatcher-0", limits.FleetConfig{MaxNodes: 5, Window: time.Hour}, limits.RealClock{})
	api.ForbidLeases(true)
	err := w.Check(t.Context())
	for _, says := range []string{"get", "create", "update", "leases", "coordination.k8s.io", ns} {
		if err == nil || !strings.Contains(err.Error(), says) {
			t.Errorf("Check without RBAC: %v; want it to say %q", err, says)
		}
	}
	if err := w.Allow(t.Context(), "node-a", 10); err == nil || isLimit(err) {
		t.Errorf("Allow without RBAC = %v, want an error that is not a limit", err)
	}
	api.ForbidLeases(false)
	if err := w.Check(t.Context()); err != nil {
		t.Fatal(err)
	}
	// Someone who can write the Lease breaks its window.
	setAnnotations(t, w, map[string]string{Annotation: "{not json"})
	if err := w.Allow(t.Context(), "node-a", 10); err == nil || isLimit(err) || !strings.Contains(err.Error(), "delete the Lease") {
		t.Errorf("Allow on a broken window = %v, want an error saying what to do", err)
	}
}

// TestBreakerDecidesNothing: this replica's open breaker holds back
// without touching the shared window.
func TestBreakerDecidesNothing(t *testing.T) {
	api := kubeapi.Start(t, ns)
	w := replica(t, api, "dispatcher-0", limits.FleetConfig{MaxNodes: 5, Window: time.Hour}, limits.RealClock{})
	w.cfg.Fleet.OpenBreaker("a human opened it")
	if err := w.Allow(t.Context(), "node-a", 10); !isLimitNamed(err, limits.LimitBreaker) {
		t.Fatalf("Allow with the breaker open = %v", err)
	}
	if writes, _ := api.LeaseWrites(); writes != 0 {
		t.Errorf("%d writes of the Lease", writes)
	}
}

func isLimit(err error) bool {
	var l *limits.Limited
	return errors.As(err, &l)
}

func isLimitNamed(err error, limit string) bool {
	var l *limits.Limited
	return errors.As(err, &l) && l.Limit == limit
}

// setAnnotations writes the Lease's annotations as another client would.
func setAnnotations(t *testing.T, w *Window, annotations map[string]string) {
	t.Helper()
	lease, err := w.leases.Get(t.Context(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	lease.Annotations = annotations
	if _, err := w.leases.Update(t.Context(), lease, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}
