package intake

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
)

// TestAlertmanagerAddsAField: a version 4 payload from a newer
// Alertmanager, with fields this receiver does not know at the top level
// and in an alert, is recorded over real HTTP (a 4xx would be final for
// Alertmanager and stop remediation silently). The known fields stay
// strict: one of the wrong type is still a 400.
func TestAlertmanagerAddsAField(t *testing.T) {
	var p map[string]any
	if err := json.Unmarshal([]byte(fixture(t, "alertmanager-0.35-firing.json")), &p); err != nil {
		t.Fatal(err)
	}
	p["futureField"] = map[string]any{"added": "in a later Alertmanager"}
	p["alerts"].([]any)[0].(map[string]any)["silencedBy"] = []any{"x"}
	body, err := json.Marshal(p)
	if err != nil {
		t.Fatal(err)
	}
	st, _ := openStore(t)
	m := newTestMetrics()
	srv := httptest.NewServer(NewHandler(Config{Recorder: st, Classify: gpuClassifier, Metrics: m, Logger: discardLogger()}))
	defer srv.Close()

	resp, err := http.Post(srv.URL, "application/json", strings.NewReader(string(body)))
	if err != nil {
		t.Fatal(err)
	}
	var reply Reply
	err = json.NewDecoder(resp.Body).Decode(&reply)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || err != nil || reply.Received != 2 || reply.Results["accepted"] != 1 {
		t.Fatalf("a payload with an extra field: %d %+v (%v); want 200 with one alert accepted", resp.StatusCode, reply, err)
	}
	if n := queueDepth(t, st); n != 1 {
		t.Errorf("queue %d, want 1", n)
	}

	p["truncatedAlerts"] = "none"
	body, _ = json.Marshal(p)
	resp, err = http.Post(srv.URL, "application/json", strings.NewReader(string(body)))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadRequest {
		t.Errorf("a known field of the wrong type: %d, want 400", resp.StatusCode)
	}
}

// TestHandlerRejects: an alert the Rejecter refuses is recorded as
// rejected (not ignored, not work), and counted so.
func TestHandlerRejects(t *testing.T) {
	st, _ := openStore(t)
	m := newTestMetrics()
	h := NewHandler(Config{Recorder: st, Classify: gpuClassifier, Metrics: m, Logger: discardLogger(),
		Reject: func(labels map[string]string) string {
			if labels["uuid"] != "GPU-5f3a1c2e-0000-1111-2222-333344445555" {
				return "on no allow-list"
			}
			return ""
		}})
	srv := httptest.NewServer(h)
	defer srv.Close()
	resp, err := http.Post(srv.URL, "application/json", strings.NewReader(fixture(t, "alertmanager-0.35-firing.json")))
	if err != nil {
		t.Fatal(err)
	}
	var reply Reply
	err = json.NewDecoder(resp.Body).Decode(&reply)
	resp.Body.Close()
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("%d %v", resp.StatusCode, err)
	}
	if reply.Results["rejected"] != 1 || reply.Results["accepted"] != 1 {
		t.Errorf("results %v, want one rejected and one accepted", reply.Results)
	}
	if v := testutil.ToFloat64(m.Notifications.WithLabelValues("rejected")); v != 1 {
		t.Errorf("notifications_total{result=rejected} = %v, want 1", v)
	}
	for _, o := range reply.Alerts {
		if o.Result == "rejected" && (o.ActionID != "" || o.Reason != "on no allow-list") {
			t.Errorf("rejected alert %+v", o)
		}
	}
}
