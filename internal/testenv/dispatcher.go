package testenv

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// The dispatcher's tests, in its packages and against a real
// kube-apiserver (test/kubernetes), share these: a node agent that
// answers as the test says, Alertmanager's webhook, and the dispatcher's
// actions. This package may not import remediate/ (cmd/imports_test.go:
// internal/ is below it), so the actions' type is the caller's.

// AgentRequest is a request as a FakeAgent got it.
type AgentRequest struct {
	Method, Path string
	// Auth is the Authorization header (the dispatcher signs each request
	// for its node).
	Auth string
	// Node is the node label of the webhook's alert; "" for the other
	// requests.
	Node string
}

// FakeAgent stands for a node agent (gpu-orphan-remediator) at a real
// listener: it answers each webhook of one alert, as the dispatcher
// forwards them, with the reply the test set, serves the action the test
// set at that action's ID (GET /api/v1/actions/ID), and records every
// request.
type FakeAgent struct {
	*httptest.Server

	mu     sync.Mutex
	reply  string
	action []byte
	id     string
	// missing makes the agent answer 404 for its action, as an agent
	// that lost it (a new store) does.
	missing bool
	got     []AgentRequest
}

// NewFakeAgent starts a FakeAgent on ip (port 0: the kernel's), closed at
// the test's end. It answers webhooks with {"received":1}, naming no
// action, until SetReply.
func NewFakeAgent(t testing.TB, ip string) *FakeAgent {
	t.Helper()
	l, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		t.Fatal(err)
	}
	f := &FakeAgent{reply: `{"received":1}`}
	f.Server = httptest.NewUnstartedServer(http.HandlerFunc(f.serve))
	f.Listener.Close()
	f.Listener = l
	f.Start()
	t.Cleanup(f.Close)
	return f
}

func (f *FakeAgent) serve(w http.ResponseWriter, r *http.Request) {
	req := AgentRequest{Method: r.Method, Path: r.URL.Path, Auth: r.Header.Get("Authorization")}
	webhook := r.Method == http.MethodPost && r.URL.Path == "/api/v1/alerts"
	if webhook {
		var msg struct {
			Alerts []struct {
				Labels map[string]string `json:"labels"`
			} `json:"alerts"`
		}
		// The dispatcher forwards each alert in a webhook of its own.
		if err := json.NewDecoder(r.Body).Decode(&msg); err != nil || len(msg.Alerts) != 1 {
			http.Error(w, "bad webhook", http.StatusBadRequest)
			return
		}
		req.Node = msg.Alerts[0].Labels["node"]
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.got = append(f.got, req)
	switch {
	case webhook:
		_, _ = w.Write([]byte(f.reply))
	case r.Method == http.MethodGet && f.action != nil && !f.missing && r.URL.Path == "/api/v1/actions/"+f.id:
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(f.action)
	default:
		http.Error(w, `{"error":"no such action"}`, http.StatusNotFound)
	}
}

// SetReply sets the answer to the webhooks.
func (f *FakeAgent) SetReply(reply string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.reply = reply
}

// SetAction sets the action the agent serves, at the ID it has in JSON
// (a remediate.Action's "id").
func (f *FakeAgent) SetAction(t testing.TB, action any) {
	t.Helper()
	b, err := json.Marshal(action)
	if err != nil {
		t.Fatal(err)
	}
	var id struct {
		ID string `json:"id"`
	}
	if err := json.Unmarshal(b, &id); err != nil || id.ID == "" {
		t.Fatalf("the agent's action has no id: %s (%v)", b, err)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.action, f.id = b, id.ID
}

// SetMissing makes the agent answer 404 for its action, or serve it again.
func (f *FakeAgent) SetMissing(missing bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.missing = missing
}

// Requests are the requests the agent got so far.
func (f *FakeAgent) Requests() []AgentRequest {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]AgentRequest(nil), f.got...)
}

// Last is the last request the agent got; the zero AgentRequest when none.
func (f *FakeAgent) Last() AgentRequest {
	got := f.Requests()
	if len(got) == 0 {
		return AgentRequest{}
	}
	return got[len(got)-1]
}

// Alerts are the node labels of the webhooks the agent got, in order.
func (f *FakeAgent) Alerts() []string {
	var nodes []string
	for _, r := range f.Requests() {
		if r.Node != "" {
			nodes = append(nodes, r.Node)
		}
	}
	return nodes
}

// ActionGets is how many times the agent was asked for its action.
func (f *FakeAgent) ActionGets() int {
	n := 0
	for _, r := range f.Requests() {
		if r.Method == http.MethodGet && strings.HasPrefix(r.Path, "/api/v1/actions/") {
			n++
		}
	}
	return n
}

// Port is the port the agent listens on.
func (f *FakeAgent) Port(t testing.TB) int32 {
	t.Helper()
	_, p, _ := net.SplitHostPort(f.Listener.Addr().String())
	n, err := strconv.Atoi(p)
	if err != nil {
		t.Fatal(err)
	}
	return int32(n)
}

// Alert is one alert of Alertmanager's webhook.
type Alert struct {
	// Status is firing or resolved (ended now).
	Status                  string
	Node, UUID, Fingerprint string
	StartsAt                time.Time
}

// PostWebhook posts Alertmanager's webhook of alerts to the daemon at
// base, with token as its bearer token (none when ""), and returns the
// counts of its reply by result (accepted, rejected). It may run on any
// goroutine: it returns the error instead of failing the test.
func PostWebhook(base, token string, alerts ...Alert) (map[string]int, error) {
	status := "resolved"
	var list []map[string]any
	for _, a := range alerts {
		endsAt := "0001-01-01T00:00:00Z"
		if a.Status == "resolved" {
			endsAt = time.Now().UTC().Format(time.RFC3339Nano)
		} else {
			status = "firing"
		}
		list = append(list, map[string]any{
			"status": a.Status, "labels": map[string]string{"alertname": "GPUOrphanMemory", "node": a.Node, "uuid": a.UUID},
			"annotations": map[string]string{}, "startsAt": a.StartsAt.UTC().Format(time.RFC3339Nano),
			"endsAt": endsAt, "generatorURL": "http://prometheus", "fingerprint": a.Fingerprint,
		})
	}
	body, _ := json.Marshal(map[string]any{"version": "4", "groupKey": "{}:{}", "truncatedAlerts": 0, "status": status, "receiver": "gpu-orphan",
		"groupLabels": map[string]string{}, "commonLabels": map[string]string{}, "commonAnnotations": map[string]string{},
		"externalURL": "http://alertmanager", "alerts": list})
	req, err := http.NewRequest(http.MethodPost, base+"/api/v1/alerts", bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var reply struct {
		Results map[string]int `json:"results"`
	}
	if resp.StatusCode != http.StatusOK || json.Unmarshal(b, &reply) != nil {
		return nil, fmt.Errorf("webhook: %d %s", resp.StatusCode, b)
	}
	return reply.Results, nil
}

var alertSeq atomic.Int64

// PostAlerts is PostWebhook, with no credentials (the dispatcher runs
// with --auth.insecure-none), of one alert per node that fired a minute
// ago, each of a GPU of its own.
func PostAlerts(base string, nodes ...string) (map[string]int, error) {
	var alerts []Alert
	for _, node := range nodes {
		n := alertSeq.Add(1)
		alerts = append(alerts, Alert{Status: "firing", Node: node, UUID: "GPU-" + strconv.FormatInt(n, 10),
			Fingerprint: fmt.Sprintf("%016x", n), StartsAt: time.Now().Add(-time.Minute)})
	}
	return PostWebhook(base, "", alerts...)
}

// MustPostAlerts is PostAlerts that fails the test on an error.
func MustPostAlerts(t testing.TB, base string, nodes ...string) map[string]int {
	t.Helper()
	res, err := PostAlerts(base, nodes...)
	if err != nil {
		t.Fatal(err)
	}
	return res
}

// Actions lists the actions of the daemon at base (GET /api/v1/actions,
// with token as its bearer token, none when ""), decoded as A:
// remediate.Action, which this package may not name.
func Actions[A any](t testing.TB, base, token string) []A {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, base+"/api/v1/actions?limit=1000", nil)
	if err != nil {
		t.Fatal(err)
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out []A
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		t.Fatalf("the actions of %s: %s: %v", base, resp.Status, err)
	}
	return out
}

// Serve runs serve (a daemon's Run, in this process, with its options)
// until the test ends, and returns once base's /-/healthy answers 200. It
// fails the test if serve returns before, or with an error at the end.
func Serve(t testing.TB, base string, serve func(context.Context) error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var runErr error
	stopped := make(chan struct{})
	go func() {
		runErr = serve(ctx)
		close(stopped)
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case <-stopped:
			if runErr != nil {
				t.Errorf("%s ended with %v", base, runErr)
			}
		case <-time.After(15 * time.Second):
			t.Errorf("%s did not stop", base)
		}
	})
	Eventually(t, 30*time.Second, base+" to serve", func() bool {
		select {
		case <-stopped:
			t.Fatalf("%s stopped: %v", base, runErr)
		default:
		}
		return Healthy(base)
	})
}

// Healthy reports whether the daemon at base answers /-/healthy with 200.
func Healthy(base string) bool {
	resp, err := http.Get(base + "/-/healthy")
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// Logger logs at debug level into the test's log, shown when it fails,
// and into also.
func Logger(t testing.TB, also ...io.Writer) *slog.Logger {
	return slog.New(slog.NewTextHandler(io.MultiWriter(append([]io.Writer{LogWriter(t)}, also...)...), &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// LogWriter writes each write, a line, into the test's log.
func LogWriter(t testing.TB) io.Writer { return testLog{t} }

type testLog struct{ t testing.TB }

func (w testLog) Write(b []byte) (int, error) {
	w.t.Log(strings.TrimSuffix(string(b), "\n"))
	return len(b), nil
}
