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

// TestMigrateFromVersion4: a store that a remediator of schema version 4
// wrote (before the hooks named their job) opens at the current version;
// its actions read with no job, and take one from then on.
func TestMigrateFromVersion4(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "v4.db")
	db, err := sql.Open("sqlite", "file:"+path+"?_pragma=journal_mode(WAL)")
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range migrations[:4] {
		if _, err := db.Exec(m); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := db.Exec(`PRAGMA user_version = 4`); err != nil {
		t.Fatal(err)
	}
	// A row as version 4's INSERT wrote it: an epilog's, before it named
	// its job on the action.
	if _, err := db.Exec(`INSERT INTO actions(id, node, gpu_uuid, gpu_index, policy, state, reason, dry_run, alert_fingerprint,
		alert_starts_at, source, freed_bytes, started_at, finished_at, verify_seconds, before_json, after_json, targets_json,
		excluded_json, leftover_json, next_step, dead_owners_json, agent_json, attempt, first_action_id, retry_of, escalation)
		VALUES ('old', 'n', 'GPU-1', 0, 'job-end', 'succeeded', '', 0, '', ?, 'epilog', 1024, ?, NULL, 0.5, 'null', 'null', '[]',
		'null', 'null', '', 'null', 'null', 1, '', '', '')`, formatTime(time.Time{}), formatTime(t0)); err != nil {
		t.Fatal(err)
	}
	db.Close()

	if _, err := OpenReadOnly(ctx, path); err == nil || !strings.Contains(err.Error(), fmt.Sprintf("schema version 4, older than this binary's %d", SchemaVersion)) {
		t.Fatalf("OpenReadOnly of a version 4 store: %v", err)
	}
	s := openTest(t, path)
	a, err := s.Action(ctx, "old")
	if err != nil {
		t.Fatal(err)
	}
	if a.Job != nil || a.Source != "epilog" || a.FreedBytes != 1024 || a.Attempt != 1 {
		t.Fatalf("old action after migration: %+v", a)
	}
	uid := 0
	a.Job = &remediate.JobRef{SlurmJob: "42", UID: &uid, User: "root"}
	if err := s.Update(ctx, a); err != nil {
		t.Fatal(err)
	}
	if got, err := s.Action(ctx, "old"); err != nil || !reflect.DeepEqual(got.Job, a.Job) {
		t.Fatalf("job after update: %+v, %v", got.Job, err)
	}
}
