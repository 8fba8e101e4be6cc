package intake

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// TestSessionCookie: the pages' session cookie opens a GET or HEAD while
// it has not expired, under the token it was made with; an expired, a
// tampered, another token's cookie, or any cookie on a POST, does not.
func TestSessionCookie(t *testing.T) {
	newAuth := func(tok string) *Auth {
		a, err := NewAuth(AuthConfig{TokenFile: writeFile(t, "token", tok)}, newTestMetrics(), discardLogger())
		if err != nil {
			t.Fatal(err)
		}
		return a
	}
	a, other := newAuth(testToken), newAuth(testToken+"-rotated")
	valid := a.session(time.Now().Add(time.Hour))
	exp, mac, _ := strings.Cut(valid, ".")
	for _, tc := range []struct {
		name, method, value string
		want                bool
	}{
		{"valid GET", http.MethodGet, valid, true},
		{"valid HEAD", http.MethodHead, valid, true},
		{"valid POST", http.MethodPost, valid, false},
		{"expired", http.MethodGet, a.session(time.Now().Add(-time.Second)), false},
		{"expiry moved", http.MethodGet, exp + "0." + mac, false},
		{"MAC changed", http.MethodGet, exp + "." + strings.Repeat("A", len(mac)), false},
		{"another token's", http.MethodGet, other.session(time.Now().Add(time.Hour)), false},
		{"the token itself", http.MethodGet, testToken, false},
		{"empty", http.MethodGet, "", false},
	} {
		r := httptest.NewRequest(tc.method, "/actions", nil)
		r.AddCookie(&http.Cookie{Name: SessionCookie, Value: tc.value})
		if got := a.sessionOK(r); got != tc.want {
			t.Errorf("%s: sessionOK %v, want %v", tc.name, got, tc.want)
		}
	}
	// Without a token there is no session to have.
	none, err := NewAuth(AuthConfig{InsecureNone: true}, newTestMetrics(), discardLogger())
	if err != nil {
		t.Fatal(err)
	}
	r := httptest.NewRequest(http.MethodGet, "/actions", nil)
	r.AddCookie(&http.Cookie{Name: SessionCookie, Value: valid})
	if none.sessionOK(r) {
		t.Error("an Auth without a token accepted a session cookie")
	}
}
