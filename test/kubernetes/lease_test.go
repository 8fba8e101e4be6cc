//go:build kubernetes

package kubernetes

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
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
	r, _, a, b := twoAgents(t, "lease", dispatcherValues(false, true))
	cp, ns := r.cp, r.namespace
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

// TestReplicaKilled: two gpu-orphan-dispatcher processes, the chart's
// flags and Role, sharing the Lease. One is killed with SIGKILL right
// after it forwarded an alert (it releases nothing: no shutdown runs).
// The other forwards the next alert at once: no replica waits for the
// dead one's turn on the Lease to expire, since none holds it. Each
// alert reaches its agent once.
func TestReplicaKilled(t *testing.T) {
	r, _, a, b := twoAgents(t, "killed", dispatcherValues(false, true))
	cp, ns := r.cp, r.namespace
	bin := testenv.Bin(t, "gpu-orphan-dispatcher")
	kubeconfig := cp.Kubeconfig(t, cp.ServiceAccountToken(t, ns, r.dispatcherName()))
	token := filepath.Join(t.TempDir(), "agent-token")
	if err := os.WriteFile(token, []byte("0123456789abcdef0123456789abcdef\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	start := func(name string) (*exec.Cmd, string) {
		addr := testenv.FreeAddr(t)
		args := []string{"--web.listen-address=" + addr, "--auth.insecure-none", "--store.path=" + filepath.Join(t.TempDir(), name+".db"),
			"--dispatch.kubernetes.kubeconfig=" + kubeconfig, "--dispatch.token-file=" + token,
			"--dispatch.max-nodes=10", "--dispatch.max-fraction=1", "--dispatch.max-attempts=1"}
		for k, v := range r.dispatcherFlags(t) {
			if strings.HasPrefix(k, "dispatch.kubernetes.") {
				args = append(args, "--"+k+"="+v)
			}
		}
		cmd := testenv.Daemon(t, bin, args...)
		base := "http://" + addr
		testenv.Eventually(t, 30*time.Second, name+" to serve", func() bool { return healthy(base) })
		return cmd, base
	}
	p1, base1 := start("replica-1")
	_, base2 := start("replica-2")

	if res := postAlerts(t, base1, "node-a"); res["accepted"] != 1 {
		t.Fatalf("replica 1: results %v, want accepted", res)
	}
	testenv.Eventually(t, 20*time.Second, "node-a's agent to get its alert from replica 1", func() bool { return len(a.received()) == 1 })
	if err := p1.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_, _ = p1.Process.Wait()

	begin := time.Now()
	if res := postAlerts(t, base2, "node-b"); res["accepted"] != 1 {
		t.Fatalf("replica 2, after replica 1 was killed: results %v, want accepted", res)
	}
	testenv.Eventually(t, 20*time.Second, "node-b's agent to get its alert from replica 2", func() bool { return len(b.received()) == 1 })
	t.Logf("replica 2 forwarded %s after replica 1 was killed", time.Since(begin).Round(time.Millisecond))
	l, err := cp.Admin(t).CoordinationV1().Leases(ns).Get(t.Context(), r.dispatcherName(), metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if d := l.Spec.LeaseDurationSeconds; d != nil && time.Since(begin) > time.Duration(*d)*time.Second {
		t.Errorf("replica 2 forwarded after %s, beyond the Lease's duration of %ds", time.Since(begin), *d)
	}
	time.Sleep(time.Second)
	if len(a.received()) != 1 || len(b.received()) != 1 {
		t.Errorf("agents got node-a %v, node-b %v: want each alert once", a.received(), b.received())
	}
}
