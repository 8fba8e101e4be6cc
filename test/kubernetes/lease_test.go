//go:build kubernetes

package kubernetes

import (
	"encoding/json"
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	authorizationv1 "k8s.io/api/authorization/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv/kubereal"
	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/app"
	"github.com/gpu-orphan/gpu-orphan/remediate/dispatch/lease"
	"github.com/gpu-orphan/gpu-orphan/remediate/limits"
)

// TestTwoReplicasShareTheLease: issue 16. Two dispatcher replicas, each
// with its own store, used to keep a fleet limit each: with a cap of one
// node, Alertmanager's alert for node-a reaching one replica and node-b's
// the other reached both nodes. The chart's two replicas, each with the
// chart's Role only (create on leases, get and update on its own Lease),
// keep one fleet window in the Lease under the real API server's
// optimistic concurrency: of two alerts posted at once, one to each
// replica, one node is forwarded, and the other replica holds its alert
// back, queued, until the turn ends; the Lease's window holds the served
// node's turn and the held node waiting in line.
func TestTwoReplicasShareTheLease(t *testing.T) {
	r, _, a, b := twoAgents(t, "lease", dispatcherValues(false, true))
	cp, ns := r.cp, r.namespace
	limit := func(o *app.Options) { o.Dispatch.MaxNodes, o.Dispatch.MaxFraction, o.Dispatch.Window = 1, 1, time.Hour }
	base1, _ := startDispatcher(t, r, limit)
	base2, _ := startDispatcher(t, r, limit)

	done := make(chan error, 2)
	post := func(base, node string) {
		res, err := testenv.PostAlerts(base, node)
		if err == nil && res["accepted"] != 1 {
			err = fmt.Errorf("results %v, want the alert accepted (held or forwarded)", res)
		}
		done <- err
	}
	go post(base1, "node-a")
	go post(base2, "node-b")
	for range 2 {
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
	// Each replica decides: one forwards, the other holds back for the
	// hour of the turn (it would forward at once if the replicas kept a
	// window each).
	var held string
	testenv.Eventually(t, 20*time.Second, "one alert forwarded and the other held back", func() bool {
		acts := actionsOf(t, base1, base2)
		if len(acts["node-a"]) != 1 || len(acts["node-b"]) != 1 {
			return false
		}
		x, y := acts["node-a"][0], acts["node-b"][0]
		switch {
		case x.State == remediate.StateSucceeded && y.State == remediate.StateQueued && strings.Contains(y.Reason, limits.LimitFleetRate):
			held = "node-b"
		case y.State == remediate.StateSucceeded && x.State == remediate.StateQueued && strings.Contains(x.Reason, limits.LimitFleetRate):
			held = "node-a"
		}
		return held != ""
	})
	agents := map[string]*testenv.FakeAgent{"node-a": a, "node-b": b}
	served := map[string]string{"node-a": "node-b", "node-b": "node-a"}[held]
	if got := agents[served].Alerts(); len(got) != 1 {
		t.Errorf("%s's agent got %v", served, got)
	}
	if got := agents[held].Alerts(); len(got) != 0 {
		t.Errorf("%s's agent got %v although the other replica served %s under a cap of one node", held, got, served)
	}
	w := leaseWindow(t, cp, ns, r.dispatcherName())
	if len(w.Turns) != 1 || w.Turns[served].IsZero() {
		t.Errorf("the Lease's window %+v, want %s's turn only", w, served)
	}
	if _, ok := w.Waiting[held]; !ok {
		t.Errorf("%s is not waiting in the Lease's line: %+v", held, w.Waiting)
	}
}

// leaseWindow is the fleet window in the Lease namespace/name.
func leaseWindow(t *testing.T, cp *kubereal.ControlPlane, namespace, name string) limits.FleetWindow {
	t.Helper()
	l, err := cp.Admin(t).CoordinationV1().Leases(namespace).Get(t.Context(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("the shared Lease: %v", err)
	}
	var w limits.FleetWindow
	if err := json.Unmarshal([]byte(l.Annotations[lease.Annotation]), &w); err != nil {
		t.Fatalf("the Lease's window, annotation %s %q: %v", lease.Annotation, l.Annotations[lease.Annotation], err)
	}
	return w
}

// TestReplicaKilled: two gpu-orphan-dispatcher processes, the chart's
// flags and Role, sharing the Lease. One is killed with SIGKILL right
// after it forwarded an alert (it releases nothing: no shutdown runs).
// The other forwards the next alert at once: no replica waits for the
// dead one's turn on the Lease to expire, since none holds it. Each
// alert reaches its agent once.
func TestReplicaKilled(t *testing.T) {
	r, _, a, b := twoAgents(t, "killed", dispatcherValues(false, true))
	cp, ns := r.cp, r.namespace
	start := func() (*exec.Cmd, string) {
		return startDispatcherBinary(t, r, append(r.kubernetesFlags(t), "--dispatch.max-nodes=10", "--dispatch.max-fraction=1", "--dispatch.max-attempts=1")...)
	}
	p1, base1 := start()
	_, base2 := start()

	if res := testenv.MustPostAlerts(t, base1, "node-a"); res["accepted"] != 1 {
		t.Fatalf("replica 1: results %v, want accepted", res)
	}
	testenv.Eventually(t, 20*time.Second, "node-a's agent to get its alert from replica 1", func() bool { return len(a.Alerts()) == 1 })
	if err := p1.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_, _ = p1.Process.Wait()

	begin := time.Now()
	if res := testenv.MustPostAlerts(t, base2, "node-b"); res["accepted"] != 1 {
		t.Fatalf("replica 2, after replica 1 was killed: results %v, want accepted", res)
	}
	testenv.Eventually(t, 20*time.Second, "node-b's agent to get its alert from replica 2", func() bool { return len(b.Alerts()) == 1 })
	t.Logf("replica 2 forwarded %s after replica 1 was killed", time.Since(begin).Round(time.Millisecond))
	l, err := cp.Admin(t).CoordinationV1().Leases(ns).Get(t.Context(), r.dispatcherName(), metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if d := l.Spec.LeaseDurationSeconds; d != nil && time.Since(begin) > time.Duration(*d)*time.Second {
		t.Errorf("replica 2 forwarded after %s, beyond the Lease's duration of %ds", time.Since(begin), *d)
	}
	time.Sleep(time.Second)
	if len(a.Alerts()) != 1 || len(b.Alerts()) != 1 {
		t.Errorf("agents got node-a %v, node-b %v: want each alert once", a.Alerts(), b.Alerts())
	}
}

// leaseRelease is a namespace of the test's own, named name, with the
// chart's RBAC for the shared Lease, and the client configuration of the
// chart's dispatcher ServiceAccount (its token, nothing more).
func leaseRelease(t *testing.T, name string) (*release, *rest.Config) {
	t.Helper()
	cp := kubereal.Get(t)
	r := installRBAC(t, cp, newNamespace(t, cp, name), dispatcherValues(false, true))
	return r, cp.TokenConfig(cp.ServiceAccountToken(t, r.namespace, r.dispatcherName()))
}

// replica is one dispatcher replica's fleet limits, on the window it
// shares with the others in the chart's Lease.
func replica(t *testing.T, r *release, rc *rest.Config, identity string, fleet *limits.Fleet) *lease.Window {
	t.Helper()
	w, err := lease.New(lease.Config{Namespace: r.namespace, Name: r.dispatcherName(), Identity: identity, RESTConfig: rc, Fleet: fleet,
		Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	return w
}

// TestReplicasNeverExceedTheLimitTogether: issue 16. Two dispatcher
// replicas used to keep a fleet limit each, so that together they served
// twice the cap. On the chart's Lease, 2 replicas × 8 concurrent alerts,
// for 12 nodes (each node's alert reaching both replicas, as
// Alertmanager's HA pair and retries deliver it), serve exactly the cap
// of 2 nodes, both in the Lease's window, whatever the API server's
// conflicts between them.
func TestReplicasNeverExceedTheLimitTogether(t *testing.T) {
	r, rc := leaseRelease(t, "lease-together")
	cfg := limits.FleetConfig{MaxNodes: 2, MaxFraction: 1, Window: time.Hour}
	replicas := []*lease.Window{replica(t, r, rc, "dispatcher-0", limits.NewFleet(cfg, limits.RealClock{})),
		replica(t, r, rc, "dispatcher-1", limits.NewFleet(cfg, limits.RealClock{}))}
	updates := map[string]string{"verb": "PUT", "resource": "leases"}
	conflicts := map[string]string{"verb": "PUT", "resource": "leases", "code": "409"}
	updated, conflicted := r.cp.Requests(t, updates), r.cp.Requests(t, conflicts)
	var (
		mu      sync.Mutex
		allowed = map[string]bool{}
		wg      sync.WaitGroup
	)
	for i, w := range replicas {
		for g := range 8 {
			wg.Go(func() {
				for n := range 12 {
					node := fmt.Sprintf("node-%d", (n+g*5+i*3)%12)
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
	t.Logf("served %v; %v updates of the Lease, %v of them refused as conflicts (409)", allowed,
		r.cp.Requests(t, updates)-updated, r.cp.Requests(t, conflicts)-conflicted)
	if len(allowed) != 2 {
		t.Fatalf("the replicas served %d distinct nodes together, want the cap, 2: %v", len(allowed), allowed)
	}
	w := leaseWindow(t, r.cp, r.namespace, r.dispatcherName())
	for node := range allowed {
		if _, ok := w.Turns[node]; !ok {
			t.Errorf("%s was served but is not in the Lease's window %v", node, w.Turns)
		}
	}
	l, err := r.cp.Admin(t).CoordinationV1().Leases(r.namespace).Get(t.Context(), r.dispatcherName(), metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if l.Spec.HolderIdentity == nil || !strings.HasPrefix(*l.Spec.HolderIdentity, "dispatcher-") {
		t.Errorf("holderIdentity %v, want the last writer", l.Spec.HolderIdentity)
	}
}

// TestWindowOutlivesAReplica: the window is the Lease's, not a replica's
// memory. A node served by one replica holds its turn on a replica started
// later (a restart, a new pod); a node held back there waits in the same
// line, and is served when the turn ends.
func TestWindowOutlivesAReplica(t *testing.T) {
	r, rc := leaseRelease(t, "lease-outlives")
	t0 := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	clock := limits.NewFakeClock(t0)
	cfg := limits.FleetConfig{MaxNodes: 1, Window: 20 * time.Second}
	first := replica(t, r, rc, "dispatcher-0", limits.NewFleet(cfg, clock))
	if err := first.Check(t.Context()); err != nil {
		t.Fatal(err)
	}
	if err := first.Allow(t.Context(), "noisy", 10); err != nil {
		t.Fatal(err)
	}
	clock.Advance(15 * time.Second)
	later := replica(t, r, rc, "dispatcher-new", limits.NewFleet(cfg, clock))
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
	if w := leaseWindow(t, r.cp, r.namespace, r.dispatcherName()); !w.Turns["quiet"].Equal(t0.Add(20*time.Second)) || len(w.Waiting) != 1 {
		t.Errorf("window %+v", w)
	}
}

// TestWindowFailsClosed: without the chart's rules for leases (taken from
// its Role, and the authorizer has seen it), the start's check fails,
// saying which verbs it needs; the API server's refusal holds every node
// back with an error that is not a limit (the dispatcher keeps the alert
// queued), never serves it. With the rules back the check passes, and a
// window that cannot be read (someone who may write the Lease broke it)
// holds back too, saying what to do.
func TestWindowFailsClosed(t *testing.T) {
	r, rc := leaseRelease(t, "lease-fails-closed")
	w := replica(t, r, rc, "dispatcher-0", limits.NewFleet(limits.FleetConfig{MaxNodes: 5, Window: time.Hour}, limits.RealClock{}))
	granted := r.roleRules(t)
	leaseAccess := func(verb string) authorizationv1.ResourceAttributes {
		return authorizationv1.ResourceAttributes{Namespace: r.namespace, Verb: verb, Group: "coordination.k8s.io", Resource: "leases", Name: r.dispatcherName()}
	}
	r.setRoleRules(t, without(granted, "leases"))
	r.cp.WaitAccess(t, r.namespace, r.dispatcherName(), false, leaseAccess("get"), leaseAccess("create"), leaseAccess("update"))
	err := w.Check(t.Context())
	for _, says := range []string{"get", "create", "update", "leases", "coordination.k8s.io", r.namespace} {
		if err == nil || !strings.Contains(err.Error(), says) {
			t.Errorf("Check without RBAC: %v; want it to say %q", err, says)
		}
	}
	if err := w.Allow(t.Context(), "node-a", 10); err == nil || isLimit(err) {
		t.Errorf("Allow without RBAC = %v, want an error that is not a limit", err)
	}

	r.setRoleRules(t, granted)
	r.cp.WaitAccess(t, r.namespace, r.dispatcherName(), true, leaseAccess("get"), leaseAccess("create"), leaseAccess("update"))
	if err := w.Check(t.Context()); err != nil {
		t.Fatal(err)
	}
	leases := r.cp.Admin(t).CoordinationV1().Leases(r.namespace)
	l, err := leases.Get(t.Context(), r.dispatcherName(), metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	l.Annotations = map[string]string{lease.Annotation: "{not json"}
	if _, err := leases.Update(t.Context(), l, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := w.Allow(t.Context(), "node-a", 10); err == nil || isLimit(err) || !strings.Contains(err.Error(), "delete the Lease") {
		t.Errorf("Allow on a broken window = %v, want an error saying what to do", err)
	}
}

// TestBreakerDecidesNothing: this replica's open breaker holds back
// without writing the shared window: the Lease, absent before, is not
// created.
func TestBreakerDecidesNothing(t *testing.T) {
	r, rc := leaseRelease(t, "lease-breaker")
	fleet := limits.NewFleet(limits.FleetConfig{MaxNodes: 5, Window: time.Hour}, limits.RealClock{})
	w := replica(t, r, rc, "dispatcher-0", fleet)
	fleet.OpenBreaker("a human opened it")
	var lim *limits.Limited
	if err := w.Allow(t.Context(), "node-a", 10); !errors.As(err, &lim) || lim.Limit != limits.LimitBreaker {
		t.Fatalf("Allow with the breaker open = %v", err)
	}
	if _, err := r.cp.Admin(t).CoordinationV1().Leases(r.namespace).Get(t.Context(), r.dispatcherName(), metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("the Lease after a decision of the open breaker: %v, want none written (404)", err)
	}
}

func isLimit(err error) bool {
	var l *limits.Limited
	return errors.As(err, &l)
}
