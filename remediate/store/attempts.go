package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/gpu-orphan/gpu-orphan/remediate"
)

// DefaultMaxAttempts is how many actions one alert gets at most, the first
// included, unless SetRetry says otherwise.
const DefaultMaxAttempts = 3

// RetryPolicy says when an alert whose last action left its memory held
// (remediate.Action.MemoryHeld) gets another attempt.
type RetryPolicy struct {
	// MaxAttempts bounds the actions of one alert, the first included; 1
	// or less makes none after the first.
	MaxAttempts int
	// Cooldown is how long after an attempt ended a notification of the
	// same alert may start the next one; a duplicate before that is a
	// duplicate. A restart's interrupted attempt is taken up at start-up,
	// without waiting.
	Cooldown time.Duration
}

// Retry causes, as the "retry" event of a new attempt names them.
const (
	// RetryRestart: the attempt before was running when the remediator
	// stopped; the new one is queued at start-up.
	RetryRestart = "restart"
	// RetryNotification: the attempt before ended with the memory still
	// held, and Alertmanager notified the alert again after the cooldown.
	RetryNotification = "notification"
)

// SetRetry sets the retry policy. Call it before the store is used.
func (s *Store) SetRetry(p RetryPolicy) { s.retry = p }

// latestAttempt returns the alert's last action; ok is false when it has
// none.
func latestAttempt(ctx context.Context, q querier, fingerprint string, startsAt time.Time) (remediate.Action, bool, error) {
	a, err := scanAction(q.QueryRowContext(ctx, `SELECT `+actionColumns+` FROM actions
		WHERE alert_fingerprint = ? AND alert_starts_at = ? ORDER BY attempt DESC, started_at DESC LIMIT 1`,
		fingerprint, formatTime(startsAt)))
	if errors.Is(err, sql.ErrNoRows) {
		return remediate.Action{}, false, nil
	}
	if err != nil {
		return remediate.Action{}, false, fmt.Errorf("reading the last attempt of alert %s: %w", fingerprint, err)
	}
	return a, true, nil
}

// endedAt is when an attempt ended: for a dispatcher's forwarded action,
// when its agent finished.
func endedAt(a remediate.Action) time.Time {
	switch {
	case a.Agent != nil && a.Agent.FinishedAt != nil:
		return *a.Agent.FinishedAt
	case a.FinishedAt != nil:
		return *a.FinishedAt
	}
	return a.StartedAt
}

// mayRetry says whether a notification at now of the alert whose last
// attempt is last starts another attempt, and if not, why not (for the
// log and tests).
func (s *Store) mayRetry(last remediate.Action, now time.Time) (bool, string) {
	switch {
	case !last.State.Final():
		return false, "its action is " + string(last.State)
	case !last.MemoryHeld():
		return false, "its action ended " + string(last.State) + " with the memory back or nothing to do"
	case last.Attempt >= s.retry.MaxAttempts:
		return false, fmt.Sprintf("attempt %d of at most %d", last.Attempt, s.retry.MaxAttempts)
	case now.Sub(endedAt(last)) < s.retry.Cooldown:
		return false, "cooling down"
	}
	return true, ""
}

// nextAttempt is the queued action that follows last, created at now.
func nextAttempt(id string, last remediate.Action, now time.Time) remediate.Action {
	first := last.FirstActionID
	if first == "" {
		first = last.ID
	}
	return remediate.Action{
		ID:               id,
		Node:             last.Node,
		GPUUUID:          last.GPUUUID,
		GPUIndex:         last.GPUIndex,
		State:            remediate.StateQueued,
		AlertFingerprint: last.AlertFingerprint,
		AlertStartsAt:    last.AlertStartsAt,
		Source:           "webhook",
		StartedAt:        now,
		Targets:          []remediate.Target{},
		Attempt:          max(last.Attempt, 1) + 1,
		FirstActionID:    first,
		RetryOf:          last.ID,
	}
}

// startAttempt records the attempt that follows last: the action, queued,
// its "retry" event, and the alert pointing at it (so that its resolution
// cancels it).
func (s *Store) startAttempt(ctx context.Context, tx *sql.Tx, last remediate.Action, now time.Time, cause string) (remediate.Action, error) {
	next := nextAttempt(s.ids.next(), last, now)
	if err := insertAction(ctx, tx, next); err != nil {
		return next, err
	}
	if _, err := tx.ExecContext(ctx, `UPDATE alerts SET action_id = ? WHERE fingerprint = ? AND starts_at = ?`,
		next.ID, next.AlertFingerprint, formatTime(next.AlertStartsAt)); err != nil {
		return next, fmt.Errorf("linking alert %s to attempt %d: %w", next.AlertFingerprint, next.Attempt, err)
	}
	reason := last.Reason
	if last.Agent != nil && last.State == remediate.StateSucceeded {
		reason = "the agent's action " + last.Agent.ActionID + " ended " + string(last.Agent.State) + ": " + last.Agent.Reason
	}
	return next, addEvent(ctx, tx, next.ID, now, "retry", map[string]any{
		"cause": cause, "attempt": next.Attempt, "retry_of": last.ID, "first_action_id": next.FirstActionID,
		"previous_state": last.State, "previous_reason": reason,
	})
}

// retryAlert starts another attempt for a firing delivery of an alert
// already recorded, when its last attempt left the memory held; ok is
// false when the delivery is a duplicate.
func (s *Store) retryAlert(ctx context.Context, tx *sql.Tx, now time.Time, a Alert) (AlertOutcome, bool, error) {
	o := AlertOutcome{Fingerprint: a.Fingerprint, StartsAt: a.StartsAt}
	var status string
	err := tx.QueryRowContext(ctx, `SELECT status FROM alerts WHERE fingerprint = ? AND starts_at = ?`,
		a.Fingerprint, formatTime(a.StartsAt)).Scan(&status)
	if err != nil {
		return o, false, fmt.Errorf("reading the alert: %w", err)
	}
	if status == "resolved" {
		return o, false, nil // a late copy of a firing notification
	}
	last, found, err := latestAttempt(ctx, tx, a.Fingerprint, a.StartsAt)
	if err != nil || !found {
		return o, false, err
	}
	if ok, _ := s.mayRetry(last, now); !ok {
		return o, false, nil
	}
	next, err := s.startAttempt(ctx, tx, last, now, RetryNotification)
	if err != nil {
		return o, false, err
	}
	ts := formatTime(now)
	if _, err := tx.ExecContext(ctx, `UPDATE alerts SET copies = copies + 1, last_seen = ? WHERE fingerprint = ? AND starts_at = ?`,
		ts, a.Fingerprint, formatTime(a.StartsAt)); err != nil {
		return o, false, fmt.Errorf("counting the alert's copy: %w", err)
	}
	o.Result, o.ActionID, o.Attempt, o.RetryOf = ResultAccepted, next.ID, next.Attempt, next.RetryOf
	return o, true, nil
}

// Recover is for start-up: every action still running was cut off by a
// restart and becomes interrupted. Each that an alert created, within the
// attempts of the retry policy and while the alert has not resolved, is
// taken up again as a new attempt, queued: it plans from a fresh snapshot
// under the same rules, and never replays the interrupted one's targets.
// Queued actions stay queued. It returns the interrupted actions and the
// new attempts.
func (s *Store) Recover(ctx context.Context) (interrupted, resumed []remediate.Action, err error) {
	now := time.Now()
	err = s.withTx(ctx, func(tx *sql.Tx) error {
		interrupted, resumed = nil, nil
		var err error
		interrupted, err = queryActions(ctx, tx, `UPDATE actions SET state = ?, reason = ?, finished_at = ?
			WHERE state = ? RETURNING `+actionColumns,
			remediate.StateInterrupted, ReasonInterrupted, formatTime(now), remediate.StateRunning)
		if err != nil {
			return err
		}
		for _, a := range interrupted {
			detail := map[string]any{"reason": ReasonInterrupted}
			if next, ok, err := s.resume(ctx, tx, a, now); err != nil {
				return err
			} else if ok {
				resumed = append(resumed, next)
				detail["resumed_by"] = next.ID
			}
			if err := addEvent(ctx, tx, a.ID, now, "interrupted", detail); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return nil, nil, fmt.Errorf("recovering the actions a restart interrupted: %w", err)
	}
	return interrupted, resumed, nil
}

// resume starts the attempt that follows an interrupted action, if it has
// an alert that still fires and attempts are left.
func (s *Store) resume(ctx context.Context, tx *sql.Tx, a remediate.Action, now time.Time) (remediate.Action, bool, error) {
	if a.AlertFingerprint == "" || a.Attempt >= s.retry.MaxAttempts {
		return remediate.Action{}, false, nil
	}
	var status string
	err := tx.QueryRowContext(ctx, `SELECT status FROM alerts WHERE fingerprint = ? AND starts_at = ?`,
		a.AlertFingerprint, formatTime(a.AlertStartsAt)).Scan(&status)
	if errors.Is(err, sql.ErrNoRows) || (err == nil && status == "resolved") {
		return remediate.Action{}, false, nil
	}
	if err != nil {
		return remediate.Action{}, false, fmt.Errorf("reading the alert of action %s: %w", a.ID, err)
	}
	// A later attempt of the same alert exists already (a retry that a
	// notification queued while this one ran): that one carries on.
	if last, found, err := latestAttempt(ctx, tx, a.AlertFingerprint, a.AlertStartsAt); err != nil {
		return remediate.Action{}, false, err
	} else if found && last.ID != a.ID {
		return remediate.Action{}, false, nil
	}
	next, err := s.startAttempt(ctx, tx, a, now, RetryRestart)
	return next, err == nil, err
}
