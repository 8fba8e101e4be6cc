package dispatch

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/intake"
	"github.com/gpu-orphan/gpu-orphan/remediate/limits"
	"github.com/gpu-orphan/gpu-orphan/remediate/remediatetest"
)

func newDispatcher(t *testing.T, cfg Config) *Dispatcher {
	t.Helper()
	if cfg.Fleet == nil {
		cfg.Fleet = limits.NewFleet(limits.FleetConfig{MaxNodes: 5, MaxFraction: 1, Window: time.Hour, BreakerFailures: 3, BreakerWindow: time.Hour}, limits.RealClock{})
	}
	cfg.Metrics = remediate.NewMetrics(prometheus.NewRegistry())
	cfg.Logger = slog.New(slog.DiscardHandler)
	d, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// TestExecuteForwards: a firing alert goes to its node's agent as a
// one-alert webhook payload, with the alert's fingerprint and startsAt,
// signed for the node (never the token), and the action succeeds on a 2xx.
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
	if !remediatetest.SignedFor(auth, "gpu-a", "0123456789abcdef") {
		t.Errorf("Authorization %q, want signed for gpu-a", auth)
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

// TestRoutes: only nodes that the targets name are known; the template
// fills only the nodes named with an empty URL, and only with names that
// cannot rewrite the URL.
func TestRoutes(t *testing.T) {
	d := newDispatcher(t, Config{URLTemplate: "https://{{.Node}}:10836", Targets: map[string]string{
		"odd/name": "https://10.0.0.5:10836", "gpu-a": "", "gpu-a.example.org": "", "user@host": "",
	}})
	for node, want := range map[string]bool{
		"gpu-a": true, "gpu-a.example.org": true, "odd/name": true,
		"gpu-b": false, "127.0.0.3": false, "": false, "evil.example.org/x?": false, "user@host": false, "{{.Node}}": false,
	} {
		if got := d.Known(node); got != want {
			t.Errorf("Known(%q) = %v, want %v", node, got, want)
		}
	}
	if _, err := New(Config{}); err == nil {
		t.Error("a dispatcher with no route was accepted")
	}
	if _, err := New(Config{URLTemplate: "https://{{.Node}}:10836"}); err == nil {
		t.Error("a template without an allow-list was accepted")
	}
	if _, err := New(Config{URLTemplate: "https://{{.Node", Targets: map[string]string{"a": ""}}); err == nil {
		t.Error("a template that does not parse was accepted")
	}
	noTemplate := newDispatcher(t, Config{Targets: map[string]string{"gpu-a": ""}})
	if noTemplate.Known("gpu-a") {
		t.Error("a node with no URL and no template is known")
	}
}

// TestTargetsFileReloads: the allow-list follows its file: a node added is
// routed, a node removed is no longer contacted, and a broken file keeps
// the previous list.
func TestTargetsFileReloads(t *testing.T) {
	path := filepath.Join(t.TempDir(), "targets.json")
	write := func(body string, mtime time.Time) {
		t.Helper()
		if err := os.WriteFile(path, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Chtimes(path, mtime, mtime); err != nil {
			t.Fatal(err)
		}
	}
	now := time.Now()
	write(`{"gpu-a": "http://10.0.0.5:10836"}`, now.Add(-time.Hour))
	d := newDispatcher(t, Config{TargetsFile: path})
	if !d.Known("gpu-a") || d.Known("gpu-b") {
		t.Fatal("initial allow-list")
	}
	write(`{"gpu-b": "http://10.0.0.6:10836"}`, now.Add(-time.Minute))
	if d.Known("gpu-a") || !d.Known("gpu-b") {
		t.Error("the changed file was not read again")
	}
	write(`{"gpu-c": `, now)
	if d.Known("gpu-c") || !d.Known("gpu-b") {
		t.Error("a broken file must keep the previous allow-list")
	}
}

// TestRedirectNotFollowed: an agent that answers 307 gets its answer taken
// as a failure; the redirect's target receives nothing, no token.
func TestRedirectNotFollowed(t *testing.T) {
	var hits int
	elsewhere := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits++
		t.Errorf("the redirect was followed: %s %s, Authorization %q", r.Method, r.URL, r.Header.Get("Authorization"))
	}))
	defer elsewhere.Close()
	agent := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, elsewhere.URL+"/steal", http.StatusTemporaryRedirect)
	}))
	defer agent.Close()
	d := newDispatcher(t, Config{Targets: map[string]string{"gpu-a": agent.URL}, Token: "0123456789abcdef", Client: &http.Client{}})
	a, _ := d.Execute(t.Context(), remediate.Action{ID: "1", Node: "gpu-a", GPUUUID: "GPU-1", AlertFingerprint: "f1", AlertStartsAt: time.Now()})
	if a.State != remediate.StateFailed || !strings.Contains(a.Reason, "307") {
		t.Errorf("after a 307: %s (%s), want failed", a.State, a.Reason)
	}
	if hits != 0 {
		t.Errorf("the redirect target got %d requests", hits)
	}
}

// TestForwardsLabelsAndAnswer: the alert goes on with its labels as
// received (a custom uuid label reaches the agent), and an agent that
// ignores it makes the dispatcher's action skipped, not succeeded.
func TestForwardsLabelsAndAnswer(t *testing.T) {
	var got intake.Message
	agent := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if err := json.NewDecoder(r.Body).Decode(&got); err != nil {
			t.Error(err)
		}
		_, _ = w.Write([]byte(`{"received":1,"results":{"ignored":1},"alerts":[{"fingerprint":"f1","result":"ignored","reason":"no uuid label"}]}`))
	}))
	defer agent.Close()
	labels := map[string]string{"alertname": "GPUOrphanMemory", "node": "gpu-a", "gpu_uuid": "GPU-1", "team": "ml"}
	d := newDispatcher(t, Config{Targets: map[string]string{"gpu-a": agent.URL},
		Labels: func(context.Context, string, time.Time) (map[string]string, error) { return labels, nil }})
	a, _ := d.Execute(t.Context(), remediate.Action{ID: "1", Node: "gpu-a", GPUUUID: "GPU-1", AlertFingerprint: "f1", AlertStartsAt: time.Now()})
	if len(got.Alerts) != 1 || !maps.Equal(map[string]string(got.Alerts[0].Labels), labels) {
		t.Errorf("forwarded labels %v, want %v", got.Alerts, labels)
	}
	if a.State != remediate.StateSkipped || !strings.Contains(a.Reason, "no uuid label") {
		t.Errorf("an ignored alert: %s (%s), want skipped with the agent's reason", a.State, a.Reason)
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
	m, err := LoadTargets(write("good.json", `{"gpu-a": "https://10.0.0.5:10836"}`))
	if err != nil || m["gpu-a"] != "https://10.0.0.5:10836" {
		t.Errorf("good targets: %v, %v", m, err)
	}
	for name, body := range map[string]string{
		"not-json.json":    `gpu-a: https://10.0.0.5:10836`,
		"ftp.json":         `{"gpu-a": "ftp://10.0.0.5"}`,
		"credentials.json": `{"gpu-a": "https://user:pw@10.0.0.5:10836"}`,
	} {
		if _, err := LoadTargets(write(name, body)); err == nil {
			t.Errorf("%s was accepted", name)
		}
	}
	if _, err := LoadTargets(filepath.Join(dir, "missing.json")); err == nil {
		t.Error("a missing targets file was accepted")
	}
}

// staticAgents is a discovery that found a fixed set of agents.
type staticAgents map[string]string

func (s staticAgents) Agents() map[string]string { return s }

// TestRoutesWithDiscovery: discovered agents are known at their URL; the
// targets win for the nodes they name, and the template fills only their
// empty entries; the fleet's known nodes are both lists together; a
// dispatcher with discovery alone starts.
func TestRoutesWithDiscovery(t *testing.T) {
	found := staticAgents{"gpu-a": "http://10.0.0.5:10836", "gpu-b": "http://10.0.0.6:10836"}
	d := newDispatcher(t, Config{Discovery: found, URLTemplate: "https://{{.Node}}:10836",
		Targets: map[string]string{"gpu-b": "https://10.9.9.9:10836", "gpu-c": ""}})
	for node, want := range map[string]string{"gpu-a": "http://10.0.0.5:10836", "gpu-b": "https://10.9.9.9:10836", "gpu-c": "https://gpu-c:10836"} {
		if got, err := d.agentBase(node); got != want || err != nil {
			t.Errorf("agentBase(%q) = %q, %v; want %q", node, got, err, want)
		}
	}
	if d.Known("gpu-d") {
		t.Error("a node on neither list is known")
	}
	if n := len(d.routes()); n != 3 {
		t.Errorf("%d known nodes, want 3", n)
	}
	if _, err := New(Config{Discovery: staticAgents{}}); err != nil {
		t.Errorf("a dispatcher with discovery alone: %v", err)
	}
}

// countingAgent is a real listener standing for a node's agent: it counts
// the requests it gets, with their Authorization headers, and answers
// with code (200: the webhook's reply naming no action).
type countingAgent struct {
	*httptest.Server
	mu    sync.Mutex
	code  int
	reqs  []string // "METHOD PATH"
	auths []string
}

func newCountingAgent(t *testing.T, code int) *countingAgent {
	t.Helper()
	a := &countingAgent{code: code}
	a.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		a.mu.Lock()
		a.reqs = append(a.reqs, r.Method+" "+r.URL.Path)
		a.auths = append(a.auths, r.Header.Get("Authorization"))
		code := a.code
		a.mu.Unlock()
		if code != http.StatusOK {
			http.Error(w, `{"error":"could not record the notification durably: database or disk is full"}`, code)
			return
		}
		_, _ = w.Write([]byte(`{"received":1}`))
	}))
	t.Cleanup(a.Close)
	return a
}

func (a *countingAgent) requests() ([]string, []string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return slices.Clone(a.reqs), slices.Clone(a.auths)
}

// closedURL is a URL where nothing listens.
func closedURL(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	u := "http://" + l.Addr().String()
	l.Close()
	return u
}

// TestUnavailableAgentsNotTheFleetBreaker: issue 16. A user filled a
// node's disk and its agent answered 503; through the dispatcher, three
// such answers opened the fleet breaker, and a healthy node's alert was
// held back. An agent's 5xx, and an agent that cannot be reached, now
// count against its node: the healthy node's alert is forwarded, signed,
// and the breaker stays closed. Since issue 24 a refusal (401: a user's
// listener on the port of a node whose agent is down) counts against its
// node too, never toward the fleet breaker.
func TestUnavailableAgentsNotTheFleetBreaker(t *testing.T) {
	full, healthy, refusing := newCountingAgent(t, http.StatusServiceUnavailable), newCountingAgent(t, http.StatusOK), newCountingAgent(t, http.StatusUnauthorized)
	d := newDispatcher(t, Config{Token: "0123456789abcdef", MaxAttempts: 2, Targets: map[string]string{
		"gpu-full": full.URL, "gpu-down": closedURL(t), "gpu-ok": healthy.URL, "gpu-refusing": refusing.URL}})
	id := 0
	execute := func(node string) remediate.Action {
		t.Helper()
		id++
		a := remediate.Action{ID: strconv.Itoa(id), Node: node, GPUUUID: "GPU-1", AlertFingerprint: fmt.Sprintf("%016x", id), AlertStartsAt: time.Now()}
		for {
			// Retried at once: the engine would wait, the test need not.
			if a, _ = d.Execute(t.Context(), a); a.State != remediate.StateQueued || !strings.HasPrefix(a.Reason, "retrying: ") {
				return a
			}
		}
	}
	for range 3 {
		for _, node := range []string{"gpu-full", "gpu-down"} {
			if a := execute(node); a.State != remediate.StateFailed {
				t.Fatalf("%s: %s (%s), want failed", node, a.State, a.Reason)
			}
		}
	}
	if d.cfg.Fleet.BreakerOpen() {
		t.Fatal("unavailable agents opened the fleet breaker")
	}
	if reqs, _ := full.requests(); len(reqs) != 6 {
		t.Errorf("the full node's agent got %d requests, want 3 alerts × 2 attempts", len(reqs))
	}
	if a := execute("gpu-ok"); a.State != remediate.StateSucceeded {
		t.Fatalf("the healthy node's alert: %s (%s), want forwarded", a.State, a.Reason)
	}
	if reqs, auths := healthy.requests(); len(reqs) != 1 || reqs[0] != "POST /api/v1/alerts" || !remediatetest.SignedFor(auths[0], "gpu-ok", "0123456789abcdef") {
		t.Errorf("the healthy node's agent got %v %v", reqs, auths)
	}
	if got := d.cfg.Fleet.State().Unavailable; got["gpu-full"] != 3 || got["gpu-down"] != 3 {
		t.Errorf("unavailable per node: %v, want 3 each", got)
	}
	for range 3 {
		if a := execute("gpu-refusing"); a.State != remediate.StateFailed {
			t.Fatalf("401: %s", a.State)
		}
	}
	if d.cfg.Fleet.BreakerOpen() {
		t.Error("3 refusals (401) by one node opened the fleet breaker")
	}
	if got := d.cfg.Fleet.State().Unavailable; got["gpu-refusing"] != 3 {
		t.Errorf("refusals counted against the node: %v, want 3", got)
	}
}

// TestNoisyNodeThroughTheDispatcher: issue 16, through the dispatcher's
// own code and real listeners, on an injected clock. With 10 known nodes
// and the default max fraction 0.1 (one turn at a time, a 20 s window), a
// node alerting every 10 s no longer keeps another node's alert at 15 s
// waiting until it stops: the quiet node's agent gets its alert at 20 s,
// when the noisy node's first turn ends.
func TestNoisyNodeThroughTheDispatcher(t *testing.T) {
	clock := limits.NewFakeClock(time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC))
	start := clock.Now()
	noisy, quiet := newCountingAgent(t, http.StatusOK), newCountingAgent(t, http.StatusOK)
	targets := map[string]string{"noisy": noisy.URL, "quiet": quiet.URL}
	for i := range 8 {
		targets[fmt.Sprintf("idle-%d", i)] = closedURL(t)
	}
	d := newDispatcher(t, Config{Targets: targets,
		Fleet: limits.NewFleet(limits.FleetConfig{MaxFraction: 0.1, Window: 20 * time.Second}, clock)})

	type pending struct {
		a    remediate.Action
		next time.Duration
	}
	var queue []*pending
	for at := time.Duration(0); at <= 80*time.Second; at += 10 * time.Second {
		queue = append(queue, &pending{remediate.Action{ID: "noisy-" + at.String(), Node: "noisy", GPUUUID: "GPU-1", AlertFingerprint: "n" + at.String()}, at})
	}
	queue = append(queue, &pending{remediate.Action{ID: "quiet", Node: "quiet", GPUUUID: "GPU-2", AlertFingerprint: "q"}, 15 * time.Second})
	quietAt := time.Duration(-1)
	// The engine's loop: each queued action is tried when due, a second at
	// a time.
	for now := time.Duration(0); now <= 120*time.Second; now += time.Second {
		clock.Set(start.Add(now))
		for _, p := range queue {
			if p.a.State.Final() || p.next > now {
				continue
			}
			var retry time.Duration
			p.a, retry = d.Execute(t.Context(), p.a)
			if p.a.State == remediate.StateQueued {
				p.next = now + max(retry, time.Second).Round(time.Second)
			}
		}
		if reqs, _ := quiet.requests(); len(reqs) > 0 && quietAt < 0 {
			quietAt = now
		}
	}
	if quietAt != 20*time.Second {
		t.Errorf("the quiet node's agent got its alert (at 15s) at %s, want 20s", quietAt)
	}
	if reqs, _ := noisy.requests(); len(reqs) != 9 {
		t.Errorf("the noisy node's agent got %d alerts, want all 9", len(reqs))
	}
}
