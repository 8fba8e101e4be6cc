package remediate_test

import (
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/remediate"
)

// TestDispatcherRoutesAndLimits: one dispatcher in front of two node agents
// on loopback. Each alert reaches the agent of the node it names, and the
// fleet limit (one node per window) holds the second node back.
func TestDispatcherRoutesAndLimits(t *testing.T) {
	skipShort(t)
	rootA, rootB := testenv.SimNode(t, 2), testenv.SimNode(t, 2)
	for _, root := range []string{rootA, rootB} {
		w := testenv.StartWorkload(t, root, 1, 1024, 1)
		w.KillParent(t)
	}
	urlA, _ := startAgent(t, rootA, filepath.Join(t.TempDir(), "a.db"), "--node.name=node-a")
	urlB, _ := startAgent(t, rootB, filepath.Join(t.TempDir(), "b.db"), "--node.name=node-b")

	targets := filepath.Join(t.TempDir(), "targets.json")
	b, _ := json.Marshal(map[string]string{"node-a": urlA, "node-b": urlB})
	if err := os.WriteFile(targets, b, 0o600); err != nil {
		t.Fatal(err)
	}
	addr := testenv.FreeAddr(t)
	testenv.Daemon(t, testenv.Bin(t, "gpu-orphan-remediator"), "--role=dispatcher", "--web.listen-address="+addr,
		"--auth.token-file="+tokenFile(t), "--dispatch.token-file="+tokenFile(t), "--dispatch.targets-file="+targets,
		"--dispatch.max-nodes=1", "--dispatch.max-fraction=1", "--dispatch.window=1h",
		"--store.path="+filepath.Join(t.TempDir(), "d.db"), "--log.level=debug")
	dispatcher := "http://" + addr
	waitReady(t, http.DefaultClient, dispatcher)

	startsAt := time.Now().Add(-time.Minute)
	code, body := post(t, dispatcher, token, payload(
		alert("firing", "node-a", gpuUUID(t, rootA, 1), fp(10), startsAt),
		alert("firing", "node-b", gpuUUID(t, rootB, 1), fp(11), startsAt),
		alert("firing", "node-c", gpuUUID(t, rootB, 1), fp(12), startsAt), // no route
	))
	if code != http.StatusOK {
		t.Fatalf("dispatcher: %d %s", code, body)
	}
	if r := results(t, body); r["accepted"] != 2 || r["ignored"] != 1 {
		t.Fatalf("dispatcher results %v", r)
	}

	// Exactly one node's agent gets its alert and plans (dry run); the
	// other is held back by the fleet limit: forwarded nowhere, kept queued.
	agents := map[string]string{"node-a": urlA, "node-b": urlB}
	fps := map[string]string{"node-a": fp(10), "node-b": fp(11)}
	var served string
	testenv.Eventually(t, 20*time.Second, "one node's agent to act", func() bool {
		for node, url := range agents {
			if as := actions(t, url); len(as) == 1 && as[0].State == remediate.StateDryRun {
				served = node
				if as[0].AlertFingerprint != fps[node] || as[0].Node != node || len(as[0].Targets) != 1 {
					t.Errorf("%s action: %+v", node, as[0])
				}
				return true
			}
		}
		return false
	})
	held := "node-a"
	if served == "node-a" {
		held = "node-b"
	}
	time.Sleep(2 * time.Second)
	if as := actions(t, agents[held]); len(as) != 0 {
		t.Fatalf("%s got %d actions despite the fleet limit", held, len(as))
	}
	var queued bool
	for _, d := range actions(t, dispatcher) {
		if d.Node == held {
			queued = d.State == remediate.StateQueued
			t.Logf("dispatcher's %s record: %s %s", held, d.State, d.Reason)
		}
	}
	if !queued {
		t.Errorf("%s's alert must stay queued behind the fleet limit: %+v", held, actions(t, dispatcher))
	}
	_, mfs := testenv.Scrape(t, dispatcher+"/metrics")
	if v, _ := testenv.Value(mfs, "gpu_orphan_remediator_limited_total", map[string]string{"limit": "fleet_rate"}); v < 1 {
		t.Errorf("fleet_rate limit not counted: %s", testenv.Describe(mfs, "gpu_orphan_remediator_limited_total"))
	}
}
