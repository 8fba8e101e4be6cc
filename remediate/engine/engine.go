// Package engine works through the store's queue of actions: it claims
// each one, hands it to an Executor (the node's cleanup, package cleanup,
// or the fleet's forwarding, package dispatch) and records what happened.
package engine

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"time"

	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/cleanup"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

// Executor carries out one claimed action. It fills in the action and
// returns it; a result in state queued is put back on the queue and tried
// again after retryAfter (held back by a limit, or the problem is still
// too young).
type Executor interface {
	Execute(ctx context.Context, a remediate.Action) (result remediate.Action, retryAfter time.Duration)
}

// Engine runs the queue.
type Engine struct {
	store *store.Store
	exec  Executor
	// turns: the executor signals this node's processes (the node role's
	// cleanup), so each action takes its GPU's turn in the store first,
	// as the hooks do: one action per GPU at a time.
	turns   bool
	workers int
	metrics *remediate.Metrics
	logger  *slog.Logger

	wake chan struct{}

	mu        sync.Mutex
	inflight  map[string]bool
	notBefore map[string]time.Time
	storeErr  error
}

// New returns an Engine. workers bounds concurrent executions; the
// limiter's own cap still applies inside.
func New(st *store.Store, exec Executor, workers int, m *remediate.Metrics, logger *slog.Logger) *Engine {
	if workers <= 0 {
		workers = 4
	}
	_, turns := exec.(*cleanup.Node)
	return &Engine{store: st, exec: exec, turns: turns, workers: workers, metrics: m, logger: logger,
		wake: make(chan struct{}, 1), inflight: map[string]bool{}, notBefore: map[string]time.Time{}}
}

// Wake asks the engine to look at the queue now.
func (e *Engine) Wake() {
	select {
	case e.wake <- struct{}{}:
	default:
	}
}

// Recover marks actions that a previous run left running as interrupted,
// and queues the next attempt of each that an alert created (within the
// store's retry policy): that attempt takes a fresh snapshot and plans
// again under the same rules, so a cleanup half done is finished, never
// replayed from the old target list. A hook's action whose process is
// gone is resolved the same way (store.ResolveStranded); one whose hook
// still runs is left to it.
func (e *Engine) Recover(ctx context.Context) error {
	return e.resolve(ctx, true)
}

// resolve resolves the running actions whose process is gone, and logs
// what it did; at start-up, the actions that a previous run of the
// remediator left running too.
func (e *Engine) resolve(ctx context.Context, startup bool) error {
	interrupted, resumed, err := e.store.ResolveStranded(ctx, startup)
	if err != nil {
		return err
	}
	next := map[string]remediate.Action{}
	for _, a := range resumed {
		next[a.RetryOf] = a
	}
	for _, a := range interrupted {
		e.metrics.Actions.WithLabelValues(string(remediate.StateInterrupted)).Inc()
		what := "Action was interrupted by a restart"
		if a.Source != remediate.SourceWebhook && a.Source != remediate.SourceDispatch {
			what = "Action was left running by a process that is gone (" + a.Reason + ")"
		}
		if n, ok := next[a.ID]; ok {
			e.logger.Warn(what+"; taken up again from a fresh snapshot", "action", a.ID, "source", a.Source,
				"gpu", a.GPUUUID, "node", a.Node, "next_action", n.ID, "attempt", n.Attempt)
			continue
		}
		e.logger.Warn(what+"; no attempt is left for it (or its alert resolved): it will not be repeated",
			"action", a.ID, "source", a.Source, "gpu", a.GPUUUID, "node", a.Node, "attempt", a.Attempt)
	}
	if len(resumed) > 0 && !startup {
		e.Wake()
	}
	return nil
}

// StoreErr is the last error the store gave when asked to prove it can
// write; nil when healthy.
func (e *Engine) StoreErr() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.storeErr
}

// Run works the queue until ctx ends. Running actions then get up to drain
// to finish their ladder and verification; one still running after that is
// cut short, left running in the store, and marked interrupted (and taken
// up again) at the next start.
func (e *Engine) Run(ctx context.Context, drain time.Duration) {
	work, stopWork := context.WithCancel(context.WithoutCancel(ctx))
	defer stopWork()
	var wg sync.WaitGroup
	defer func() {
		done := make(chan struct{})
		go func() { wg.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(drain):
			e.logger.Warn("Running actions did not finish in time; cutting them short", "drain", drain)
			stopWork()
			<-done
		}
	}()
	sem := make(chan struct{}, e.workers)
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		e.round(ctx, work, &wg, sem)
		select {
		case <-ctx.Done():
			return
		case <-e.wake:
		case <-tick.C:
		}
	}
}

// round starts the queued actions that are due. ctx stops the round;
// work is the context the actions run under.
func (e *Engine) round(ctx, work context.Context, wg *sync.WaitGroup, sem chan struct{}) {
	// Refuse to act without a record: prove the store can write first.
	err := e.store.Ping(ctx)
	e.mu.Lock()
	changed := (err == nil) != (e.storeErr == nil)
	e.storeErr = err
	e.mu.Unlock()
	if err != nil {
		e.metrics.StoreUp.Set(0)
		e.metrics.Limited.WithLabelValues("store").Inc()
		if changed {
			e.logger.Error("Audit store cannot be written: refusing to act until it recovers", "err", err)
		}
		return
	}
	e.metrics.StoreUp.Set(1)
	if changed {
		e.logger.Info("Audit store writable again: acting resumes")
	}
	// The hooks' actions whose process is gone (killed during its grace)
	// are this reader's to resolve and take up.
	if err := e.resolve(ctx, false); err != nil {
		e.logger.Error("Resolving the actions whose process is gone failed", "err", err)
	}
	queued, err := e.store.Queued(ctx)
	if err != nil {
		e.logger.Error("Reading the queue failed", "err", err)
		return
	}
	e.metrics.QueueDepth.Set(float64(len(queued)))
	now := time.Now()
	for _, a := range queued {
		e.mu.Lock()
		skip := e.inflight[a.ID] || now.Before(e.notBefore[a.ID])
		if !skip {
			e.inflight[a.ID] = true
		}
		e.mu.Unlock()
		if skip {
			continue
		}
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			e.done(a.ID, 0)
			return
		}
		wg.Add(1)
		go func(id string) {
			defer wg.Done()
			defer func() { <-sem }()
			e.done(id, e.process(work, id))
		}(a.ID)
	}
}

func (e *Engine) done(id string, retryAfter time.Duration) {
	e.mu.Lock()
	defer e.mu.Unlock()
	delete(e.inflight, id)
	if retryAfter > 0 {
		e.notBefore[id] = time.Now().Add(retryAfter)
	} else {
		delete(e.notBefore, id)
	}
}

// process claims one action and executes it; it returns how long to wait
// before trying it again, or 0 when it is finished.
func (e *Engine) process(ctx context.Context, id string) time.Duration {
	a, ok, err := e.store.Claim(ctx, id)
	if err != nil {
		e.logger.Error("Claiming an action failed", "action", id, "err", err)
		return 5 * time.Second
	}
	if !ok {
		return 0 // cancelled by a resolved alert, or finished elsewhere
	}
	if e.turns {
		release, retry, ok := e.takeTurn(ctx, a)
		if !ok {
			return retry
		}
		defer release()
	}
	result, retryAfter := e.exec.Execute(ctx, a)
	if errors.Is(ctx.Err(), context.Canceled) && result.State == remediate.StateRunning {
		// Shutting down mid-action: leave it running so the next start
		// marks it interrupted and takes it up again from a fresh snapshot.
		return 0
	}
	if result.State == remediate.StateQueued {
		if err := e.store.Update(ctx, result); err != nil {
			e.logger.Error("Putting an action back on the queue failed", "action", id, "err", err)
		}
		return max(retryAfter, 500*time.Millisecond)
	}
	if result.FinishedAt == nil {
		now := time.Now()
		result.FinishedAt = &now
	}
	if err := e.store.Update(ctx, result); err != nil {
		e.logger.Error("Recording an action's result failed", "action", id, "err", err)
	}
	e.metrics.Actions.WithLabelValues(string(result.State)).Inc()
	e.metrics.LastAction.WithLabelValues(string(result.State)).Set(float64(result.FinishedAt.UnixNano()) / 1e9)
	e.logger.Info("Action finished", "action", result.ID, "node", result.Node, "gpu", result.GPUUUID,
		"state", result.State, "reason", result.Reason, "freed_mib", result.FreedBytes>>20, "targets", len(result.Targets))
	return 0
}

// TurnWait bounds how long an action waits for its GPU's turn before it
// is put back on the queue.
const TurnWait = 10 * time.Minute

// turnPoll is how often a waiting action looks at its GPU's turn.
const turnPoll = 200 * time.Millisecond

// takeTurn takes the GPU's turn for the claimed action a, waiting while a
// hook's action (or another of ours) holds it; the executor then plans
// from a fresh snapshot, after whatever that action freed. ok is false
// when it did not get the turn: the action is back on the queue, to be
// tried again after retry.
func (e *Engine) takeTurn(ctx context.Context, a remediate.Action) (release func(), retry time.Duration, ok bool) {
	wctx, cancel := context.WithTimeout(ctx, TurnWait)
	defer cancel()
	waited, err := e.store.WaitTurn(wctx, a.GPUUUID, a.ID, a.Source, turnPoll)
	if err == nil {
		if len(waited) > 0 {
			w := waited[len(waited)-1]
			e.logger.Info("Waited for another action on this GPU: planning again from a fresh snapshot", "action", a.ID,
				"gpu", a.GPUUUID, "waited_for", w.ActionID, "by", store.SourceName(w.Source), "pid", w.Holder.PID)
		}
		return func() {
			if err := e.store.ReleaseTurn(a.GPUUUID, a.ID); err != nil {
				e.logger.Error("Giving back the GPU's turn failed", "action", a.ID, "err", err)
			}
		}, 0, true
	}
	// Not our turn (yet): back on the queue, with whose turn it is.
	a.State = remediate.StateQueued
	if len(waited) > 0 {
		a.Reason = "waiting for " + waited[len(waited)-1].Who() + " on this GPU"
	}
	uctx, ucancel := context.WithTimeout(context.WithoutCancel(ctx), store.BusyTimeout+time.Second)
	defer ucancel()
	if uerr := e.store.Update(uctx, a); uerr != nil {
		e.logger.Error("Putting an action back on the queue failed", "action", a.ID, "err", uerr)
	}
	e.logger.Warn("Did not get the GPU's turn: the action is back on the queue", "action", a.ID, "gpu", a.GPUUUID, "reason", a.Reason, "err", err)
	return nil, 5 * time.Second, false
}
