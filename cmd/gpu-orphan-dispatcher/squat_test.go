package main_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/remediate"
)

// agentToken is the fleet's secret: the agents' --auth.token-file and the
// dispatcher's --dispatch.token-file.
const agentToken = "issue24-fleet-secret-7c1e9a40d2b35f68"

// writeFile writes content to a new file in dir.
func writeFile(t *testing.T, dir, name, content string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// startAgent runs a real node agent (gpu-orphan-remediator, a dry run) for
// node on a simulated node, with the fleet's secret as its token.
func startAgent(t *testing.T, node, tokenFile string) string {
	t.Helper()
	root := testenv.SimNode(t, 1)
	cmd := exec.Command(testenv.Bin(t, "gpu-orphan-remediator"), "--backend=sim", "--sim.root="+root,
		"--store.path="+filepath.Join(t.TempDir(), "agent.db"), "--auth.token-file="+tokenFile, "--node.name="+node,
		"--collector.interval=200ms", "--web.systemd-socket")
	base := "http://" + testenv.PassListener(t, cmd)
	testenv.DaemonCmd(t, cmd)
	testenv.WaitReady(t, base, "the agent of "+node, 20*time.Second)
	return base
}

// startFleetDispatcher runs the real dispatcher binary with targets
// (node to URL), the fleet's secret, and a fleet breaker of 3 failures.
func startFleetDispatcher(t *testing.T, dir string, targets map[string]string, webhookToken, tokenFile string) string {
	t.Helper()
	b, _ := json.Marshal(targets)
	cmd := exec.Command(testenv.Bin(t, "gpu-orphan-dispatcher"), "--web.systemd-socket",
		"--auth.token-file="+writeFile(t, dir, "webhook-token", webhookToken), "--dispatch.token-file="+tokenFile,
		"--dispatch.targets-file="+writeFile(t, dir, "targets.json", string(b)), "--store.path="+filepath.Join(dir, "d.db"),
		"--limit.breaker-failures=3", "--dispatch.max-fraction=1", "--dispatch.max-attempts=1")
	base := "http://" + testenv.PassListener(t, cmd)
	testenv.DaemonCmd(t, cmd)
	testenv.WaitReady(t, base, "the dispatcher", 20*time.Second)
	return base
}

// postAlert posts one alert (firing, or resolved now) that started at
// startsAt to the dispatcher, as Alertmanager does.
func postAlert(t *testing.T, base, webhookToken, status, node, uuid, fingerprint string, startsAt time.Time) {
	t.Helper()
	if _, err := testenv.PostWebhook(base, webhookToken, testenv.Alert{Status: status, Node: node, UUID: uuid, Fingerprint: fingerprint, StartsAt: startsAt}); err != nil {
		t.Fatalf("posting the %s alert for %s: %v", status, node, err)
	}
}

// actions lists the dispatcher's actions by node.
func actions(t *testing.T, base, webhookToken string) map[string][]remediate.Action {
	t.Helper()
	out := map[string][]remediate.Action{}
	for _, a := range testenv.Actions[remediate.Action](t, base, webhookToken) {
		out[a.Node] = append(out[a.Node], a)
	}
	return out
}

// TestSquatterOnAgentPortGetsNothingReusable: issue 24, item 1, with the
// real dispatcher and real node agents. node-c's agent is down and a
// user's listener holds its port, answering 401. The dispatcher used to
// send it `Authorization: Bearer <the fleet token>` with each of three
// alerts, count three failed cleanups and open the fleet breaker, so that
// node-a's next alert was held back. Now what the listener gets holds no
// token; replayed to node-a's agent it is refused, and replayed to
// node-c's own agent (back up) it works at most once; the fleet breaker
// stays closed and node-a's alert reaches node-a's agent.
func TestSquatterOnAgentPortGetsNothingReusable(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the dispatcher and the node agents")
	}
	dir := t.TempDir()
	const webhookToken = "issue24-webhook-token-0a1b2c3d4e5f"
	tokenFile := writeFile(t, dir, "agent-token", agentToken+"\n")
	agentA := startAgent(t, "node-a", tokenFile)
	squat := testenv.NewSquatter(t)
	base := startFleetDispatcher(t, dir, map[string]string{"node-a": agentA, "node-c": squat.URL}, webhookToken, tokenFile)

	for i := range 3 {
		postAlert(t, base, webhookToken, "firing", "node-c", fmt.Sprintf("GPU-c%d", i), fmt.Sprintf("c0ffee%02d", i), time.Now().Add(-time.Minute))
	}
	testenv.Eventually(t, 30*time.Second, "node-c's three alerts to fail against the squatter", func() bool {
		n := 0
		for _, a := range actions(t, base, webhookToken)["node-c"] {
			if a.State == remediate.StateFailed && strings.Contains(a.Reason, "401") {
				n++
			}
		}
		return n == 3
	})
	got := squat.Requests()
	if len(got) != 3 {
		t.Fatalf("the squatter got %d requests, want 3", len(got))
	}
	for _, r := range got {
		for k, vs := range r.Header {
			for _, v := range vs {
				if strings.Contains(v, agentToken) || strings.HasPrefix(strings.ToLower(v), "bearer") {
					t.Errorf("the squatter got a reusable credential: %s: %s", k, v)
				}
			}
		}
		if bytes.Contains(r.Body, []byte(agentToken)) {
			t.Errorf("the squatter got the token in the body")
		}
	}

	// Replayed to another node's agent: refused.
	if code := testenv.Replay(t, agentA, got[0]); code != http.StatusUnauthorized {
		t.Errorf("node-c's request replayed to node-a's agent: %d, want 401", code)
	}
	// The fleet breaker stayed closed: node-a's next alert reaches its agent.
	postAlert(t, base, webhookToken, "firing", "node-a", "GPU-a0", "a11ce000", time.Now().Add(-time.Minute))
	testenv.Eventually(t, 30*time.Second, "node-a's alert to be taken by its agent", func() bool {
		as := actions(t, base, webhookToken)["node-a"]
		return len(as) == 1 && as[0].Agent != nil && (as[0].State == remediate.StateSucceeded || as[0].State == remediate.StateSkipped)
	})
	_, mfs := testenv.Scrape(t, base+"/metrics")
	if v, ok := testenv.Value(mfs, "gpu_orphan_remediator_breaker_open", nil); !ok || v != 0 {
		t.Errorf("the fleet breaker: breaker_open %v (found %v), want 0", v, ok)
	}

	// node-c's agent is back: the request it was sent works once within
	// the window (it is node-c's own alert), never twice.
	agentC := startAgent(t, "node-c", tokenFile)
	first := testenv.Replay(t, agentC, got[1])
	if second := testenv.Replay(t, agentC, got[1]); second != http.StatusUnauthorized {
		t.Errorf("a request replayed to node-c's agent a second time: %d (first %d), want 401", second, first)
	}
	// The API with the stolen request: another path, refused.
	r := got[2]
	r.Method, r.URI, r.Body = http.MethodPost, "/api/v1/breaker/reset", nil
	if code := testenv.Replay(t, agentC, r); code != http.StatusUnauthorized {
		t.Errorf("the breaker reset with node-c's signature: %d, want 401", code)
	}
}
