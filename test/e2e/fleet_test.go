//go:build e2e

package e2e

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

// TestFleetSquatterThroughAlertmanager: issue 24, item 1, through the real
// Alertmanager: Alertmanager → gpu-orphan-dispatcher → node agents. node-c's
// agent is down and a user's listener holds its port, answering 401. Three
// alerts for node-c reach it through Alertmanager; it must get no token
// (the dispatcher sent `Authorization: Bearer <fleet token>`), what it got
// must be refused by node-a's real agent, and the fleet breaker must stay
// closed: node-a's alert, through Alertmanager too, reaches node-a's agent.
func TestFleetSquatterThroughAlertmanager(t *testing.T) {
	_, alertmanager := tools(t)
	dir := t.TempDir()
	const fleetSecret, webhookToken = "issue24-e2e-fleet-secret-5d2c81f0a9", "issue24-e2e-webhook-token-77b3e1"
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	fleetFile, webhookFile := write("agent-token", fleetSecret+"\n"), write("webhook-token", webhookToken+"\n")

	// node-a's real agent, on a simulated node.
	agent := exec.Command(bin(t, "gpu-orphan-remediator"), "--backend=sim", "--sim.root="+testenv.SimNode(t, 1),
		"--store.path="+filepath.Join(dir, "agent.db"), "--auth.token-file="+fleetFile, "--node.name=node-a",
		"--collector.interval=200ms", "--web.systemd-socket")
	agentA := "http://" + testenv.PassListener(t, agent)
	testenv.DaemonCmd(t, agent)
	testenv.WaitReady(t, agentA, "node-a's agent", 30*time.Second)

	// The listener on node-c's port.
	squat := testenv.NewSquatter(t)

	targets, _ := json.Marshal(map[string]string{"node-a": agentA, "node-c": squat.URL})
	disp := exec.Command(bin(t, "gpu-orphan-dispatcher"), "--web.systemd-socket", "--auth.token-file="+webhookFile,
		"--dispatch.token-file="+fleetFile, "--dispatch.targets-file="+write("targets.json", string(targets)),
		"--store.path="+filepath.Join(dir, "dispatcher.db"), "--limit.breaker-failures=3", "--dispatch.max-fraction=1")
	dispatcher := "http://" + testenv.PassListener(t, disp)
	testenv.DaemonCmd(t, disp)
	testenv.WaitReady(t, dispatcher, "the dispatcher", 30*time.Second)

	amAddr := testenv.FreeAddr(t)
	amConfig := write("alertmanager.yml", fmt.Sprintf(`route:
  receiver: gpu-orphan-dispatcher
  group_by: [alertname, node, uuid]
  group_wait: 0s
  group_interval: 1s
  repeat_interval: 1h
receivers:
  - name: gpu-orphan-dispatcher
    webhook_configs:
      - url: %s/api/v1/alerts
        max_alerts: 0
        http_config:
          authorization:
            type: Bearer
            credentials_file: %s
`, dispatcher, webhookFile))
	am := exec.Command(alertmanager, "--config.file="+amConfig, "--storage.path="+filepath.Join(dir, "am-data"),
		"--web.listen-address="+amAddr, "--cluster.listen-address=", "--web.external-url=http://"+amAddr)
	testenv.DaemonCmd(t, am)
	amURL := "http://" + amAddr
	testenv.WaitReady(t, amURL, "Alertmanager", 30*time.Second)

	fire := func(node, uuid string) {
		t.Helper()
		body, _ := json.Marshal([]map[string]any{{"labels": map[string]string{"alertname": "GPUOrphanMemory", "node": node, "uuid": uuid},
			"startsAt": time.Now().Add(-time.Minute).UTC().Format(time.RFC3339)}})
		resp, err := http.Post(amURL+"/api/v2/alerts", "application/json", bytes.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("posting the alert to Alertmanager: %s", resp.Status)
		}
	}
	actions := func() map[string][]remediate.Action {
		req, _ := http.NewRequest(http.MethodGet, dispatcher+"/api/v1/actions", nil)
		req.Header.Set("Authorization", "Bearer "+webhookToken)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var list []remediate.Action
		if err := json.NewDecoder(resp.Body).Decode(&list); err != nil {
			t.Fatal(err)
		}
		out := map[string][]remediate.Action{}
		for _, a := range list {
			out[a.Node] = append(out[a.Node], a)
		}
		return out
	}

	for i := range 3 {
		fire("node-c", fmt.Sprintf("GPU-c%d", i))
	}
	testenv.Eventually(t, 60*time.Second, "node-c's three alerts to fail against the listener", func() bool {
		n := 0
		for _, a := range actions()["node-c"] {
			if a.State == remediate.StateFailed && strings.Contains(a.Reason, "401") {
				n++
			}
		}
		return n == 3
	})
	seen := squat.Requests()
	if len(seen) == 0 {
		t.Fatal("the listener got nothing")
	}
	for _, r := range seen {
		for k, vs := range r.Header {
			for _, v := range vs {
				if strings.Contains(v, fleetSecret) || strings.HasPrefix(strings.ToLower(v), "bearer") {
					t.Errorf("the listener got a reusable credential: %s: %s", k, v)
				}
			}
		}
		if bytes.Contains(r.Body, []byte(fleetSecret)) {
			t.Error("the listener got the token in a body")
		}
	}
	// What it got, replayed to node-a's agent: refused.
	if code := testenv.Replay(t, agentA, seen[0]); code != http.StatusUnauthorized {
		t.Errorf("node-c's request replayed to node-a's agent: %d %s, want 401", code, http.StatusText(code))
	}

	// The fleet breaker stayed closed: node-a's alert reaches its agent.
	fire("node-a", "GPU-a0")
	testenv.Eventually(t, 60*time.Second, "node-a's alert to be taken by its agent", func() bool {
		as := actions()["node-a"]
		return len(as) == 1 && as[0].Agent != nil && (as[0].State == remediate.StateSucceeded || as[0].State == remediate.StateSkipped)
	})
	_, mfs := testenv.Scrape(t, dispatcher+"/metrics")
	if v, ok := testenv.Value(mfs, "gpu_orphan_remediator_breaker_open", nil); !ok || v != 0 {
		t.Errorf("the fleet breaker: breaker_open %v (found %v), want 0", v, ok)
	}
}
