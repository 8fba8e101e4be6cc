package store

import (
	"context"
	"database/sql"
	"fmt"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/remediate"
)

// TestDeadOwnerFilter: Filter.User and Filter.SlurmJob select actions by
// their dead owners, and follow an Update that changes them.
func TestDeadOwnerFilter(t *testing.T) {
	ctx := context.Background()
	s := openTest(t, "")
	alice := remediate.DeadOwner{PID: 1, Known: true, User: "alice", SlurmJob: "100"}
	bob := remediate.DeadOwner{PID: 2, Known: true, User: "bob", SlurmJob: "200"}
	var ids []string
	for i, owners := range [][]remediate.DeadOwner{{alice}, {alice, bob}, {{PID: 3}}, nil} {
		id, err := s.Insert(ctx, remediate.Action{Node: "n", State: remediate.StateSucceeded, StartedAt: t0.Add(time.Duration(i) * time.Second), DeadOwners: owners})
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	// An epilog's action for carol's job 300 (its targets are the job's
	// live processes, no dead owner), and a prolog's for dave's job 400
	// that cleaned alice's job 100.
	for i, a := range []remediate.Action{
		{Source: remediate.SourceEpilog, Job: &remediate.JobRef{SlurmJob: "300", User: "carol"}},
		{Source: remediate.SourceProlog, Job: &remediate.JobRef{SlurmJob: "400", User: "dave"}, DeadOwners: []remediate.DeadOwner{alice}},
	} {
		a.Node, a.State, a.StartedAt = "n", remediate.StateSucceeded, t0.Add(time.Duration(10+i)*time.Second)
		id, err := s.Insert(ctx, a)
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	check := func(f Filter, want ...int) {
		t.Helper()
		got, err := s.Actions(ctx, f)
		if err != nil {
			t.Fatal(err)
		}
		var gotIDs, wantIDs []string
		for _, a := range got {
			gotIDs = append(gotIDs, a.ID)
		}
		for _, i := range want {
			wantIDs = append(wantIDs, ids[i])
		}
		if !reflect.DeepEqual(gotIDs, wantIDs) {
			t.Errorf("%+v: got %v, want %v", f, gotIDs, wantIDs)
		}
	}
	check(Filter{User: "bob"}, 1)
	check(Filter{SlurmJob: "300"}, 4)
	check(Filter{User: "carol"}, 4)
	check(Filter{SlurmJob: "400", User: "dave"}, 5)
	check(Filter{SlurmJob: "100"}, 5, 1, 0)
	check(Filter{User: "alice"}, 5, 1, 0)
	check(Filter{SlurmJob: "300", User: "alice"})
	check(Filter{SlurmJob: "200", User: "alice"}, 1)
	check(Filter{SlurmJob: "200", User: "nobody"})
	check(Filter{}, 5, 4, 3, 2, 1, 0)

	// The plan names other owners on the next look: the filter follows.
	a, err := s.Action(ctx, ids[1])
	if err != nil {
		t.Fatal(err)
	}
	a.DeadOwners = []remediate.DeadOwner{bob}
	if err := s.Update(ctx, a); err != nil {
		t.Fatal(err)
	}
	check(Filter{User: "alice"}, 5, 0)
	check(Filter{User: "bob"}, 1)
}

// TestAgentPending: a dispatcher's actions whose agent has not finished.
func TestAgentPending(t *testing.T) {
	ctx := context.Background()
	s := openTest(t, "")
	var ids []string
	for i, agent := range []*remediate.AgentResult{
		nil,
		{URL: "http://a", ActionID: "1", State: remediate.StateQueued},
		{URL: "http://a", ActionID: "2", State: remediate.StateRunning},
		{URL: "http://a", ActionID: "3", State: remediate.StateSucceeded},
		{URL: "http://a", State: remediate.StateSkipped, Reason: "ignored by the agent"},
	} {
		id, err := s.Insert(ctx, remediate.Action{Node: "n", State: remediate.StateSucceeded, Source: "dispatch", StartedAt: t0.Add(time.Duration(i) * time.Second), Agent: agent})
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	got, err := s.Actions(ctx, Filter{AgentPending: true})
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got[0].ID != ids[2] || got[1].ID != ids[1] {
		t.Fatalf("pending: %+v", got)
	}
}

// TestMigrateFromVersion1: a database that a remediator of schema version 1
// wrote opens at the current version; its actions read with no dead owners
// and no agent, and take them from then on.
func TestMigrateFromVersion1(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "v1.db")
	db, err := sql.Open("sqlite", "file:"+path+"?_pragma=journal_mode(WAL)")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(migrations[0]); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`PRAGMA user_version = 1`); err != nil {
		t.Fatal(err)
	}
	// A row as version 1's INSERT wrote it.
	if _, err := db.Exec(`INSERT INTO actions(id, node, gpu_uuid, gpu_index, policy, state, reason, dry_run, alert_fingerprint,
		alert_starts_at, source, freed_bytes, started_at, finished_at, verify_seconds, before_json, after_json, targets_json,
		excluded_json, leftover_json, next_step) VALUES ('old', 'n', 'GPU-1', 0, 'dead-owner', 'succeeded', '', 0, 'fp',
		?, 'webhook', 1024, ?, NULL, 0.5, 'null', 'null', '[]', 'null', 'null', '')`, formatTime(t0), formatTime(t0)); err != nil {
		t.Fatal(err)
	}
	db.Close()

	// Read-only, an old schema is refused with what to do.
	if _, err := OpenReadOnly(ctx, path); err == nil || !strings.Contains(err.Error(), fmt.Sprintf("schema version 1, older than this binary's %d", SchemaVersion)) {
		t.Fatalf("OpenReadOnly of a version 1 store: %v", err)
	}

	s := openTest(t, path)
	a, err := s.Action(ctx, "old")
	if err != nil {
		t.Fatal(err)
	}
	if a.DeadOwners != nil || a.Agent != nil || a.FreedBytes != 1024 || a.State != remediate.StateSucceeded {
		t.Fatalf("old action after migration: %+v", a)
	}
	a.DeadOwners = []remediate.DeadOwner{{PID: 7, Known: true, User: "alice", SlurmJob: "9"}}
	if err := s.Update(ctx, a); err != nil {
		t.Fatal(err)
	}
	got, err := s.Actions(ctx, Filter{SlurmJob: "9"})
	if err != nil || len(got) != 1 || got[0].ID != "old" {
		t.Fatalf("filter after migration: %+v, %v", got, err)
	}
}

// TestOpenReadOnly: the report's view of a store writes nothing, and says
// what is wrong with a path that is not a store.
func TestOpenReadOnly(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	path := filepath.Join(dir, "store.db")
	s := openTest(t, path)
	if _, err := s.Insert(ctx, fullAction()); err != nil {
		t.Fatal(err)
	}
	ro, err := OpenReadOnly(ctx, path)
	if err != nil {
		t.Fatal(err)
	}
	defer ro.Close()
	got, err := ro.Actions(ctx, Filter{User: "alice"})
	if err != nil || len(got) != 1 || len(got[0].DeadOwners) != 2 {
		t.Fatalf("read-only read: %+v, %v", got, err)
	}
	if _, err := ro.Insert(ctx, fullAction()); err == nil {
		t.Fatal("a read-only store accepted a write")
	}

	if _, err := OpenReadOnly(ctx, filepath.Join(dir, "missing.db")); err == nil || !strings.Contains(err.Error(), "no audit database at") {
		t.Errorf("missing file: %v", err)
	}
	if _, err := OpenReadOnly(ctx, dir); err == nil || !strings.Contains(err.Error(), "is not a file") {
		t.Errorf("a directory: %v", err)
	}
}
