package store

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/remediate"
	"modernc.org/sqlite"
	sqlite3 "modernc.org/sqlite/lib"
)

var t0 = time.Date(2026, 11, 30, 12, 0, 0, 123456789, time.UTC)

func openTest(t testing.TB, path string) *Store {
	t.Helper()
	if path == "" {
		path = filepath.Join(t.TempDir(), "store.db")
	}
	s, err := Open(context.Background(), path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func firing(fp string, startsAt time.Time) Alert {
	return Alert{
		Fingerprint: fp, StartsAt: startsAt, Status: "firing", Node: "node-a", GPUUUID: "GPU-1234",
		Labels: map[string]string{"alertname": "GPUOrphanMemory", "gpu": "3", "uuid": "GPU-1234", "instance": "node-a"}, Candidate: true,
	}
}

func resolvedCopy(a Alert) Alert {
	a.Status = "resolved"
	a.EndsAt = a.StartsAt.Add(time.Minute)
	return a
}

func record(t testing.TB, s *Store, alerts ...Alert) []AlertOutcome {
	t.Helper()
	out, err := s.RecordNotification(context.Background(), Notification{
		ReceivedAt: t0.Add(time.Second), Remote: "10.0.0.1:9093", Receiver: "gpu-orphan", GroupKey: "{}:{}", Status: "firing", Alerts: alerts,
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func results(out []AlertOutcome) []string {
	var r []string
	for _, o := range out {
		r = append(r, o.Result)
	}
	return r
}

func fullAction() remediate.Action {
	fin := t0.Add(7 * time.Second)
	return remediate.Action{
		Node: "node-b", GPUUUID: "GPU-abcd", GPUIndex: 0, Policy: remediate.PolicyOrphaned,
		State: remediate.StateSucceeded, Reason: "", DryRun: true,
		AlertFingerprint: "0123abcd", AlertStartsAt: t0.Add(-time.Hour), Source: "cli",
		FreedBytes: 1<<64 - 1, StartedAt: t0, FinishedAt: &fin, VerifySeconds: 0.375,
		Before: &remediate.MemoryEvidence{At: t0, UsedBytes: 7 << 30, OwnedDeadBytes: 6 << 30, UnownedAgeSeconds: 12.5,
			DeadOwnerPIDs: []uint32{4242}, HolderPIDs: []int{4243, 4244}},
		After: &remediate.MemoryEvidence{At: fin, UsedBytes: 0},
		Targets: []remediate.Target{{
			ProcessInfo: remediate.ProcessInfo{PID: 4243, PPID: 1, PGID: 4242, SID: 4200, StartTime: 998877, State: "S",
				User: "alice", Comm: "pt_data_worker", Command: "python train.py", Cgroup: "/user.slice", Pod: "ns/p"},
			Reason: "holds /dev/nvidia3 of dead owner 4242", WholeGroup: true,
			Outcome: "exited_after_sigterm", Signals: []string{"SIGTERM"},
		}},
		Excluded: []remediate.Exclusion{{ProcessInfo: remediate.ProcessInfo{PID: 1, Comm: "systemd"}, Why: "protected"}},
		Leftover: []remediate.Leftover{{PID: 77, Kind: "d_state", Detail: "in nvidia_ioctl"}},
		NextStep: "reboot",
		DeadOwners: []remediate.DeadOwner{
			{PID: 4242, UsedBytes: 6 << 30, Known: true, StartTime: 998800, Comm: "python", Cmdline: "python train.py --epochs 3",
				User: "alice", UID: &uid1001, SlurmJob: "81234", SlurmStep: "0", Cgroup: "/system.slice/slurmstepd.scope/job_81234/step_0/user/task_0",
				LastSeen: t0.Add(-time.Minute)},
			{PID: 4250, UsedBytes: 8 << 20},
		},
		Agent:   &remediate.AgentResult{URL: "https://node-b:10836", ActionID: "0123", State: remediate.StateSucceeded, Reason: "done", FinishedAt: &fin},
		Attempt: 2, FirstActionID: "0000000000000001aaaaaaaa", RetryOf: "0000000000000001aaaaaaaa", Escalation: remediate.EscalationHiddenHolder,
		Job: &remediate.JobRef{SlurmJob: "81240", UID: &uid1001, User: "alice"},
	}
}

var uid1001 = 1001

func TestActionRoundTrip(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "store.db")
	s := openTest(t, path)

	for name, a := range map[string]remediate.Action{
		"full":    fullAction(),
		"minimal": {Node: "n", State: remediate.StateQueued, Source: "cli", StartedAt: t0, Attempt: 1},
		"empty slices": {Node: "n", State: remediate.StateQueued, Targets: []remediate.Target{},
			Excluded: []remediate.Exclusion{}, StartedAt: t0, FinishedAt: &time.Time{}, Attempt: 1},
	} {
		t.Run(name, func(t *testing.T) {
			id, err := s.Insert(ctx, a)
			if err != nil {
				t.Fatal(err)
			}
			a.ID = id
			got, err := s.Action(ctx, id)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, a) {
				t.Fatalf("round trip changed the action:\ngot  %+v\nwant %+v", got, a)
			}
			// What the API serves must not change either.
			gj, _ := json.Marshal(got)
			wj, _ := json.Marshal(a)
			if string(gj) != string(wj) {
				t.Fatalf("JSON differs:\ngot  %s\nwant %s", gj, wj)
			}
		})
	}

	// Update writes every field; a non-UTC time comes back as the same
	// instant in UTC.
	a := fullAction()
	id, err := s.Insert(ctx, remediate.Action{State: remediate.StateQueued})
	if err != nil {
		t.Fatal(err)
	}
	a.ID = id
	a.StartedAt = t0.In(time.FixedZone("CET", 3600))
	if err := s.Update(ctx, a); err != nil {
		t.Fatal(err)
	}
	// The file, not a cache, holds it.
	s.Close()
	s = openTest(t, path)
	got, err := s.Action(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	if !got.StartedAt.Equal(a.StartedAt) || got.StartedAt.Location() != time.UTC {
		t.Fatalf("StartedAt = %v, want %v in UTC", got.StartedAt, a.StartedAt)
	}
	a.StartedAt = a.StartedAt.UTC()
	if !reflect.DeepEqual(got, a) {
		t.Fatalf("Update lost something:\ngot  %+v\nwant %+v", got, a)
	}

	if err := s.Update(ctx, remediate.Action{ID: "nope"}); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Update of unknown action: err = %v, want ErrNotFound", err)
	}
	if _, err := s.Insert(ctx, a); err == nil {
		t.Fatal("Insert of an existing ID succeeded")
	}
}

func TestRecordNotification(t *testing.T) {
	ctx := context.Background()
	s := openTest(t, "")
	a := firing("aaaa", t0)
	ign := firing("bbbb", t0)
	ign.Candidate, ign.IgnoreReason = false, "node not managed by this remediator"

	// First delivery: one accepted, one ignored, and a second copy of the
	// first alert inside the same notification.
	out := record(t, s, a, ign, a)
	if got, want := results(out), []string{ResultAccepted, ResultIgnored, ResultDuplicate}; !reflect.DeepEqual(got, want) {
		t.Fatalf("results = %v, want %v", got, want)
	}
	id := out[0].ActionID
	if id == "" || out[2].ActionID != id || out[1].ActionID != "" {
		t.Fatalf("action IDs = %q %q %q", out[0].ActionID, out[1].ActionID, out[2].ActionID)
	}
	if out[1].Reason != ign.IgnoreReason {
		t.Fatalf("ignored reason = %q", out[1].Reason)
	}
	q, err := s.Queued(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(q) != 1 || q[0].ID != id || q[0].Node != "node-a" || q[0].GPUUUID != "GPU-1234" || q[0].GPUIndex != 3 ||
		q[0].State != remediate.StateQueued || q[0].Source != "webhook" || q[0].AlertFingerprint != "aaaa" ||
		!q[0].AlertStartsAt.Equal(t0) || !q[0].StartedAt.Equal(t0.Add(time.Second)) {
		t.Fatalf("queued = %+v", q)
	}

	// Retries: duplicates, ignored ones included; no second action.
	if got, want := results(record(t, s, a, ign)), []string{ResultDuplicate, ResultDuplicate}; !reflect.DeepEqual(got, want) {
		t.Fatalf("results = %v, want %v", got, want)
	}
	// A new firing of the same fingerprint is a new key.
	again := firing("aaaa", t0.Add(time.Hour))
	out2 := record(t, s, again)
	if out2[0].Result != ResultAccepted || out2[0].ActionID == id {
		t.Fatalf("new startsAt: %+v", out2[0])
	}

	// Resolved: cancels the queued action once; a resolved copy is a
	// duplicate; a late firing copy changes nothing.
	out = record(t, s, resolvedCopy(a))
	if out[0].Result != ResultResolved || out[0].ActionID != id {
		t.Fatalf("resolve: %+v", out[0])
	}
	got, err := s.Action(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	if got.State != remediate.StateSkipped || got.Reason != ReasonResolvedBeforeAction || got.FinishedAt == nil {
		t.Fatalf("cancelled action = %+v", got)
	}
	if got, want := results(record(t, s, resolvedCopy(a), a)), []string{ResultDuplicate, ResultDuplicate}; !reflect.DeepEqual(got, want) {
		t.Fatalf("results = %v, want %v", got, want)
	}
	if got, _ := s.Action(ctx, id); got.State != remediate.StateSkipped {
		t.Fatalf("late firing copy revived the action: %+v", got)
	}
	// Resolved before ever seen firing: recorded, no action.
	if out := record(t, s, resolvedCopy(firing("cccc", t0))); out[0].Result != ResultResolved || out[0].ActionID != "" {
		t.Fatalf("unseen resolved: %+v", out[0])
	}

	if n, err := s.QueueDepth(ctx); err != nil || n != 1 {
		t.Fatalf("QueueDepth = %d, %v; want 1", n, err)
	}
	if n, err := s.Duplicates(ctx); err != nil || n != 5 {
		t.Fatalf("Duplicates = %d, %v; want 5", n, err)
	}
	var deliveries int
	if err := s.db.QueryRow(`SELECT count(*) FROM deliveries`).Scan(&deliveries); err != nil {
		t.Fatal(err)
	}
	if deliveries != 10 {
		t.Fatalf("deliveries = %d, want 10", deliveries)
	}
	evs, err := s.Events(ctx, id)
	if err != nil || len(evs) != 1 || evs[0].Kind != "cancel" {
		t.Fatalf("events = %+v, %v", evs, err)
	}
}

func TestResolvedDoesNotCancelRunning(t *testing.T) {
	ctx := context.Background()
	s := openTest(t, "")
	a := firing("aaaa", t0)
	id := record(t, s, a)[0].ActionID
	if _, ok, err := s.Claim(ctx, id); err != nil || !ok {
		t.Fatalf("Claim = %v, %v", ok, err)
	}
	if out := record(t, s, resolvedCopy(a)); out[0].Result != ResultResolved {
		t.Fatalf("resolve: %+v", out[0])
	}
	if got, _ := s.Action(ctx, id); got.State != remediate.StateRunning {
		t.Fatalf("running action was changed: %+v", got)
	}
}

// Three Alertmanager replicas deliver the same alert at once, through two
// Store handles on one file (as the remediator and the CLI would be).
func TestRecordNotificationHACopies(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "store.db")
	stores := []*Store{openTest(t, path), openTest(t, path)}
	a := firing("feedface", t0)

	const senders = 30
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		counts   = map[string]int{}
		actionID = map[string]bool{}
		start    = make(chan struct{})
	)
	for i := range senders {
		wg.Go(func() {
			<-start
			out, err := stores[i%len(stores)].RecordNotification(ctx, Notification{
				ReceivedAt: time.Now(), Remote: fmt.Sprintf("alertmanager-%d:9093", i%3), Status: "firing", Alerts: []Alert{a},
			})
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				t.Error(err)
				return
			}
			counts[out[0].Result]++
			actionID[out[0].ActionID] = true
		})
	}
	close(start)
	wg.Wait()

	if counts[ResultAccepted] != 1 || counts[ResultDuplicate] != senders-1 || len(actionID) != 1 {
		t.Fatalf("results %v, action IDs %v", counts, actionID)
	}
	q, err := stores[0].Queued(ctx)
	if err != nil || len(q) != 1 {
		t.Fatalf("queued = %d actions, %v", len(q), err)
	}
	var copies int
	if err := stores[1].db.QueryRow(`SELECT copies FROM alerts WHERE fingerprint = 'feedface'`).Scan(&copies); err != nil {
		t.Fatal(err)
	}
	if copies != senders {
		t.Fatalf("copies = %d, want %d", copies, senders)
	}
	if n, _ := stores[0].Duplicates(ctx); n != senders-1 {
		t.Fatalf("Duplicates = %d", n)
	}
}

func TestQueueAndClaim(t *testing.T) {
	ctx := context.Background()
	s := openTest(t, "")
	out := record(t, s, firing("01", t0), firing("02", t0), firing("03", t0))
	q, err := s.Queued(ctx)
	if err != nil || len(q) != 3 {
		t.Fatalf("queued %d, %v", len(q), err)
	}
	for i := range q {
		if q[i].ID != out[i].ActionID {
			t.Fatalf("queue order: %s at %d, want %s", q[i].ID, i, out[i].ActionID)
		}
	}

	a, ok, err := s.Claim(ctx, q[0].ID)
	if err != nil || !ok || a.State != remediate.StateRunning || a.ID != q[0].ID {
		t.Fatalf("first Claim = %+v, %v, %v", a, ok, err)
	}
	if _, ok, err := s.Claim(ctx, q[0].ID); err != nil || ok {
		t.Fatalf("second Claim = %v, %v; want false", ok, err)
	}
	if _, ok, err := s.Claim(ctx, "unknown"); err != nil || ok {
		t.Fatalf("Claim of unknown = %v, %v; want false", ok, err)
	}
	// Cancelled by its resolution: cannot be claimed.
	record(t, s, resolvedCopy(firing("02", t0)))
	if _, ok, err := s.Claim(ctx, q[1].ID); err != nil || ok {
		t.Fatalf("Claim of cancelled = %v, %v; want false", ok, err)
	}
	if n, _ := s.QueueDepth(ctx); n != 1 {
		t.Fatalf("QueueDepth = %d, want 1", n)
	}

	// The plan, then the result.
	if err := s.AddEvent(ctx, a.ID, "plan", map[string]any{"targets": []int{4243}}); err != nil {
		t.Fatal(err)
	}
	if err := s.AddEvent(ctx, a.ID, "signal", struct {
		PID    int    `json:"pid"`
		Signal string `json:"signal"`
	}{4243, "SIGTERM"}); err != nil {
		t.Fatal(err)
	}
	if err := s.AddEvent(ctx, "no-such-action", "plan", nil); err == nil {
		t.Fatal("AddEvent to an unknown action succeeded: foreign keys are off")
	}
	evs, err := s.Events(ctx, a.ID)
	if err != nil {
		t.Fatal(err)
	}
	var kinds []string
	for _, e := range evs {
		kinds = append(kinds, e.Kind)
	}
	if want := []string{"claim", "plan", "signal"}; !reflect.DeepEqual(kinds, want) {
		t.Fatalf("event kinds = %v, want %v", kinds, want)
	}
	if string(evs[2].Detail) != `{"pid":4243,"signal":"SIGTERM"}` {
		t.Fatalf("detail = %s", evs[2].Detail)
	}
}

// TestRecoverAfterRestart: an action that a restart cut off is marked
// interrupted and, since an alert created it, taken up again as a new
// attempt, queued and linked to it; one without an alert (the CLI's) is
// not; queued actions stay queued.
func TestRecoverAfterRestart(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "store.db")
	s := openTest(t, path)
	out := record(t, s, firing("01", t0), firing("02", t0))
	running, queued := out[0].ActionID, out[1].ActionID
	if _, ok, err := s.Claim(ctx, running); err != nil || !ok {
		t.Fatalf("Claim = %v, %v", ok, err)
	}
	cli, err := s.Insert(ctx, remediate.Action{Node: "node-a", GPUUUID: "GPU-1234", State: remediate.StateRunning, Source: "cli", StartedAt: t0})
	if err != nil {
		t.Fatal(err)
	}
	// The process dies mid-action.
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}

	s = openTest(t, path)
	got, resumed, err := s.Recover(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 {
		t.Fatalf("interrupted = %+v, want the webhook's and the CLI's", got)
	}
	for _, a := range got {
		if a.State != remediate.StateInterrupted || a.Reason != ReasonInterrupted || a.FinishedAt == nil {
			t.Errorf("interrupted %+v", a)
		}
		stored, err := s.Action(ctx, a.ID)
		if err != nil || !reflect.DeepEqual(stored, a) {
			t.Fatalf("stored %+v, %v; returned %+v", stored, err, a)
		}
	}
	if len(resumed) != 1 {
		t.Fatalf("resumed = %+v, want one attempt for the webhook's action only", resumed)
	}
	next := resumed[0]
	if next.State != remediate.StateQueued || next.Attempt != 2 || next.RetryOf != running || next.FirstActionID != running ||
		next.AlertFingerprint != "01" || !next.AlertStartsAt.Equal(t0) || len(next.Targets) != 0 {
		t.Fatalf("the next attempt %+v", next)
	}
	q, err := s.Queued(ctx)
	if err != nil || len(q) != 2 || q[0].ID != queued || q[1].ID != next.ID {
		t.Fatalf("queued = %+v, %v", q, err)
	}
	evs, err := s.Events(ctx, running)
	if err != nil || len(evs) != 2 || evs[1].Kind != "interrupted" || !strings.Contains(string(evs[1].Detail), `"resumed_by":"`+next.ID+`"`) {
		t.Fatalf("events of the interrupted action: %+v, %v", evs, err)
	}
	if evs, err := s.Events(ctx, next.ID); err != nil || len(evs) != 1 || evs[0].Kind != "retry" || !strings.Contains(string(evs[0].Detail), `"cause":"restart"`) {
		t.Fatalf("events of the new attempt: %+v, %v", evs, err)
	}
	if evs, err := s.Events(ctx, cli); err != nil || len(evs) != 1 || strings.Contains(string(evs[0].Detail), "resumed_by") {
		t.Fatalf("events of the CLI's action: %+v, %v", evs, err)
	}
	// A copy of the alert while its next attempt waits is a duplicate of
	// that attempt; its resolution cancels that attempt.
	if o := record(t, s, firing("01", t0)); o[0].Result != ResultDuplicate || o[0].ActionID != next.ID {
		t.Fatalf("copy while queued: %+v", o)
	}
	if again, resumed, err := s.Recover(ctx); err != nil || len(again) != 0 || len(resumed) != 0 {
		t.Fatalf("second Recover = %+v, %+v, %v", again, resumed, err)
	}
	if o := record(t, s, resolvedCopy(firing("01", t0))); o[0].Result != ResultResolved || o[0].ActionID != next.ID {
		t.Fatalf("resolution: %+v", o)
	}
	if a, err := s.Action(ctx, next.ID); err != nil || a.State != remediate.StateSkipped {
		t.Fatalf("the next attempt after its alert resolved: %+v, %v", a, err)
	}
}

// TestRecoverBoundedAttempts: a remediator that dies in every attempt
// (a crash loop) takes an alert up MaxAttempts times, not more.
func TestRecoverBoundedAttempts(t *testing.T) {
	ctx := context.Background()
	s := openTest(t, "")
	id := record(t, s, firing("01", t0))[0].ActionID
	for attempt := 1; ; attempt++ {
		if _, ok, err := s.Claim(ctx, id); err != nil || !ok {
			t.Fatalf("attempt %d: Claim = %v, %v", attempt, ok, err)
		}
		_, resumed, err := s.Recover(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if attempt == DefaultMaxAttempts {
			if len(resumed) != 0 {
				t.Fatalf("attempt %d was resumed: %+v", attempt+1, resumed)
			}
			return
		}
		if len(resumed) != 1 || resumed[0].Attempt != attempt+1 || resumed[0].RetryOf != id {
			t.Fatalf("after attempt %d: %+v", attempt, resumed)
		}
		id = resumed[0].ID
	}
}

// finish ends an action as an executor would.
func finish(t *testing.T, s *Store, id string, state remediate.State, reason string, at time.Time, leftovers ...remediate.Leftover) remediate.Action {
	t.Helper()
	a, err := s.Action(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	a.State, a.Reason, a.FinishedAt, a.Leftover = state, reason, &at, leftovers
	if err := s.Update(context.Background(), a); err != nil {
		t.Fatal(err)
	}
	return a
}

// TestRetryOnNotification: Alertmanager re-sends a firing alert with the
// same fingerprint and startsAt. After an action that left the memory held
// (failed, interrupted, or succeeded with other holders remaining), the
// next copy after the cooldown is a new attempt, linked to the first;
// before the cooldown, while an attempt runs, or after one that brought
// the memory back, a duplicate; never more than MaxAttempts.
func TestRetryOnNotification(t *testing.T) {
	ctx := context.Background()
	for _, c := range []struct {
		state     remediate.State
		leftovers []remediate.Leftover
		retry     bool
	}{
		{remediate.StateFailed, nil, true},
		{remediate.StateInterrupted, nil, true},
		{remediate.StateSucceeded, []remediate.Leftover{{PID: 7, Kind: "other_holder"}}, true},
		{remediate.StateSucceeded, nil, false},
		{remediate.StateSkipped, nil, false},
		{remediate.StateDryRun, nil, false},
	} {
		name := string(c.state)
		if len(c.leftovers) > 0 {
			name += " with others remaining"
		}
		t.Run(name, func(t *testing.T) {
			s := openTest(t, "")
			s.SetRetry(RetryPolicy{MaxAttempts: 3, Cooldown: time.Minute})
			// record's notifications arrive at t0+1s.
			first := record(t, s, firing("01", t0))[0].ActionID
			if _, ok, err := s.Claim(ctx, first); err != nil || !ok {
				t.Fatal(ok, err)
			}
			if o := record(t, s, firing("01", t0)); o[0].Result != ResultDuplicate || o[0].ActionID != first {
				t.Fatalf("copy while running: %+v", o)
			}
			finish(t, s, first, c.state, "why", t0.Add(-30*time.Second), c.leftovers...)
			if o := record(t, s, firing("01", t0)); o[0].Result != ResultDuplicate {
				t.Fatalf("copy 31 s after the end, cooldown 1m: %+v", o)
			}
			finish(t, s, first, c.state, "why", t0.Add(-time.Minute), c.leftovers...)
			o := record(t, s, firing("01", t0))
			if !c.retry {
				if o[0].Result != ResultDuplicate || o[0].ActionID != first {
					t.Fatalf("copy after %s: %+v, want a duplicate", name, o)
				}
				return
			}
			if o[0].Result != ResultAccepted || o[0].ActionID == first || o[0].Attempt != 2 || o[0].RetryOf != first {
				t.Fatalf("copy after the cooldown: %+v, want attempt 2", o)
			}
			second, err := s.Action(ctx, o[0].ActionID)
			if err != nil || second.State != remediate.StateQueued || second.FirstActionID != first || second.RetryOf != first ||
				second.Attempt != 2 || second.GPUUUID != "GPU-1234" || second.Node != "node-a" {
				t.Fatalf("attempt 2: %+v, %v", second, err)
			}
			if evs, err := s.Events(ctx, second.ID); err != nil || len(evs) != 1 || evs[0].Kind != "retry" ||
				!strings.Contains(string(evs[0].Detail), `"cause":"notification"`) || !strings.Contains(string(evs[0].Detail), `"previous_state":"`+string(c.state)+`"`) {
				t.Fatalf("events of attempt 2: %+v, %v", evs, err)
			}
			// Attempt 2 fails too: attempt 3, linked to the first.
			if _, ok, err := s.Claim(ctx, second.ID); err != nil || !ok {
				t.Fatal(ok, err)
			}
			finish(t, s, second.ID, remediate.StateFailed, "again", t0.Add(-time.Hour))
			o = record(t, s, firing("01", t0))
			third, err := s.Action(ctx, o[0].ActionID)
			if err != nil || o[0].Result != ResultAccepted || third.Attempt != 3 || third.FirstActionID != first || third.RetryOf != second.ID {
				t.Fatalf("attempt 3: %+v %+v, %v", o, third, err)
			}
			if _, ok, err := s.Claim(ctx, third.ID); err != nil || !ok {
				t.Fatal(ok, err)
			}
			finish(t, s, third.ID, remediate.StateFailed, "again", t0.Add(-time.Hour))
			if o := record(t, s, firing("01", t0)); o[0].Result != ResultDuplicate || o[0].ActionID != third.ID {
				t.Fatalf("copy after the last attempt: %+v, want a duplicate of it", o)
			}
			// A resolved alert, then a late firing copy: no attempt.
			record(t, s, resolvedCopy(firing("01", t0)))
			s.SetRetry(RetryPolicy{MaxAttempts: 10})
			if o := record(t, s, firing("01", t0)); o[0].Result != ResultDuplicate {
				t.Fatalf("firing copy after the resolution: %+v", o)
			}
			as, err := s.Actions(ctx, Filter{})
			if err != nil || len(as) != 3 {
				t.Fatalf("%d actions, want 3: %v", len(as), err)
			}
		})
	}
}

// TestRetryForwardedAction: a dispatcher's forwarded action is judged by
// its agent's outcome.
func TestRetryForwardedAction(t *testing.T) {
	ctx := context.Background()
	s := openTest(t, "")
	first := record(t, s, firing("01", t0))[0].ActionID
	if _, ok, err := s.Claim(ctx, first); err != nil || !ok {
		t.Fatal(ok, err)
	}
	a, err := s.Action(ctx, first)
	if err != nil {
		t.Fatal(err)
	}
	end := t0.Add(-time.Minute)
	a.State, a.FinishedAt = remediate.StateSucceeded, &end
	a.Agent = &remediate.AgentResult{URL: "http://node-a:10836", ActionID: "x", State: remediate.StateRunning}
	if err := s.Update(ctx, a); err != nil {
		t.Fatal(err)
	}
	if o := record(t, s, firing("01", t0)); o[0].Result != ResultDuplicate {
		t.Fatalf("copy while the agent works: %+v", o)
	}
	a.Agent.State, a.Agent.Reason, a.Agent.FinishedAt = remediate.StateFailed, "memory did not come back", &end
	if err := s.Update(ctx, a); err != nil {
		t.Fatal(err)
	}
	if o := record(t, s, firing("01", t0)); o[0].Result != ResultAccepted || o[0].Attempt != 2 {
		t.Fatalf("copy after the agent failed: %+v", o)
	}
}

func TestActionsFilter(t *testing.T) {
	ctx := context.Background()
	s := openTest(t, "")
	type spec struct {
		node, uuid string
		index      int
		state      remediate.State
		at         time.Duration
	}
	specs := []spec{
		{"n1", "GPU-a", 0, remediate.StateSucceeded, 0},
		{"n1", "GPU-b", 1, remediate.StateFailed, time.Minute},
		{"n2", "GPU-c", 0, remediate.StateSucceeded, 2 * time.Minute},
		{"n2", "GPU-d", 1, remediate.StateDryRun, 3 * time.Minute},
		{"n1", "GPU-a", 0, remediate.StateSkipped, 4 * time.Minute},
	}
	ids := make([]string, len(specs))
	for i, sp := range specs {
		id, err := s.Insert(ctx, remediate.Action{Node: sp.node, GPUUUID: sp.uuid, GPUIndex: sp.index, State: sp.state, StartedAt: t0.Add(sp.at)})
		if err != nil {
			t.Fatal(err)
		}
		ids[i] = id
	}
	for _, tc := range []struct {
		name string
		f    Filter
		want []int // indexes into specs, newest first
	}{
		{"all", Filter{}, []int{4, 3, 2, 1, 0}},
		{"node", Filter{Node: "n1"}, []int{4, 1, 0}},
		{"gpu uuid", Filter{GPU: "GPU-a"}, []int{4, 0}},
		{"gpu index", Filter{GPU: "1"}, []int{3, 1}},
		{"node and gpu index", Filter{Node: "n2", GPU: "0"}, []int{2}},
		{"since inclusive", Filter{Since: t0.Add(2 * time.Minute)}, []int{4, 3, 2}},
		{"until exclusive", Filter{Until: t0.Add(2 * time.Minute)}, []int{1, 0}},
		{"window", Filter{Since: t0.Add(time.Minute), Until: t0.Add(3*time.Minute + 1)}, []int{3, 2, 1}},
		{"state", Filter{State: remediate.StateSucceeded}, []int{2, 0}},
		{"limit", Filter{Limit: 2}, []int{4, 3}},
		{"no match", Filter{Node: "n3"}, nil},
		{"id", Filter{ID: "placeholder"}, []int{2}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.f.ID != "" {
				tc.f.ID = ids[2]
			}
			got, err := s.Actions(ctx, tc.f)
			if err != nil {
				t.Fatal(err)
			}
			var gotIDs, wantIDs []string
			for _, a := range got {
				gotIDs = append(gotIDs, a.ID)
			}
			for _, i := range tc.want {
				wantIDs = append(wantIDs, ids[i])
			}
			if !reflect.DeepEqual(gotIDs, wantIDs) {
				t.Fatalf("got %v, want %v", gotIDs, wantIDs)
			}
		})
	}
}

func TestActionsLimitCapped(t *testing.T) {
	ctx := context.Background()
	s := openTest(t, "")
	// One transaction, or this test would pay for 1,001 fsyncs.
	err := s.withTx(ctx, func(tx *sql.Tx) error {
		for i := range MaxLimit + 1 {
			if err := insertAction(ctx, tx, remediate.Action{ID: fmt.Sprintf("%08d", i), State: remediate.StateSucceeded, StartedAt: t0}); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for limit, want := range map[int]int{0: DefaultLimit, 5000: MaxLimit, 7: 7} {
		got, err := s.Actions(ctx, Filter{Limit: limit})
		if err != nil || len(got) != want {
			t.Fatalf("Limit %d: %d actions, %v; want %d", limit, len(got), err, want)
		}
	}
}

func TestBreakerPersists(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "store.db")
	s := openTest(t, path)
	if open, reason, at, err := s.Breaker(ctx); err != nil || open || reason != "" || !at.IsZero() {
		t.Fatalf("fresh Breaker = %v %q %v %v", open, reason, at, err)
	}
	if err := s.SetBreaker(ctx, true, "3 failed actions in 10m", t0); err != nil {
		t.Fatal(err)
	}
	s.Close()
	s = openTest(t, path)
	open, reason, at, err := s.Breaker(ctx)
	if err != nil || !open || reason != "3 failed actions in 10m" || !at.Equal(t0) {
		t.Fatalf("Breaker after restart = %v %q %v %v", open, reason, at, err)
	}
	if err := s.SetBreaker(ctx, false, "reset by alice", t0.Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	if open, reason, _, _ := s.Breaker(ctx); open || reason != "reset by alice" {
		t.Fatalf("Breaker after reset = %v %q", open, reason)
	}
}

func TestOpen(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()

	_, err := Open(ctx, filepath.Join(dir, "missing", "store.db"))
	if err == nil || !strings.Contains(err.Error(), "does not exist") || !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("missing directory: err = %v", err)
	}
	file := filepath.Join(dir, "file")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Open(ctx, filepath.Join(file, "store.db")); err == nil || !strings.Contains(err.Error(), "not a directory") {
		t.Fatalf("parent is a file: err = %v", err)
	}

	// A directory name that needs escaping in a URI.
	odd := filepath.Join(dir, "a?b#c%20d")
	if err := os.Mkdir(odd, 0o700); err != nil {
		t.Fatal(err)
	}
	s := openTest(t, filepath.Join(odd, "store.db"))
	if _, err := os.Stat(filepath.Join(odd, "store.db")); err != nil {
		t.Fatalf("database not where asked: %v", err)
	}
	for pragma, want := range map[string]string{
		"journal_mode": "wal", "synchronous": "2", "foreign_keys": "1", "busy_timeout": "5000",
		"user_version": fmt.Sprint(SchemaVersion),
	} {
		var got string
		if err := s.db.QueryRow("PRAGMA " + pragma).Scan(&got); err != nil || got != want {
			t.Errorf("PRAGMA %s = %q, %v; want %q", pragma, got, err, want)
		}
	}
	if err := s.Ping(ctx); err != nil {
		t.Fatal(err)
	}

	// A file from a newer binary is left alone.
	if _, err := s.db.Exec(fmt.Sprintf("PRAGMA user_version = %d", SchemaVersion+1)); err != nil {
		t.Fatal(err)
	}
	s.Close()
	if _, err := Open(ctx, filepath.Join(odd, "store.db")); err == nil || !strings.Contains(err.Error(), "newer") {
		t.Fatalf("newer schema: err = %v", err)
	}
}

func isFull(err error) bool {
	var se *sqlite.Error
	return errors.As(err, &se) && se.Code()&0xff == sqlite3.SQLITE_FULL
}

// A full disk, simulated with SQLite's own size limit (root ignores file
// modes): writes fail, nothing half-done is left, and the store recovers
// once there is room again.
func TestFullStore(t *testing.T) {
	ctx := context.Background()
	s := openTest(t, "")
	record(t, s, firing("00", t0))
	if err := s.Ping(ctx); err != nil {
		t.Fatal(err)
	}

	// The limit cannot go below the current size: 1 pins it there.
	if _, err := s.db.Exec("PRAGMA max_page_count = 1"); err != nil {
		t.Fatal(err)
	}
	if err := s.Ping(ctx); !errors.Is(err, ErrNoRoom) {
		t.Fatalf("Ping on a full store: err = %v, want ErrNoRoom", err)
	}
	big := strings.Repeat("x", 2000)
	var (
		failed Alert
		err    error
	)
	for i := range 200 {
		a := firing(fmt.Sprintf("%04x", i+1), t0)
		a.Labels = map[string]string{"description": big}
		if _, err = s.RecordNotification(ctx, Notification{ReceivedAt: t0, Alerts: []Alert{a}}); err != nil {
			failed = a
			break
		}
	}
	if !isFull(err) {
		t.Fatalf("RecordNotification on a full store: err = %v, want SQLITE_FULL", err)
	}
	if _, err := s.Insert(ctx, remediate.Action{Targets: []remediate.Target{{Reason: remediate.TargetReason(big)}, {Reason: remediate.TargetReason(big)}}}); !isFull(err) {
		t.Fatalf("Insert on a full store: err = %v, want SQLITE_FULL", err)
	}

	if _, err := s.db.Exec("PRAGMA max_page_count = 1073741823"); err != nil {
		t.Fatal(err)
	}
	if err := s.Ping(ctx); err != nil {
		t.Fatalf("Ping after room came back: %v", err)
	}
	// The failed notification left nothing behind: its retry is accepted.
	out, err := s.RecordNotification(ctx, Notification{ReceivedAt: t0, Alerts: []Alert{failed}})
	if err != nil || out[0].Result != ResultAccepted {
		t.Fatalf("retry after recovery = %+v, %v", out, err)
	}
}

func TestReadOnlyStore(t *testing.T) {
	ctx := context.Background()
	s := openTest(t, "")
	if _, err := s.db.Exec("PRAGMA query_only = 1"); err != nil {
		t.Fatal(err)
	}
	if err := s.Ping(ctx); err == nil {
		t.Fatal("Ping on a read-only store succeeded")
	}
	if _, err := s.RecordNotification(ctx, Notification{Alerts: []Alert{firing("01", t0)}}); err == nil {
		t.Fatal("RecordNotification on a read-only store succeeded")
	}
	if _, err := s.db.Exec("PRAGMA query_only = 0"); err != nil {
		t.Fatal(err)
	}
	if err := s.Ping(ctx); err != nil {
		t.Fatal(err)
	}
}

func TestIDsSortByTime(t *testing.T) {
	var g idSource
	prev := g.next()
	for range 1000 {
		id := g.next()
		if len(id) != 24 || id <= prev {
			t.Fatalf("id %q after %q", id, prev)
		}
		prev = id
	}
}

func BenchmarkRecordNotification(b *testing.B) {
	ctx := context.Background()
	s := openTest(b, "")
	a := firing("", t0)
	i := 0
	for b.Loop() {
		i++
		a.Fingerprint = fmt.Sprintf("%016x", i)
		// A new alert and an HA replica's copy of it.
		if _, err := s.RecordNotification(ctx, Notification{ReceivedAt: t0, Remote: "am-0", Alerts: []Alert{a, a}}); err != nil {
			b.Fatal(err)
		}
	}
}
