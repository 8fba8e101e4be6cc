package dispatch

import (
	"encoding/json"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv/kubeapi"
	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/discovery"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

// fakeAgent answers the webhook with one outcome and serves its action,
// whatever state the test sets.
type fakeAgent struct {
	mu      sync.Mutex
	reply   string
	action  remediate.Action
	auth    string
	gets    int
	missing bool
	// requests counts every request, tokens those that carried one.
	requests, tokens int
}

func (f *fakeAgent) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.auth = r.Header.Get("Authorization")
	f.requests++
	if f.auth != "" {
		f.tokens++
	}
	switch {
	case r.Method == http.MethodPost && r.URL.Path == "/api/v1/alerts":
		w.Write([]byte(f.reply))
	case r.Method == http.MethodGet && r.URL.Path == "/api/v1/actions/"+f.action.ID && !f.missing:
		f.gets++
		_ = json.NewEncoder(w).Encode(struct {
			remediate.Action
			Events []any `json:"events"`
		}{f.action, []any{}})
	default:
		http.Error(w, `{"error":"no such action"}`, http.StatusNotFound)
	}
}

func (f *fakeAgent) set(fn func(f *fakeAgent)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	fn(f)
}

func openStore(t *testing.T) *store.Store {
	t.Helper()
	st, err := store.Open(t.Context(), filepath.Join(t.TempDir(), "d.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	return st
}

// TestFollowCollectsAgentResult: after forwarding, the dispatcher asks the
// agent for the action it made until it finishes, and keeps the agent's
// evidence, freed bytes and dead owners in its own record.
func TestFollowCollectsAgentResult(t *testing.T) {
	uid := 0
	fin := time.Date(2026, 12, 1, 12, 0, 5, 0, time.UTC)
	agentAction := remediate.Action{ID: "ag1", Node: "gpu-a", GPUUUID: "GPU-1", GPUIndex: 1, State: remediate.StateRunning,
		Policy: remediate.PolicyDeadOwner, Source: "webhook"}
	f := &fakeAgent{action: agentAction,
		reply: `{"received":1,"results":{"accepted":1},"alerts":[{"fingerprint":"fp1","starts_at":"2026-12-01T12:00:00Z","result":"accepted","action_id":"ag1"}]}`}
	srv := httptest.NewServer(f)
	defer srv.Close()
	st := openStore(t)
	d := newDispatcher(t, Config{Targets: map[string]string{"gpu-a": srv.URL}, Token: "0123456789abcdef"})

	a, _ := d.Execute(t.Context(), remediate.Action{Node: "gpu-a", GPUUUID: "GPU-1", AlertFingerprint: "fp1",
		AlertStartsAt: time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC), StartedAt: time.Now()})
	if a.State != remediate.StateSucceeded || a.Agent == nil || a.Agent.ActionID != "ag1" || a.Agent.URL != srv.URL || a.Agent.State != remediate.StateQueued {
		t.Fatalf("forwarded: %s %s, agent %+v", a.State, a.Reason, a.Agent)
	}
	id, err := st.Insert(t.Context(), a)
	if err != nil {
		t.Fatal(err)
	}

	// Running: asked, noted, still due.
	d.FollowOnce(t.Context(), st)
	got, _ := st.Action(t.Context(), id)
	if got.Agent.State != remediate.StateRunning || f.gets != 1 || !signedFor(f.auth, "gpu-a") {
		t.Fatalf("while running: agent %+v, %d gets, auth %q", got.Agent, f.gets, f.auth)
	}

	f.set(func(f *fakeAgent) {
		f.action.State, f.action.FinishedAt, f.action.FreedBytes = remediate.StateSucceeded, &fin, 4<<30
		f.action.Before = &remediate.MemoryEvidence{UnownedBytes: 4 << 30, UnownedAgeSeconds: 150}
		f.action.Targets = []remediate.Target{{ProcessInfo: remediate.ProcessInfo{PID: 7, Comm: "pt_data_worker"}, Outcome: "exited_after_sigterm"}}
		f.action.DeadOwners = []remediate.DeadOwner{{PID: 6, UsedBytes: 4 << 30, Known: true, Comm: "python", User: "root", UID: &uid, SlurmJob: "81234"}}
	})
	d.FollowOnce(t.Context(), st)
	got, _ = st.Action(t.Context(), id)
	if got.State != remediate.StateSucceeded || got.Source != "dispatch" || got.Agent.State != remediate.StateSucceeded ||
		!got.Agent.FinishedAt.Equal(fin) || got.FreedBytes != 4<<30 || got.Before == nil || got.Before.UnownedAgeSeconds != 150 ||
		len(got.Targets) != 1 || len(got.DeadOwners) != 1 || got.DeadOwners[0].SlurmJob != "81234" || got.GPUIndex != 1 {
		t.Fatalf("after the agent finished: %+v, agent %+v", got, got.Agent)
	}
	if byJob, _ := st.Actions(t.Context(), store.Filter{SlurmJob: "81234"}); len(byJob) != 1 || byJob[0].ID != id {
		t.Errorf("the dispatcher's record is not found by the agent's Slurm job: %+v", byJob)
	}
	events, _ := st.Events(t.Context(), id)
	if len(events) != 1 || events[0].Kind != "agent_result" {
		t.Errorf("events %+v", events)
	}

	// Finished: not asked again.
	d.FollowOnce(t.Context(), st)
	if f.gets != 2 {
		t.Errorf("the agent was asked %d times, want 2", f.gets)
	}
}

// TestFollowAgentTroubles: an alert the agent ignores is final at once; a
// reply that names no action (not a gpu-orphan agent's) is not followed;
// an agent that does not know the action is noted, and asked again later.
func TestFollowAgentTroubles(t *testing.T) {
	f := &fakeAgent{action: remediate.Action{ID: "ag2", State: remediate.StateSucceeded},
		reply: `{"received":1,"results":{"ignored":1},"alerts":[{"fingerprint":"fp1","result":"ignored","reason":"uuid names no GPU of this node"}]}`}
	srv := httptest.NewServer(f)
	defer srv.Close()
	st := openStore(t)
	d := newDispatcher(t, Config{Targets: map[string]string{"gpu-a": srv.URL}})
	a, _ := d.Execute(t.Context(), remediate.Action{Node: "gpu-a", GPUUUID: "GPU-1", AlertFingerprint: "fp1", StartedAt: time.Now()})
	if a.Agent.State != remediate.StateSkipped || a.Agent.Reason != "the agent made no action of the alert: ignored: uuid names no GPU of this node" {
		t.Fatalf("ignored: %+v", a.Agent)
	}

	for _, reply := range []string{`Accepted`, `{"received":1,"results":{"accepted":1}}`} {
		f.set(func(f *fakeAgent) { f.reply = reply })
		a, _ = d.Execute(t.Context(), remediate.Action{Node: "gpu-a", GPUUUID: "GPU-1", AlertFingerprint: "fp2", StartedAt: time.Now()})
		if a.State != remediate.StateSucceeded || a.Agent != nil {
			t.Fatalf("reply %s: %s, agent %+v", reply, a.State, a.Agent)
		}
	}

	f.set(func(f *fakeAgent) {
		f.missing = true
		f.reply = `{"alerts":[{"fingerprint":"fp3","result":"accepted","action_id":"ag2"}]}`
	})
	a, _ = d.Execute(t.Context(), remediate.Action{Node: "gpu-a", GPUUUID: "GPU-1", AlertFingerprint: "fp3", StartedAt: time.Now()})
	id, _ := st.Insert(t.Context(), a)
	d.FollowOnce(t.Context(), st)
	got, _ := st.Action(t.Context(), id)
	if got.Agent.ActionID != "ag2" || got.Agent.State != remediate.StateQueued || got.Agent.Error == "" {
		t.Fatalf("unknown to the agent: %+v", got.Agent)
	}
	f.set(func(f *fakeAgent) { f.missing = false })
	d.FollowOnce(t.Context(), st)
	got, _ = st.Action(t.Context(), id)
	if got.Agent.State != remediate.StateSucceeded || got.Agent.Error != "" {
		t.Fatalf("known again: %+v", got.Agent)
	}
}

// counts returns how many requests, and requests with a token, the agent
// got.
func (f *fakeAgent) counts() (requests, tokens int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.requests, f.tokens
}

// forwardAndStore forwards an alert for node and records the dispatcher's
// action, as the engine does.
func forwardAndStore(t *testing.T, d *Dispatcher, st *store.Store, node, fingerprint string) string {
	t.Helper()
	a, _ := d.Execute(t.Context(), remediate.Action{Node: node, GPUUUID: "GPU-1", AlertFingerprint: fingerprint,
		AlertStartsAt: time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC), StartedAt: time.Now()})
	if a.State != remediate.StateSucceeded || a.Agent == nil || a.Agent.ActionID == "" {
		t.Fatalf("forwarding %s's alert: %s %s, agent %+v", node, a.State, a.Reason, a.Agent)
	}
	id, err := st.Insert(t.Context(), a)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// TestFollowStopsWhenTargetRemoved: issue 16. A node removed from the
// targets file used to be asked for its action, with the agent's token,
// every second for up to 6 h. The allow-list is read again before every
// request: once the node is off it, its agent gets nothing more, and the
// follow-up ends with the reason recorded.
func TestFollowStopsWhenTargetRemoved(t *testing.T) {
	f := &fakeAgent{action: remediate.Action{ID: "ag1", State: remediate.StateRunning},
		reply: `{"alerts":[{"fingerprint":"fp1","result":"accepted","action_id":"ag1"}]}`}
	srv := httptest.NewServer(f)
	defer srv.Close()
	path := filepath.Join(t.TempDir(), "targets.json")
	write := func(body string, mtime time.Time) {
		t.Helper()
		if err := os.WriteFile(path, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Chtimes(path, mtime, mtime); err != nil {
			t.Fatal(err)
		}
	}
	write(`{"gpu-a": "`+srv.URL+`", "gpu-b": "http://10.0.0.6:10836"}`, time.Now().Add(-time.Hour))
	st := openStore(t)
	d := newDispatcher(t, Config{TargetsFile: path, Token: "0123456789abcdef"})
	id := forwardAndStore(t, d, st, "gpu-a", "fp1")
	d.FollowOnce(t.Context(), st)
	if req, tok := f.counts(); req != 2 || tok != 2 {
		t.Fatalf("before the removal: %d requests, %d with the token; want the webhook and one GET", req, tok)
	}

	write(`{"gpu-b": "http://10.0.0.6:10836"}`, time.Now())
	for range 3 {
		d.FollowOnce(t.Context(), st)
	}
	if req, tok := f.counts(); req != 2 || tok != 2 {
		t.Errorf("after gpu-a left the targets file its agent got %d requests (%d with the token), want none more", req-2, tok-2)
	}
	got, _ := st.Action(t.Context(), id)
	if got.Agent.State != remediate.StateSkipped || !strings.Contains(got.Agent.Reason, `node "gpu-a" is on no allow-list`) ||
		!strings.Contains(got.Agent.Reason, "last known state was running") {
		t.Errorf("the follow-up: %+v, want ended with the reason", got.Agent)
	}
	events, _ := st.Events(t.Context(), id)
	if len(events) != 1 || events[0].Kind != "agent_not_followed" {
		t.Errorf("events %+v, want agent_not_followed", events)
	}
	if pending, _ := st.Actions(t.Context(), store.Filter{AgentPending: true}); len(pending) != 0 {
		t.Errorf("still pending: %+v", pending)
	}
}

// TestFollowAsksTheNodesAgentNow: issue 16, under Kubernetes discovery
// (the real informer, against the test API server). gpu-a's agent pod is
// replaced: its new pod serves elsewhere, and the old address now serves
// gpu-b's agent. The follow-up of gpu-a's action goes to gpu-a's agent as
// discovery names it now, never to the stored address; once gpu-a leaves
// the slices, nobody is asked, and the follow-up ends.
func TestFollowAsksTheNodesAgentNow(t *testing.T) {
	const ns, service = "gpu-orphan", "gpu-orphan-node"
	reply := `{"alerts":[{"fingerprint":"fp1","result":"accepted","action_id":"ag1"}]}`
	oldPod := &fakeAgent{action: remediate.Action{ID: "ag1", State: remediate.StateRunning}, reply: reply}
	newPod := &fakeAgent{action: remediate.Action{ID: "ag1", State: remediate.StateRunning}, reply: reply}
	oldSrv, newSrv := httptest.NewServer(oldPod), httptest.NewServer(newPod)
	defer oldSrv.Close()
	defer newSrv.Close()
	port := func(s *httptest.Server) int32 {
		_, p, _ := net.SplitHostPort(s.Listener.Addr().String())
		n, _ := strconv.Atoi(p)
		return int32(n)
	}
	api := kubeapi.Start(t, ns)
	// The agents' pods, which discovery checks each endpoint against.
	ds := api.AddDaemonSet(service)
	api.AddPod(kubeapi.AgentPod("agent-gpu-a", ds, "gpu-a", "127.0.0.1", "remediator", port(oldSrv)))
	api.Apply(kubeapi.Slice("agents-1", service, "remediator", port(oldSrv), kubeapi.Endpoint("gpu-a", "127.0.0.1", nil)))
	api.Apply(kubeapi.Slice("agents-2", service, "remediator", port(newSrv)))
	k, err := discovery.New(discovery.Config{Service: service, Namespace: ns, PortName: "remediator", Scheme: "http", Kubeconfig: api.Kubeconfig(t)})
	if err != nil {
		t.Fatal(err)
	}
	if err := k.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	st := openStore(t)
	d := newDispatcher(t, Config{Discovery: k, Token: "0123456789abcdef"})
	id := forwardAndStore(t, d, st, "gpu-a", "fp1")

	// The pod is replaced; its old address is gpu-b's agent's now.
	newA := kubeapi.AgentPod("agent-gpu-a", ds, "gpu-a", "127.0.0.1", "remediator", port(newSrv))
	newA.UID = "uid-pod-agent-gpu-a-2"
	api.AddPod(newA)
	api.AddPod(kubeapi.AgentPod("agent-gpu-b", ds, "gpu-b", "127.0.0.1", "remediator", port(oldSrv)))
	api.Apply(kubeapi.Slice("agents-1", service, "remediator", port(oldSrv), kubeapi.Endpoint("gpu-b", "127.0.0.1", nil)))
	api.Apply(kubeapi.Slice("agents-2", service, "remediator", port(newSrv), kubeapi.Endpoint("gpu-a", "127.0.0.1", nil)))
	testenv.Eventually(t, 10*time.Second, "discovery to see the new pods", func() bool {
		a := k.Agents()
		return a["gpu-a"] == newSrv.URL && a["gpu-b"] == oldSrv.URL
	})
	newPod.set(func(f *fakeAgent) { f.action.State = remediate.StateSucceeded })
	d.FollowOnce(t.Context(), st)
	if req, tok := oldPod.counts(); req != 1 || tok != 1 {
		t.Errorf("the old address, gpu-b's agent now, got %d requests (%d with the token), want only the first webhook", req, tok)
	}
	var gets int
	var auth string
	newPod.set(func(f *fakeAgent) { gets, auth = f.gets, f.auth })
	if gets != 1 || !signedFor(auth, "gpu-a") {
		t.Errorf("gpu-a's agent now was asked %d times (auth %q), want once, signed for gpu-a", gets, auth)
	}
	got, _ := st.Action(t.Context(), id)
	if got.Agent.URL != newSrv.URL || got.Agent.State != remediate.StateSucceeded {
		t.Errorf("the record: %+v, want the result from %s", got.Agent, newSrv.URL)
	}

	// Another action of gpu-a, then its agent leaves the slices.
	newPod.set(func(f *fakeAgent) {
		f.action = remediate.Action{ID: "ag2", State: remediate.StateRunning}
		f.reply = `{"alerts":[{"fingerprint":"fp2","result":"accepted","action_id":"ag2"}]}`
	})
	id2 := forwardAndStore(t, d, st, "gpu-a", "fp2")
	api.Delete("agents-2")
	testenv.Eventually(t, 10*time.Second, "gpu-a to leave discovery", func() bool { _, ok := k.Agents()["gpu-a"]; return !ok })
	before, _ := newPod.counts()
	d.FollowOnce(t.Context(), st)
	if after, _ := newPod.counts(); after != before {
		t.Errorf("gpu-a's agent, off the slices, got %d more requests", after-before)
	}
	if req, _ := oldPod.counts(); req != 1 {
		t.Errorf("the old address got %d requests", req)
	}
	got, _ = st.Action(t.Context(), id2)
	if got.Agent.State != remediate.StateSkipped || !strings.Contains(got.Agent.Reason, "no allow-list") {
		t.Errorf("the follow-up of gpu-a's second action: %+v, want ended", got.Agent)
	}
}
