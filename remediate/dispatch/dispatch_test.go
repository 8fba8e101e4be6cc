package dispatch

import (
	"encoding/json"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/intake"
	"github.com/gpu-orphan/gpu-orphan/remediate/limits"
)

func newDispatcher(t *testing.T, cfg Config) *Dispatcher {
	t.Helper()
	cfg.Fleet = limits.NewFleet(limits.FleetConfig{MaxNodes: 5, MaxFraction: 1, Window: time.Hour, BreakerFailures: 3, BreakerWindow: time.Hour}, limits.RealClock{})
	cfg.Metrics = remediate.NewMetrics(prometheus.NewRegistry())
	cfg.Logger = slog.New(slog.DiscardHandler)
	d, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// TestExecuteForwards: a firing alert goes to its node's agent as a
// one-alert webhook payload, with the alert's fingerprint and startsAt and
// the bearer token, and the action succeeds on a 2xx.
func TestExecuteForwards(t *testing.T) {
	var got intake.Message
	var auth string
	agent := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		auth = r.Header.Get("Authorization")
		if r.URL.Path != "/api/v1/alerts" || json.NewDecoder(r.Body).Decode(&got) != nil {
			http.Error(w, "bad request", http.StatusBadRequest)
			return
		}
		_, _ = w.Write([]byte(`{"accepted":1}`))
	}))
	defer agent.Close()
	d := newDispatcher(t, Config{Targets: map[string]string{"gpu-a": agent.URL}, Token: "0123456789abcdef"})

	startsAt := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	a, retry := d.Execute(t.Context(), remediate.Action{ID: "1", Node: "gpu-a", GPUUUID: "GPU-1", AlertFingerprint: "fp1", AlertStartsAt: startsAt})
	if a.State != remediate.StateSucceeded || retry != 0 || a.Source != "dispatch" {
		t.Fatalf("action %s (%s), retry %v", a.State, a.Reason, retry)
	}
	if auth != "Bearer 0123456789abcdef" {
		t.Errorf("Authorization %q", auth)
	}
	if got.Data == nil || len(got.Alerts) != 1 || got.Alerts[0].Fingerprint != "fp1" || !got.Alerts[0].StartsAt.Equal(startsAt) ||
		got.Alerts[0].Labels["node"] != "gpu-a" || got.Alerts[0].Labels["uuid"] != "GPU-1" || got.Alerts[0].Status != "firing" {
		t.Errorf("forwarded %+v", got)
	}
}

// TestExecuteRetriesThenFails: an agent that answers 5xx is retried with
// backoff, then the action fails, never dropped; a 4xx is final at once.
func TestExecuteRetriesThenFails(t *testing.T) {
	code := http.StatusServiceUnavailable
	agent := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "busy", code)
	}))
	defer agent.Close()
	d := newDispatcher(t, Config{Targets: map[string]string{"gpu-a": agent.URL}, MaxAttempts: 2})
	a := remediate.Action{ID: "1", Node: "gpu-a", GPUUUID: "GPU-1"}
	a, retry := d.Execute(t.Context(), a)
	if a.State != remediate.StateQueued || retry != 2*time.Second || !strings.HasPrefix(a.Reason, "retrying: ") {
		t.Errorf("first 503: %s (%s), retry %v; want queued, retry 2s", a.State, a.Reason, retry)
	}
	if a, _ = d.Execute(t.Context(), a); a.State != remediate.StateFailed {
		t.Errorf("second 503: %s (%s), want failed", a.State, a.Reason)
	}
	code = http.StatusUnauthorized
	if a, _ = d.Execute(t.Context(), remediate.Action{ID: "2", Node: "gpu-a", GPUUUID: "GPU-1"}); a.State != remediate.StateFailed {
		t.Errorf("401: %s (%s), want failed at once", a.State, a.Reason)
	}
}

// TestRoutes: a template routes only node names that cannot rewrite the
// URL; the targets file names any node.
func TestRoutes(t *testing.T) {
	d := newDispatcher(t, Config{URLTemplate: "https://{{.Node}}:9836", Targets: map[string]string{"odd/name": "https://10.0.0.5:9836"}})
	for node, want := range map[string]bool{
		"gpu-a": true, "gpu-a.example.org": true, "odd/name": true,
		"": false, "evil.example.org/x?": false, "user@host": false, "{{.Node}}": false,
	} {
		if got := d.Known(node); got != want {
			t.Errorf("Known(%q) = %v, want %v", node, got, want)
		}
	}
	if _, err := New(Config{}); err == nil {
		t.Error("a dispatcher with no route was accepted")
	}
	if _, err := New(Config{URLTemplate: "https://{{.Node"}); err == nil {
		t.Error("a template that does not parse was accepted")
	}
}

func TestLoadTargets(t *testing.T) {
	dir := t.TempDir()
	write := func(name, body string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	m, err := LoadTargets(write("good.json", `{"gpu-a": "https://10.0.0.5:9836"}`))
	if err != nil || m["gpu-a"] != "https://10.0.0.5:9836" {
		t.Errorf("good targets: %v, %v", m, err)
	}
	for name, body := range map[string]string{
		"not-json.json":    `gpu-a: https://10.0.0.5:9836`,
		"ftp.json":         `{"gpu-a": "ftp://10.0.0.5"}`,
		"credentials.json": `{"gpu-a": "https://user:pw@10.0.0.5:9836"}`,
	} {
		if _, err := LoadTargets(write(name, body)); err == nil {
			t.Errorf("%s was accepted", name)
		}
	}
	if _, err := LoadTargets(filepath.Join(dir, "missing.json")); err == nil {
		t.Error("a missing targets file was accepted")
	}
}
