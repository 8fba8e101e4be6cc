package intake

import (
	"bytes"
	"context"
	"flag"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/alertmanager/alert"
	amcommoncfg "github.com/prometheus/alertmanager/config/common"
	"github.com/prometheus/alertmanager/notify"
	"github.com/prometheus/alertmanager/notify/webhook"
	"github.com/prometheus/alertmanager/template"
	commoncfg "github.com/prometheus/common/config"
	"github.com/prometheus/common/model"
)

var update = flag.Bool("update", false, "rewrite testdata/alertmanager-0.35-*.json from what Alertmanager 0.35's webhook notifier sends")

// The alerts of testdata/alertmanager-0.25-*.json, as Alertmanager holds
// them: the same labels give the same fingerprints in every version.
var (
	amStartsAt   = time.Date(2026, 11, 30, 11, 10, 55, 0, time.UTC)
	amResolvedAt = time.Date(2026, 11, 30, 11, 16, 3, 0, time.UTC)
	amGroupKey   = `{}:{alertname="GPUOrphanMemory", instance="node-a:9835"}`
)

func amAlerts(endsAt time.Time) []*alert.Alert {
	mk := func(labels, annotations model.LabelSet) *alert.Alert {
		return alert.New(model.Alert{
			Labels: labels, Annotations: annotations, StartsAt: amStartsAt, EndsAt: endsAt,
			GeneratorURL: "http://prometheus.example:9090/graph?g0.expr=gpu_orphan",
		}, amStartsAt, false)
	}
	return []*alert.Alert{
		mk(model.LabelSet{"alertname": "GPUOrphanMemory", "gpu": "0", "instance": "node-a:9835", "node": "node-a",
			"severity": "critical", "uuid": "GPU-aaaaaaaa-0000-1111-2222-333344445555"},
			model.LabelSet{"summary": "GPU 0"}),
		mk(model.LabelSet{"alertname": "GPUOrphanMemory", "gpu": "3", "instance": "node-a:9835", "node": "node-a",
			"severity": "critical", "uuid": "GPU-5f3a1c2e-0000-1111-2222-333344445555",
			"evil_path": "../../etc/passwd", "evil_tmpl": "{{.Node}}", "evil_shell": "$(rm -rf /); `id`", "evil_nl": "line1\nline2"},
			model.LabelSet{"summary": "GPU 3 on node-a holds 6 GiB owned by dead processes", "runbook_url": "https://example.com/runbooks/GPUOrphanMemory"}),
	}
}

// amNotify sends alerts to target through Alertmanager 0.35's own webhook
// notifier, configured as a user would: a bearer token from a
// credentials_file, and optionally a custom payload.
func amNotify(t *testing.T, target, token string, payload any, reason notify.NotifyReason, alerts []*alert.Alert) notify.NotifyVerdict {
	t.Helper()
	tmpl, err := template.FromGlobs(nil)
	if err != nil {
		t.Fatal(err)
	}
	if tmpl.ExternalURL, err = url.Parse("http://alertmanager.example:9093"); err != nil {
		t.Fatal(err)
	}
	n, err := webhook.New(&webhook.WebhookConfig{
		URL: amcommoncfg.SecretTemplateURL(target),
		HTTPConfig: &commoncfg.HTTPClientConfig{
			Authorization: &commoncfg.Authorization{Type: "Bearer", CredentialsFile: writeFile(t, "token", token+"\n")},
		},
		Timeout: 5 * time.Second,
		Payload: payload,
	}, tmpl, discardLogger())
	if err != nil {
		t.Fatal(err)
	}
	ctx := notify.WithGroupKey(context.Background(), amGroupKey)
	ctx = notify.WithReceiverName(ctx, "gpu-orphan")
	ctx = notify.WithGroupLabels(ctx, model.LabelSet{"alertname": "GPUOrphanMemory", "instance": "node-a:9835"})
	ctx = notify.WithNotificationReason(ctx, reason)
	return n.Notify(ctx, alerts...)
}

// capture keeps the bodies a handler was sent.
type capture struct {
	mu     sync.Mutex
	bodies [][]byte
	next   http.Handler
}

func (c *capture) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	b, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	c.mu.Lock()
	c.bodies = append(c.bodies, b)
	c.mu.Unlock()
	r.Body = io.NopCloser(bytes.NewReader(b))
	c.next.ServeHTTP(w, r)
}

func (c *capture) last(t *testing.T) []byte {
	t.Helper()
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.bodies) == 0 {
		t.Fatal("the notifier sent nothing")
	}
	return c.bodies[len(c.bodies)-1]
}

// golden compares body with a fixture, or rewrites it with -update.
func golden(t *testing.T, name string, body []byte) {
	t.Helper()
	path := filepath.Join("testdata", name)
	if *update {
		if err := os.WriteFile(path, body, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(body, want) {
		t.Errorf("Alertmanager 0.35 now sends\n%s\nnot %s as in %s: check the payload, then run go test -run TestAlertmanager035Notifier -update", body, want, path)
	}
}

// TestAlertmanager035Notifier drives the real thing: Alertmanager 0.35's
// webhook notifier (the alertmanager module this repository builds with)
// posts to Auth + Handler + a real store, and its retry verdicts show that
// the status codes mean to Alertmanager what intake intends.
func TestAlertmanager035Notifier(t *testing.T) {
	st, _ := openStore(t)
	m := newTestMetrics()
	auth, err := NewAuth(AuthConfig{TokenFile: writeFile(t, "token", testToken)}, m, discardLogger())
	if err != nil {
		t.Fatal(err)
	}
	wakes := 0
	h := NewHandler(Config{Recorder: st, Classify: gpuClassifier, Wake: func() { wakes++ }, Metrics: m, Logger: discardLogger()})
	c := &capture{next: auth.Wrap(h)}
	srv := httptest.NewServer(c)
	defer srv.Close()
	target := srv.URL + "/api/v1/alerts"

	// First notification: GPU 3's alert is queued, GPU 0's ignored.
	v := amNotify(t, target, testToken, nil, notify.ReasonFirstNotification, amAlerts(time.Time{}))
	if v.Err() != nil {
		t.Fatalf("first notification: %v", v.Err())
	}
	body := c.last(t)
	golden(t, "alertmanager-0.35-firing.json", body)
	msg, err := ParseMessage(body)
	if err != nil {
		t.Fatalf("what Alertmanager 0.35 sent was rejected: %v", err)
	}
	if msg.NotificationReason != "first notification" || msg.Alerts[0].Fingerprint != "bb28e4793b3159a9" || msg.Alerts[1].Fingerprint != "50f2f5aaad1375f4" {
		t.Errorf("unexpected 0.35 payload: reason %q, fingerprints %s %s", msg.NotificationReason, msg.Alerts[0].Fingerprint, msg.Alerts[1].Fingerprint)
	}
	if n := queueDepth(t, st); n != 1 || wakes != 1 {
		t.Fatalf("after the first notification: queue %d, wakes %d; want 1, 1", n, wakes)
	}

	// The repeat (or an HA peer's copy) is a success, and no new work.
	if v := amNotify(t, target, testToken, nil, notify.ReasonRepeatIntervalElapsed, amAlerts(time.Time{})); v.Err() != nil {
		t.Fatalf("repeated notification: %v", v.Err())
	}
	if d, err := st.Duplicates(context.Background()); err != nil || d != 2 {
		t.Errorf("duplicates %d (%v), want 2", d, err)
	}
	if n := queueDepth(t, st); n != 1 || wakes != 1 {
		t.Errorf("after the repeat: queue %d, wakes %d; want 1, 1", n, wakes)
	}

	// A wrong token is final: retrying cannot fix it.
	v = amNotify(t, target, "wrong-token-0123456789", nil, notify.ReasonFirstNotification, amAlerts(time.Time{}))
	if v.Err() == nil || v.ShouldRetry() || !strings.Contains(v.Err().Error(), "401") {
		t.Errorf("wrong token: err %v, retry %v; want a final 401", v.Err(), v.ShouldRetry())
	}

	// A custom payload (webhook_config.payload) is not the version 4
	// contract: 400, final, and the reply says why.
	v = amNotify(t, target, testToken, map[string]any{"text": "{{ .Status }}"}, notify.ReasonFirstNotification, amAlerts(time.Time{}))
	if v.Err() == nil || v.ShouldRetry() || !strings.Contains(v.Err().Error(), "400") || !strings.Contains(v.Err().Error(), `unsupported payload version ""`) {
		t.Errorf("custom payload: err %v, retry %v; want a final 400 that says why", v.Err(), v.ShouldRetry())
	}

	// All resolved: GPU 3's queued action is cancelled.
	if v := amNotify(t, target, testToken, nil, notify.ReasonAllAlertsResolved, amAlerts(amResolvedAt)); v.Err() != nil {
		t.Fatalf("resolved notification: %v", v.Err())
	}
	golden(t, "alertmanager-0.35-resolved.json", c.last(t))
	if n := queueDepth(t, st); n != 0 || wakes != 2 {
		t.Errorf("after resolving: queue %d, wakes %d; want 0, 2", n, wakes)
	}

	// A store that cannot record: 503, which Alertmanager retries.
	failing := NewHandler(Config{Recorder: failingRecorder{}, Classify: gpuClassifier, Metrics: m, Logger: discardLogger()})
	srv2 := httptest.NewServer(auth.Wrap(failing))
	defer srv2.Close()
	v = amNotify(t, srv2.URL+"/api/v1/alerts", testToken, nil, notify.ReasonFirstNotification, amAlerts(time.Time{}))
	if v.Err() == nil || !v.ShouldRetry() || !strings.Contains(v.Err().Error(), "503") {
		t.Errorf("failing store: err %v, retry %v; want a 503 to retry", v.Err(), v.ShouldRetry())
	}
}
