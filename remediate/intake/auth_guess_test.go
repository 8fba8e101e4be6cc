package intake

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/alertmanager/notify"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// postAuthz posts an empty JSON object to url over real HTTP with an
// Authorization header (none if empty) and returns the status code.
func postAuthz(t *testing.T, url, authorization string) int {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader("{}"))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	if authorization != "" {
		req.Header.Set("Authorization", authorization)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// TestAuthCorrectTokenFromGuessingSource: 200 wrong tokens from one
// source block its failures, but not its correct token. Callers share
// source addresses (a cluster behind one SNAT address, Alertmanager behind
// a guesser's NAT), and a 429 is final for Alertmanager, so a correct
// credential is always admitted; only failures get 429.
func TestAuthCorrectTokenFromGuessingSource(t *testing.T) {
	const burst = 5
	cfg := tokenConfig(t)
	cfg.FailureBurst = burst
	cfg.FailuresPerMinute = 0.001 // nothing recovers during the test
	at := newAuthTest(t, cfg)
	srv := httptest.NewServer(at.h) // every request comes from 127.0.0.1
	defer srv.Close()
	url := srv.URL + "/api/v1/alerts"

	codes := map[int]int{}
	for i := range 200 {
		want := http.StatusUnauthorized
		if i >= burst {
			want = http.StatusTooManyRequests
		}
		code := postAuthz(t, url, "Bearer wrong-token-0123456789")
		if code != want {
			t.Fatalf("wrong token %d of 200: status %d, want %d (401 for the first %d, then 429)", i+1, code, want, burst)
		}
		codes[code]++
	}

	// The correct token from the blocked source reaches the next handler.
	if code := postAuthz(t, url, "Bearer "+testToken); code != http.StatusNoContent || at.served != 1 {
		t.Fatalf("blocked source, correct token: status %d, served %d; want the next handler's 204, served 1", code, at.served)
	}
	// The source is still blocked for failures, with or without a token.
	for _, authz := range []string{"Bearer wrong-token-again-0123456789", ""} {
		if code := postAuthz(t, url, authz); code != http.StatusTooManyRequests {
			t.Errorf("blocked source after a correct token, Authorization %q: status %d, want 429", authz, code)
		}
		codes[http.StatusTooManyRequests]++
	}
	if at.served != 1 {
		t.Errorf("the next handler ran %d times, want once", at.served)
	}
	// Only the 401s spent the budget and count as auth failures.
	if got := testutil.ToFloat64(at.metrics.AuthFailures); got != burst {
		t.Errorf("auth_failures_total = %v, want %d", got, burst)
	}
	if at.requests("401") != float64(codes[401]) || at.requests("429") != float64(codes[429]) {
		t.Errorf("requests_total 401 = %v, 429 = %v; want %d, %d", at.requests("401"), at.requests("429"), codes[401], codes[429])
	}
}

// TestAlertmanagerBehindGuessersAddress: Alertmanager 0.35's own webhook
// notifier shares a source address with a token guesser. After the
// guesser's 200 wrong tokens, Alertmanager's notification is still
// accepted and recorded; a notification with a wrong token gets a final
// 429.
func TestAlertmanagerBehindGuessersAddress(t *testing.T) {
	st, _ := openStore(t)
	m := newTestMetrics()
	auth, err := NewAuth(AuthConfig{TokenFile: writeFile(t, "token", testToken), FailuresPerMinute: 0.001}, m, discardLogger())
	if err != nil {
		t.Fatal(err)
	}
	h := NewHandler(Config{Recorder: st, Classify: gpuClassifier, Metrics: m, Logger: discardLogger()})
	srv := httptest.NewServer(auth.Wrap(h))
	defer srv.Close()
	target := srv.URL + "/api/v1/alerts"

	for i := range 200 {
		postAuthz(t, target, "Bearer guess-0123456789-"+string(rune('a'+i%26)))
	}
	if code := postAuthz(t, target, "Bearer guess-0123456789"); code != http.StatusTooManyRequests {
		t.Fatalf("the guesser is not blocked: status %d, want 429", code)
	}

	v := amNotify(t, target, testToken, nil, notify.ReasonFirstNotification, amAlerts(time.Time{}))
	if v.Err() != nil {
		t.Fatalf("Alertmanager's notification from the guesser's address: %v, want accepted", v.Err())
	}
	if n := queueDepth(t, st); n != 1 {
		t.Errorf("queue %d, want GPU 3's action queued", n)
	}

	v = amNotify(t, target, "wrong-token-0123456789", nil, notify.ReasonFirstNotification, amAlerts(time.Time{}))
	if v.Err() == nil || v.ShouldRetry() || !strings.Contains(v.Err().Error(), "429") {
		t.Errorf("wrong token from the blocked address: err %v, retry %v; want a final 429", v.Err(), v.ShouldRetry())
	}
}
