//go:build kubernetes

package kubernetes

import (
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv/kubereal"
	"github.com/gpu-orphan/gpu-orphan/remediate/app"
	"github.com/gpu-orphan/gpu-orphan/remediate/dispatch/lease"
)

// TestTwoReplicasShareTheLease: the chart's two dispatcher replicas, each
// with the chart's Role only (create on leases, get and update on its own
// Lease), keep one fleet window in the Lease under the real API server's
// optimistic concurrency: with a fleet limit of one node an hour, two
// alerts for two nodes posted at once, one to each replica, get one node
// forwarded, not one per replica.
func TestTwoReplicasShareTheLease(t *testing.T) {
	cp := kubereal.Get(t)
	ns := newNamespace(t, cp, "lease")
	r := installRBAC(t, cp, ns, dispatcherValues(false, true))
	f := newFleet(t, cp, r)
	a, b := newAgent(t), newAgent(t)
	f.addAgent(t, "node-a", a)
	f.addAgent(t, "node-b", b)
	limit := func(o *app.Options) { o.Dispatch.MaxNodes, o.Dispatch.MaxFraction, o.Dispatch.Window = 1, 1, time.Hour }
	base1, _ := startDispatcher(t, r, limit)
	base2, _ := startDispatcher(t, r, limit)

	done := make(chan map[string]int, 2)
	go func() { done <- postAlertsNoFatal(base1, "node-a") }()
	go func() { done <- postAlertsNoFatal(base2, "node-b") }()
	for range 2 {
		if res := <-done; res == nil || res["accepted"] != 1 {
			t.Fatalf("results %v, want the alert accepted (held or forwarded)", res)
		}
	}
	testenv.Eventually(t, 20*time.Second, "one node's agent to get its alert", func() bool {
		return len(a.received())+len(b.received()) >= 1
	})
	// The held node's alert would be forwarded at once if the replicas
	// kept a window each.
	time.Sleep(2 * time.Second)
	if n := len(a.received()) + len(b.received()); n != 1 {
		t.Errorf("%d nodes forwarded (node-a %v, node-b %v), want 1: the replicas exceeded the shared fleet limit", n, a.received(), b.received())
	}
	l, err := cp.Admin(t).CoordinationV1().Leases(ns).Get(t.Context(), r.dispatcherName(), metav1.GetOptions{})
	if err != nil {
		t.Fatalf("the shared Lease: %v", err)
	}
	if l.Annotations[lease.Annotation] == "" {
		t.Errorf("the Lease carries no %s annotation: %v", lease.Annotation, l.Annotations)
	}
}
