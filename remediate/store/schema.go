package store

import (
	"context"
	"database/sql"
	"fmt"
)

// migrations[i] takes the schema from version i to i+1 (PRAGMA
// user_version). Append; never edit a released step.
var migrations = []string{
	// 1: the initial schema. Times are UTC text in timeLayout, which sorts
	// like the instants it names.
	`
CREATE TABLE actions (
	id                TEXT PRIMARY KEY,
	node              TEXT NOT NULL,
	gpu_uuid          TEXT NOT NULL,
	gpu_index         INTEGER NOT NULL,
	policy            TEXT NOT NULL,
	state             TEXT NOT NULL,
	reason            TEXT NOT NULL,
	dry_run           INTEGER NOT NULL,
	alert_fingerprint TEXT NOT NULL,
	alert_starts_at   TEXT NOT NULL,
	source            TEXT NOT NULL,
	freed_bytes       INTEGER NOT NULL,
	started_at        TEXT NOT NULL,
	finished_at       TEXT,
	verify_seconds    REAL NOT NULL,
	before_json       TEXT NOT NULL,
	after_json        TEXT NOT NULL,
	targets_json      TEXT NOT NULL,
	excluded_json     TEXT NOT NULL,
	leftover_json     TEXT NOT NULL,
	next_step         TEXT NOT NULL
);
CREATE INDEX actions_state ON actions(state, started_at);
CREATE INDEX actions_started ON actions(started_at);
CREATE INDEX actions_node ON actions(node, started_at);
CREATE INDEX actions_gpu ON actions(gpu_uuid);

CREATE TABLE notifications (
	id          INTEGER PRIMARY KEY,
	received_at TEXT NOT NULL,
	remote      TEXT NOT NULL,
	receiver    TEXT NOT NULL,
	group_key   TEXT NOT NULL,
	status      TEXT NOT NULL,
	alerts      INTEGER NOT NULL
);

-- One row per alert instance: Alertmanager's idempotency key is
-- (fingerprint, startsAt). The UNIQUE key is what stops two concurrent
-- deliveries from creating two actions.
CREATE TABLE alerts (
	fingerprint   TEXT NOT NULL,
	starts_at     TEXT NOT NULL,
	ends_at       TEXT NOT NULL,
	status        TEXT NOT NULL,
	node          TEXT NOT NULL,
	gpu_uuid      TEXT NOT NULL,
	labels_json   TEXT NOT NULL,
	candidate     INTEGER NOT NULL,
	ignore_reason TEXT NOT NULL,
	action_id     TEXT REFERENCES actions(id) DEFERRABLE INITIALLY DEFERRED,
	first_seen    TEXT NOT NULL,
	last_seen     TEXT NOT NULL,
	resolved_at   TEXT,
	copies        INTEGER NOT NULL,
	duplicates    INTEGER NOT NULL,
	PRIMARY KEY (fingerprint, starts_at)
);
CREATE INDEX alerts_action ON alerts(action_id);

-- Every delivery of every alert, with what we made of it.
CREATE TABLE deliveries (
	notification_id INTEGER NOT NULL REFERENCES notifications(id),
	fingerprint     TEXT NOT NULL,
	starts_at       TEXT NOT NULL,
	status          TEXT NOT NULL,
	result          TEXT NOT NULL,
	action_id       TEXT,
	FOREIGN KEY (fingerprint, starts_at) REFERENCES alerts(fingerprint, starts_at)
);
CREATE INDEX deliveries_notification ON deliveries(notification_id);
CREATE INDEX deliveries_alert ON deliveries(fingerprint, starts_at);

CREATE TABLE events (
	id        INTEGER PRIMARY KEY,
	action_id TEXT NOT NULL REFERENCES actions(id),
	at        TEXT NOT NULL,
	kind      TEXT NOT NULL,
	detail    TEXT NOT NULL
);
CREATE INDEX events_action ON events(action_id, id);

CREATE TABLE breaker (
	id     INTEGER PRIMARY KEY CHECK (id = 1),
	open   INTEGER NOT NULL,
	reason TEXT NOT NULL,
	at     TEXT NOT NULL
);

CREATE TABLE heartbeat (
	id    INTEGER PRIMARY KEY CHECK (id = 1),
	at    TEXT NOT NULL,
	beats INTEGER NOT NULL
);

CREATE TABLE counters (
	name  TEXT PRIMARY KEY,
	value INTEGER NOT NULL
);
`,
	// 2: who left the memory. dead_owners_json is Action.DeadOwners;
	// action_owners repeats each dead owner's user and Slurm job (empty
	// when unknown) for GET /api/v1/actions?user=&slurm_job=. agent_json is
	// a dispatcher's Action.Agent. Rows of version 1 read as none.
	`
ALTER TABLE actions ADD COLUMN dead_owners_json TEXT NOT NULL DEFAULT 'null';
ALTER TABLE actions ADD COLUMN agent_json TEXT NOT NULL DEFAULT 'null';

CREATE TABLE action_owners (
	action_id  TEXT NOT NULL REFERENCES actions(id),
	pid        INTEGER NOT NULL,
	owner_user TEXT NOT NULL,
	slurm_job  TEXT NOT NULL
);
CREATE INDEX action_owners_action ON action_owners(action_id);
CREATE INDEX action_owners_user ON action_owners(owner_user, action_id);
CREATE INDEX action_owners_slurm_job ON action_owners(slurm_job, action_id);
`,
	// 3: what the node's collector remembers across restarts (the owners it
	// saw alive, the descent it recorded: snapshot.Lineage), by name.
	`
CREATE TABLE state (
	name       TEXT PRIMARY KEY,
	value      BLOB NOT NULL,
	updated_at TEXT NOT NULL
);
`,
	// 4: attempts (issue 16). An alert whose action ended with its memory
	// still held gets another action, linked to the first (first_action_id)
	// and to the one it follows (retry_of); attempt numbers them from 1.
	// escalation is Action.Escalation. Rows of earlier versions are first
	// attempts. alerts.action_id names the alert's latest attempt from now
	// on, so that a resolved alert cancels that one.
	`
ALTER TABLE actions ADD COLUMN attempt INTEGER NOT NULL DEFAULT 1;
ALTER TABLE actions ADD COLUMN first_action_id TEXT NOT NULL DEFAULT '';
ALTER TABLE actions ADD COLUMN retry_of TEXT NOT NULL DEFAULT '';
ALTER TABLE actions ADD COLUMN escalation TEXT NOT NULL DEFAULT '';
CREATE INDEX actions_alert ON actions(alert_fingerprint, alert_starts_at, attempt);
`,
	// 5: the Slurm job of a prolog's or an epilog's action (issue 17):
	// job_json is Action.Job; rows of earlier versions read as none.
	// actions_source_state serves the count of recorded actions by source
	// and state that the node agent exposes at every scrape
	// (gpu_orphan_remediator_recorded_actions_total) from the index alone.
	`
ALTER TABLE actions ADD COLUMN job_json TEXT NOT NULL DEFAULT 'null';
CREATE INDEX actions_source_state ON actions(source, state);
`,
	// 6: one action per GPU at a time across the node agent and the hooks
	// (issue 24). holder_json names the process that runs a running action
	// (store.Holder: PID, start time, boot, PID namespace), so that the
	// next reader resolves one whose process is gone; rows of earlier
	// versions name none. gpu_turns holds, per GPU, the action whose turn
	// it is, and its process.
	`
ALTER TABLE actions ADD COLUMN holder_json TEXT NOT NULL DEFAULT 'null';
CREATE TABLE gpu_turns (
	gpu_uuid    TEXT PRIMARY KEY,
	action_id   TEXT NOT NULL,
	source      TEXT NOT NULL,
	holder_json TEXT NOT NULL,
	taken_at    TEXT NOT NULL
);
`,
}

// SchemaVersion is the schema version this package writes.
var SchemaVersion = len(migrations)

// migrate applies the missing migrations, each in its own transaction with
// its version bump, so a crash leaves the file at a known version. The
// version is read inside the write transaction: two processes opening a
// new file at once do not both migrate it.
func (s *Store) migrate(ctx context.Context) error {
	for {
		done := false
		err := s.withTx(ctx, func(tx *sql.Tx) error {
			var v int
			if err := tx.QueryRowContext(ctx, "PRAGMA user_version").Scan(&v); err != nil {
				return fmt.Errorf("reading schema version: %w", err)
			}
			if v > len(migrations) {
				return fmt.Errorf("schema version %d is newer than this binary's %d: refusing to touch it", v, len(migrations))
			}
			if v == len(migrations) {
				done = true
				return nil
			}
			if _, err := tx.ExecContext(ctx, migrations[v]); err != nil {
				return fmt.Errorf("migrating schema to version %d: %w", v+1, err)
			}
			// PRAGMA takes no bound parameters.
			if _, err := tx.ExecContext(ctx, fmt.Sprintf("PRAGMA user_version = %d", v+1)); err != nil {
				return fmt.Errorf("setting schema version %d: %w", v+1, err)
			}
			return nil
		})
		if err != nil {
			return err
		}
		if done {
			return nil
		}
	}
}
