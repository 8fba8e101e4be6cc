package main_test

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv/kubeapi"
	"github.com/gpu-orphan/gpu-orphan/remediate"
)

func TestMain(m *testing.M) { os.Exit(testenv.Main(m)) }

const token = "test-token-0123456789abcdef"

// TestEscalateTaint: the real dispatcher binary with --escalate.taint
// forwards an alert to a fake node agent, whose cleanup ends failed with
// an escalation (memory that no visible process holds); the dispatcher
// taints the node on the test API server (its strict JSON patch) and posts
// an Event on it. When the alert resolves, the taint goes.
func TestEscalateTaint(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the dispatcher binary")
	}
	fin := time.Now()
	agent := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.Method == http.MethodPost && r.URL.Path == "/api/v1/alerts":
			_, _ = w.Write([]byte(`{"received":1,"results":{"accepted":1},"alerts":[{"fingerprint":"f00d","result":"accepted","action_id":"ag1"}]}`))
		case r.Method == http.MethodGet && r.URL.Path == "/api/v1/actions/ag1":
			_ = json.NewEncoder(w).Encode(remediate.Action{ID: "ag1", Node: "gpu-a", GPUUUID: "GPU-1", State: remediate.StateFailed,
				Reason: "the memory stays after every target exited", Escalation: remediate.EscalationHiddenHolder, FinishedAt: &fin,
				Leftover: []remediate.Leftover{{Kind: "driver", Detail: "no process holds the GPU"}}})
		default:
			http.NotFound(w, r)
		}
	}))
	defer agent.Close()
	api := kubeapi.Start(t, "gpu-orphan")
	api.AddNode("gpu-a")
	dir := t.TempDir()
	targets, tok := filepath.Join(dir, "targets.json"), filepath.Join(dir, "token")
	if err := os.WriteFile(targets, []byte(`{"gpu-a": "`+agent.URL+`"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(tok, []byte(token), 0o600); err != nil {
		t.Fatal(err)
	}
	// The dispatcher serves on a socket the test holds from the start: no
	// port to lose to another process, and the first request waits in the
	// socket's backlog until the dispatcher serves.
	cmd := exec.Command(testenv.Bin(t, "gpu-orphan-dispatcher"), "--web.systemd-socket", "--auth.token-file="+tok,
		"--dispatch.targets-file="+targets, "--dispatch.kubernetes.kubeconfig="+api.Kubeconfig(t), "--escalate.taint",
		"--store.path="+filepath.Join(dir, "d.db"))
	base := "http://" + testenv.PassListener(t, cmd)
	testenv.DaemonCmd(t, cmd)
	testenv.Eventually(t, 20*time.Second, "the dispatcher to be ready", func() bool {
		resp, err := http.Get(base + "/-/ready")
		if err != nil {
			t.Fatalf("the dispatcher did not serve: %v", err)
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})

	startsAt := time.Now().Add(-time.Minute).UTC()
	send := func(status string) {
		t.Helper()
		postAlert(t, base, token, status, "gpu-a", "GPU-1", "f00d", startsAt)
	}
	tainted := func() string {
		for _, tt := range api.Node("gpu-a").Spec.Taints {
			if tt.Key == "gpu-orphan.io/unreclaimable-memory" {
				return tt.Value + ":" + string(tt.Effect)
			}
		}
		return ""
	}
	send("firing")
	testenv.Eventually(t, 20*time.Second, "gpu-a to be tainted", func() bool { return tainted() == "GPU-1:NoSchedule" })
	// The Event is posted after the taint: wait for it, then check it.
	testenv.Eventually(t, 20*time.Second, "an Event on gpu-a", func() bool { return len(api.NodeEvents()) > 0 })
	evs := api.NodeEvents()
	if len(evs) != 1 || evs[0].InvolvedObject.Name != "gpu-a" || evs[0].Reason != "GPUOrphanTainted" || !strings.Contains(evs[0].Message, "hidden_holder") {
		t.Fatalf("Events: %+v", evs)
	}
	send("resolved")
	testenv.Eventually(t, 20*time.Second, "gpu-a to be untainted", func() bool { return tainted() == "" })
	if _, refused := api.Patches(); refused != 0 {
		t.Errorf("%d patches refused", refused)
	}
}
