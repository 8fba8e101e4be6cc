package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/gpu-orphan/gpu-orphan/remediate"
)

// Notification is one webhook delivery from Alertmanager.
type Notification struct {
	ReceivedAt time.Time
	Remote     string
	Receiver   string
	GroupKey   string
	Status     string
	Alerts     []Alert
}

// Alert is one alert of a notification, classified by intake.
type Alert struct {
	Fingerprint string
	StartsAt    time.Time
	EndsAt      time.Time
	// Status is the alert's own status, "firing" or "resolved".
	Status  string
	Node    string
	GPUUUID string
	Labels  map[string]string
	// Candidate is true when the alert is work for this remediator;
	// IgnoreReason says why not otherwise.
	Candidate    bool
	IgnoreReason string
	// Rejected marks an alert that is not merely ignored but refused: it
	// names a node on no allow-list of a dispatcher. It is recorded with
	// the result "rejected" and never becomes an action.
	Rejected bool
}

// Results of RecordNotification, per alert.
const (
	ResultAccepted  = "accepted"
	ResultDuplicate = "duplicate"
	ResultIgnored   = "ignored"
	ResultResolved  = "resolved"
	ResultRejected  = "rejected"
)

// ReasonResolvedBeforeAction is the reason of a queued action cancelled
// because its alert resolved first.
const ReasonResolvedBeforeAction = "resolved_before_action"

// AlertOutcome is what RecordNotification made of one alert.
type AlertOutcome struct {
	Fingerprint string    `json:"fingerprint"`
	StartsAt    time.Time `json:"starts_at"`
	Result      string    `json:"result"`
	// ActionID is the action this alert created, or the one it is a
	// duplicate of or resolved; empty when there is none.
	ActionID string `json:"action_id,omitempty"`
	// Reason says why an alert was ignored.
	Reason string `json:"reason,omitempty"`
	// Attempt and RetryOf are set when the alert was accepted again: its
	// last action left the memory held, and ActionID is the next attempt.
	Attempt int    `json:"attempt,omitempty"`
	RetryOf string `json:"retry_of,omitempty"`
}

// RecordNotification records a notification and decides, per alert, in one
// transaction committed before it returns: a firing candidate seen for the
// first time queues an action; a key (fingerprint, startsAt) seen before is
// a duplicate, unless its last action ended with the memory still held, in
// which case it queues the next attempt once the cooldown has passed, up
// to the RetryPolicy's MaxAttempts; a resolved alert cancels its latest
// action if that is still queued. A new action's StartedAt is n.ReceivedAt,
// its GPUIndex the alert's "gpu" label (-1 without one). On error nothing
// was recorded, and the sender should retry.
func (s *Store) RecordNotification(ctx context.Context, n Notification) ([]AlertOutcome, error) {
	if n.ReceivedAt.IsZero() {
		n.ReceivedAt = time.Now()
	}
	out := make([]AlertOutcome, 0, len(n.Alerts))
	err := s.withTx(ctx, func(tx *sql.Tx) error {
		res, err := tx.ExecContext(ctx, `INSERT INTO notifications(received_at, remote, receiver, group_key, status, alerts)
			VALUES (?, ?, ?, ?, ?, ?)`, formatTime(n.ReceivedAt), n.Remote, n.Receiver, n.GroupKey, n.Status, len(n.Alerts))
		if err != nil {
			return fmt.Errorf("inserting notification: %w", err)
		}
		nid, err := res.LastInsertId()
		if err != nil {
			return fmt.Errorf("inserting notification: %w", err)
		}
		for _, a := range n.Alerts {
			o, err := s.recordAlert(ctx, tx, n.ReceivedAt, a)
			if err != nil {
				return fmt.Errorf("alert %s@%s: %w", a.Fingerprint, formatTime(a.StartsAt), err)
			}
			if _, err := tx.ExecContext(ctx, `INSERT INTO deliveries(notification_id, fingerprint, starts_at, status, result, action_id)
				VALUES (?, ?, ?, ?, ?, ?)`, nid, a.Fingerprint, formatTime(a.StartsAt), a.Status, o.Result, nullString(o.ActionID)); err != nil {
				return fmt.Errorf("alert %s: recording delivery: %w", a.Fingerprint, err)
			}
			out = append(out, o)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("recording notification from %s: %w", n.Remote, err)
	}
	return out, nil
}

func (s *Store) recordAlert(ctx context.Context, tx *sql.Tx, now time.Time, a Alert) (AlertOutcome, error) {
	o := AlertOutcome{Fingerprint: a.Fingerprint, StartsAt: a.StartsAt}
	labels, err := toJSON(a.Labels)
	if err != nil {
		return o, err
	}
	key := []any{a.Fingerprint, formatTime(a.StartsAt)}
	ts := formatTime(now)

	resolved := a.Status == "resolved"
	candidate := a.Candidate && !resolved
	reason := a.IgnoreReason
	if !resolved && a.Status != "firing" {
		// Intake validates statuses; should one slip through, record it
		// rather than fail the whole notification into endless retries.
		candidate, reason = false, fmt.Sprintf("unknown alert status %q", a.Status)
	}
	var actionID string
	if candidate {
		actionID = s.ids.next()
	}
	var resolvedAt any
	if resolved {
		resolvedAt = ts
	}

	// The first delivery of a key inserts its row; every later one hits
	// the primary key and changes nothing here.
	res, err := tx.ExecContext(ctx, `INSERT INTO alerts(fingerprint, starts_at, ends_at, status, node, gpu_uuid,
			labels_json, candidate, ignore_reason, action_id, first_seen, last_seen, resolved_at, copies, duplicates)
		VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 1, 0)
		ON CONFLICT(fingerprint, starts_at) DO NOTHING`,
		a.Fingerprint, formatTime(a.StartsAt), formatTime(a.EndsAt), a.Status, a.Node, a.GPUUUID,
		labels, a.Candidate, reason, nullString(actionID), ts, ts, resolvedAt)
	if err != nil {
		return o, fmt.Errorf("inserting alert: %w", err)
	}
	first, err := res.RowsAffected()
	if err != nil {
		return o, fmt.Errorf("inserting alert: %w", err)
	}

	switch {
	case first == 1 && candidate:
		act := remediate.Action{
			ID:               actionID,
			Node:             a.Node,
			GPUUUID:          a.GPUUUID,
			GPUIndex:         gpuIndex(a.Labels),
			State:            remediate.StateQueued,
			AlertFingerprint: a.Fingerprint,
			AlertStartsAt:    a.StartsAt,
			Source:           "webhook",
			StartedAt:        now,
			Targets:          []remediate.Target{},
		}
		if err := insertAction(ctx, tx, act); err != nil {
			return o, err
		}
		o.Result, o.ActionID = ResultAccepted, actionID
		return o, nil
	case first == 1 && resolved:
		o.Result = ResultResolved
		return o, nil
	case first == 1 && a.Rejected:
		o.Result, o.Reason = ResultRejected, reason
		return o, nil
	case first == 1:
		o.Result, o.Reason = ResultIgnored, reason
		return o, nil
	}

	if resolved {
		// The first resolved copy of a firing key: cancel its action if no
		// worker has claimed it yet. A running action is left to finish.
		var id sql.NullString
		err := tx.QueryRowContext(ctx, `UPDATE alerts SET status = 'resolved', ends_at = ?, resolved_at = ?,
				last_seen = ?, copies = copies + 1
			WHERE fingerprint = ? AND starts_at = ? AND status != 'resolved'
			RETURNING action_id`, append([]any{formatTime(a.EndsAt), ts, ts}, key...)...).Scan(&id)
		if err == nil {
			o.Result, o.ActionID = ResultResolved, id.String
			if id.Valid {
				if err := cancelQueued(ctx, tx, id.String, now); err != nil {
					return o, err
				}
			}
			return o, nil
		}
		if !errors.Is(err, sql.ErrNoRows) {
			return o, fmt.Errorf("resolving alert: %w", err)
		}
	}

	// Seen before, firing, and its last attempt left the memory held: the
	// next attempt, once the cooldown has passed (RetryPolicy).
	if candidate {
		if o, ok, err := s.retryAlert(ctx, tx, now, a); err != nil || ok {
			return o, err
		}
	}

	// Seen before with this status (or firing after resolved, a late
	// retry): a duplicate, counted and otherwise ignored.
	var id sql.NullString
	if err := tx.QueryRowContext(ctx, `UPDATE alerts SET copies = copies + 1, duplicates = duplicates + 1, last_seen = ?
		WHERE fingerprint = ? AND starts_at = ? RETURNING action_id`, append([]any{ts}, key...)...).Scan(&id); err != nil {
		return o, fmt.Errorf("counting duplicate: %w", err)
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO counters(name, value) VALUES ('duplicates', 1)
		ON CONFLICT(name) DO UPDATE SET value = value + 1`); err != nil {
		return o, fmt.Errorf("counting duplicate: %w", err)
	}
	o.Result, o.ActionID = ResultDuplicate, id.String
	return o, nil
}

// cancelQueued skips the action if it is still queued, and notes why.
func cancelQueued(ctx context.Context, tx *sql.Tx, id string, now time.Time) error {
	res, err := tx.ExecContext(ctx, `UPDATE actions SET state = ?, reason = ?, finished_at = ? WHERE id = ? AND state = ?`,
		remediate.StateSkipped, ReasonResolvedBeforeAction, formatTime(now), id, remediate.StateQueued)
	if err != nil {
		return fmt.Errorf("cancelling action %s: %w", id, err)
	}
	if n, err := res.RowsAffected(); err != nil || n == 0 {
		return err
	}
	return addEvent(ctx, tx, id, now, "cancel", map[string]string{"reason": ReasonResolvedBeforeAction})
}

// gpuIndex reads the exporter's "gpu" label (the index); -1 when the alert
// does not carry one, since 0 would name a real GPU.
func gpuIndex(labels map[string]string) int {
	if i, err := strconv.Atoi(labels["gpu"]); err == nil && i >= 0 {
		return i
	}
	return -1
}

func nullString(s string) any {
	if s == "" {
		return nil
	}
	return s
}

// AlertLabels returns the labels of the alert (fingerprint, startsAt) as
// its first delivery carried them; nil when it was never recorded.
func (s *Store) AlertLabels(ctx context.Context, fingerprint string, startsAt time.Time) (map[string]string, error) {
	var js string
	err := s.db.QueryRowContext(ctx, `SELECT labels_json FROM alerts WHERE fingerprint = ? AND starts_at = ?`,
		fingerprint, formatTime(startsAt)).Scan(&js)
	if errors.Is(err, sql.ErrNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("reading the labels of alert %s: %w", fingerprint, err)
	}
	var labels map[string]string
	if err := fromJSON(js, &labels); err != nil {
		return nil, err
	}
	return labels, nil
}
