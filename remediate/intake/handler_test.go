package intake

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"io"
	"maps"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"testing/iotest"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

// failingRecorder fails as a full disk or a locked database would.
type failingRecorder struct{}

func (failingRecorder) RecordNotification(context.Context, store.Notification) ([]store.AlertOutcome, error) {
	return nil, errors.New("database is locked")
}

// spyRecorder keeps what it was asked to record, and passes it on to next
// when there is one.
type spyRecorder struct {
	mu   sync.Mutex
	got  []store.Notification
	next Recorder
}

func (s *spyRecorder) RecordNotification(ctx context.Context, n store.Notification) ([]store.AlertOutcome, error) {
	s.mu.Lock()
	s.got = append(s.got, n)
	s.mu.Unlock()
	if s.next == nil {
		out := make([]store.AlertOutcome, 0, len(n.Alerts))
		for _, a := range n.Alerts {
			out = append(out, store.AlertOutcome{Fingerprint: a.Fingerprint, StartsAt: a.StartsAt, Result: store.ResultIgnored, Reason: "spy"})
		}
		return out, nil
	}
	return s.next.RecordNotification(ctx, n)
}

func (s *spyRecorder) calls() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.got)
}

type handlerTest struct {
	h       *Handler
	metrics *remediate.Metrics
	mu      sync.Mutex
	wakes   int
}

func newHandlerTest(rec Recorder, maxBody int64) *handlerTest {
	ht := &handlerTest{metrics: newTestMetrics()}
	ht.h = NewHandler(Config{
		Recorder: rec, Classify: gpuClassifier, MaxBodyBytes: maxBody,
		Wake:    func() { ht.mu.Lock(); ht.wakes++; ht.mu.Unlock() },
		Metrics: ht.metrics, Logger: discardLogger(),
	})
	return ht
}

func (ht *handlerTest) woken() int {
	ht.mu.Lock()
	defer ht.mu.Unlock()
	return ht.wakes
}

func (ht *handlerTest) post(t *testing.T, contentType, body string) *httptest.ResponseRecorder {
	t.Helper()
	return ht.do(t, newPost(contentType, body))
}

func (ht *handlerTest) do(t *testing.T, r *http.Request) *httptest.ResponseRecorder {
	t.Helper()
	w := httptest.NewRecorder()
	ht.h.ServeHTTP(w, r)
	return w
}

func newPost(contentType, body string) *http.Request {
	r := httptest.NewRequest(http.MethodPost, "/api/v1/alerts", strings.NewReader(body))
	if contentType != "" {
		r.Header.Set("Content-Type", contentType)
	}
	r.RemoteAddr = "192.0.2.7:40123"
	return r
}

func (ht *handlerTest) requests(code string) float64 {
	return testutil.ToFloat64(ht.metrics.Requests.WithLabelValues(code))
}

func (ht *handlerTest) notifications(result string) float64 {
	return testutil.ToFloat64(ht.metrics.Notifications.WithLabelValues(result))
}

// wantError checks an error reply: its code, and a plain-text body that
// says what was wrong.
func wantError(t *testing.T, w *httptest.ResponseRecorder, code int, says string) {
	t.Helper()
	if w.Code != code {
		t.Fatalf("status %d, want %d; body %q", w.Code, code, w.Body)
	}
	if ct := w.Header().Get("Content-Type"); !strings.HasPrefix(ct, "text/plain") {
		t.Errorf("error reply has Content-Type %q, want text/plain", ct)
	}
	if !strings.Contains(w.Body.String(), says) {
		t.Errorf("body %q does not say %q", w.Body, says)
	}
}

func readReply(t *testing.T, w *httptest.ResponseRecorder) Reply {
	t.Helper()
	if w.Code != http.StatusOK {
		t.Fatalf("status %d, want 200; body %q", w.Code, w.Body)
	}
	if ct := w.Header().Get("Content-Type"); ct != "application/json" {
		t.Errorf("reply Content-Type %q", ct)
	}
	var r Reply
	dec := json.NewDecoder(w.Body)
	dec.DisallowUnknownFields()
	if err := dec.Decode(&r); err != nil {
		t.Fatalf("decoding the reply: %v", err)
	}
	if r.Received != len(r.Alerts) {
		t.Errorf("reply says %d received with %d outcomes", r.Received, len(r.Alerts))
	}
	return r
}

func fixture(t testing.TB, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", name))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestHandlerContentType(t *testing.T) {
	body := mustJSON(t, validPayload())
	for _, tc := range []struct {
		contentType string
		code        int
	}{
		{"application/json", http.StatusOK},
		{"application/json; charset=utf-8", http.StatusOK},
		{"Application/JSON", http.StatusOK},
		{"", http.StatusUnsupportedMediaType},
		{"text/plain", http.StatusUnsupportedMediaType},
		{"application/x-www-form-urlencoded", http.StatusUnsupportedMediaType},
		{"multipart/form-data; boundary=x", http.StatusUnsupportedMediaType},
		{"application/jsonx", http.StatusUnsupportedMediaType},
		{"application/json; charset", http.StatusUnsupportedMediaType},
		{"application/json, text/plain", http.StatusUnsupportedMediaType},
	} {
		t.Run(tc.contentType, func(t *testing.T) {
			spy := &spyRecorder{}
			ht := newHandlerTest(spy, 0)
			w := ht.post(t, tc.contentType, body)
			if tc.code == http.StatusOK {
				readReply(t, w)
				return
			}
			wantError(t, w, tc.code, "Content-Type must be application/json")
			if spy.calls() != 0 {
				t.Errorf("recorder called for a request with Content-Type %q", tc.contentType)
			}
			if got := ht.requests("415"); got != 1 {
				t.Errorf("requests_total{code=415} = %v, want 1", got)
			}
		})
	}
}

func TestHandlerBodySize(t *testing.T) {
	const limit = 2048
	valid := mustJSON(t, validPayload())
	pad := func(n int) string { return valid + strings.Repeat(" ", n-len(valid)) }

	spy := &spyRecorder{}
	ht := newHandlerTest(spy, limit)
	// Exactly at the limit: read whole and accepted (trailing blanks are
	// allowed after the object).
	readReply(t, ht.post(t, "application/json", pad(limit)))

	w := ht.post(t, "application/json", pad(limit+1))
	wantError(t, w, http.StatusRequestEntityTooLarge, "payload larger than 2048 bytes")
	w = ht.post(t, "application/json", pad(10*limit))
	wantError(t, w, http.StatusRequestEntityTooLarge, "payload larger than 2048 bytes")
	if spy.calls() != 1 {
		t.Errorf("recorder called %d times, want once (for the body at the limit)", spy.calls())
	}
	if got := ht.requests("413"); got != 2 {
		t.Errorf("requests_total{code=413} = %v, want 2", got)
	}

	// Without a limit configured, 1 MiB applies.
	ht = newHandlerTest(&spyRecorder{}, 0)
	wantError(t, ht.post(t, "application/json", pad(1<<20+1)), http.StatusRequestEntityTooLarge, "payload larger than 1048576 bytes")
	readReply(t, ht.post(t, "application/json", pad(1<<20)))
}

func TestHandlerBadPayload(t *testing.T) {
	for _, tc := range []struct {
		name, body, says string
	}{
		{"malformed JSON", `{"version": "4", "alerts": [`, "invalid JSON payload"},
		{"not JSON", "hello", "invalid JSON payload"},
		{"empty body", "", "invalid JSON payload"},
		{"wrong version", with(t, func(p map[string]any) { p["version"] = "3" }), `unsupported payload version "3"`},
		{"known field of the wrong type", with(t, func(p map[string]any) { p["foo"] = 1; p["status"] = 1 }), "invalid JSON payload"},
		{"no alerts", with(t, func(p map[string]any) { p["alerts"] = []any{} }), "payload has no alerts"},
		{"bad fingerprint", withAlert(t, func(a map[string]any) { a["fingerprint"] = "nope" }), `alert 0: invalid fingerprint "nope"`},
		{"zero startsAt", withAlert(t, func(a map[string]any) { delete(a, "startsAt") }), "alert 0: missing startsAt"},
		{"trailing data", mustJSON(t, validPayload()) + "{}", "data after the top-level object"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			spy := &spyRecorder{}
			ht := newHandlerTest(spy, 0)
			wantError(t, ht.post(t, "application/json", tc.body), http.StatusBadRequest, tc.says)
			if spy.calls() != 0 || ht.woken() != 0 {
				t.Errorf("a rejected payload reached the recorder (%d) or woke the engine (%d)", spy.calls(), ht.woken())
			}
			if ht.requests("400") != 1 || ht.notifications("rejected") != 1 {
				t.Errorf("requests_total{code=400} = %v, notifications_total{result=rejected} = %v; want 1, 1",
					ht.requests("400"), ht.notifications("rejected"))
			}
		})
	}

	t.Run("unreadable body", func(t *testing.T) {
		ht := newHandlerTest(&spyRecorder{}, 0)
		r := newPost("application/json", "")
		r.Body = io.NopCloser(iotest.ErrReader(errors.New("connection reset by peer")))
		wantError(t, ht.do(t, r), http.StatusBadRequest, "reading the body: connection reset by peer")
	})
}

func TestHandlerRecorderFails(t *testing.T) {
	ht := newHandlerTest(failingRecorder{}, 0)
	w := ht.post(t, "application/json", fixture(t, "alertmanager-0.25-firing.json"))
	wantError(t, w, http.StatusServiceUnavailable, "could not record the notification durably: database is locked")
	if ht.woken() != 0 {
		t.Errorf("Wake called %d times after a failed recording", ht.woken())
	}
	if ht.requests("503") != 1 {
		t.Errorf("requests_total{code=503} = %v, want 1", ht.requests("503"))
	}
	for _, r := range []string{"accepted", "duplicate", "ignored", "resolved", "rejected"} {
		if n := ht.notifications(r); n != 0 {
			t.Errorf("notifications_total{result=%s} = %v after a failed recording, want 0", r, n)
		}
	}
}

// rawDB opens the store's file beside the store, to look at what it holds
// or to make it fail. It knows the store's table names.
func rawDB(t *testing.T, path string) *sql.DB {
	t.Helper()
	db, err := sql.Open("sqlite", "file:"+path+"?_pragma=busy_timeout(5000)")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return db
}

func count(t *testing.T, db *sql.DB, table string) int {
	t.Helper()
	var n int
	if err := db.QueryRow("SELECT count(*) FROM " + table).Scan(&n); err != nil {
		t.Fatalf("counting %s: %v", table, err)
	}
	return n
}

// TestHandlerStoreFailsMidway makes the real store fail after it has
// written the notification, the alerts and the action, but before it
// commits: the reply is 503 and nothing at all is left recorded, so
// Alertmanager's retry starts from scratch and is not a "duplicate".
func TestHandlerStoreFailsMidway(t *testing.T) {
	st, path := openStore(t)
	db := rawDB(t, path)
	if _, err := db.Exec(`CREATE TRIGGER fail_deliveries BEFORE INSERT ON deliveries BEGIN SELECT RAISE(ABORT, 'disk on fire'); END`); err != nil {
		t.Fatal(err)
	}
	ht := newHandlerTest(st, 0)
	body := fixture(t, "alertmanager-0.25-firing.json")
	wantError(t, ht.post(t, "application/json", body), http.StatusServiceUnavailable, "disk on fire")
	if n := queueDepth(t, st); n != 0 {
		t.Errorf("queue depth %d after a failed recording, want 0", n)
	}
	for _, table := range []string{"notifications", "alerts", "actions", "deliveries"} {
		if n := count(t, db, table); n != 0 {
			t.Errorf("%d rows in %s after a failed recording, want 0", n, table)
		}
	}
	if ht.woken() != 0 {
		t.Errorf("Wake called after a failed recording")
	}

	// Alertmanager retries; now the store works.
	if _, err := db.Exec(`DROP TRIGGER fail_deliveries`); err != nil {
		t.Fatal(err)
	}
	r := readReply(t, ht.post(t, "application/json", body))
	if !maps.Equal(r.Results, map[string]int{"accepted": 1, "ignored": 1}) {
		t.Errorf("the retry's results %v, want one accepted and one ignored", r.Results)
	}
	if n := queueDepth(t, st); n != 1 || ht.woken() != 1 {
		t.Errorf("after the retry: queue %d, wakes %d; want 1, 1", n, ht.woken())
	}
}

func TestHandlerStoreUnavailable(t *testing.T) {
	body := fixture(t, "alertmanager-0.25-firing.json")

	t.Run("closed store", func(t *testing.T) {
		st, path := openStore(t)
		st.Close()
		ht := newHandlerTest(st, 0)
		wantError(t, ht.post(t, "application/json", body), http.StatusServiceUnavailable, "could not record the notification durably")
		reopened, err := store.Open(context.Background(), path)
		if err != nil {
			t.Fatal(err)
		}
		defer reopened.Close()
		if n := queueDepth(t, reopened); n != 0 {
			t.Errorf("queue depth %d, want 0", n)
		}
	})

	t.Run("request cancelled", func(t *testing.T) {
		// Alertmanager's timeout ended the request: nothing recorded.
		st, _ := openStore(t)
		ht := newHandlerTest(st, 0)
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		w := ht.do(t, newPost("application/json", body).WithContext(ctx))
		wantError(t, w, http.StatusServiceUnavailable, "could not record the notification durably")
		if n := queueDepth(t, st); n != 0 {
			t.Errorf("queue depth %d, want 0", n)
		}
	})
}

// TestHandlerRealStore replays what Alertmanager 0.25 sent for one group,
// from first notification to resolution, into a real store.
func TestHandlerRealStore(t *testing.T) {
	st, path := openStore(t)
	ht := newHandlerTest(st, 0)
	const (
		fpGPU0 = "bb28e4793b3159a9" // ignored: not a GPU of this node
		fpGPU3 = "50f2f5aaad1375f4" // a candidate
	)
	steps := []struct {
		fixture string
		results map[string]int
		// per alert, in payload order
		outcomes   []string
		wakes      int
		queueDepth int
	}{
		{"alertmanager-0.25-firing.json", map[string]int{"ignored": 1, "accepted": 1}, []string{"ignored", "accepted"}, 1, 1},
		// Alertmanager's retry, or its HA peer's copy.
		{"alertmanager-0.25-firing.json", map[string]int{"duplicate": 2}, []string{"duplicate", "duplicate"}, 1, 1},
		// GPU 3's alert resolves while its action is still queued.
		{"alertmanager-0.25-partly-resolved.json", map[string]int{"duplicate": 1, "resolved": 1}, []string{"duplicate", "resolved"}, 2, 0},
		{"alertmanager-0.25-resolved.json", map[string]int{"resolved": 1, "duplicate": 1}, []string{"resolved", "duplicate"}, 3, 0},
	}
	var actionID string
	for i, s := range steps {
		r := readReply(t, ht.post(t, "application/json", fixture(t, s.fixture)))
		if !maps.Equal(r.Results, s.results) {
			t.Errorf("step %d (%s): results %v, want %v", i, s.fixture, r.Results, s.results)
		}
		for j, o := range r.Alerts {
			if o.Result != s.outcomes[j] {
				t.Errorf("step %d: alert %d (%s) %s, want %s", i, j, o.Fingerprint, o.Result, s.outcomes[j])
			}
		}
		if got := ht.woken(); got != s.wakes {
			t.Errorf("step %d: Wake called %d times in all, want %d", i, got, s.wakes)
		}
		if n := queueDepth(t, st); n != s.queueDepth {
			t.Errorf("step %d: queue depth %d, want %d", i, n, s.queueDepth)
		}
		if i == 0 {
			ign, acc := r.Alerts[0], r.Alerts[1]
			if ign.Fingerprint != fpGPU0 || ign.Reason != "uuid names no GPU of this node" || ign.ActionID != "" {
				t.Errorf("ignored outcome %+v", ign)
			}
			if acc.Fingerprint != fpGPU3 || acc.ActionID == "" || acc.Reason != "" || !acc.StartsAt.Equal(amStartsAt) {
				t.Errorf("accepted outcome %+v", acc)
			}
			actionID = acc.ActionID
		}
		if i == 1 && r.Alerts[1].ActionID != actionID {
			t.Errorf("duplicate names action %q, want %q", r.Alerts[1].ActionID, actionID)
		}
	}

	for result, want := range map[string]float64{"accepted": 1, "ignored": 1, "duplicate": 4, "resolved": 2, "rejected": 0} {
		if got := ht.notifications(result); got != want {
			t.Errorf("notifications_total{result=%s} = %v, want %v", result, got, want)
		}
	}
	if got := ht.requests("200"); got != 4 {
		t.Errorf("requests_total{code=200} = %v, want 4", got)
	}

	// The one action: queued by the first delivery, cancelled by the
	// resolution before any worker claimed it.
	act, err := st.Action(context.Background(), actionID)
	if err != nil {
		t.Fatal(err)
	}
	if act.Node != "node-a" || act.GPUUUID != "GPU-5f3a1c2e-0000-1111-2222-333344445555" || act.GPUIndex != 3 ||
		act.AlertFingerprint != fpGPU3 || !act.AlertStartsAt.Equal(amStartsAt) || act.Source != "webhook" {
		t.Errorf("action %+v", act)
	}
	if act.State != remediate.StateSkipped || act.Reason != store.ReasonResolvedBeforeAction {
		t.Errorf("action state %s (%s), want %s (%s)", act.State, act.Reason, remediate.StateSkipped, store.ReasonResolvedBeforeAction)
	}

	// The classifier's reason is in the audit log, and the hostile label
	// values are stored as they came.
	db := rawDB(t, path)
	var reason string
	var candidate bool
	if err := db.QueryRow(`SELECT ignore_reason, candidate FROM alerts WHERE fingerprint = ?`, fpGPU0).Scan(&reason, &candidate); err != nil {
		t.Fatal(err)
	}
	if reason != "uuid names no GPU of this node" || candidate {
		t.Errorf("GPU 0's alert recorded with reason %q, candidate %v", reason, candidate)
	}
	var labelsJSON string
	if err := db.QueryRow(`SELECT labels_json FROM alerts WHERE fingerprint = ?`, fpGPU3).Scan(&labelsJSON); err != nil {
		t.Fatal(err)
	}
	var labels map[string]string
	if err := json.Unmarshal([]byte(labelsJSON), &labels); err != nil {
		t.Fatal(err)
	}
	if labels["evil_path"] != "../../etc/passwd" || labels["evil_tmpl"] != "{{.Node}}" || labels["evil_shell"] != "$(rm -rf /); `id`" || labels["evil_nl"] != "line1\nline2" {
		t.Errorf("labels stored as %v", labels)
	}
	if n := count(t, db, "notifications"); n != 4 {
		t.Errorf("%d notifications recorded, want 4", n)
	}
}

// TestHandlerNotification checks what the handler asks the recorder to
// record: the sender, the group, and each alert with its classification.
func TestHandlerNotification(t *testing.T) {
	st, _ := openStore(t)
	spy := &spyRecorder{next: st}
	ht := newHandlerTest(spy, 0)
	before := time.Now()
	readReply(t, ht.post(t, "application/json", fixture(t, "alertmanager-0.25-partly-resolved.json")))
	if spy.calls() != 1 {
		t.Fatalf("recorder called %d times, want 1", spy.calls())
	}
	n := spy.got[0]
	if n.Remote != "192.0.2.7" || n.Receiver != "gpu-orphan" || n.GroupKey != amGroupKey || n.Status != "firing" {
		t.Errorf("notification %+v", n)
	}
	if n.ReceivedAt.Before(before) || n.ReceivedAt.After(time.Now()) {
		t.Errorf("ReceivedAt %s is not the time of the request", n.ReceivedAt)
	}
	if len(n.Alerts) != 2 {
		t.Fatalf("%d alerts, want 2", len(n.Alerts))
	}
	a0, a1 := n.Alerts[0], n.Alerts[1]
	if a0.Fingerprint != "bb28e4793b3159a9" || a0.Status != "firing" || a0.Candidate || a0.IgnoreReason != "uuid names no GPU of this node" ||
		a0.Node != "node-a" || a0.GPUUUID != "GPU-aaaaaaaa-0000-1111-2222-333344445555" || !a0.EndsAt.IsZero() {
		t.Errorf("alert 0: %+v", a0)
	}
	if a1.Fingerprint != "50f2f5aaad1375f4" || a1.Status != "resolved" || !a1.Candidate || a1.IgnoreReason != "" ||
		a1.Node != "node-a" || a1.GPUUUID != "GPU-5f3a1c2e-0000-1111-2222-333344445555" ||
		!a1.StartsAt.Equal(amStartsAt) || !a1.EndsAt.After(amStartsAt) || a1.Labels["evil_tmpl"] != "{{.Node}}" {
		t.Errorf("alert 1: %+v", a1)
	}
	// A resolved alert first seen resolved still wakes the engine.
	if ht.woken() != 1 {
		t.Errorf("Wake called %d times, want 1", ht.woken())
	}
}

// TestHandlerWake checks that only accepted or resolved alerts wake the
// engine: ignored and duplicate ones bring no work.
func TestHandlerWake(t *testing.T) {
	for _, tc := range []struct {
		results []string
		wake    bool
	}{
		{[]string{"ignored"}, false},
		{[]string{"duplicate", "ignored"}, false},
		{[]string{"accepted"}, true},
		{[]string{"resolved"}, true},
		{[]string{"ignored", "duplicate", "resolved"}, true},
	} {
		t.Run(strings.Join(tc.results, "+"), func(t *testing.T) {
			rec := recorderFunc(func(_ context.Context, n store.Notification) ([]store.AlertOutcome, error) {
				var out []store.AlertOutcome
				for i, r := range tc.results {
					out = append(out, store.AlertOutcome{Fingerprint: n.Alerts[0].Fingerprint + string(rune('0'+i)), Result: r})
				}
				return out, nil
			})
			ht := newHandlerTest(rec, 0)
			r := readReply(t, ht.post(t, "application/json", mustJSON(t, validPayload())))
			if (ht.woken() == 1) != tc.wake || ht.woken() > 1 {
				t.Errorf("Wake called %d times, want wake=%v", ht.woken(), tc.wake)
			}
			want := map[string]int{}
			for _, res := range tc.results {
				want[res]++
			}
			if !maps.Equal(r.Results, want) || r.Received != len(tc.results) {
				t.Errorf("reply results %v (received %d), want %v", r.Results, r.Received, want)
			}
			for res, n := range want {
				if got := ht.notifications(res); got != float64(n) {
					t.Errorf("notifications_total{result=%s} = %v, want %d", res, got, n)
				}
			}
		})
	}
}

type recorderFunc func(context.Context, store.Notification) ([]store.AlertOutcome, error)

func (f recorderFunc) RecordNotification(ctx context.Context, n store.Notification) ([]store.AlertOutcome, error) {
	return f(ctx, n)
}

// TestHandlerDefaults: without Wake the handler still answers; without a
// limit, 1 MiB applies (see TestHandlerBodySize).
func TestHandlerDefaults(t *testing.T) {
	rec := recorderFunc(func(_ context.Context, n store.Notification) ([]store.AlertOutcome, error) {
		return []store.AlertOutcome{{Fingerprint: n.Alerts[0].Fingerprint, StartsAt: n.Alerts[0].StartsAt, Result: store.ResultAccepted, ActionID: "a1"}}, nil
	})
	m := newTestMetrics()
	h := NewHandler(Config{Recorder: rec, Classify: gpuClassifier, Metrics: m, Logger: discardLogger()})
	w := httptest.NewRecorder()
	h.ServeHTTP(w, newPost("application/json", mustJSON(t, validPayload())))
	r := readReply(t, w)
	if r.Results["accepted"] != 1 || r.Alerts[0].ActionID != "a1" || r.Alerts[0].Fingerprint != "50f2f5aaad1375f4" {
		t.Errorf("reply %+v", r)
	}
	if got := testutil.ToFloat64(m.Requests.WithLabelValues("200")); got != 1 {
		t.Errorf("requests_total{code=200} = %v, want 1", got)
	}
}
