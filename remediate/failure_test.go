package remediate_test

import (
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/remediate"
)

// TestFailedCleanupOpensBreaker: when a target survives its signals and
// the memory does not come back, the action fails and says what is left
// and what a human should do; the breaker then opens, holds further work
// back, and a human resets it. (Memory that stays after every target
// exited is an escalation instead, which never opens the breaker:
// TestBreakerIgnoresHiddenHolders.)
func TestFailedCleanupOpensBreaker(t *testing.T) {
	skipShort(t)
	t.Parallel()
	root := testenv.SimNode(t, 2)
	uuid := gpuUUID(t, root, 1)
	w := testenv.StartWorkload(t, root, 1, 2048, 1)
	// The child is frozen (cgroup v1 freezer): it survives SIGTERM and
	// SIGKILL in D state, its context open, as a process stuck in the
	// kernel does. (A tracer's hold is the tracer's user's, an escalation
	// that never opens the breaker: TestPtraceHeldTargetEscalates.)
	freezeInKernel(t, w.Children[0])

	url, _ := startAgent(t, root, filepath.Join(t.TempDir(), "r.db"), "--act", "--remediate.verify-timeout=2s",
		"--limit.breaker-failures=1", "--limit.cooldown=0s")
	w.KillParent(t)
	startsAt := time.Now().Add(-time.Minute)
	if code, body := post(t, url, token, payload(alert("firing", "node-a", uuid, fp(20), startsAt))); code != http.StatusOK {
		t.Fatalf("post: %d %s", code, body)
	}
	a := finished(t, url, 30*time.Second)
	if a.State != remediate.StateFailed {
		t.Fatalf("action %s (%s), want failed", a.State, a.Reason)
	}
	if len(a.Targets) != 1 || a.Targets[0].Outcome != "still_alive" || a.Escalation != "" {
		t.Errorf("targets %+v, escalation %q", a.Targets, a.Escalation)
	}
	if len(a.Leftover) == 0 || a.Leftover[0].PID != w.Children[0] || a.Leftover[0].Kind != "d_state" || a.NextStep == "" {
		t.Errorf("leftover %+v, next step %q", a.Leftover, a.NextStep)
	}
	if a.After == nil || a.After.UnownedBytes < 2048<<20 {
		t.Errorf("after evidence %+v: the memory is still there", a.After)
	}
	// The action's end is recorded before its limiter permit is returned:
	// poll for the breaker.
	testenv.Eventually(t, 5*time.Second, "the breaker to open after a failed cleanup with --limit.breaker-failures=1", func() bool {
		_, mfs := testenv.Scrape(t, url+"/metrics")
		v, _ := testenv.Value(mfs, "gpu_orphan_remediator_breaker_open", nil)
		return v == 1
	})
	// The store records the end before the counter moves: poll.
	testenv.Eventually(t, 5*time.Second, "actions_total{state=failed} to count it", func() bool {
		_, mfs := testenv.Scrape(t, url+"/metrics")
		v, _ := testenv.Value(mfs, "gpu_orphan_remediator_actions_total", map[string]string{"state": "failed"})
		return v == 1
	})

	// While open, new work is held back, not acted on.
	w2 := testenv.StartWorkload(t, root, 0, 1024, 1)
	w2.KillParent(t)
	if code, body := post(t, url, token, payload(alert("firing", "node-a", gpuUUID(t, root, 0), fp(21), startsAt))); code != http.StatusOK {
		t.Fatalf("post: %d %s", code, body)
	}
	testenv.Eventually(t, 15*time.Second, "the breaker to hold work back", func() bool {
		_, mfs := testenv.Scrape(t, url+"/metrics")
		v, _ := testenv.Value(mfs, "gpu_orphan_remediator_limited_total", map[string]string{"limit": "breaker"})
		return v >= 1
	})
	if !testenv.Alive(w2.Children[0]) {
		t.Fatal("acted while the breaker was open")
	}

	// A human resets it; the held work then runs.
	req, _ := http.NewRequest(http.MethodPost, url+"/api/v1/breaker/reset", nil)
	if resp, err := http.DefaultClient.Do(req); err != nil || resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("reset without a token: %v %v", resp, err)
	}
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("reset: %v %v", resp, err)
	}
	resp.Body.Close()
	testenv.Eventually(t, 20*time.Second, "the held work to run after the reset", func() bool {
		return !testenv.Alive(w2.Children[0])
	})
}

// freezeInKernel freezes pid in a cgroup of the v1 freezer of its own: a
// frozen task sleeps in D state and acts on no signal, SIGKILL included,
// until it is thawed, which cleanup does (the cgroup is removed after).
func freezeInKernel(t *testing.T, pid int) {
	t.Helper()
	rel := fmt.Sprintf("gpu-orphan-test-frozen-%d", pid)
	testenv.IntoCgroup(t, testenv.CgroupV1, rel, pid)
	state := filepath.Join(testenv.CgroupV1, rel, "freezer.state")
	if _, err := os.Stat(state); err != nil {
		t.Skipf("no v1 freezer at %s: %v", testenv.CgroupV1, err)
	}
	t.Cleanup(func() { _ = os.WriteFile(state, []byte("THAWED"), 0) })
	if err := os.WriteFile(state, []byte("FROZEN"), 0); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 5*time.Second, fmt.Sprintf("PID %d to be frozen", pid), func() bool {
		b, err := os.ReadFile(state)
		return err == nil && strings.TrimSpace(string(b)) == "FROZEN"
	})
}
