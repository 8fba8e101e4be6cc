package api_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/api"
	"github.com/gpu-orphan/gpu-orphan/remediate/intake"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

const token = "abcdefghijklmnop0123456789"

type breaker struct{ open bool }

func (b *breaker) Reset()            { b.open = false }
func (b *breaker) BreakerOpen() bool { return b.open }

// newServer serves the real router over HTTP, with a real token check and
// a real store in a temporary directory that holds one action started at
// each of the times given.
func newServer(t *testing.T, started ...time.Time) *httptest.Server {
	t.Helper()
	var as []remediate.Action
	for _, at := range started {
		as = append(as, remediate.Action{Node: "node-a", GPUUUID: "GPU-a", State: remediate.StateSucceeded, StartedAt: at})
	}
	return newServerWith(t, as...)
}

// newServerWith serves a store that holds the actions given.
func newServerWith(t *testing.T, actions ...remediate.Action) *httptest.Server {
	t.Helper()
	ctx := context.Background()
	dir := t.TempDir()
	st, err := store.Open(ctx, filepath.Join(dir, "store.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	for _, a := range actions {
		if _, err := st.Insert(ctx, a); err != nil {
			t.Fatal(err)
		}
	}
	tokenFile := filepath.Join(dir, "token")
	if err := os.WriteFile(tokenFile, []byte(token), 0o600); err != nil {
		t.Fatal(err)
	}
	logger := slog.New(slog.DiscardHandler)
	reg := prometheus.NewRegistry()
	metrics := remediate.NewMetrics(reg)
	auth, err := intake.NewAuth(intake.AuthConfig{TokenFile: tokenFile}, metrics, logger)
	if err != nil {
		t.Fatal(err)
	}
	router, err := api.NewRouter(api.Config{
		Webhook:  http.NotFoundHandler(),
		Auth:     auth,
		Store:    st,
		Breaker:  &breaker{},
		Registry: reg,
		Ready:    func() error { return errors.New("not under test") },
		Status:   func(context.Context) api.Status { return api.Status{} },
		Logger:   logger,
	})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(router)
	t.Cleanup(srv.Close)
	return srv
}

// getActions sends GET /api/v1/actions?name=value and returns the status
// and the body.
func getActions(t *testing.T, srv *httptest.Server, name, value string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, srv.URL+"/api/v1/actions?"+url.Values{name: {value}}.Encode(), nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := srv.Client().Do(req)
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

// TestListActionsTimeBounds: since and until take RFC 3339 or Unix
// seconds from 1970 through 9999; anything else is a 400 that says why,
// never a filter silently dropped or wrapped around (1e300 seconds once
// became year 1677 and listed everything).
func TestListActionsTimeBounds(t *testing.T) {
	jan := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	jun := time.Date(2026, 6, 1, 0, 0, 0, 0, time.UTC)
	srv := newServer(t, jan, jun)
	mar := time.Date(2026, 3, 1, 0, 0, 0, 0, time.UTC)

	for _, tc := range []struct {
		value string
		since int // actions listed with since=value
		until int // and with until=value
	}{
		{"1772323200", 1, 1}, // 2026-03-01T00:00:00Z
		{"1772323200.25", 1, 1},
		{"1.7723232e9", 1, 1},
		{mar.Format(time.RFC3339), 1, 1},
		{mar.Add(time.Nanosecond).Format(time.RFC3339Nano), 1, 1},
		{"2026-03-01T01:00:00+01:00", 1, 1},
		{"0", 2, 0},
		{"1970-01-01T00:00:00Z", 2, 0},
		{"1e10", 0, 2}, // year 2286: nanoseconds since 1970 overflow int64
		{"253402300799.5", 0, 2},
		{"9999-12-31T23:59:59.999999999Z", 0, 2},
	} {
		for _, p := range []struct {
			name string
			want int
		}{{"since", tc.since}, {"until", tc.until}} {
			code, body := getActions(t, srv, p.name, tc.value)
			if code != http.StatusOK {
				t.Errorf("%s=%s: status %d (%s), want 200", p.name, tc.value, code, strings.TrimSpace(body))
				continue
			}
			var got []remediate.Action
			if err := json.Unmarshal([]byte(body), &got); err != nil {
				t.Fatalf("%s=%s: %v in %s", p.name, tc.value, err, body)
			}
			if len(got) != p.want {
				t.Errorf("%s=%s: %d actions, want %d", p.name, tc.value, len(got), p.want)
			}
		}
	}

	const notUnix = "is not a finite Unix time between 1970 and 9999"
	for _, tc := range []struct{ value, says string }{
		{"1e300", notUnix},
		{"-1e300", notUnix},
		{"NaN", notUnix},
		{"nan", notUnix},
		{"Inf", notUnix},
		{"+Inf", notUnix},
		{"-Inf", notUnix},
		{"infinity", notUnix},
		{"1e19", notUnix},
		{"253402300800", notUnix}, // 10000-01-01T00:00:00Z
		{"-1", notUnix},
		{"-0.5", notUnix},
		{"1969-12-31T23:59:59Z", "is not between 1970 and 9999"},
		{"0001-01-01T00:00:00Z", "is not between 1970 and 9999"},
		{"9999-12-31T23:59:59-01:00", "is not between 1970 and 9999"}, // year 10000 in UTC
		{"10000-01-01T00:00:00Z", "is neither RFC 3339 nor Unix seconds"},
		{"yesterday", "is neither RFC 3339 nor Unix seconds"},
	} {
		for _, name := range []string{"since", "until"} {
			code, body := getActions(t, srv, name, tc.value)
			var reply struct{ Error string }
			if err := json.Unmarshal([]byte(body), &reply); err != nil {
				if len(body) > 60 {
					body = body[:60] + "..."
				}
				t.Errorf("%s=%s: status %d, body %q; want 400 with a JSON error", name, tc.value, code, body)
				continue
			}
			if code != http.StatusBadRequest || !strings.HasPrefix(reply.Error, name+": ") || !strings.Contains(reply.Error, tc.says) {
				t.Errorf("%s=%s: status %d, error %q; want 400 with %q", name, tc.value, code, reply.Error, name+": ... "+tc.says)
			}
		}
	}
}

// TestListActionsByDeadOwner: user and slurm_job select the actions with a
// dead owner of that user or Slurm job; an owner whose identity is unknown
// matches neither.
func TestListActionsByDeadOwner(t *testing.T) {
	at := time.Date(2026, 12, 1, 7, 0, 0, 0, time.UTC)
	uid := 1001
	alice := remediate.DeadOwner{PID: 463, UsedBytes: 4 << 30, Known: true, Comm: "python", User: "alice", UID: &uid, SlurmJob: "81234", SlurmStep: "0"}
	bob := remediate.DeadOwner{PID: 464, UsedBytes: 1 << 30, Known: true, Comm: "python", User: "bob", UID: &uid, SlurmJob: "81235"}
	unknown := remediate.DeadOwner{PID: 465, UsedBytes: 1 << 30}
	srv := newServerWith(t,
		remediate.Action{Node: "a", State: remediate.StateSucceeded, StartedAt: at, DeadOwners: []remediate.DeadOwner{alice}},
		remediate.Action{Node: "b", State: remediate.StateSucceeded, StartedAt: at.Add(time.Second), DeadOwners: []remediate.DeadOwner{alice, bob}},
		remediate.Action{Node: "c", State: remediate.StateSucceeded, StartedAt: at.Add(2 * time.Second), DeadOwners: []remediate.DeadOwner{unknown}},
		remediate.Action{Node: "d", State: remediate.StateSucceeded, StartedAt: at.Add(3 * time.Second)},
	)
	for _, tc := range []struct {
		name, value string
		nodes       string
	}{
		{"user", "alice", "b a"},
		{"user", "bob", "b"},
		{"user", "carol", ""},
		{"user", "", "d c b a"},
		{"slurm_job", "81234", "b a"},
		{"slurm_job", "81235", "b"},
		{"slurm_job", "8123", ""},
		{"user", "unknown", ""},
	} {
		code, body := getActions(t, srv, tc.name, tc.value)
		if code != http.StatusOK {
			t.Fatalf("%s=%s: %d %s", tc.name, tc.value, code, body)
		}
		var got []remediate.Action
		if err := json.Unmarshal([]byte(body), &got); err != nil {
			t.Fatal(err)
		}
		var nodes []string
		for _, a := range got {
			nodes = append(nodes, a.Node)
		}
		if strings.Join(nodes, " ") != tc.nodes {
			t.Errorf("%s=%q: actions of nodes %v, want %q", tc.name, tc.value, nodes, tc.nodes)
		}
		if tc.value == "alice" {
			// The record carries who the dead owner was.
			if d := got[len(got)-1].DeadOwners; len(d) != 1 || d[0].SlurmJob != "81234" || d[0].UID == nil || *d[0].UID != uid || !d[0].Known {
				t.Errorf("dead owners as served: %+v", d)
			}
			if !strings.Contains(body, `"dead_owners": [`) || !strings.Contains(body, `"slurm_job": "81234"`) {
				t.Errorf("JSON field names: %s", body)
			}
		}
	}
}
