package remediate_test

// Issue 22's backstop: a re-plan that finds holders not yet provable (too
// young) looks again until --remediate.verify-timeout instead of giving up
// after one round.

import (
	"path/filepath"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/remediate"
)

// TestReplanWaitsForTooYoung: job A's trainer on GPU 1 died long enough
// ago (min-age 8 s) and its worker, which ignores SIGTERM, is the action's
// target. While the ladder waits out its grace, job B's trainer on the same
// GPU dies: B's worker now holds a dead owner's context that the plan did
// not name, and a re-plan finds it too young. The action looks again until
// B's owner is old enough, signals B's worker, and the memory comes back.
// (The old code re-planned once, found nothing it could act on, and ended
// failed as unproven_holder.)
func TestReplanWaitsForTooYoung(t *testing.T) {
	skipShort(t)
	t.Parallel()
	root := testenv.SimNode(t, 2)
	url, _ := startAgent(t, root, filepath.Join(t.TempDir(), "r.db"), "--act", "--remediate.min-age=8s",
		"--remediate.grace=3s", "--remediate.verify-timeout=20s")
	a := testenv.StartWorkload(t, root, 1, 1024, 1, "--ignore-sigterm")
	b := testenv.StartWorkload(t, root, 1, 512, 1)
	waitRecorded(t, url, 2)
	a.KillParent(t)
	body := payload(alert("firing", "node-a", gpuUUID(t, root, 1), fp(730), time.Now().Add(-time.Minute)))
	if code, resp := post(t, url, token, body); code != 200 {
		t.Fatalf("post: %d %s", code, resp)
	}
	// The action runs once A's owner is 8 s dead: its ladder then waits 3 s
	// for the worker that ignores SIGTERM.
	testenv.Eventually(t, 30*time.Second, "the action to signal job A's worker", func() bool {
		as := actions(t, url)
		return len(as) == 1 && len(signalled(t, getAction(t, url, as[0].ID))[a.Children[0]]) > 0
	})
	start := time.Now()
	b.KillParent(t)

	var got remediate.Action
	testenv.Eventually(t, 60*time.Second, "the action to finish", func() bool {
		as := actions(t, url)
		got = as[0]
		return got.State.Final()
	})
	t.Logf("action %s (%s) %.1f s after B's trainer died; targets %v", got.State, got.Reason, time.Since(start).Seconds(), targetPIDs(got))
	if got.State != remediate.StateSucceeded || got.Escalation != "" {
		t.Fatalf("action %s (%s), escalation %q; want succeeded", got.State, got.Reason, got.Escalation)
	}
	wantTargets(t, got, append(a.Children, b.Children...)...)
	wantDead(t, "job B's worker, signalled once its owner was old enough", b.Children...)
	wantUsedMiB(t, root, 1, 0)
	replans := 0
	for _, e := range getAction(t, url, got.ID).Events {
		if e.Kind == "replan" {
			replans++
		}
	}
	if replans < 2 {
		t.Errorf("%d replan events, want the too-young one and the one that found B's worker", replans)
	}
}
