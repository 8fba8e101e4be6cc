package intake

import (
	"crypto/tls"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"
)

func sessionAuth(t *testing.T, tok string, scope SessionScope) *Auth {
	t.Helper()
	a, err := NewAuth(AuthConfig{TokenFile: writeFile(t, "token", tok), Session: scope}, newTestMetrics(), discardLogger())
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// TestSessionCookie: the pages' session cookie opens a GET or HEAD of the
// pages while it has not expired, under the token and the remediator
// (node, listener, external URL) it was made for; an expired, a tampered,
// another token's or another remediator's cookie, any cookie on a POST,
// and any cookie on the API, does not.
func TestSessionCookie(t *testing.T) {
	scope := SessionScope{Role: "node", Node: "node-a", Listeners: []string{":10836"}}
	a := sessionAuth(t, testToken, scope)
	other := sessionAuth(t, testToken+"-rotated", scope)
	nodeB := sessionAuth(t, testToken, SessionScope{Role: "node", Node: "node-b", Listeners: []string{":10836"}})
	port := sessionAuth(t, testToken, SessionScope{Role: "node", Node: "node-a", Listeners: []string{":10837"}})
	ext, _ := url.Parse("http://gpu-17.example.com:10836")
	external := sessionAuth(t, testToken, SessionScope{Role: "node", Node: "node-a", Listeners: []string{":10836"}, ExternalURL: ext})
	hour := time.Now().Add(time.Hour)
	valid := a.newSession(hour)
	exp, rest, _ := strings.Cut(valid, ".")
	id, mac, _ := strings.Cut(rest, ".")
	for _, tc := range []struct {
		name, method, path, value string
		want                      bool
	}{
		{"valid GET", http.MethodGet, "/actions", valid, true},
		{"valid GET of a detail", http.MethodGet, "/actions/01J", valid, true},
		{"valid HEAD", http.MethodHead, "/actions", valid, true},
		{"valid POST", http.MethodPost, "/actions", valid, false},
		{"the API's actions", http.MethodGet, "/api/v1/actions", valid, false},
		{"the API's status", http.MethodGet, "/api/v1/status", valid, false},
		{"a path that only starts alike", http.MethodGet, "/actionsx", valid, false},
		{"expired", http.MethodGet, "/actions", a.newSession(time.Now().Add(-time.Second)), false},
		{"expiry moved", http.MethodGet, "/actions", exp + "0." + id + "." + mac, false},
		{"ID changed", http.MethodGet, "/actions", exp + ".x" + id + "." + mac, false},
		{"MAC changed", http.MethodGet, "/actions", exp + "." + id + "." + strings.Repeat("A", len(mac)), false},
		{"the old format (expiry.MAC)", http.MethodGet, "/actions", exp + "." + mac, false},
		{"another token's", http.MethodGet, "/actions", other.newSession(hour), false},
		{"node-b's, same token", http.MethodGet, "/actions", nodeB.newSession(hour), false},
		{"another listener's, same node and token", http.MethodGet, "/actions", port.newSession(hour), false},
		{"another external URL's", http.MethodGet, "/actions", external.newSession(hour), false},
		{"the token itself", http.MethodGet, "/actions", testToken, false},
		{"empty", http.MethodGet, "/actions", "", false},
	} {
		r := httptest.NewRequest(tc.method, tc.path, nil)
		r.AddCookie(&http.Cookie{Name: SessionCookie, Value: tc.value})
		if got := a.sessionOK(r); got != tc.want {
			t.Errorf("%s: sessionOK %v, want %v", tc.name, got, tc.want)
		}
	}
	// Over TLS, only the __Host- cookie counts.
	for name, want := range map[string]bool{SecureSessionCookie: true, SessionCookie: false} {
		r := httptest.NewRequest(http.MethodGet, "/actions", nil)
		r.TLS = &tls.ConnectionState{HandshakeComplete: true}
		r.AddCookie(&http.Cookie{Name: name, Value: valid})
		if got := a.sessionOK(r); got != want {
			t.Errorf("over TLS, cookie %s: sessionOK %v, want %v", name, got, want)
		}
	}
	// Without a token there is no session to have.
	none, err := NewAuth(AuthConfig{InsecureNone: true, Session: scope}, newTestMetrics(), discardLogger())
	if err != nil {
		t.Fatal(err)
	}
	r := httptest.NewRequest(http.MethodGet, "/actions", nil)
	r.AddCookie(&http.Cookie{Name: SessionCookie, Value: valid})
	if none.sessionOK(r) {
		t.Error("an Auth without a token accepted a session cookie")
	}
}

// TestSessionRevokedWhenFull: past maxRevoked revoked sessions that have
// not expired, every session issued so far is revoked at once, rather
// than one revocation forgotten.
func TestSessionRevokedWhenFull(t *testing.T) {
	a := sessionAuth(t, testToken, SessionScope{Node: "node-a"})
	kept := a.newSession(time.Now().Add(SessionLifetime))
	exp := time.Now().Add(time.Hour)
	for i := range maxRevoked + 1 {
		a.revoke("session-"+strconv.Itoa(i), exp)
	}
	r := httptest.NewRequest(http.MethodGet, "/actions", nil)
	r.AddCookie(&http.Cookie{Name: SessionCookie, Value: kept})
	if a.sessionOK(r) {
		t.Error("a session issued before the revocation table filled up still opens the pages")
	}
	if len(a.revoked) > maxRevoked {
		t.Errorf("%d revoked sessions kept, want at most %d", len(a.revoked), maxRevoked)
	}
}
