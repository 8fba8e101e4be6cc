package api_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/api"
	"github.com/gpu-orphan/gpu-orphan/remediate/intake"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

// fixture is the real router over HTTP, with a real token check and a real
// store in a temporary directory; the webhook, the breaker, readiness and
// status are the test's.
type fixture struct {
	srv      *httptest.Server
	store    *store.Store
	webhooks atomic.Int32 // requests that reached the webhook
}

type fixtureConfig struct {
	breakerOpen bool
	ready       error
	status      api.Status
}

func newFixture(t *testing.T, cfg fixtureConfig) *fixture {
	t.Helper()
	dir := t.TempDir()
	st, err := store.Open(t.Context(), filepath.Join(dir, "store.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	tokenFile := filepath.Join(dir, "token")
	if err := os.WriteFile(tokenFile, []byte(token), 0o600); err != nil {
		t.Fatal(err)
	}
	logger := slog.New(slog.DiscardHandler)
	reg := prometheus.NewRegistry()
	// Enough wrong tokens for TestRouterAuth before the source is blocked
	// (intake's tests cover the blocking).
	auth, err := intake.NewAuth(intake.AuthConfig{TokenFile: tokenFile, FailureBurst: 100}, remediate.NewMetrics(reg), logger)
	if err != nil {
		t.Fatal(err)
	}
	f := &fixture{store: st}
	router, err := api.NewRouter(api.Config{
		Webhook: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			f.webhooks.Add(1)
			w.WriteHeader(http.StatusAccepted)
		}),
		Auth:     auth,
		Store:    st,
		Breaker:  &breaker{open: cfg.breakerOpen},
		Registry: reg,
		Ready:    func() error { return cfg.ready },
		Status:   func(context.Context) api.Status { return cfg.status },
		Logger:   logger,
	})
	if err != nil {
		t.Fatal(err)
	}
	f.srv = httptest.NewServer(router)
	t.Cleanup(f.srv.Close)
	return f
}

// do sends a request with the bearer token bearer ("" for none) and
// returns the status and the body.
func (f *fixture) do(t *testing.T, method, path, bearer string) (int, string) {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), method, f.srv.URL+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	if bearer != "" {
		req.Header.Set("Authorization", "Bearer "+bearer)
	}
	resp, err := f.srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(body)
}

// insert records an action and returns its ID.
func (f *fixture) insert(t *testing.T, a remediate.Action) string {
	t.Helper()
	id, err := f.store.Insert(t.Context(), a)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// TestRouterAuth: everything under /api/v1 needs the token, and a wrong
// one is no better than none; metrics, health, readiness and the landing
// page need none.
func TestRouterAuth(t *testing.T) {
	f := newFixture(t, fixtureConfig{})
	for _, tc := range []struct{ method, path string }{
		{http.MethodPost, "/api/v1/alerts"},
		{http.MethodGet, "/api/v1/actions"},
		{http.MethodGet, "/api/v1/actions/some-id"},
		{http.MethodPost, "/api/v1/breaker/reset"},
		{http.MethodGet, "/api/v1/status"},
	} {
		for _, bearer := range []string{"", strings.Repeat("x", len(token))} {
			if code, body := f.do(t, tc.method, tc.path, bearer); code != http.StatusUnauthorized {
				t.Errorf("%s %s with token %q: %d %s, want 401", tc.method, tc.path, bearer, code, body)
			}
		}
		if code, body := f.do(t, tc.method, tc.path, token); code == http.StatusUnauthorized {
			t.Errorf("%s %s with the token: 401 %s", tc.method, tc.path, body)
		}
	}
	if n := f.webhooks.Load(); n != 1 {
		t.Errorf("the webhook got %d requests, want the 1 with the token", n)
	}
	for _, path := range []string{"/metrics", "/-/healthy", "/"} {
		if code, body := f.do(t, http.MethodGet, path, ""); code != http.StatusOK {
			t.Errorf("GET %s without a token: %d %s, want 200", path, code, body)
		}
	}
}

// TestReady: /-/ready is 200 while Ready says so, and 503 with the reason
// when it does not.
func TestReady(t *testing.T) {
	for _, tc := range []struct {
		ready    error
		wantCode int
		wantBody string
	}{
		{nil, http.StatusOK, "Ready\n"},
		{errors.New("store: disk full"), http.StatusServiceUnavailable, "Not ready: store: disk full\n"},
	} {
		f := newFixture(t, fixtureConfig{ready: tc.ready})
		if code, body := f.do(t, http.MethodGet, "/-/ready", ""); code != tc.wantCode || body != tc.wantBody {
			t.Errorf("ready %v: %d %q, want %d %q", tc.ready, code, body, tc.wantCode, tc.wantBody)
		}
	}
}

// TestListActionsFilters: node, gpu (UUID or index), state and limit
// narrow the list, newest first; an empty result is [], not null; a limit
// outside 1..1000 is a 400 that says so.
func TestListActionsFilters(t *testing.T) {
	f := newFixture(t, fixtureConfig{})
	if code, body := f.do(t, http.MethodGet, "/api/v1/actions", token); code != http.StatusOK || strings.TrimSpace(body) != "[]" {
		t.Fatalf("an empty store: %d %s, want 200 []", code, body)
	}
	t0 := time.Date(2026, 3, 1, 0, 0, 0, 0, time.UTC)
	ids := map[string]string{}
	for i, a := range []remediate.Action{
		{Node: "node-a", GPUUUID: "GPU-a0", GPUIndex: 0, State: remediate.StateSucceeded},
		{Node: "node-a", GPUUUID: "GPU-a1", GPUIndex: 1, State: remediate.StateFailed},
		{Node: "node-b", GPUUUID: "GPU-b0", GPUIndex: 0, State: remediate.StateSucceeded},
	} {
		a.StartedAt = t0.Add(time.Duration(i) * time.Minute)
		ids[a.GPUUUID] = f.insert(t, a)
	}
	for _, tc := range []struct {
		query string
		want  []string // GPU UUIDs, newest first
	}{
		{"", []string{"GPU-b0", "GPU-a1", "GPU-a0"}},
		{"node=node-a", []string{"GPU-a1", "GPU-a0"}},
		{"gpu=GPU-a1", []string{"GPU-a1"}},
		{"gpu=0", []string{"GPU-b0", "GPU-a0"}},
		{"state=failed", []string{"GPU-a1"}},
		{"node=node-a&state=succeeded", []string{"GPU-a0"}},
		{"limit=1", []string{"GPU-b0"}},
		{"node=node-c", nil},
	} {
		code, body := f.do(t, http.MethodGet, "/api/v1/actions?"+tc.query, token)
		if code != http.StatusOK {
			t.Errorf("?%s: %d %s", tc.query, code, body)
			continue
		}
		var got []remediate.Action
		if err := json.Unmarshal([]byte(body), &got); err != nil {
			t.Fatalf("?%s: %v: %s", tc.query, err, body)
		}
		var gpus []string
		for _, a := range got {
			gpus = append(gpus, a.GPUUUID)
			if a.ID != ids[a.GPUUUID] {
				t.Errorf("?%s: %s has ID %s, want %s", tc.query, a.GPUUUID, a.ID, ids[a.GPUUUID])
			}
		}
		if strings.Join(gpus, " ") != strings.Join(tc.want, " ") {
			t.Errorf("?%s: %v, want %v", tc.query, gpus, tc.want)
		}
	}
	for _, limit := range []string{"0", "1001", "-1", "ten"} {
		code, body := f.do(t, http.MethodGet, "/api/v1/actions?limit="+limit, token)
		if code != http.StatusBadRequest || !strings.Contains(body, "limit must be a number from 1 to 1000") {
			t.Errorf("limit=%s: %d %s, want 400 that names the range", limit, code, body)
		}
	}
}

// TestGetAction: one action with its events, oldest first; an unknown ID
// is a 404 that names it.
func TestGetAction(t *testing.T) {
	f := newFixture(t, fixtureConfig{})
	id := f.insert(t, remediate.Action{Node: "node-a", GPUUUID: "GPU-a0", State: remediate.StateSucceeded, StartedAt: time.Now()})
	for _, kind := range []string{"plan", "signal", "verify"} {
		if err := f.store.AddEvent(t.Context(), id, kind, map[string]string{"step": kind}); err != nil {
			t.Fatal(err)
		}
	}
	code, body := f.do(t, http.MethodGet, "/api/v1/actions/"+id, token)
	if code != http.StatusOK {
		t.Fatalf("GET the action: %d %s", code, body)
	}
	var got struct {
		remediate.Action
		Events []store.Event `json:"events"`
	}
	if err := json.Unmarshal([]byte(body), &got); err != nil {
		t.Fatalf("%v: %s", err, body)
	}
	if got.ID != id || got.GPUUUID != "GPU-a0" || got.State != remediate.StateSucceeded {
		t.Errorf("action %+v, want %s on GPU-a0, succeeded", got.Action, id)
	}
	var kinds []string
	for _, e := range got.Events {
		kinds = append(kinds, e.Kind)
		if e.ActionID != id {
			t.Errorf("event %d belongs to %s, want %s", e.ID, e.ActionID, id)
		}
	}
	if strings.Join(kinds, " ") != "plan signal verify" {
		t.Errorf("events %v, want plan signal verify", kinds)
	}

	code, body = f.do(t, http.MethodGet, "/api/v1/actions/no-such-action", token)
	var e struct{ Error string }
	if err := json.Unmarshal([]byte(body), &e); err != nil || code != http.StatusNotFound || e.Error != `no action "no-such-action"` {
		t.Errorf("an unknown ID: %d %s, want 404 that names it", code, body)
	}
}

// TestResetBreaker: POST /api/v1/breaker/reset closes the breaker and says
// whether it was open; a GET resets nothing.
func TestResetBreaker(t *testing.T) {
	f := newFixture(t, fixtureConfig{breakerOpen: true})
	if code, body := f.do(t, http.MethodGet, "/api/v1/breaker/reset", token); code == http.StatusOK {
		t.Errorf("GET: %d %s, want no reset", code, body)
	}
	for _, wasOpen := range []bool{true, false} {
		code, body := f.do(t, http.MethodPost, "/api/v1/breaker/reset", token)
		var got map[string]bool
		if err := json.Unmarshal([]byte(body), &got); err != nil || code != http.StatusOK {
			t.Fatalf("POST: %d %s (%v)", code, body, err)
		}
		if got["was_open"] != wasOpen || got["open"] {
			t.Errorf("POST with the breaker open=%t: %s, want was_open %t and closed", wasOpen, body, wasOpen)
		}
	}
}

// TestStatus: GET /api/v1/status is the remediator's Status as JSON.
func TestStatus(t *testing.T) {
	want := api.Status{Role: "agent", Node: "node-a", Act: true, Policy: remediate.PolicyDeadOwner, BreakerOpen: true, QueueDepth: 3}
	f := newFixture(t, fixtureConfig{status: want})
	code, body := f.do(t, http.MethodGet, "/api/v1/status", token)
	var got api.Status
	if err := json.Unmarshal([]byte(body), &got); err != nil || code != http.StatusOK {
		t.Fatalf("%d %s (%v)", code, body, err)
	}
	if got != want {
		t.Errorf("status %+v, want %+v", got, want)
	}
}

// TestStoreUnreadable: a store that cannot be read is a 500 that says so,
// for the list and for one action alike.
func TestStoreUnreadable(t *testing.T) {
	f := newFixture(t, fixtureConfig{})
	if err := f.store.Close(); err != nil {
		t.Fatal(err)
	}
	for _, path := range []string{"/api/v1/actions", "/api/v1/actions/some-id"} {
		code, body := f.do(t, http.MethodGet, path, token)
		if code != http.StatusInternalServerError || !strings.Contains(body, "reading the audit store") {
			t.Errorf("GET %s: %d %s, want 500 about the store", path, code, body)
		}
	}
}
