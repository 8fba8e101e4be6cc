package store

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/gpu-orphan/gpu-orphan/remediate"
)

// ReasonInterrupted is the reason of an action that was running when the
// remediator stopped.
const ReasonInterrupted = "remediator restarted mid-action"

// actionColumnList is the actions table's columns in the order that
// actionValues and scanAction use.
var actionColumnList = []string{"id", "node", "gpu_uuid", "gpu_index", "policy", "state", "reason", "dry_run",
	"alert_fingerprint", "alert_starts_at", "source", "freed_bytes", "started_at", "finished_at", "verify_seconds",
	"before_json", "after_json", "targets_json", "excluded_json", "leftover_json", "next_step",
	"dead_owners_json", "agent_json", "attempt", "first_action_id", "retry_of", "escalation", "job_json"}

var (
	actionColumns   = strings.Join(actionColumnList, ", ")
	insertActionSQL = `INSERT INTO actions(` + actionColumns + `) VALUES (?` + strings.Repeat(", ?", len(actionColumnList)-1) + `)`
	updateActionSQL = `UPDATE actions SET ` + strings.Join(actionColumnList[1:], " = ?, ") + ` = ? WHERE id = ?`
)

// querier is what reads need from *sql.DB and *sql.Tx alike.
type querier interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// actionValues are the columns after id, in actionColumns' order.
func actionValues(a remediate.Action) ([]any, error) {
	var finished any
	if a.FinishedAt != nil {
		finished = formatTime(*a.FinishedAt)
	}
	vals := []any{a.Node, a.GPUUUID, a.GPUIndex, a.Policy, a.State, a.Reason, a.DryRun,
		a.AlertFingerprint, formatTime(a.AlertStartsAt), a.Source,
		// SQLite integers are signed; the bits round-trip.
		int64(a.FreedBytes),
		formatTime(a.StartedAt), finished, a.VerifySeconds}
	for _, v := range []any{a.Before, a.After, a.Targets, a.Excluded, a.Leftover} {
		j, err := toJSON(v)
		if err != nil {
			return nil, fmt.Errorf("action %s: %w", a.ID, err)
		}
		vals = append(vals, j)
	}
	vals = append(vals, a.NextStep)
	for _, v := range []any{a.DeadOwners, a.Agent} {
		j, err := toJSON(v)
		if err != nil {
			return nil, fmt.Errorf("action %s: %w", a.ID, err)
		}
		vals = append(vals, j)
	}
	job, err := toJSON(a.Job)
	if err != nil {
		return nil, fmt.Errorf("action %s: %w", a.ID, err)
	}
	return append(vals, max(a.Attempt, 1), a.FirstActionID, a.RetryOf, a.Escalation, job), nil
}

// writeOwners replaces the action_owners rows of an action with its dead
// owners, which the user and slurm_job filters read.
func writeOwners(ctx context.Context, q querier, a remediate.Action) error {
	if _, err := q.ExecContext(ctx, `DELETE FROM action_owners WHERE action_id = ?`, a.ID); err != nil {
		return fmt.Errorf("action %s: clearing its dead owners: %w", a.ID, err)
	}
	for _, o := range a.DeadOwners {
		if _, err := q.ExecContext(ctx, `INSERT INTO action_owners(action_id, pid, owner_user, slurm_job) VALUES (?, ?, ?, ?)`,
			a.ID, o.PID, o.User, o.SlurmJob); err != nil {
			return fmt.Errorf("action %s: recording dead owner %d: %w", a.ID, o.PID, err)
		}
	}
	return nil
}

func insertAction(ctx context.Context, q querier, a remediate.Action) error {
	vals, err := actionValues(a)
	if err != nil {
		return err
	}
	_, err = q.ExecContext(ctx, insertActionSQL, append([]any{a.ID}, vals...)...)
	if err != nil {
		return fmt.Errorf("inserting action %s: %w", a.ID, err)
	}
	if len(a.DeadOwners) == 0 {
		return nil // nothing to clear in a new action
	}
	return writeOwners(ctx, q, a)
}

type rowScanner interface{ Scan(dest ...any) error }

func scanAction(r rowScanner) (remediate.Action, error) {
	var (
		a                                           remediate.Action
		alertStarts, started                        string
		finished                                    sql.NullString
		freed                                       int64
		before, after, targets, excluded, leftovers string
		deadOwners, agent, job                      string
	)
	if err := r.Scan(&a.ID, &a.Node, &a.GPUUUID, &a.GPUIndex, &a.Policy, &a.State, &a.Reason, &a.DryRun,
		&a.AlertFingerprint, &alertStarts, &a.Source, &freed, &started, &finished, &a.VerifySeconds,
		&before, &after, &targets, &excluded, &leftovers, &a.NextStep, &deadOwners, &agent,
		&a.Attempt, &a.FirstActionID, &a.RetryOf, &a.Escalation, &job); err != nil {
		return a, err
	}
	a.FreedBytes = uint64(freed)
	var err error
	if a.AlertStartsAt, err = parseTime(alertStarts); err != nil {
		return a, err
	}
	if a.StartedAt, err = parseTime(started); err != nil {
		return a, err
	}
	if finished.Valid {
		t, err := parseTime(finished.String)
		if err != nil {
			return a, err
		}
		a.FinishedAt = &t
	}
	for _, c := range []struct {
		text string
		dst  any
	}{{before, &a.Before}, {after, &a.After}, {targets, &a.Targets}, {excluded, &a.Excluded}, {leftovers, &a.Leftover},
		{deadOwners, &a.DeadOwners}, {agent, &a.Agent}, {job, &a.Job}} {
		if err := fromJSON(c.text, c.dst); err != nil {
			return a, fmt.Errorf("action %s: %w", a.ID, err)
		}
	}
	return a, nil
}

func queryActions(ctx context.Context, q querier, query string, args ...any) ([]remediate.Action, error) {
	rows, err := q.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []remediate.Action
	for rows.Next() {
		a, err := scanAction(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, a)
	}
	return out, rows.Err()
}

// Insert records an action that no alert created (the CLI's manual
// cleanup, the hooks'). It assigns an ID when a.ID is empty, and the state
// queued when a.State is empty, and returns the ID. An action inserted
// running records this process as the one that runs it (Holder).
func (s *Store) Insert(ctx context.Context, a remediate.Action) (string, error) {
	if a.ID == "" {
		a.ID = s.ids.next()
	}
	if a.State == "" {
		a.State = remediate.StateQueued
	}
	err := s.withTx(ctx, func(tx *sql.Tx) error {
		if err := insertAction(ctx, tx, a); err != nil {
			return err
		}
		// An action inserted running runs in this process (a hook's, the
		// CLI's): the next reader resolves it when this process is gone.
		if a.State == remediate.StateRunning {
			return setHolder(ctx, tx, a.ID)
		}
		return nil
	})
	if err != nil {
		return "", err
	}
	return a.ID, nil
}

// Update writes the whole action: the plan before acting, the result
// after. It returns ErrNotFound for an unknown ID.
func (s *Store) Update(ctx context.Context, a remediate.Action) error {
	vals, err := actionValues(a)
	if err != nil {
		return err
	}
	err = s.withTx(ctx, func(tx *sql.Tx) error {
		res, err := tx.ExecContext(ctx, updateActionSQL, append(vals, a.ID)...)
		if err != nil {
			return err
		}
		n, err := res.RowsAffected()
		if err != nil {
			return err
		}
		if n == 0 {
			return ErrNotFound
		}
		return writeOwners(ctx, tx, a)
	})
	if err != nil {
		return fmt.Errorf("updating action %s: %w", a.ID, err)
	}
	return nil
}

// Queued returns the actions waiting for a worker, oldest first.
func (s *Store) Queued(ctx context.Context) ([]remediate.Action, error) {
	as, err := queryActions(ctx, s.db, `SELECT `+actionColumns+` FROM actions WHERE state = ? ORDER BY started_at, id`,
		remediate.StateQueued)
	if err != nil {
		return nil, fmt.Errorf("listing queued actions: %w", err)
	}
	return as, nil
}

// QueueDepth is the number of queued actions.
func (s *Store) QueueDepth(ctx context.Context) (int, error) {
	var n int
	if err := s.db.QueryRowContext(ctx, `SELECT count(*) FROM actions WHERE state = ?`, remediate.StateQueued).Scan(&n); err != nil {
		return 0, fmt.Errorf("counting queued actions: %w", err)
	}
	return n, nil
}

// Claim moves a queued action to running and returns it. It returns false
// when the action is not queued any more (cancelled by a resolved alert,
// claimed by another worker) or does not exist: the caller must not act.
func (s *Store) Claim(ctx context.Context, id string) (remediate.Action, bool, error) {
	var (
		a  remediate.Action
		ok bool
	)
	err := s.withTx(ctx, func(tx *sql.Tx) error {
		var err error
		a, err = scanAction(tx.QueryRowContext(ctx, `UPDATE actions SET state = ? WHERE id = ? AND state = ?
			RETURNING `+actionColumns, remediate.StateRunning, id, remediate.StateQueued))
		if errors.Is(err, sql.ErrNoRows) {
			return nil
		}
		if err != nil {
			return err
		}
		ok = true
		// The claimer runs it: the next reader resolves it when this
		// process is gone (ResolveStranded).
		if err := setHolder(ctx, tx, id); err != nil {
			return err
		}
		return addEvent(ctx, tx, id, time.Now(), "claim", nil)
	})
	if err != nil {
		return remediate.Action{}, false, fmt.Errorf("claiming action %s: %w", id, err)
	}
	if !ok {
		return remediate.Action{}, false, nil
	}
	return a, true, nil
}

// Filter selects actions. Zero fields match everything.
type Filter struct {
	// ID selects one action by its exact ID.
	ID   string
	Node string
	// GPU matches the GPU's UUID or, when it is a number, its index.
	GPU string
	// Since is inclusive and Until exclusive, on StartedAt.
	Since, Until time.Time
	State        remediate.State
	// User and SlurmJob select actions with a dead owner of that user, or
	// of that Slurm job (Action.DeadOwners), and the prolog's and the
	// epilog's actions for a job of that user, or for that job (Action.Job).
	User, SlurmJob string
	// AgentPending selects a dispatcher's actions whose agent's result is
	// still to come (Action.Agent queued or running).
	AgentPending bool
	// Limit defaults to DefaultLimit and is capped at MaxLimit.
	Limit int
}

// Limits on the number of actions one query returns.
const (
	DefaultLimit = 100
	MaxLimit     = 1000
)

// Actions returns the actions that match f, newest first.
func (s *Store) Actions(ctx context.Context, f Filter) ([]remediate.Action, error) {
	var (
		where []string
		args  []any
	)
	if f.ID != "" {
		where, args = append(where, "id = ?"), append(args, f.ID)
	}
	if f.Node != "" {
		where, args = append(where, "node = ?"), append(args, f.Node)
	}
	if f.GPU != "" {
		if i, err := strconv.Atoi(f.GPU); err == nil {
			where, args = append(where, "(gpu_uuid = ? OR gpu_index = ?)"), append(args, f.GPU, i)
		} else {
			where, args = append(where, "gpu_uuid = ?"), append(args, f.GPU)
		}
	}
	if !f.Since.IsZero() {
		where, args = append(where, "started_at >= ?"), append(args, formatTime(f.Since))
	}
	if !f.Until.IsZero() {
		where, args = append(where, "started_at < ?"), append(args, formatTime(f.Until))
	}
	if f.State != "" {
		where, args = append(where, "state = ?"), append(args, f.State)
	}
	if f.User != "" {
		where, args = append(where, "(id IN (SELECT action_id FROM action_owners WHERE owner_user = ?) OR json_extract(job_json, '$.user') = ?)"),
			append(args, f.User, f.User)
	}
	if f.SlurmJob != "" {
		where, args = append(where, "(id IN (SELECT action_id FROM action_owners WHERE slurm_job = ?) OR json_extract(job_json, '$.slurm_job') = ?)"),
			append(args, f.SlurmJob, f.SlurmJob)
	}
	if f.AgentPending {
		where = append(where, "agent_json != 'null' AND json_extract(agent_json, '$.state') IN (?, ?)")
		args = append(args, remediate.StateQueued, remediate.StateRunning)
	}
	limit := f.Limit
	if limit <= 0 {
		limit = DefaultLimit
	}
	limit = min(limit, MaxLimit)

	q := `SELECT ` + actionColumns + ` FROM actions`
	if len(where) > 0 {
		q += ` WHERE ` + strings.Join(where, " AND ")
	}
	q += ` ORDER BY started_at DESC, id DESC LIMIT ?`
	as, err := queryActions(ctx, s.db, q, append(args, limit)...)
	if err != nil {
		return nil, fmt.Errorf("listing actions: %w", err)
	}
	return as, nil
}

// Action returns one action, or ErrNotFound.
func (s *Store) Action(ctx context.Context, id string) (remediate.Action, error) {
	a, err := scanAction(s.db.QueryRowContext(ctx, `SELECT `+actionColumns+` FROM actions WHERE id = ?`, id))
	if errors.Is(err, sql.ErrNoRows) {
		err = ErrNotFound
	}
	if err != nil {
		return remediate.Action{}, fmt.Errorf("reading action %s: %w", id, err)
	}
	return a, nil
}

// Event is one step of an action, in the order it happened.
type Event struct {
	ID       int64           `json:"id"`
	ActionID string          `json:"action_id"`
	At       time.Time       `json:"at"`
	Kind     string          `json:"kind"`
	Detail   json.RawMessage `json:"detail"`
}

// AddEvent appends an event (kinds like "plan", "signal", "verify") to an
// action's history; detail is stored as JSON. The action must exist. The
// store adds "claim", "cancel" and "interrupted" events itself.
func (s *Store) AddEvent(ctx context.Context, actionID, kind string, detail any) error {
	err := s.withTx(ctx, func(tx *sql.Tx) error { return addEvent(ctx, tx, actionID, time.Now(), kind, detail) })
	if err != nil {
		return fmt.Errorf("adding %s event to action %s: %w", kind, actionID, err)
	}
	return nil
}

func addEvent(ctx context.Context, tx *sql.Tx, actionID string, at time.Time, kind string, detail any) error {
	d, err := toJSON(detail)
	if err != nil {
		return err
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO events(action_id, at, kind, detail) VALUES (?, ?, ?, ?)`,
		actionID, formatTime(at), kind, d); err != nil {
		return fmt.Errorf("inserting %s event: %w", kind, err)
	}
	return nil
}

// Events returns an action's events, oldest first.
func (s *Store) Events(ctx context.Context, actionID string) ([]Event, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT id, action_id, at, kind, detail FROM events WHERE action_id = ? ORDER BY id`, actionID)
	if err != nil {
		return nil, fmt.Errorf("listing events of action %s: %w", actionID, err)
	}
	defer rows.Close()
	var out []Event
	for rows.Next() {
		var (
			e      Event
			at, dt string
		)
		if err := rows.Scan(&e.ID, &e.ActionID, &at, &e.Kind, &dt); err != nil {
			return nil, fmt.Errorf("listing events of action %s: %w", actionID, err)
		}
		if e.At, err = parseTime(at); err != nil {
			return nil, fmt.Errorf("listing events of action %s: %w", actionID, err)
		}
		e.Detail = json.RawMessage(dt)
		out = append(out, e)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("listing events of action %s: %w", actionID, err)
	}
	return out, nil
}
