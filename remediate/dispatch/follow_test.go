package dispatch

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/remediate"
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
}

func (f *fakeAgent) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.auth = r.Header.Get("Authorization")
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
	if got.Agent.State != remediate.StateRunning || f.gets != 1 || f.auth != "Bearer 0123456789abcdef" {
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
