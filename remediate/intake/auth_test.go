package intake

import (
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io/fs"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/time/rate"

	"github.com/gpu-orphan/gpu-orphan/remediate"
)

type authTest struct {
	auth    *Auth
	metrics *remediate.Metrics
	h       http.Handler
	served  int
}

func newAuthTest(t *testing.T, cfg AuthConfig) *authTest {
	t.Helper()
	at := &authTest{metrics: newTestMetrics()}
	var err error
	if at.auth, err = NewAuth(cfg, at.metrics, discardLogger()); err != nil {
		t.Fatal(err)
	}
	at.h = at.auth.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		at.served++
		w.WriteHeader(http.StatusNoContent)
	}))
	return at
}

// call sends a request from source with an Authorization header (none if
// empty) and returns the status code.
func (at *authTest) call(t *testing.T, source, authorization string) *httptest.ResponseRecorder {
	t.Helper()
	r := httptest.NewRequest(http.MethodPost, "/api/v1/alerts", strings.NewReader("{}"))
	r.RemoteAddr = source
	if authorization != "" {
		r.Header.Set("Authorization", authorization)
	}
	w := httptest.NewRecorder()
	at.h.ServeHTTP(w, r)
	return w
}

func (at *authTest) requests(code string) float64 {
	return testutil.ToFloat64(at.metrics.Requests.WithLabelValues(code))
}

func tokenConfig(t *testing.T) AuthConfig {
	return AuthConfig{TokenFile: writeFile(t, "token", testToken+"\n")}
}

func TestAuthToken(t *testing.T) {
	for _, tc := range []struct {
		name, authorization string
		ok                  bool
	}{
		{"correct token", "Bearer " + testToken, true},
		{"scheme in lower case", "bearer " + testToken, true},
		{"scheme in capitals", "BEARER " + testToken, true},
		{"blanks around the token", "Bearer   " + testToken + " ", true},
		{"missing header", "", false},
		{"wrong token", "Bearer wrong-token-0123456789", false},
		{"prefix of the token", "Bearer " + testToken[:16], false},
		{"token with a suffix", "Bearer " + testToken + "x", false},
		{"token in another case", "Bearer " + strings.ToUpper(testToken), false},
		{"empty token", "Bearer ", false},
		{"scheme only", "Bearer", false},
		{"token without a scheme", testToken, false},
		{"basic auth", "Basic " + testToken, false},
		{"token as the scheme", testToken + " " + testToken, false},
		{"very long token", "Bearer " + strings.Repeat("a", 1<<16), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			at := newAuthTest(t, tokenConfig(t))
			w := at.call(t, "192.0.2.10:5555", tc.authorization)
			if tc.ok {
				if w.Code != http.StatusNoContent || at.served != 1 {
					t.Fatalf("status %d, served %d; want the next handler to run", w.Code, at.served)
				}
				if got := testutil.ToFloat64(at.metrics.AuthFailures); got != 0 {
					t.Errorf("auth_failures_total = %v for a good token", got)
				}
				return
			}
			if w.Code != http.StatusUnauthorized || at.served != 0 {
				t.Fatalf("status %d, served %d; want 401 and the next handler not run", w.Code, at.served)
			}
			if got := w.Header().Get("WWW-Authenticate"); got != `Bearer realm="gpu-orphan-remediator"` {
				t.Errorf("WWW-Authenticate %q", got)
			}
			if !strings.Contains(w.Body.String(), "missing or wrong bearer token") {
				t.Errorf("body %q", w.Body)
			}
			if strings.Contains(w.Body.String(), testToken) {
				t.Errorf("the reply shows the token: %q", w.Body)
			}
			if testutil.ToFloat64(at.metrics.AuthFailures) != 1 || at.requests("401") != 1 {
				t.Errorf("auth_failures_total = %v, requests_total{code=401} = %v; want 1, 1",
					testutil.ToFloat64(at.metrics.AuthFailures), at.requests("401"))
			}
		})
	}
}

// TestAuthTokenHashed checks that Auth keeps only the token's SHA-256 and
// compares hashes, so the comparison takes the same time whatever the
// length of what a caller sends.
func TestAuthTokenHashed(t *testing.T) {
	at := newAuthTest(t, tokenConfig(t))
	if !at.auth.hasToken || at.auth.tokenSum != sha256.Sum256([]byte(testToken)) {
		t.Errorf("Auth holds %x, want the SHA-256 of the trimmed token", at.auth.tokenSum)
	}
	// No field holds the token itself.
	v := reflect.ValueOf(at.auth).Elem()
	for i := range v.NumField() {
		if f := v.Field(i); f.Kind() == reflect.String && strings.Contains(f.String(), testToken) {
			t.Errorf("field %s holds the token in clear", v.Type().Field(i).Name)
		}
	}
	// Every candidate, whatever its length, is reduced to 32 bytes before
	// the constant-time comparison; none of these may panic or pass.
	for _, n := range []int{0, 1, 15, 16, len(testToken) - 1, len(testToken) + 1, 64, 1 << 20} {
		r := httptest.NewRequest(http.MethodPost, "/", nil)
		r.Header.Set("Authorization", "Bearer "+strings.Repeat("a", n))
		if at.auth.tokenOK(r) {
			t.Errorf("a token of %d bytes passed", n)
		}
	}
}

func TestNewAuth(t *testing.T) {
	for _, tc := range []struct {
		name    string
		content string
		wantErr string
	}{
		{"16 characters", strings.Repeat("k", 16), ""},
		{"with a trailing newline", testToken + "\n", ""},
		{"15 characters", strings.Repeat("k", 15), "is 15 characters long: use at least 16"},
		{"short after trimming blanks", "  short-token \n\n", "is 11 characters long: use at least 16"},
		{"empty file", "", "is 0 characters long: use at least 16"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := writeFile(t, "token", tc.content)
			a, err := NewAuth(AuthConfig{TokenFile: path}, newTestMetrics(), discardLogger())
			if tc.wantErr == "" {
				if err != nil || a == nil {
					t.Fatalf("NewAuth: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatalf("NewAuth accepted a token of %q", tc.content)
			}
			if !strings.Contains(err.Error(), tc.wantErr) || !strings.Contains(err.Error(), path) {
				t.Errorf("error %q should name %s and say %q", err, path, tc.wantErr)
			}
		})
	}

	t.Run("missing token file", func(t *testing.T) {
		_, err := NewAuth(AuthConfig{TokenFile: t.TempDir() + "/nonexistent"}, newTestMetrics(), discardLogger())
		if !errors.Is(err, fs.ErrNotExist) || !strings.Contains(err.Error(), "--auth.token-file") {
			t.Errorf("error %v, want one that names --auth.token-file and wraps fs.ErrNotExist", err)
		}
	})

	t.Run("token file is a directory", func(t *testing.T) {
		if _, err := NewAuth(AuthConfig{TokenFile: t.TempDir()}, newTestMetrics(), discardLogger()); err == nil {
			t.Error("NewAuth accepted a directory as the token file")
		}
	})
}

func TestAuthWithoutToken(t *testing.T) {
	t.Run("no token and not insecure: only client certificates", func(t *testing.T) {
		at := newAuthTest(t, AuthConfig{})
		if w := at.call(t, "192.0.2.10:5555", "Bearer "+testToken); w.Code != http.StatusUnauthorized {
			t.Errorf("status %d, want 401: there is no token to match", w.Code)
		}
		if w := at.call(t, "192.0.2.10:5555", ""); w.Code != http.StatusUnauthorized {
			t.Errorf("status %d, want 401", w.Code)
		}
	})

	// example.com is httptest's Host, given as a name of the remediator
	// (TestInsecureNoneHost: other names are refused).
	t.Run("InsecureNone admits everyone", func(t *testing.T) {
		at := newAuthTest(t, AuthConfig{InsecureNone: true, FailureBurst: 1, Hosts: []string{"example.com"}})
		for i, authz := range []string{"", "Bearer wrong", "Bearer " + testToken, "", ""} {
			if w := at.call(t, "192.0.2.10:5555", authz); w.Code != http.StatusNoContent {
				t.Errorf("call %d: status %d, want the next handler", i, w.Code)
			}
		}
		if at.served != 5 || testutil.ToFloat64(at.metrics.AuthFailures) != 0 {
			t.Errorf("served %d, auth failures %v; want 5, 0", at.served, testutil.ToFloat64(at.metrics.AuthFailures))
		}
	})

	t.Run("InsecureNone with a token file still admits everyone", func(t *testing.T) {
		cfg := tokenConfig(t)
		cfg.InsecureNone, cfg.Hosts = true, []string{"example.com"}
		at := newAuthTest(t, cfg)
		if w := at.call(t, "192.0.2.10:5555", "Bearer wrong"); w.Code != http.StatusNoContent {
			t.Errorf("status %d, want the next handler", w.Code)
		}
	})
}

// TestInsecureNoneHost: with --auth.insecure-none, a request without a
// credential is served only under the remediator's own names, IP
// addresses and localhost, on the API and the pages alike: a foreign Host,
// which a DNS rebinding brings, gets 403 and reaches nothing (the old
// remediator served it). A request with the token is served whatever its
// Host.
func TestInsecureNoneHost(t *testing.T) {
	cfg := tokenConfig(t)
	cfg.InsecureNone, cfg.Hosts = true, []string{"remediator.svc"}
	at := newAuthTest(t, cfg)
	page := at.auth.WrapPage(at.h, func(w http.ResponseWriter, _ *http.Request, code int, _ string, _ bool) { w.WriteHeader(code) })
	srv := httptest.NewServer(http.NewServeMux())
	mux := srv.Config.Handler.(*http.ServeMux)
	mux.Handle("GET /api/v1/actions", at.h)
	mux.Handle("POST /api/v1/breaker/reset", at.h)
	mux.Handle("GET /actions", page)
	defer srv.Close()
	for _, tc := range []struct {
		method, path, host, authz string
		want                      int
	}{
		{"GET", "/api/v1/actions", "rebind.example", "", http.StatusForbidden},
		{"POST", "/api/v1/breaker/reset", "rebind.example:10836", "", http.StatusForbidden},
		{"GET", "/actions", "rebind.example", "", http.StatusForbidden},
		{"GET", "/api/v1/actions", "rebind.example", "Bearer wrong-token-0123456789", http.StatusForbidden},
		{"GET", "/api/v1/actions", "127.0.0.1.nip.io", "", http.StatusForbidden},
		{"GET", "/api/v1/actions", "rebind.example", "Bearer " + testToken, http.StatusNoContent},
		{"POST", "/api/v1/breaker/reset", "rebind.example", "Bearer " + testToken, http.StatusNoContent},
		{"GET", "/api/v1/actions", "127.0.0.1:10836", "", http.StatusNoContent},
		{"POST", "/api/v1/breaker/reset", "[::1]:10836", "", http.StatusNoContent},
		{"POST", "/api/v1/breaker/reset", "10.0.0.5:10836", "", http.StatusNoContent},
		{"POST", "/api/v1/breaker/reset", "localhost:10836", "", http.StatusNoContent},
		{"POST", "/api/v1/breaker/reset", "remediator.svc:10836", "", http.StatusNoContent},
		{"GET", "/actions", "remediator.svc", "", http.StatusNoContent},
	} {
		req, _ := http.NewRequest(tc.method, srv.URL+tc.path, nil)
		req.Host = tc.host
		if tc.authz != "" {
			req.Header.Set("Authorization", tc.authz)
		}
		// 204 is the handler's answer: what did not reach it is not 204.
		resp, err := srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != tc.want {
			t.Errorf("%s %s, Host %s, %q: %d, want %d", tc.method, tc.path, tc.host, tc.authz, resp.StatusCode, tc.want)
		}
	}
	if v := at.requests("403"); v != 5 {
		t.Errorf("requests_total{code=\"403\"} = %v, want 5", v)
	}
}

func TestAuthClientCertificate(t *testing.T) {
	at := newAuthTest(t, tokenConfig(t))
	send := func(state *tls.ConnectionState, authz string) int {
		r := httptest.NewRequest(http.MethodPost, "/api/v1/alerts", nil)
		r.RemoteAddr = "192.0.2.20:5555"
		r.TLS = state
		if authz != "" {
			r.Header.Set("Authorization", authz)
		}
		w := httptest.NewRecorder()
		at.h.ServeHTTP(w, r)
		return w.Code
	}
	verified := &tls.ConnectionState{
		HandshakeComplete: true,
		PeerCertificates:  []*x509.Certificate{{}},
		VerifiedChains:    [][]*x509.Certificate{{{}, {}}},
	}
	if code := send(verified, ""); code != http.StatusNoContent {
		t.Errorf("verified client certificate without a token: %d, want admitted", code)
	}
	if code := send(verified, "Bearer wrong"); code != http.StatusNoContent {
		t.Errorf("verified client certificate with a wrong token: %d, want admitted (the certificate suffices)", code)
	}
	// A certificate the TLS layer did not verify proves nothing.
	unverified := &tls.ConnectionState{HandshakeComplete: true, PeerCertificates: []*x509.Certificate{{}}}
	if code := send(unverified, ""); code != http.StatusUnauthorized {
		t.Errorf("unverified certificate: %d, want 401", code)
	}
	if code := send(&tls.ConnectionState{HandshakeComplete: true}, ""); code != http.StatusUnauthorized {
		t.Errorf("TLS without a client certificate: %d, want 401", code)
	}
	if code := send(&tls.ConnectionState{HandshakeComplete: true}, "Bearer "+testToken); code != http.StatusNoContent {
		t.Errorf("TLS without a client certificate, correct token: %d, want admitted", code)
	}
}

// TestAuthFailureLimit: a source that keeps failing is cut off with 429
// (final for Alertmanager) while other sources are served as usual.
//
// A blocked source gets 429 for every failed request until its failure
// budget recovers (one failure per 60/FailuresPerMinute seconds), but a
// correct credential, token or verified client certificate, is admitted
// even from a blocked source: callers share source addresses, and a 429
// would lose Alertmanager's notification (see auth_guess_test.go).
func TestAuthFailureLimit(t *testing.T) {
	const burst = 3
	cfg := tokenConfig(t)
	cfg.FailureBurst = burst
	cfg.FailuresPerMinute = 0.001 // nothing recovers during the test
	at := newAuthTest(t, cfg)
	const bad, good = "198.51.100.1:1000", "198.51.100.2:1000"

	for i := range burst {
		if w := at.call(t, bad, "Bearer wrong-token-0123456789"); w.Code != http.StatusUnauthorized {
			t.Fatalf("failure %d: status %d, want 401 within the burst", i+1, w.Code)
		}
	}
	// The same host from another port is the same source.
	for _, authz := range []string{"Bearer wrong-token-0123456789", ""} {
		w := at.call(t, "198.51.100.1:2000", authz)
		if w.Code != http.StatusTooManyRequests {
			t.Errorf("blocked source with %q: status %d, want 429", authz, w.Code)
		}
		if !strings.Contains(w.Body.String(), "too many failed authentication attempts from 198.51.100.1") {
			t.Errorf("429 body %q", w.Body)
		}
	}
	if at.served != 0 {
		t.Errorf("the blocked source's failures reached the next handler %d times", at.served)
	}
	// 429s are not failures: they do not deepen the block.
	if got := testutil.ToFloat64(at.metrics.AuthFailures); got != burst {
		t.Errorf("auth_failures_total = %v, want %d", got, burst)
	}
	if at.requests("401") != burst || at.requests("429") != 2 {
		t.Errorf("requests_total 401 = %v, 429 = %v; want %d, 2", at.requests("401"), at.requests("429"), burst)
	}
	// The blocked source's correct token is served, and lifts no block.
	if w := at.call(t, "198.51.100.1:2000", "Bearer "+testToken); w.Code != http.StatusNoContent || at.served != 1 {
		t.Errorf("blocked source, correct token: %d, served %d; want served", w.Code, at.served)
	}
	if w := at.call(t, bad, ""); w.Code != http.StatusTooManyRequests {
		t.Errorf("blocked source after its correct token, no token: %d, want 429", w.Code)
	}

	// Another source is unaffected: 401 for a wrong token, served with the
	// right one.
	if w := at.call(t, good, "Bearer nope-nope-nope-nope"); w.Code != http.StatusUnauthorized {
		t.Errorf("other source, wrong token: %d, want 401", w.Code)
	}
	if w := at.call(t, good, "Bearer "+testToken); w.Code != http.StatusNoContent {
		t.Errorf("other source, correct token: %d, want served", w.Code)
	}
	// IPv6 sources are told apart by address too.
	if w := at.call(t, "[2001:db8::1]:443", "Bearer "+testToken); w.Code != http.StatusNoContent {
		t.Errorf("IPv6 source, correct token: %d, want served", w.Code)
	}

	// A client certificate gets through even from the blocked source.
	r := httptest.NewRequest(http.MethodPost, "/api/v1/alerts", nil)
	r.RemoteAddr = bad
	r.TLS = &tls.ConnectionState{VerifiedChains: [][]*x509.Certificate{{{}}}}
	w := httptest.NewRecorder()
	at.h.ServeHTTP(w, r)
	if w.Code != http.StatusNoContent {
		t.Errorf("blocked source with a verified certificate: %d, want served", w.Code)
	}
}

// TestAuthFailureLimitSuccessesAreFree: correct tokens never spend the
// failure budget.
func TestAuthFailureLimitSuccessesAreFree(t *testing.T) {
	cfg := tokenConfig(t)
	cfg.FailureBurst, cfg.FailuresPerMinute = 2, 0.001
	at := newAuthTest(t, cfg)
	const src = "203.0.113.5:1"
	for range 20 {
		if w := at.call(t, src, "Bearer "+testToken); w.Code != http.StatusNoContent {
			t.Fatalf("status %d, want served", w.Code)
		}
	}
	at.call(t, src, "")
	if w := at.call(t, src, "Bearer "+testToken); w.Code != http.StatusNoContent {
		t.Errorf("after one failure of a budget of 2: status %d, want served", w.Code)
	}
	at.call(t, src, "")
	if w := at.call(t, src, ""); w.Code != http.StatusTooManyRequests {
		t.Errorf("after two failures of a budget of 2: status %d, want 429", w.Code)
	}
	if w := at.call(t, src, "Bearer "+testToken); w.Code != http.StatusNoContent {
		t.Errorf("correct token after the budget is spent: status %d, want served", w.Code)
	}
}

func TestAuthFailureLimitRecovers(t *testing.T) {
	cfg := tokenConfig(t)
	cfg.FailureBurst, cfg.FailuresPerMinute = 1, 300 // one failure back every 200 ms
	at := newAuthTest(t, cfg)
	const src = "203.0.113.9:1"
	at.call(t, src, "")
	if w := at.call(t, src, ""); w.Code != http.StatusTooManyRequests {
		t.Fatalf("right after the failure: status %d, want 429", w.Code)
	}
	time.Sleep(300 * time.Millisecond)
	if w := at.call(t, src, ""); w.Code != http.StatusUnauthorized {
		t.Errorf("after the budget recovered: status %d, want 401, the token checked again", w.Code)
	}
}

func TestAuthDefaults(t *testing.T) {
	at := newAuthTest(t, tokenConfig(t))
	if at.auth.failBurst != 5 || at.auth.failRate != rate.Limit(10.0/60) {
		t.Errorf("defaults: burst %d, rate %v; want 5 failures, 10 a minute", at.auth.failBurst, at.auth.failRate)
	}
	for i := range 5 {
		if w := at.call(t, "192.0.2.99:1", ""); w.Code != http.StatusUnauthorized {
			t.Fatalf("failure %d: %d, want 401", i+1, w.Code)
		}
	}
	if w := at.call(t, "192.0.2.99:1", ""); w.Code != http.StatusTooManyRequests {
		t.Errorf("sixth failure: %d, want 429", w.Code)
	}
}

// TestAuthSweep: sources whose budget is full again are forgotten, so
// that a scan from many addresses does not grow the map for ever; blocked
// ones are kept.
func TestAuthSweep(t *testing.T) {
	cfg := tokenConfig(t)
	cfg.FailureBurst, cfg.FailuresPerMinute = 2, 0.001
	at := newAuthTest(t, cfg)
	at.call(t, "192.0.2.1:1", "")
	at.call(t, "192.0.2.1:1", "") // blocked now
	at.auth.mu.Lock()
	at.auth.failures["192.0.2.2"] = rate.NewLimiter(at.auth.failRate, at.auth.failBurst) // recovered
	at.auth.lastSweep = time.Now().Add(-11 * time.Minute)
	at.auth.mu.Unlock()

	at.call(t, "192.0.2.3:1", "")

	at.auth.mu.Lock()
	defer at.auth.mu.Unlock()
	if _, ok := at.auth.failures["192.0.2.2"]; ok {
		t.Error("a recovered source was not forgotten")
	}
	if _, ok := at.auth.failures["192.0.2.1"]; !ok {
		t.Error("a blocked source was forgotten")
	}
	if _, ok := at.auth.failures["192.0.2.3"]; !ok {
		t.Error("the failing source was not recorded")
	}
}

func TestSourceOf(t *testing.T) {
	for addr, want := range map[string]string{
		"192.0.2.1:1234":    "192.0.2.1",
		"[2001:db8::1]:443": "2001:db8::1",
		"@":                 "@", // a Unix socket's peer
		"":                  "",
	} {
		r := &http.Request{RemoteAddr: addr}
		if got := sourceOf(r); got != want {
			t.Errorf("sourceOf(%q) = %q, want %q", addr, got, want)
		}
	}
}
