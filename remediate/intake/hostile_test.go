package intake

// The hostile review's tests (issue 16, section 5): example tokens, the
// failure table and the log under a scan from many addresses, and requests
// a browser on another site can make.

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/alertmanager/notify"

	"github.com/gpu-orphan/gpu-orphan/internal/stack/slowness"
)

// shippedPlaceholders reads the example tokens the repository ships:
// deploy/compose/token.example (docker-compose.yml's default) and the
// auth values of deploy/kubernetes/values.yaml.
func shippedPlaceholders(t *testing.T) []string {
	t.Helper()
	b, err := os.ReadFile("../../deploy/compose/token.example")
	if err != nil {
		t.Fatal(err)
	}
	tokens := []string{strings.TrimSpace(string(b))}
	f, err := os.Open("../../deploy/kubernetes/values.yaml")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		key, value, ok := strings.Cut(strings.TrimSpace(sc.Text()), ":")
		if ok && strings.HasSuffix(key, "Token") && strings.TrimSpace(value) != "" {
			tokens = append(tokens, strings.Trim(strings.TrimSpace(value), `"'`))
		}
	}
	if len(tokens) < 3 {
		t.Fatalf("found %d shipped tokens (%q), want the compose example and values.yaml's two", len(tokens), tokens)
	}
	return tokens
}

// TestExampleTokensRefused: the placeholder tokens of deploy/ (which a
// running remediator accepted) are refused at start, with an error that
// names the file and says how to make a token; a token is accepted
// otherwise, whatever else it contains.
func TestExampleTokensRefused(t *testing.T) {
	refused := shippedPlaceholders(t)
	refused = append(refused, "  "+strings.ToUpper(refused[0])+"\n", "my-token-REPLACE-ME-later-0123")
	for _, tok := range refused {
		path := writeFile(t, "token", tok+"\n")
		_, err := NewAuth(AuthConfig{TokenFile: path}, newTestMetrics(), discardLogger())
		if err == nil {
			t.Errorf("token %q was accepted", tok)
			continue
		}
		for _, says := range []string{path, "--auth.token-file", "placeholder", "head -c 32 /dev/urandom | base64"} {
			if !strings.Contains(err.Error(), says) {
				t.Errorf("token %q: error %q does not say %q", tok, err, says)
			}
		}
		if _, err := ReadTokenFile("--dispatch.token-file", path); err == nil || !strings.Contains(err.Error(), "--dispatch.token-file") {
			t.Errorf("token %q as the dispatcher's: %v, want an error naming --dispatch.token-file", tok, err)
		}
	}
	for _, tok := range []string{"gpu-orphan-example-token", "Q2hhbmdlZCBpdCwgZ29vZCBqb2IhIDEyMzQ1Ng=="} {
		if _, err := ReadTokenFile("--auth.token-file", writeFile(t, "token", tok)); err != nil {
			t.Errorf("token %q: %v", tok, err)
		}
	}
}

// lockedBuffer is a log destination that counts lines.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// loopbackClient dials each request from the next address of 127.1.0.0/16
// and up, with a new connection, so that each is a source of its own.
func loopbackClient() *http.Client {
	var n atomic.Uint32
	dial := func(ctx context.Context, network, addr string) (net.Conn, error) {
		i := n.Add(1)
		local := net.IPv4(127, byte(1+i>>16), byte(i>>8), byte(i))
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: local}, Timeout: 5 * time.Second}
		return d.DialContext(ctx, network, addr)
	}
	return &http.Client{Transport: &http.Transport{DialContext: dial, DisableKeepAlives: true}}
}

// TestAuthManySources: wrong tokens from 10,000 distinct loopback
// addresses over real HTTP (150,000 of them grew the old remediator's RSS
// from 55 to 101 MB and its log by 20 MiB). The failure table stays at
// DefaultMaxSources, the log at a few lines, and a correct token from yet
// another source is admitted; the sources beyond the table share one
// budget, so that their wrong tokens are refused with 429 once its burst
// is spent.
//
// The counts must not depend on how long 10,000 connections take (seconds
// idle, much longer with -race on a loaded machine): the budgets refill
// too slowly to matter (one failure per ~10^11 s), so that the full
// table's sweep forgets nobody, and the log's interval outlasts the test.
// What refills and when is TestAuthWarningsSummarised's and the rate
// tests' business.
func TestAuthManySources(t *testing.T) {
	if testing.Short() {
		t.Skip("10,000 connections")
	}
	const sources = 10_000
	var logs lockedBuffer
	logger := slog.New(slog.NewTextHandler(&logs, nil))
	cfg := tokenConfig(t)
	cfg.FailuresPerMinute = 1e-9
	a, err := NewAuth(cfg, newTestMetrics(), logger)
	if err != nil {
		t.Fatal(err)
	}
	a.warn = newThrottledLog(logger, 24*time.Hour, warnBurst)
	defer func() {
		a.warn.mu.Lock()
		if a.warn.timer != nil {
			a.warn.timer.Stop()
		}
		a.warn.mu.Unlock()
	}()
	var served atomic.Int32
	srv := httptest.NewServer(a.Wrap(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		served.Add(1)
		w.WriteHeader(http.StatusNoContent)
	})))
	defer srv.Close()
	c := loopbackClient()

	codes := map[int]int{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	work := make(chan int)
	const workers = 8
	for range workers {
		wg.Go(func() {
			for range work {
				req, _ := http.NewRequest(http.MethodPost, srv.URL+"/api/v1/alerts", strings.NewReader("{}"))
				req.Header.Set("Content-Type", "application/json")
				req.Header.Set("Authorization", "Bearer wrong-token-0123456789")
				resp, err := c.Do(req)
				if err != nil {
					t.Error(err)
					return
				}
				resp.Body.Close()
				mu.Lock()
				codes[resp.StatusCode]++
				mu.Unlock()
			}
		})
	}
	start := time.Now()
	for i := range sources {
		work <- i
	}
	close(work)
	wg.Wait()
	t.Logf("%d wrong tokens from %d sources in %s: %v", sources, sources, time.Since(start).Round(time.Millisecond), codes)

	a.mu.Lock()
	tracked := len(a.failures)
	a.mu.Unlock()
	if tracked > DefaultMaxSources {
		t.Errorf("the failure table holds %d sources, want at most %d", tracked, DefaultMaxSources)
	}
	// One 401 for each source in the table and for the shared budget's
	// burst, 429 for the rest; a request that found budget left may be
	// answered 401 while the others in flight spend the last of it.
	want := DefaultMaxSources + a.failBurst
	if n := codes[http.StatusUnauthorized]; n < want || n > want+workers-1 || n+codes[http.StatusTooManyRequests] != sources {
		t.Errorf("codes %v: want %d to %d 401s (the table's sources, then the shared budget's burst), and 429s for the rest",
			codes, want, want+workers-1)
	}
	lines := strings.Count(logs.String(), "\n")
	if lines > warnBurst+1 {
		t.Errorf("%d rejected requests logged %d lines, want at most %d:\n%s", sources, lines, warnBurst+1, logs.String())
	}
	// A correct token is admitted from a new source all the same.
	req, _ := http.NewRequest(http.MethodPost, srv.URL+"/api/v1/alerts", strings.NewReader("{}"))
	req.Header.Set("Authorization", "Bearer "+testToken)
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusNoContent || served.Load() != 1 {
		t.Errorf("a correct token from a new source: %d, served %d; want 204, 1", resp.StatusCode, served.Load())
	}
}

// TestAuthWarningsSummarised: past the first warnBurst warnings of an
// interval, rejected requests are counted, and one line at the interval's
// end says how many and names the last.
func TestAuthWarningsSummarised(t *testing.T) {
	var logs lockedBuffer
	cfg := tokenConfig(t)
	cfg.FailureBurst = 1000
	at := newAuthTest(t, cfg)
	at.auth.warn = newThrottledLog(slog.New(slog.NewTextHandler(&logs, nil)), 300*time.Millisecond, 3)
	for i := range 50 {
		at.call(t, fmt.Sprintf("192.0.2.%d:1", i+1), "")
	}
	if n := strings.Count(logs.String(), "\n"); n != 3 {
		t.Fatalf("50 rejected requests: %d lines before the interval ended, want 3:\n%s", n, logs.String())
	}
	deadline := time.Now().Add(slowness.Scale(5*time.Second, slowness.Factor()))
	for !strings.Contains(logs.String(), "suppressed=47") && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	out := logs.String()
	if !strings.Contains(out, "not logged one by one") || !strings.Contains(out, "suppressed=47") || !strings.Contains(out, "last.remote=192.0.2.50") {
		t.Fatalf("no summary of the 47 others naming the last:\n%s", out)
	}
	// The next interval logs again.
	at.call(t, "192.0.2.99:1", "")
	if !strings.Contains(logs.String(), "remote=192.0.2.99") {
		t.Errorf("the next interval's first warning was not logged:\n%s", logs.String())
	}
}

// TestAuthIPv6SharesA64: the addresses of one IPv6 /64 (one host's, as a
// rule) share a failure budget.
func TestAuthIPv6SharesA64(t *testing.T) {
	cfg := tokenConfig(t)
	cfg.FailureBurst, cfg.FailuresPerMinute = 3, 0.001
	at := newAuthTest(t, cfg)
	for i := range 3 {
		if w := at.call(t, fmt.Sprintf("[2001:db8:0:1::%x]:1", i+1), ""); w.Code != http.StatusUnauthorized {
			t.Fatalf("failure %d: %d, want 401", i+1, w.Code)
		}
	}
	if w := at.call(t, "[2001:db8:0:1:ffff::9]:1", ""); w.Code != http.StatusTooManyRequests {
		t.Errorf("a fourth address of the same /64: %d, want 429", w.Code)
	}
	if w := at.call(t, "[2001:db8:0:2::1]:1", ""); w.Code != http.StatusUnauthorized {
		t.Errorf("another /64: %d, want 401", w.Code)
	}
}

// crossSiteServer is Auth (no credential needed, as with a client
// certificate a browser presents by itself) + RefuseCrossSite + a handler
// that counts what reaches it.
func crossSiteServer(t *testing.T, external string) (http.Handler, *atomic.Int32) {
	t.Helper()
	// remediator is a name the remediator is served under (its listen
	// address's host, or --web.external-url's): without a credential,
	// --auth.insecure-none serves those only (hostChecked).
	a, err := NewAuth(AuthConfig{InsecureNone: true, Hosts: []string{"remediator"}}, newTestMetrics(), discardLogger())
	if err != nil {
		t.Fatal(err)
	}
	var ext *url.URL
	if external != "" {
		ext, _ = url.Parse(external)
	}
	guard, err := a.RefuseCrossSite(ext)
	if err != nil {
		t.Fatal(err)
	}
	var reached atomic.Int32
	return a.Wrap(guard(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		reached.Add(1)
		w.WriteHeader(http.StatusOK)
	}))), &reached
}

// TestRefuseCrossSite: a state-changing request that a form on another
// site can make a browser send is refused (with client certificates, a
// cross-site POST of application/x-www-form-urlencoded reset the breaker);
// what Alertmanager, curl and same-origin pages send is not.
func TestRefuseCrossSite(t *testing.T) {
	h, reached := crossSiteServer(t, "https://gpu-17.example.com")
	for _, tc := range []struct {
		name, method, contentType, origin, fetchSite, authz string
		want                                                int
	}{
		{"Alertmanager", "POST", "application/json", "", "", "", 200},
		{"JSON with a charset", "POST", "application/json; charset=utf-8", "", "", "", 200},
		{"curl with a bearer token, no body", "POST", "", "", "", "Bearer x", 200},
		{"form, no Origin (an old browser)", "POST", "application/x-www-form-urlencoded", "", "", "", 415},
		{"multipart form", "POST", "multipart/form-data; boundary=x", "", "", "", 415},
		{"text/plain form", "POST", "text/plain", "", "", "", 415},
		{"no content type (fetch, no-cors)", "POST", "", "", "", "", 415},
		{"form with Basic credentials the browser attached", "POST", "application/x-www-form-urlencoded", "", "", "Basic dTpw", 415},
		{"cross-site form", "POST", "application/x-www-form-urlencoded", "https://evil.example", "cross-site", "", 403},
		{"cross-site JSON (after a preflight it never gets)", "POST", "application/json", "https://evil.example", "cross-site", "", 403},
		{"same-site, another port", "POST", "application/json", "http://remediator:9999", "same-site", "", 403},
		{"Origin only, foreign", "POST", "application/json", "https://evil.example", "", "", 403},
		{"Origin null", "POST", "application/json", "null", "", "", 403},
		{"same origin", "POST", "application/json", "http://remediator:10836", "same-origin", "", 200},
		{"same origin, old browser", "POST", "application/json", "http://remediator:10836", "", "", 200},
		{"the external URL", "POST", "application/json", "https://gpu-17.example.com", "cross-site", "", 200},
		{"GET cross-site reads nothing it may not", "GET", "", "https://evil.example", "cross-site", "", 200},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := reached.Load()
			r := httptest.NewRequest(tc.method, "http://remediator:10836/api/v1/breaker/reset", strings.NewReader("a=b"))
			for k, v := range map[string]string{"Content-Type": tc.contentType, "Origin": tc.origin, "Sec-Fetch-Site": tc.fetchSite, "Authorization": tc.authz} {
				if v != "" {
					r.Header.Set(k, v)
				}
			}
			w := httptest.NewRecorder()
			h.ServeHTTP(w, r)
			if w.Code != tc.want {
				t.Fatalf("%d %s, want %d", w.Code, w.Body, tc.want)
			}
			if got := reached.Load() - before; (tc.want == 200) != (got == 1) {
				t.Errorf("the handler ran %d times", got)
			}
			switch tc.want {
			case 415:
				if !strings.Contains(w.Body.String(), "Content-Type: application/json") {
					t.Errorf("the refusal does not say what to send: %s", w.Body)
				}
			case 403:
				if !strings.Contains(w.Body.String(), "--web.external-url") {
					t.Errorf("the refusal does not name --web.external-url: %s", w.Body)
				}
			}
		})
	}
}

// TestAlertmanagerPassesCrossSiteCheck: Alertmanager 0.35's own notifier
// still delivers through RefuseCrossSite, since what it sends is exactly
// Content-Type: application/json and no Origin.
func TestAlertmanagerPassesCrossSiteCheck(t *testing.T) {
	st, _ := openStore(t)
	m := newTestMetrics()
	auth, err := NewAuth(AuthConfig{TokenFile: writeFile(t, "token", testToken)}, m, discardLogger())
	if err != nil {
		t.Fatal(err)
	}
	guard, err := auth.RefuseCrossSite(nil)
	if err != nil {
		t.Fatal(err)
	}
	var header http.Header
	h := NewHandler(Config{Recorder: st, Classify: gpuClassifier, Metrics: m, Logger: discardLogger()})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		header = r.Header.Clone()
		auth.Wrap(guard(h)).ServeHTTP(w, r)
	}))
	defer srv.Close()
	if v := amNotify(t, srv.URL+"/api/v1/alerts", testToken, nil, notify.ReasonFirstNotification, amAlerts(time.Time{})); v.Err() != nil {
		t.Fatalf("Alertmanager's notification: %v", v.Err())
	}
	if got := header.Get("Content-Type"); got != "application/json" {
		t.Errorf("Alertmanager sent Content-Type %q", got)
	}
	if header.Get("Origin") != "" || header.Get("Sec-Fetch-Site") != "" {
		t.Errorf("Alertmanager sent Origin %q, Sec-Fetch-Site %q", header.Get("Origin"), header.Get("Sec-Fetch-Site"))
	}
	if n := queueDepth(t, st); n != 1 {
		t.Errorf("queue %d, want 1", n)
	}
}
