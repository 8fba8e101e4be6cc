package store

// One action per GPU at a time, across the node agent and the hooks
// (gpu-orphan prolog, epilog, clean --act), which share this file: the
// store is the lock. A GPU's turn is a row of gpu_turns naming the action
// and the process that runs it, taken in a transaction, released when the
// action ends, and taken over when that process is gone. And a running
// action whose process is gone (a hook killed with SIGKILL, a remediator
// that died) is resolved as interrupted by the next reader, agent or
// hook, and taken up again as the agent takes up its own.

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"sync"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/proc"
	"github.com/gpu-orphan/gpu-orphan/remediate"
)

// Holder is the process that runs an action: its PID and start time (field
// 22 of /proc/PID/stat), of this boot, in this PID namespace. A PID alone
// could name another process once the holder is gone.
type Holder struct {
	PID       int    `json:"pid"`
	StartTime uint64 `json:"start_time"`
	BootID    string `json:"boot_id"`
	PIDNS     string `json:"pid_namespace"`
}

// reader is this process as a Holder, and the procfs it reads other
// holders through, made once: Liveness runs for each running action at
// every look at the agent's queue.
type reader struct {
	me  Holder
	pfs proc.FS
}

var self = sync.OnceValues(func() (reader, error) {
	pfs, err := proc.NewFS("/proc")
	if err != nil {
		return reader{}, err
	}
	st, err := pfs.ReadStat(os.Getpid())
	if err != nil {
		return reader{}, err
	}
	boot, err := pfs.BootID()
	if err != nil {
		return reader{}, err
	}
	ns, err := os.Readlink("/proc/self/ns/pid")
	if err != nil {
		return reader{}, fmt.Errorf("this process's PID namespace: %w", err)
	}
	return reader{me: Holder{PID: os.Getpid(), StartTime: st.StartTime, BootID: boot, PIDNS: ns}, pfs: pfs}, nil
})

// Self is this process as the holder of the actions it runs.
func Self() (Holder, error) {
	r, err := self()
	return r.me, err
}

// Liveness is what a reader can tell of a holder.
type Liveness int

const (
	// Unknown: the holder is of another PID namespace, or a row of a
	// schema before holders were recorded; a reader cannot tell.
	Unknown Liveness = iota
	// Alive: the process runs.
	Alive
	// Gone: the process exited (or is a zombie), its PID names another
	// process now, or it ran before the last boot.
	Gone
)

// Liveness tells whether h still runs, as this process sees it.
func (h Holder) Liveness() Liveness {
	r, err := self()
	if h.PID <= 0 || err != nil {
		return Unknown
	}
	if h.BootID != r.me.BootID {
		return Gone
	}
	if h.PIDNS != r.me.PIDNS {
		return Unknown
	}
	if h == r.me {
		return Alive
	}
	st, err := r.pfs.ReadStat(h.PID)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return Gone
	case err != nil:
		return Unknown
	case st.StartTime != h.StartTime || st.State == 'Z' || st.State == 'X':
		return Gone
	}
	return Alive
}

// Turn is the action whose turn it is on a GPU.
type Turn struct {
	GPU      string    `json:"gpu_uuid"`
	ActionID string    `json:"action_id"`
	Source   string    `json:"source"`
	Holder   Holder    `json:"holder"`
	TakenAt  time.Time `json:"taken_at"`
}

// Who names a turn's action for a log line: "action ID (epilog, PID N)".
func (t Turn) Who() string {
	return fmt.Sprintf("action %s (%s, PID %d)", t.ActionID, SourceName(t.Source), t.Holder.PID)
}

// SourceName names what runs an action of a source, for people.
func SourceName(source string) string {
	switch source {
	case remediate.SourceWebhook, remediate.SourceDispatch, "":
		return "the remediator"
	case remediate.SourceCLI:
		return "gpu-orphan clean"
	}
	return "the " + source
}

// errStale says that the turn's holder is gone: resolve it, then try again.
var errStale = errors.New("the turn's holder is gone")

// tryTurn takes the GPU's turn for the running action id, or returns the
// turn that holds it. A turn whose action is no longer running is taken
// over at once; one whose process is gone returns errStale.
func (s *Store) tryTurn(ctx context.Context, gpu, id, source string) (held Turn, taken bool, err error) {
	me, err := Self()
	if err != nil {
		return Turn{}, false, fmt.Errorf("who runs this action: %w", err)
	}
	meJSON, err := toJSON(me)
	if err != nil {
		return Turn{}, false, err
	}
	err = s.withTx(ctx, func(tx *sql.Tx) error {
		var (
			t               Turn
			holder, takenAt string
			state           sql.NullString
		)
		err := tx.QueryRowContext(ctx, `SELECT t.action_id, t.source, t.holder_json, t.taken_at, a.state
			FROM gpu_turns t LEFT JOIN actions a ON a.id = t.action_id WHERE t.gpu_uuid = ?`, gpu).
			Scan(&t.ActionID, &t.Source, &holder, &takenAt, &state)
		switch {
		case errors.Is(err, sql.ErrNoRows):
		case err != nil:
			return fmt.Errorf("reading the turn of GPU %s: %w", gpu, err)
		case t.ActionID == id:
			taken = true
			return nil
		default:
			t.GPU = gpu
			if err := fromJSON(holder, &t.Holder); err != nil {
				return err
			}
			if t.TakenAt, err = parseTime(takenAt); err != nil {
				return err
			}
			if state.String == string(remediate.StateRunning) {
				held = t
				if t.Holder.Liveness() == Gone {
					return errStale
				}
				return nil
			}
			// Its action ended (or is gone) without releasing the turn.
		}
		if _, err := tx.ExecContext(ctx, `INSERT INTO gpu_turns(gpu_uuid, action_id, source, holder_json, taken_at) VALUES (?, ?, ?, ?, ?)
			ON CONFLICT(gpu_uuid) DO UPDATE SET action_id = excluded.action_id, source = excluded.source,
			holder_json = excluded.holder_json, taken_at = excluded.taken_at`,
			gpu, id, source, meJSON, formatTime(time.Now())); err != nil {
			return fmt.Errorf("taking the turn of GPU %s: %w", gpu, err)
		}
		taken = true
		return nil
	})
	return held, taken, err
}

// WaitTurn takes the GPU's turn for the running action id (of source),
// waiting while another running action holds it, polling every poll,
// until ctx ends. It returns the turns it waited for, in order: the
// caller plans again from a fresh snapshot after waiting (the other
// action has probably freed the memory). While it waits, the action gets
// a "waiting" event naming whose turn it is; once it has the turn, a
// "waited" event. A turn whose process is gone is resolved (its action
// interrupted, ResolveStranded) and taken. On ctx's end it returns the
// turns waited for and ctx's error, without the turn.
func (s *Store) WaitTurn(ctx context.Context, gpu, id, source string, poll time.Duration) ([]Turn, error) {
	var waited []Turn
	start := time.Now()
	for {
		held, taken, err := s.tryTurn(ctx, gpu, id, source)
		if err != nil && ctx.Err() != nil {
			// The transaction ended with ctx: nothing was taken.
			return waited, context.Cause(ctx)
		}
		if errors.Is(err, errStale) {
			if _, _, err := s.ResolveStranded(ctx, false); err != nil {
				return waited, err
			}
			continue
		}
		if err != nil {
			return waited, err
		}
		if taken {
			if len(waited) > 0 {
				last := waited[len(waited)-1]
				detail := map[string]any{"for_action": last.ActionID, "source": last.Source, "pid": last.Holder.PID,
					"seconds": time.Since(start).Seconds(), "waited_for": waited}
				if a, err := s.Action(ctx, last.ActionID); err == nil {
					detail["its_state"], detail["its_freed_bytes"] = a.State, a.FreedBytes
				}
				if err := s.AddEvent(ctx, id, "waited", detail); err != nil {
					_ = s.ReleaseTurn(gpu, id) // the event's error says more
					return waited, err
				}
			}
			return waited, nil
		}
		if len(waited) == 0 || waited[len(waited)-1].ActionID != held.ActionID {
			waited = append(waited, held)
			if err := s.AddEvent(ctx, id, "waiting", map[string]any{"for_action": held.ActionID, "source": held.Source,
				"pid": held.Holder.PID, "gpu_uuid": gpu}); err != nil {
				return waited, err
			}
		}
		select {
		case <-ctx.Done():
			return waited, context.Cause(ctx)
		case <-time.After(poll):
		}
	}
}

// ReleaseTurn gives the GPU's turn back, if the action id holds it. It
// does not depend on the caller's context, which may have ended: a turn
// left behind would hold the next action back until its holder is gone.
func (s *Store) ReleaseTurn(gpu, id string) error {
	ctx, cancel := context.WithTimeout(context.Background(), BusyTimeout+time.Second)
	defer cancel()
	if _, err := s.db.ExecContext(ctx, `DELETE FROM gpu_turns WHERE gpu_uuid = ? AND action_id = ?`, gpu, id); err != nil {
		return fmt.Errorf("releasing the turn of GPU %s: %w", gpu, err)
	}
	return nil
}

// setHolder records this process as the one that runs action id.
func setHolder(ctx context.Context, tx *sql.Tx, id string) error {
	me, err := Self()
	if err != nil {
		return fmt.Errorf("who runs action %s: %w", id, err)
	}
	j, err := toJSON(me)
	if err != nil {
		return err
	}
	if _, err := tx.ExecContext(ctx, `UPDATE actions SET holder_json = ? WHERE id = ?`, j, id); err != nil {
		return fmt.Errorf("recording who runs action %s: %w", id, err)
	}
	return nil
}

// interruptedReason is the reason of an action whose process is gone:
// what ran it, and its PID.
func interruptedReason(source string, h Holder) string {
	switch source {
	case remediate.SourceWebhook, remediate.SourceDispatch:
		return ReasonInterrupted
	}
	return fmt.Sprintf("%s that ran it (PID %d) ended mid-action", SourceName(source), h.PID)
}

// ResolveStranded resolves the running actions whose process is gone as
// interrupted, and takes each up again as a new attempt, queued for the
// node agent, which plans it from a fresh snapshot under its own rules
// (never replaying the old targets): an alert's action while its alert
// fires and attempts are left (as at a restart), and a hook's (prolog,
// epilog) while attempts are left, for the same GPU and job; the CLI's is
// left to the person who ran it. Every reader calls it: the node agent at
// start-up (startup true: the alerts' actions still running are a previous
// run's, as are those that name no process, from before holders were
// recorded) and at each look at its queue, and the hooks and gpu-orphan
// clean when they open the store. Their GPU turns are given back.
func (s *Store) ResolveStranded(ctx context.Context, startup bool) (interrupted, resumed []remediate.Action, err error) {
	me, err := Self()
	if err != nil {
		return nil, nil, fmt.Errorf("who reads the store: %w", err)
	}
	// Most looks find nothing: they read, and take the write lock only
	// when there is something to resolve.
	if found, err := strandedActions(ctx, s.db, startup); err != nil || len(found) == 0 {
		return nil, nil, err
	}
	now := time.Now()
	err = s.withTx(ctx, func(tx *sql.Tx) error {
		interrupted, resumed = nil, nil
		found, err := strandedActions(ctx, tx, startup)
		if err != nil {
			return err
		}
		for _, r := range found {
			reason := interruptedReason(r.source, r.holder)
			a, err := scanAction(tx.QueryRowContext(ctx, `UPDATE actions SET state = ?, reason = ?, finished_at = ?
				WHERE id = ? AND state = ? RETURNING `+actionColumns,
				remediate.StateInterrupted, reason, formatTime(now), r.id, remediate.StateRunning))
			if err != nil {
				return fmt.Errorf("marking action %s interrupted: %w", r.id, err)
			}
			interrupted = append(interrupted, a)
			detail := map[string]any{"reason": reason, "resolved_by": me.PID}
			if r.holder.PID > 0 {
				detail["holder"] = r.holder
			}
			next, ok, err := s.resumeStranded(ctx, tx, a, now)
			if err != nil {
				return err
			}
			if ok {
				resumed = append(resumed, next)
				detail["resumed_by"] = next.ID
			}
			if err := addEvent(ctx, tx, a.ID, now, "interrupted", detail); err != nil {
				return err
			}
			if _, err := tx.ExecContext(ctx, `DELETE FROM gpu_turns WHERE action_id = ?`, a.ID); err != nil {
				return fmt.Errorf("giving back the turn of action %s: %w", a.ID, err)
			}
		}
		return nil
	})
	if err != nil {
		return nil, nil, fmt.Errorf("resolving the actions whose process is gone: %w", err)
	}
	return interrupted, resumed, nil
}

// stranded is a running action whose process is gone.
type stranded struct {
	id, source string
	holder     Holder
}

// strandedActions lists the running actions whose process is gone; at
// start-up, also the alerts' actions, which only a remediator runs (a
// previous run's, then), and those that name no process (from before
// holders were recorded).
func strandedActions(ctx context.Context, q querier, startup bool) ([]stranded, error) {
	rows, err := q.QueryContext(ctx, `SELECT id, source, holder_json FROM actions WHERE state = ?`, remediate.StateRunning)
	if err != nil {
		return nil, fmt.Errorf("listing running actions: %w", err)
	}
	defer rows.Close()
	var found []stranded
	for rows.Next() {
		var r stranded
		var j string
		if err := rows.Scan(&r.id, &r.source, &j); err != nil {
			return nil, err
		}
		if err := fromJSON(j, &r.holder); err != nil {
			return nil, err
		}
		own := r.source == remediate.SourceWebhook || r.source == remediate.SourceDispatch
		if (startup && (own || r.holder.PID == 0)) || r.holder.Liveness() == Gone {
			found = append(found, r)
		}
	}
	return found, rows.Err()
}

// resumeStranded queues the attempt that follows an interrupted action:
// an alert's as a restart's (resume); a hook's for the same GPU and job,
// within the attempts of the retry policy.
func (s *Store) resumeStranded(ctx context.Context, tx *sql.Tx, a remediate.Action, now time.Time) (remediate.Action, bool, error) {
	if a.AlertFingerprint != "" {
		return s.resume(ctx, tx, a, now)
	}
	if a.GPUUUID == "" || a.Attempt >= s.retry.MaxAttempts || (a.Source != remediate.SourceProlog && a.Source != remediate.SourceEpilog) {
		return remediate.Action{}, false, nil
	}
	next := nextAttempt(s.ids.next(), a, now)
	next.Source, next.Job = a.Source, a.Job
	if err := insertAction(ctx, tx, next); err != nil {
		return next, false, err
	}
	return next, true, addEvent(ctx, tx, next.ID, now, "retry", map[string]any{
		"cause": RetryStranded, "attempt": next.Attempt, "retry_of": a.ID, "first_action_id": next.FirstActionID,
		"previous_state": remediate.StateInterrupted, "previous_reason": a.Reason, "previous_source": a.Source,
	})
}

// RetryStranded: the attempt before was running when its process (a
// hook, gpu-orphan clean) went away; the node agent plans it again.
const RetryStranded = "stranded"
