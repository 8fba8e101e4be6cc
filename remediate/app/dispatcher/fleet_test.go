package dispatcher

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/app"
	"github.com/gpu-orphan/gpu-orphan/remediate/intake"
	"github.com/gpu-orphan/gpu-orphan/remediate/remediatetest"
)

const agentToken = "issue16-agent-token-5f0c9a7e2b1d4c38a6e0f1b2c3d4e5f6"

// TestFullDiskNodeLeavesTheFleetBreakerClosed: issue 16, through the whole
// dispatcher (intake, store, queue, forwarding), its agents in a targets
// file. A user filled a node's disk; its agent answers 503 to every alert.
// Three such alerts used to open the fleet breaker
// (--limit.breaker-failures=3), and the next healthy node's alert was held
// back. Now the three fail against their node, the breaker stays closed,
// and the healthy node's agent gets its alert, signed for it, without the
// token.
func TestFullDiskNodeLeavesTheFleetBreakerClosed(t *testing.T) {
	var fullHits atomic.Int32
	full := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fullHits.Add(1)
		http.Error(w, `{"error":"could not record the notification durably: database or disk is full"}`, http.StatusServiceUnavailable)
	}))
	t.Cleanup(full.Close)
	healthy := testenv.NewFakeAgent(t, "127.0.0.1")
	dir := t.TempDir()
	targets, token := filepath.Join(dir, "targets.json"), filepath.Join(dir, "agent-token")
	b, _ := json.Marshal(map[string]string{"node-full": full.URL, "node-ok": healthy.URL})
	if err := os.WriteFile(targets, b, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(token, []byte(agentToken+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	wc := webConfig(t)
	o := app.Options{
		Web: wc, Auth: intake.AuthConfig{InsecureNone: true}, NodeLabel: "node", UUIDLabel: "uuid",
		StorePath: filepath.Join(dir, "d.db"), Logger: testenv.Logger(t),
		Dispatch: app.Dispatch{TargetsFile: targets, TokenFile: token, Timeout: 5 * time.Second, MaxAttempts: 1,
			MaxNodes: 10, MaxFraction: 1, Window: time.Hour},
	}
	o.Limits.BreakerFailures, o.Limits.BreakerWindow = 3, time.Hour
	base := "http://" + (*wc.WebListenAddresses)[0]
	testenv.Serve(t, base, func(ctx context.Context) error { return Run(ctx, o, Escalate{}) })

	if r := testenv.MustPostAlerts(t, base, "node-full", "node-full", "node-full"); r["accepted"] != 3 {
		t.Fatalf("results %v", r)
	}
	testenv.Eventually(t, 20*time.Second, "the full node's three alerts to fail", func() bool {
		n := 0
		for _, a := range testenv.Actions[remediate.Action](t, base, "") {
			if a.Node == "node-full" && a.State == remediate.StateFailed && strings.Contains(a.Reason, "503") {
				n++
			}
		}
		return n == 3
	})
	if r := testenv.MustPostAlerts(t, base, "node-ok"); r["accepted"] != 1 {
		t.Fatalf("results %v", r)
	}
	testenv.Eventually(t, 20*time.Second, "the healthy node's agent to get its alert", func() bool { return len(healthy.Requests()) == 1 })
	if got := healthy.Requests()[0]; got.Method != http.MethodPost || got.Path != "/api/v1/alerts" || got.Node != "node-ok" ||
		!remediatetest.SignedFor(got.Auth, "node-ok", agentToken) {
		t.Errorf("the healthy agent got %+v, want node-ok's alert signed for it, without the token", got)
	}
	_, mfs := testenv.Scrape(t, base+"/metrics")
	if v, _ := testenv.Value(mfs, "gpu_orphan_remediator_breaker_open", nil); v != 0 {
		t.Error("the fleet breaker opened")
	}
	if n := fullHits.Load(); n != 3 {
		t.Errorf("the full node's agent got %d requests, want 3 (one attempt each)", n)
	}
}
