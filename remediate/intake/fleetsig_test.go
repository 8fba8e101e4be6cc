package intake

import (
	"bytes"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// TestFleetSignature: issue 24, item 1. A request that the dispatcher
// signed for node-a is admitted by node-a's agent once, within the
// window; the same request is refused by node-b's agent, a second time by
// node-a's, after the window, with its body or path changed, and by an
// agent of another fleet secret. The bearer token still admits a human.
func TestFleetSignature(t *testing.T) {
	now := time.Unix(1_800_000_000, 0)
	newAuth := func(node, token string) *Auth {
		t.Helper()
		a, err := NewAuth(AuthConfig{TokenFile: writeFile(t, "token", token), FleetNode: node, FailureBurst: 1000}, newTestMetrics(), discardLogger())
		if err != nil {
			t.Fatal(err)
		}
		a.fleet.now = func() time.Time { return now }
		return a
	}
	nodeA, nodeB, otherFleet := newAuth("node-a", testToken), newAuth("node-b", testToken), newAuth("node-a", testToken+"-other")
	body := []byte(`{"version":"4","alerts":[]}`)
	signed := func(node, path string, at time.Time) *http.Request {
		r := httptest.NewRequest(http.MethodPost, path, bytes.NewReader(body))
		if err := SignFleetRequest(r, body, testToken, node, at); err != nil {
			t.Fatal(err)
		}
		if h := r.Header.Get("Authorization"); strings.Contains(h, testToken) || strings.HasPrefix(strings.ToLower(h), "bearer") {
			t.Fatalf("the signed request carries the token: %q", h)
		}
		return r
	}
	// replay copies a request as a listener saw it: method, URI, headers, body.
	replay := func(r *http.Request, path string) *http.Request {
		c := httptest.NewRequest(r.Method, path, bytes.NewReader(body))
		c.Header = r.Header.Clone()
		return c
	}
	code := func(a *Auth, r *http.Request) int {
		w := httptest.NewRecorder()
		var got []byte
		a.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			buf := new(bytes.Buffer)
			_, _ = buf.ReadFrom(r.Body)
			got = buf.Bytes()
		})).ServeHTTP(w, r)
		if w.Code == http.StatusOK && r.Method == http.MethodPost && !bytes.Equal(got, body) {
			t.Errorf("the handler read %q after the check, want the body", got)
		}
		return w.Code
	}

	first := signed("node-a", "/api/v1/alerts", now)
	for _, c := range []struct {
		name string
		auth *Auth
		req  *http.Request
		want int
	}{
		{"node-a's own, first time", nodeA, replay(first, "/api/v1/alerts"), http.StatusOK},
		{"node-a's own, second time", nodeA, replay(first, "/api/v1/alerts"), http.StatusUnauthorized},
		{"node-a's, to node-b", nodeB, replay(first, "/api/v1/alerts"), http.StatusUnauthorized},
		{"node-a's, to another path", nodeA, replay(signed("node-a", "/api/v1/alerts", now), "/api/v1/breaker/reset"), http.StatusUnauthorized},
		{"node-a's, another fleet secret", otherFleet, signed("node-a", "/api/v1/alerts", now), http.StatusUnauthorized},
		{"signed 61 s ago", nodeA, signed("node-a", "/api/v1/alerts", now.Add(-FleetWindow-time.Second)), http.StatusUnauthorized},
		{"signed 61 s ahead", nodeA, signed("node-a", "/api/v1/alerts", now.Add(FleetWindow+time.Second)), http.StatusUnauthorized},
		{"signed 59 s ago", nodeA, signed("node-a", "/api/v1/alerts", now.Add(-FleetWindow+time.Second)), http.StatusOK},
		{"signed for node-b, sent to node-b", nodeB, signed("node-b", "/api/v1/alerts", now), http.StatusOK},
	} {
		if got := code(c.auth, c.req); got != c.want {
			t.Errorf("%s: %d, want %d", c.name, got, c.want)
		}
	}

	// A changed body: the signature is the original's.
	r := signed("node-a", "/api/v1/alerts", now)
	r.Body = http.NoBody
	if got := code(nodeA, r); got != http.StatusUnauthorized {
		t.Errorf("changed body: %d, want 401", got)
	}
	// After the window, the first request again: its time is too old.
	now = now.Add(FleetWindow + time.Second)
	if got := code(nodeA, replay(first, "/api/v1/alerts")); got != http.StatusUnauthorized {
		t.Errorf("after the window: %d, want 401", got)
	}
	// The bearer token still works for humans and other clients.
	h := httptest.NewRequest(http.MethodGet, "/api/v1/actions", nil)
	h.Header.Set("Authorization", "Bearer "+testToken)
	if got := code(nodeA, h); got != http.StatusOK {
		t.Errorf("bearer token: %d, want 200", got)
	}
}
