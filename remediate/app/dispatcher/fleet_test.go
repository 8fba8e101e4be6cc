package dispatcher

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/utils/ptr"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv/kubeapi"
	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/app"
	"github.com/gpu-orphan/gpu-orphan/remediate/dispatch/lease"
	"github.com/gpu-orphan/gpu-orphan/remediate/intake"
	"github.com/gpu-orphan/gpu-orphan/remediate/limits"
)

const agentToken = "issue16-agent-token-5f0c9a7e2b1d4c38a6e0f1b2c3d4e5f6"

// tokenListener is a real listener standing for a node's agent that
// records the Authorization header of every request.
type tokenListener struct {
	*httptest.Server
	mu    sync.Mutex
	auths []string
}

func newTokenListener(t *testing.T) *tokenListener {
	t.Helper()
	l := &tokenListener{}
	l.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		l.mu.Lock()
		l.auths = append(l.auths, r.Method+" "+r.URL.Path+" "+r.Header.Get("Authorization"))
		l.mu.Unlock()
		_, _ = w.Write([]byte(`{"received":1}`))
	}))
	t.Cleanup(l.Close)
	return l
}

func (l *tokenListener) got() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.auths...)
}

func (l *tokenListener) port(t *testing.T) int32 {
	return (&agentListener{Server: l.Server}).port(t)
}

// signedRequest reports whether a tokenListener's record is a webhook
// signed for node, without the token (issue 24).
func signedRequest(got, node string) bool {
	return strings.HasPrefix(got, "POST /api/v1/alerts "+intake.FleetScheme+" ") && strings.Contains(got, "node="+node+"&") &&
		!strings.Contains(got, agentToken)
}

// withAgentToken makes the dispatcher send agentToken to its agents.
func withAgentToken(t *testing.T) func(*app.Options) {
	path := filepath.Join(t.TempDir(), "agent-token")
	if err := os.WriteFile(path, []byte(agentToken+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return func(o *app.Options) { o.Dispatch.TokenFile = path }
}

// dispatcherActions lists a dispatcher's actions through its API.
func dispatcherActions(t *testing.T, base string) []remediate.Action {
	t.Helper()
	resp, err := http.Get(base + "/api/v1/actions")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out []remediate.Action
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestReplicasShareOneFleetLimit: issue 16. Two dispatcher replicas, each
// with its own store, used to keep a fleet limit each: with a cap of one
// node, Alertmanager's alert for node-a reaching one replica and node-b's
// the other reached both nodes. With --dispatch.kubernetes.lease they keep
// the window in one Lease on the API server: one node is served, and the
// other replica holds its alert back, queued, until the turn ends.
func TestReplicasShareOneFleetLimit(t *testing.T) {
	api := kubeapi.Start(t, agentsNamespace)
	agents := map[string]*agentListener{"node-a": newAgentListener(t), "node-b": newAgentListener(t), "node-c": newAgentListener(t)}
	for node, a := range agents {
		applyAgent(t, api, node, a, ptr.To(true))
	}
	tune := func(o *app.Options) {
		o.Dispatch.MaxNodes, o.Dispatch.MaxFraction, o.Dispatch.Window = 1, 1, time.Hour
		o.Dispatch.Kubernetes.Lease = "gpu-orphan-dispatcher"
	}
	one, two := startDispatcher(t, api, "", tune), startDispatcher(t, api, "", tune)
	if r := postAlerts(t, one, "node-a"); r["accepted"] != 1 {
		t.Fatalf("replica one: %v", r)
	}
	if r := postAlerts(t, two, "node-b"); r["accepted"] != 1 {
		t.Fatalf("replica two: %v", r)
	}
	// Each replica decides: one forwards, the other holds back.
	var held string
	testenv.Eventually(t, 20*time.Second, "one alert forwarded and the other held back", func() bool {
		states := map[string]remediate.Action{}
		for _, base := range []string{one, two} {
			for _, a := range dispatcherActions(t, base) {
				states[a.Node] = a
			}
		}
		a, b := states["node-a"], states["node-b"]
		switch {
		case a.State == remediate.StateSucceeded && b.State == remediate.StateQueued && strings.Contains(b.Reason, "fleet_rate"):
			held = "node-b"
		case b.State == remediate.StateSucceeded && a.State == remediate.StateQueued && strings.Contains(a.Reason, "fleet_rate"):
			held = "node-a"
		}
		return held != ""
	})
	served := map[string]string{"node-a": "node-b", "node-b": "node-a"}[held]
	if got := agents[served].received(); len(got) != 1 {
		t.Errorf("%s's agent got %v", served, got)
	}
	if got := agents[held].received(); len(got) != 0 {
		t.Errorf("%s's agent got %v although the other replica served %s under a cap of one node", held, got, served)
	}
	l := api.Lease("gpu-orphan-dispatcher")
	if l == nil {
		t.Fatal("no Lease")
	}
	var w limits.FleetWindow
	if err := json.Unmarshal([]byte(l.Annotations[lease.Annotation]), &w); err != nil || len(w.Turns) != 1 || w.Turns[served].IsZero() {
		t.Errorf("the Lease's window %s (%v), want %s's turn", l.Annotations[lease.Annotation], err, served)
	}
	if _, ok := w.Waiting[held]; !ok {
		t.Errorf("%s is not waiting in the Lease's line: %+v", held, w.Waiting)
	}
}

// TestLeaseForbiddenFailsStart: without RBAC for leases the dispatcher does
// not start, and says which verbs it needs.
func TestLeaseForbiddenFailsStart(t *testing.T) {
	api := kubeapi.Start(t, agentsNamespace)
	api.ForbidLeases(true)
	o := app.Options{Web: webConfig(t), Auth: intake.AuthConfig{InsecureNone: true}, NodeLabel: "node",
		StorePath: filepath.Join(t.TempDir(), "d.db"),
		Dispatch: app.Dispatch{Timeout: time.Second, Kubernetes: app.Kubernetes{Service: agentsService, Namespace: agentsNamespace,
			PortName: "remediator", Scheme: "http", Kubeconfig: api.Kubeconfig(t), SyncTimeout: 10 * time.Second, Lease: "gpu-orphan-dispatcher"}}}
	err := Run(t.Context(), o, Escalate{})
	for _, says := range []string{"get, create and update", "leases", "coordination.k8s.io"} {
		if err == nil || !strings.Contains(err.Error(), says) {
			t.Errorf("Run without RBAC for leases: %v; want it to say %q", err, says)
		}
	}
}

// TestForgedSlicesGetNoToken: issue 16. Discovery used to accept any
// EndpointSlice labelled with the agents' Service: whoever could write one
// received alerts and the agents' token. Now a slice not made by the
// EndpointSlice controller for the Service, and an endpoint that points at
// no Pod, name no agent: alerts for their nodes are rejected, and their
// listeners get no request, no token, while the real agent gets its
// alert with the token.
func TestForgedSlicesGetNoToken(t *testing.T) {
	api := kubeapi.Start(t, agentsNamespace)
	real, forged, notPod, mirrored := newTokenListener(t), newTokenListener(t), newTokenListener(t), newTokenListener(t)
	addAgentPod(api, "node-a", real.port(t))
	api.Apply(kubeapi.Slice("agents-a", agentsService, "remediator", real.port(t), kubeapi.Endpoint("node-a", "127.0.0.1", ptr.To(true))))
	hand := kubeapi.Slice("hand-written", agentsService, "remediator", forged.port(t), kubeapi.Endpoint("node-f", "127.0.0.1", ptr.To(true)))
	delete(hand.Labels, discoveryv1.LabelManagedBy)
	hand.OwnerReferences = nil
	api.Apply(hand)
	mirror := kubeapi.Slice("mirrored", agentsService, "remediator", mirrored.port(t), kubeapi.Endpoint("node-m", "127.0.0.1", ptr.To(true)))
	mirror.Labels[discoveryv1.LabelManagedBy] = "endpointslicemirroring-controller.k8s.io"
	api.Apply(mirror)
	nodeTarget := kubeapi.Endpoint("node-n", "127.0.0.1", ptr.To(true))
	nodeTarget.TargetRef.Kind = "Node"
	api.Apply(kubeapi.Slice("agents-n", agentsService, "remediator", notPod.port(t), nodeTarget))
	base := startDispatcher(t, api, "", withAgentToken(t))

	if r := postAlerts(t, base, "node-a", "node-f", "node-m", "node-n"); r["accepted"] != 1 || r["rejected"] != 3 {
		t.Fatalf("results %v, want node-a accepted, node-f, node-m and node-n rejected", r)
	}
	testenv.Eventually(t, 20*time.Second, "the real agent to get its alert", func() bool { return len(real.got()) == 1 })
	if got := real.got()[0]; !signedRequest(got, "node-a") {
		t.Errorf("the real agent got %q", got)
	}
	// Rejected alerts make no action: nothing is ever sent for them.
	for name, l := range map[string]*tokenListener{"hand-written slice": forged, "mirrored slice": mirrored, "endpoint pointing at a Node": notPod} {
		if got := l.got(); len(got) != 0 {
			t.Errorf("the listener of the %s got %v", name, got)
		}
	}
	for _, a := range dispatcherActions(t, base) {
		if a.Node != "node-a" {
			t.Errorf("an action for %s: %+v", a.Node, a)
		}
	}
}

// TestFullDiskNodeLeavesTheFleetBreakerClosed: issue 16, through the whole
// dispatcher (intake, store, queue, forwarding). A user filled a node's
// disk; its agent answers 503 to every alert. Three such alerts used to
// open the fleet breaker (--limit.breaker-failures=3), and the next
// healthy node's alert was held back. Now the three fail against their
// node, the breaker stays closed, and the healthy node's agent gets its
// alert with the token.
func TestFullDiskNodeLeavesTheFleetBreakerClosed(t *testing.T) {
	api := kubeapi.Start(t, agentsNamespace)
	var fullHits sync.Mutex
	fullCount := 0
	full := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fullHits.Lock()
		fullCount++
		fullHits.Unlock()
		http.Error(w, `{"error":"could not record the notification durably: database or disk is full"}`, http.StatusServiceUnavailable)
	}))
	t.Cleanup(full.Close)
	healthy := newTokenListener(t)
	targets := filepath.Join(t.TempDir(), "targets.json")
	b, _ := json.Marshal(map[string]string{"node-full": full.URL, "node-ok": healthy.URL})
	if err := os.WriteFile(targets, b, 0o600); err != nil {
		t.Fatal(err)
	}
	token := withAgentToken(t)
	base := startDispatcher(t, api, targets, func(o *app.Options) {
		token(o)
		o.Limits.BreakerFailures, o.Limits.BreakerWindow = 3, time.Hour
		o.Dispatch.MaxNodes, o.Dispatch.MaxFraction, o.Dispatch.Window = 10, 1, time.Hour
	})
	if r := postAlerts(t, base, "node-full", "node-full", "node-full"); r["accepted"] != 3 {
		t.Fatalf("results %v", r)
	}
	testenv.Eventually(t, 20*time.Second, "the full node's three alerts to fail", func() bool {
		n := 0
		for _, a := range dispatcherActions(t, base) {
			if a.Node == "node-full" && a.State == remediate.StateFailed && strings.Contains(a.Reason, "503") {
				n++
			}
		}
		return n == 3
	})
	if r := postAlerts(t, base, "node-ok"); r["accepted"] != 1 {
		t.Fatalf("results %v", r)
	}
	testenv.Eventually(t, 20*time.Second, "the healthy node's agent to get its alert", func() bool { return len(healthy.got()) == 1 })
	if got := healthy.got()[0]; !signedRequest(got, "node-ok") {
		t.Errorf("the healthy agent got %q", got)
	}
	_, mfs := testenv.Scrape(t, base+"/metrics")
	if v, _ := testenv.Value(mfs, "gpu_orphan_remediator_breaker_open", nil); v != 0 {
		t.Error("the fleet breaker opened")
	}
	fullHits.Lock()
	defer fullHits.Unlock()
	if fullCount != 3 {
		t.Errorf("the full node's agent got %d requests, want 3 (one attempt each)", fullCount)
	}
}
