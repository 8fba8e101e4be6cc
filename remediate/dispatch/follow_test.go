package dispatch

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/remediatetest"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

// newFakeAgent is a node agent on 127.0.0.1 that answers the webhook with
// reply and serves action.
func newFakeAgent(t *testing.T, reply string, action remediate.Action) *testenv.FakeAgent {
	t.Helper()
	f := testenv.NewFakeAgent(t, "127.0.0.1")
	f.SetReply(reply)
	f.SetAction(t, action)
	return f
}

// counts is how many requests the agent got, and how many carried an
// Authorization header.
func counts(f *testenv.FakeAgent) (requests, signed int) {
	for _, r := range f.Requests() {
		requests++
		if r.Auth != "" {
			signed++
		}
	}
	return requests, signed
}

// TestFollowCollectsAgentResult: after forwarding, the dispatcher asks the
// agent for the action it made until it finishes, and keeps the agent's
// evidence, freed bytes and dead owners in its own record.
func TestFollowCollectsAgentResult(t *testing.T) {
	uid := 0
	fin := time.Date(2026, 12, 1, 12, 0, 5, 0, time.UTC)
	agentAction := remediate.Action{ID: "ag1", Node: "gpu-a", GPUUUID: "GPU-1", GPUIndex: 1, State: remediate.StateRunning,
		Policy: remediate.PolicyDeadOwner, Source: "webhook"}
	f := newFakeAgent(t, `{"received":1,"results":{"accepted":1},"alerts":[{"fingerprint":"fp1","starts_at":"2026-12-01T12:00:00Z","result":"accepted","action_id":"ag1"}]}`,
		agentAction)
	st := remediatetest.OpenStore(t)
	d := newDispatcher(t, Config{Targets: map[string]string{"gpu-a": f.URL}, Token: "0123456789abcdef"})

	a, _ := d.Execute(t.Context(), remediate.Action{Node: "gpu-a", GPUUUID: "GPU-1", AlertFingerprint: "fp1",
		AlertStartsAt: time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC), StartedAt: time.Now()})
	if a.State != remediate.StateSucceeded || a.Agent == nil || a.Agent.ActionID != "ag1" || a.Agent.URL != f.URL || a.Agent.State != remediate.StateQueued {
		t.Fatalf("forwarded: %s %s, agent %+v", a.State, a.Reason, a.Agent)
	}
	id, err := st.Insert(t.Context(), a)
	if err != nil {
		t.Fatal(err)
	}

	// Running: asked, noted, still due.
	d.FollowOnce(t.Context(), st)
	got, _ := st.Action(t.Context(), id)
	if got.Agent.State != remediate.StateRunning || f.ActionGets() != 1 || !remediatetest.SignedFor(f.Last().Auth, "gpu-a", "0123456789abcdef") {
		t.Fatalf("while running: agent %+v, %d gets, auth %q", got.Agent, f.ActionGets(), f.Last().Auth)
	}

	agentAction.State, agentAction.FinishedAt, agentAction.FreedBytes = remediate.StateSucceeded, &fin, 4<<30
	agentAction.Before = &remediate.MemoryEvidence{UnownedBytes: 4 << 30, UnownedAgeSeconds: 150}
	agentAction.Targets = []remediate.Target{{ProcessInfo: remediate.ProcessInfo{PID: 7, Comm: "pt_data_worker"}, Outcome: "exited_after_sigterm"}}
	agentAction.DeadOwners = []remediate.DeadOwner{{PID: 6, UsedBytes: 4 << 30, Known: true, Comm: "python", User: "root", UID: &uid, SlurmJob: "81234"}}
	f.SetAction(t, agentAction)
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
	if n := f.ActionGets(); n != 2 {
		t.Errorf("the agent was asked %d times, want 2", n)
	}
}

// TestFollowAgentTroubles: an alert the agent ignores is final at once; a
// reply that names no action (not a gpu-orphan agent's) is not followed;
// an agent that does not know the action is noted, and asked again later.
func TestFollowAgentTroubles(t *testing.T) {
	f := newFakeAgent(t, `{"received":1,"results":{"ignored":1},"alerts":[{"fingerprint":"fp1","result":"ignored","reason":"uuid names no GPU of this node"}]}`,
		remediate.Action{ID: "ag2", State: remediate.StateSucceeded})
	st := remediatetest.OpenStore(t)
	d := newDispatcher(t, Config{Targets: map[string]string{"gpu-a": f.URL}})
	a, _ := d.Execute(t.Context(), remediate.Action{Node: "gpu-a", GPUUUID: "GPU-1", AlertFingerprint: "fp1", StartedAt: time.Now()})
	if a.Agent.State != remediate.StateSkipped || a.Agent.Reason != "the agent made no action of the alert: ignored: uuid names no GPU of this node" {
		t.Fatalf("ignored: %+v", a.Agent)
	}

	for _, reply := range []string{`Accepted`, `{"received":1,"results":{"accepted":1}}`} {
		f.SetReply(reply)
		a, _ = d.Execute(t.Context(), remediate.Action{Node: "gpu-a", GPUUUID: "GPU-1", AlertFingerprint: "fp2", StartedAt: time.Now()})
		if a.State != remediate.StateSucceeded || a.Agent != nil {
			t.Fatalf("reply %s: %s, agent %+v", reply, a.State, a.Agent)
		}
	}

	f.SetMissing(true)
	f.SetReply(`{"alerts":[{"fingerprint":"fp3","result":"accepted","action_id":"ag2"}]}`)
	a, _ = d.Execute(t.Context(), remediate.Action{Node: "gpu-a", GPUUUID: "GPU-1", AlertFingerprint: "fp3", StartedAt: time.Now()})
	id, _ := st.Insert(t.Context(), a)
	d.FollowOnce(t.Context(), st)
	got, _ := st.Action(t.Context(), id)
	if got.Agent.ActionID != "ag2" || got.Agent.State != remediate.StateQueued || got.Agent.Error == "" {
		t.Fatalf("unknown to the agent: %+v", got.Agent)
	}
	f.SetMissing(false)
	d.FollowOnce(t.Context(), st)
	got, _ = st.Action(t.Context(), id)
	if got.Agent.State != remediate.StateSucceeded || got.Agent.Error != "" {
		t.Fatalf("known again: %+v", got.Agent)
	}
}

// TestFollowStopsWhenTargetRemoved: issue 16. A node removed from the
// targets file used to be asked for its action, with the agent's token,
// every second for up to 6 h. The allow-list is read again before every
// request: once the node is off it, its agent gets nothing more, and the
// follow-up ends with the reason recorded.
func TestFollowStopsWhenTargetRemoved(t *testing.T) {
	f := newFakeAgent(t, `{"alerts":[{"fingerprint":"fp1","result":"accepted","action_id":"ag1"}]}`,
		remediate.Action{ID: "ag1", State: remediate.StateRunning})
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
	write(`{"gpu-a": "`+f.URL+`", "gpu-b": "http://10.0.0.6:10836"}`, time.Now().Add(-time.Hour))
	st := remediatetest.OpenStore(t)
	d := newDispatcher(t, Config{TargetsFile: path, Token: "0123456789abcdef"})
	id := remediatetest.ForwardAndStore(t, d, st, "gpu-a", "fp1")
	d.FollowOnce(t.Context(), st)
	if req, tok := counts(f); req != 2 || tok != 2 {
		t.Fatalf("before the removal: %d requests, %d with the token; want the webhook and one GET", req, tok)
	}

	write(`{"gpu-b": "http://10.0.0.6:10836"}`, time.Now())
	for range 3 {
		d.FollowOnce(t.Context(), st)
	}
	if req, tok := counts(f); req != 2 || tok != 2 {
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
