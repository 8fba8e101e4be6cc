// Package cleanup cleans up one GPU of this node: a fresh snapshot as
// evidence, the plan (package decide), the limits, the kill ladder (package
// kill), and the verification that the memory came back, each step
// recorded before the next. The remediator's queue runner (package engine)
// calls it for each alert; `gpu-orphan clean` calls it by hand.
package cleanup

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpu-orphan/gpu-orphan/internal/proc"
	"github.com/gpu-orphan/gpu-orphan/internal/snapshot"
	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/decide"
	"github.com/gpu-orphan/gpu-orphan/remediate/kill"
	"github.com/gpu-orphan/gpu-orphan/remediate/limits"
)

// EventRecorder receives an action's progress as it happens; the store
// implements it, and the CLI prints instead.
type EventRecorder interface {
	Update(ctx context.Context, a remediate.Action) error
	AddEvent(ctx context.Context, actionID, kind string, detail any) error
}

// Snapshots gives a fresh snapshot, taken now, whose age clocks
// (snapshot.Owner.DeadSince, snapshot.GPU.UnownedSince,
// snapshot.Holder.Since) are set, and whose lineage proves inheritors: a
// snapshot.Loop, for the remediator and gpu-orphan clean alike.
type Snapshots interface {
	Refresh(ctx context.Context, forceScan bool) *snapshot.Snapshot
}

// Config configures cleanup on this node.
type Config struct {
	Snapshots Snapshots
	// Proc lists process groups for the plan and names what is left after
	// a failed cleanup.
	Proc   proc.FS
	Decide decide.Config
	Ladder *kill.Ladder
	// Limiter may be nil (the CLI acts by hand, unlimited).
	Limiter *limits.Limiter
	// Act is false for a dry run: the plan is recorded, nothing is signalled.
	Act bool
	// VerifyTimeout bounds the wait for memory to come back.
	VerifyTimeout time.Duration
	// MaxWait bounds how long a too-young problem is kept queued.
	MaxWait time.Duration
	// Planner, when set, is the rule that decides every plan of this node,
	// its re-plans included, in place of decide.Decide under Decide and the
	// whole-group rule: the epilog's job-end rule (remediate/jobend), whose
	// targets are the ended job's processes and nothing else.
	Planner func(s *snapshot.Snapshot, gpuID string, now time.Time) decide.Plan
	// TracerRule, when set, makes a process that traces a target a target
	// too when it says so, beyond what the node's plans of its GPUs
	// target: the epilog's processes of the ended job that hold no GPU.
	TracerRule TracerRule
	Recorder   EventRecorder
	Metrics    *remediate.Metrics
	Logger     *slog.Logger
}

// Node cleans up GPUs of this node.
type Node struct{ cfg Config }

// New returns a Node.
func New(cfg Config) *Node {
	if cfg.VerifyTimeout <= 0 {
		cfg.VerifyTimeout = 30 * time.Second
	}
	if cfg.MaxWait <= 0 {
		cfg.MaxWait = 2*cfg.Decide.MinAge + time.Minute
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if w := pauseWarning(); w != "" {
		cfg.Logger.Warn(w)
	}
	return &Node{cfg: cfg}
}

// Plan takes a fresh snapshot and decides. The alert is only a trigger:
// this snapshot is the evidence.
func (n *Node) Plan(ctx context.Context, gpuID string) decide.Plan {
	return n.PlanFrom(n.cfg.Snapshots.Refresh(ctx, true), gpuID)
}

// PlanFrom decides on a snapshot the caller took from Snapshots, listing
// the process groups of the targets for the whole-group rule.
func (n *Node) PlanFrom(s *snapshot.Snapshot, gpuID string) decide.Plan {
	snap := func() *snapshot.Snapshot { return s }
	if n.cfg.Planner != nil {
		return n.withTracers(n.cfg.Planner(s, gpuID, time.Now()), snap)
	}
	plan := decide.Decide(s, gpuID, n.cfg.Decide, time.Now())
	groups := map[int]decide.Group{}
	for _, pgid := range plan.GroupsToList() {
		members, err := n.cfg.Proc.GroupMembers(pgid)
		groups[pgid] = decide.Group{Members: members, Err: err}
	}
	return n.withTracers(plan.WithGroups(s, n.cfg.Decide, groups), snap)
}

// Execute cleans up the GPU that a claimed action names (engine.Executor):
// a result in state queued is tried again after the duration returned.
func (n *Node) Execute(ctx context.Context, a remediate.Action) (remediate.Action, time.Duration) {
	plan := n.Plan(ctx, a.GPUUUID)
	applyPlan(&a, plan, n.cfg.Act)
	n.cfg.Logger.Info("Plan", "action", a.ID, "gpu", a.GPUUUID, "policy", a.Policy, "act", plan.Act,
		"skip_reason", plan.SkipReason, "skip_detail", plan.SkipDetail, "targets", targetSummary(a.Targets), "dry_run", a.DryRun)

	if !plan.Act {
		// A problem too young to act on, or a snapshot we cannot trust (a
		// failing or hung driver), is looked at again later rather than
		// dropped, up to MaxWait after the alert arrived.
		if retry, ok := retryable(plan.SkipReason, n.cfg.Decide.MinAge); ok && time.Since(a.StartedAt) < n.cfg.MaxWait {
			a.State, a.Reason = remediate.StateQueued, "waiting: "+plan.SkipText()
			return a, retry
		}
		a.State, a.Reason = remediate.StateSkipped, plan.SkipText()
		return a, 0
	}
	var permit limits.Permit // the zero Permit's Done is a no-op
	if n.cfg.Limiter != nil {
		p, err := n.cfg.Limiter.Acquire(a.GPUUUID)
		if retry, limit, ok := limits.Retry(err); ok {
			n.cfg.Metrics.Limited.WithLabelValues(limit).Inc()
			a.State, a.Reason = remediate.StateQueued, "held back by the "+limit+" limit"
			n.cfg.Logger.Info("Held back by a limit", "action", a.ID, "limit", limit, "retry_after", retry)
			return a, retry
		} else if err != nil {
			a.State, a.Reason = remediate.StateFailed, "limiter: "+err.Error()
			return a, 0
		}
		permit = p
	}
	if !n.cfg.Act {
		a.State = remediate.StateDryRun
		a.Reason = "dry run: start with --act to signal the targets"
		permit.Done(limits.NoSignals)
		return a, 0
	}
	a = n.Act(ctx, a, plan)
	switch {
	case a.State == remediate.StateSucceeded:
		permit.Done(limits.Succeeded)
	case a.Escalation != "":
		// Our targets are gone: what keeps the memory is not the
		// remediator's failure, and must not stop other users' cleanups.
		permit.Done(limits.Escalated)
	default:
		permit.Done(limits.Failed)
	}
	return a, 0
}

// retryable says whether a skipped plan is worth another look, and when.
func retryable(skip decide.SkipReason, minAge time.Duration) (time.Duration, bool) {
	switch skip {
	case decide.SkipTooYoung:
		return max(minAge/4, 100*time.Millisecond), true
	case decide.SkipSnapshotUnhealthy, decide.SkipGPUReadFailed:
		return 2 * time.Second, true
	}
	return 0, false
}

// Act runs the kill ladder on the plan's targets and verifies that the
// memory came back. The plan is recorded before the first signal. A plan
// made elsewhere (the epilog's) gets its targets' tracers named, and
// those that are targets added, here.
func (n *Node) Act(ctx context.Context, a remediate.Action, plan decide.Plan) remediate.Action {
	a.State, a.Reason = remediate.StateRunning, ""
	plan = n.withTracers(plan, func() *snapshot.Snapshot { return n.cfg.Snapshots.Refresh(ctx, true) })
	a.Targets = plan.Targets
	if err := n.record(ctx, a, "plan", plan); err != nil {
		a.State, a.Reason = remediate.StateFailed, "refused to act: the plan could not be recorded: "+err.Error()
		return a
	}
	pausePoint(PausePlanRecorded)
	ladder := *n.cfg.Ladder
	// Every signal is recorded before it is sent; when a record cannot be
	// written the signal is not sent and the ladder stops: no signal goes
	// unaccounted for, even if the remediator dies the moment after.
	ladderCtx, stop := context.WithCancelCause(ctx)
	defer stop(nil)
	// The ladder calls BeforeSignal and OnSignal from each target's
	// goroutine.
	ladder.BeforeSignal = func(pid int, sig unix.Signal) error {
		if n.cfg.Recorder == nil {
			return nil
		}
		if err := n.cfg.Recorder.AddEvent(ctx, a.ID, "signal", map[string]any{"pid": pid, "signal": unix.SignalName(sig)}); err != nil {
			n.cfg.Logger.Error("Recording a signal failed: not sending it, and stopping the action", "action", a.ID, "err", err)
			stop(fmt.Errorf("recording a signal: %w", err))
			return err
		}
		return nil
	}
	var firstSignalOnce sync.Once
	firstSignal := time.Time{}
	ladder.OnSignal = func(pid int, sig unix.Signal) {
		firstSignalOnce.Do(func() { firstSignal = time.Now() })
		name := unix.SignalName(sig)
		if n.cfg.Metrics != nil {
			n.cfg.Metrics.Signals.WithLabelValues(name).Inc()
		}
		// The ladder itself logs each signal at info.
		n.cfg.Logger.Debug("Signal sent", "action", a.ID, "pid", pid, "signal", name)
		switch sig {
		case unix.SIGTERM:
			pausePoint(PauseSIGTERMSent)
		case unix.SIGKILL:
			pausePoint(PauseSIGKILLSent)
		}
	}
	a.Targets = ladder.Kill(ladderCtx, a.Targets)
	firstSignalOnce.Do(func() { firstSignal = time.Now() })
	if cause := context.Cause(ladderCtx); cause != nil && ctx.Err() == nil {
		now := time.Now()
		a.FinishedAt = &now
		a.State, a.Reason = remediate.StateFailed, "stopped: the audit record could not be written: "+cause.Error()
		if n.cfg.Metrics != nil {
			n.cfg.Metrics.CountOrphan(a)
		}
		_ = n.record(ctx, a, "verify", map[string]any{"state": a.State, "reason": a.Reason})
		return a
	}
	after, g, verdict := n.verify(ctx, a)
	// Holders the plan did not name: a worker's replacement forked on
	// SIGTERM, a process that took the context since. Re-plan from a fresh
	// snapshot, under the same rules, a bounded number of times. A re-plan
	// that finds them not yet provable (too young: their dead owner died
	// during the action, or was seen dead late) looks again until
	// VerifyTimeout after the first re-plan rather than giving up at once.
	waitUntil := time.Now().Add(n.cfg.VerifyTimeout)
	waited := false
	for round := 1; verdict == verdictUnplanned && round <= maxReplans && ctx.Err() == nil; {
		extra, young, err := n.replan(ctx, a, round, waited)
		if err != nil {
			break
		}
		if len(extra) == 0 {
			if !young || time.Now().After(waitUntil) {
				if waited {
					// What was waited for may have ended by itself.
					after, g, verdict = n.verify(ctx, a)
				}
				break
			}
			if !waited {
				n.cfg.Logger.Info("Re-plan found holders too young to act on: looking again", "action", a.ID, "until", waitUntil)
			}
			waited = true
			retry, _ := retryable(decide.SkipTooYoung, n.cfg.Decide.MinAge)
			select {
			case <-ctx.Done():
			case <-time.After(min(retry, time.Until(waitUntil)+time.Millisecond)):
			}
			continue
		}
		a.Targets = append(a.Targets, ladder.Kill(ladderCtx, extra)...)
		after, g, verdict = n.verify(ctx, a)
		round++
	}
	now := time.Now()
	a.After = after
	a.FinishedAt = &now
	a.VerifySeconds = now.Sub(firstSignal).Seconds()
	if a.Before != nil && after != nil && a.Before.UsedBytes > after.UsedBytes {
		a.FreedBytes = a.Before.UsedBytes - after.UsedBytes
	}
	switch verdict {
	case verdictClean, verdictOthersRemain:
		a.State = remediate.StateSucceeded
		if verdict == verdictOthersRemain {
			a.Leftover = n.otherHolders(a, g)
			a.Reason = OthersRemain + ": " + leftoverSummary(a.Leftover)
		}
		if n.cfg.Metrics != nil {
			n.cfg.Metrics.ActionDuration.Observe(now.Sub(a.StartedAt).Seconds())
		}
	case verdictUnplanned:
		a.State = remediate.StateFailed
		a.Leftover = n.leftovers(a, g)
		a.Reason = "processes the plan did not name still hold the GPU, and nothing proves that they inherited a dead owner's context: " + unplannedSummary(a, g)
		a.NextStep = "look at them with `gpu-orphan ps`; gpu-orphan signals only what the kernel proves holds the dead owner's context"
		a.Escalation = remediate.EscalationUnprovenHolder
	default:
		a.State = remediate.StateFailed
		a.Reason = "memory did not come back within " + n.cfg.VerifyTimeout.String()
		a.Leftover = n.leftovers(a, g)
		a.NextStep = nextStep(a)
		switch {
		case targetsGone(a.Targets):
			// Every target exited: whatever keeps the memory is beyond
			// what the remediator's signals can reach.
			a.Escalation = escalation(a.Leftover)
			if a.Escalation == remediate.EscalationHiddenHolder {
				a.NextStep = hiddenHolderNextStep(a)
			}
		case heldByTracers(a.Targets):
			// Every survivor is held in a tracing stop by a tracer that
			// is not a target: the tracer's user's doing.
			a.Escalation = remediate.EscalationTracedHolder
			a.Reason += "; the targets that outlived their signals are held in a tracing stop by their tracer: " + tracersWho(a.Targets)
			a.NextStep = tracedNextStep(a)
		}
	}
	if n.cfg.Metrics != nil {
		// As verified: memory that came back counts even if its record
		// fails below.
		n.cfg.Metrics.CountOrphan(a)
		if a.Escalation != "" {
			n.cfg.Metrics.CountEscalation(a)
		}
	}
	if a.Escalation != "" {
		n.cfg.Logger.Warn("Escalation: the memory stays held where the remediator's signals cannot reach; not counted toward the circuit breaker",
			"action", a.ID, "gpu", a.GPUUUID, "escalation", a.Escalation, "users", strings.Join(a.EscalationUsers(), ","), "next_step", a.NextStep)
	}
	detail := map[string]any{"state": a.State, "freed_bytes": a.FreedBytes, "seconds": a.VerifySeconds}
	if a.Escalation != "" {
		detail["escalation"] = a.Escalation
	}
	if err := n.record(ctx, a, "verify", detail); err != nil {
		n.cfg.Logger.Error("Recording the verification failed", "action", a.ID, "err", err)
		a.State = remediate.StateFailed
		a.Reason = "the audit record of the verification could not be written: " + err.Error()
	}
	return a
}

// OthersRemain begins the reason of an action whose targets are all gone
// while processes it did not target still hold memory on the GPU: the
// action is judged by its own targets, and those leftovers are not its
// failure (nor the breaker's business).
const OthersRemain = "other holders remain"

// settle is how long memory may take to come back after the last holder
// of a context exits (0.1-0.4 s measured on the H200).
const settle = time.Second

type verdict int

const (
	verdictFailed verdict = iota
	verdictClean
	verdictOthersRemain
	// verdictUnplanned: every target is gone, and holders that the plan
	// neither targeted nor excluded by name keep the memory.
	verdictUnplanned
)

// maxReplans bounds the fresh plans one action makes for holders that its
// first plan did not name.
const maxReplans = 3

// replan decides again on a fresh snapshot and returns the targets that
// the action has not signalled yet, recording the new plan, and whether
// holders are left alone only for now, too young to act on. quiet leaves
// a plan with nothing new unrecorded: a wait for too-young holders looks
// again often.
func (n *Node) replan(ctx context.Context, a remediate.Action, round int, quiet bool) ([]remediate.Target, bool, error) {
	plan := n.Plan(ctx, a.GPUUUID)
	var extra []remediate.Target
	for _, t := range plan.Targets {
		if !slices.ContainsFunc(a.Targets, func(d remediate.Target) bool { return d.PID == t.PID && d.StartTime == t.StartTime }) {
			extra = append(extra, t)
		}
	}
	young := plan.SkipReason == decide.SkipTooYoung ||
		slices.ContainsFunc(plan.Excluded, func(e remediate.Exclusion) bool { return e.Why == decide.WhyDeadOwnerTooYoung })
	if quiet && len(extra) == 0 {
		return nil, young, nil
	}
	n.cfg.Logger.Info("Re-planned: holders the plan did not name remain", "action", a.ID, "round", round,
		"new_targets", targetSummary(extra), "skip_reason", plan.SkipReason)
	detail := map[string]any{"round": round, "targets": extra, "excluded": plan.Excluded}
	if !plan.Act {
		detail["skip"] = plan.SkipText()
	}
	if err := n.record(ctx, a, "replan", detail); err != nil {
		return nil, false, err
	}
	return extra, young, nil
}

func (n *Node) record(ctx context.Context, a remediate.Action, kind string, detail any) error {
	if n.cfg.Recorder == nil {
		return nil
	}
	if err := n.cfg.Recorder.Update(ctx, a); err != nil {
		return err
	}
	return n.cfg.Recorder.AddEvent(ctx, a.ID, kind, detail)
}

// verify polls fresh snapshots until the action can be judged by what it
// did: clean when the GPU shows no orphaned memory above the threshold and
// no dead owner; others remain when every target is gone and, once the
// memory had time to come back, the only processes still holding the
// device node mapped are those the plan excluded by name; unplanned when
// others hold it; failed at the timeout.
func (n *Node) verify(ctx context.Context, a remediate.Action) (*remediate.MemoryEvidence, snapshot.GPU, verdict) {
	pausePoint(PauseVerifying)
	start := time.Now()
	deadline := start.Add(n.cfg.VerifyTimeout)
	var last snapshot.GPU
	var ev *remediate.MemoryEvidence
	for {
		s := n.cfg.Snapshots.Refresh(ctx, true)
		if g, ok := s.GPUByID(a.GPUUUID); ok && g.Accountable() {
			last = g
			e := remediate.NewMemoryEvidence(g, s.Taken, s.Taken)
			ev = &e
			if g.UnexplainedBytes <= n.cfg.Decide.MinBytes && !g.DeadOwnerListed() && !hasOrphaned(g, n.cfg.Decide.Policy) {
				return ev, g, verdictClean
			}
			if time.Since(start) >= settle && targetsGone(a.Targets) {
				others := othersHolding(a, g)
				switch {
				case len(others) == 0:
				case slices.ContainsFunc(others, func(h snapshot.Holding) bool { return !excludedByPlan(a, h.Process) }):
					return ev, g, verdictUnplanned
				default:
					return ev, g, verdictOthersRemain
				}
			}
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return ev, last, verdictFailed
		}
		select {
		case <-ctx.Done():
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// targetsGone reports whether every target has exited.
func targetsGone(ts []remediate.Target) bool {
	for _, t := range ts {
		if !targetGone(t) {
			return false
		}
	}
	return true
}

// targetGone reports whether t has exited.
func targetGone(t remediate.Target) bool {
	switch t.Outcome {
	case kill.OutcomeExitedAfterSIGTERM, kill.OutcomeExitedAfterSIGKILL, kill.OutcomeGoneBeforeSignal, kill.OutcomeIdentityChanged:
		return true
	}
	return false
}

// othersHolding are the live processes that map the GPU's device node,
// belong to no live job (whose contexts are live-owned), and were not
// targets of the action: those that may keep a dead owner's memory.
func othersHolding(a remediate.Action, g snapshot.GPU) []snapshot.Holding {
	var out []snapshot.Holding
	for _, h := range g.Holders {
		if h.Mapped && len(h.LiveJobGPUs) == 0 && !slices.ContainsFunc(a.Targets, func(t remediate.Target) bool { return t.PID == h.PID && t.StartTime == h.StartTime }) {
			out = append(out, h)
		}
	}
	return out
}

// excludedByPlan reports whether the action's plan named p (PID and start
// time) among the processes it leaves alone.
func excludedByPlan(a remediate.Action, p proc.Process) bool {
	return slices.ContainsFunc(a.Excluded, func(e remediate.Exclusion) bool { return e.PID == p.PID && e.StartTime == p.StartTime })
}

// unplannedSummary names the holders that the plan did not name.
func unplannedSummary(a remediate.Action, g snapshot.GPU) string {
	var b strings.Builder
	for _, h := range othersHolding(a, g) {
		if excludedByPlan(a, h.Process) {
			continue
		}
		if b.Len() > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%d (%s)", h.PID, h.Comm)
	}
	return b.String()
}

// otherHolders names the processes the action left holding the GPU.
func (n *Node) otherHolders(a remediate.Action, g snapshot.GPU) []remediate.Leftover {
	var out []remediate.Leftover
	for _, h := range othersHolding(a, g) {
		detail := "holds the device node mapped and was not a target"
		for _, e := range a.Excluded {
			if e.PID == h.PID {
				detail = excludedDetail(e, g)
			}
		}
		out = append(out, remediate.Leftover{PID: h.PID, Kind: LeftoverOtherHolder, Detail: h.Comm + ": " + detail})
	}
	return out
}

// excludedDetail says why the plan left a holder alone, with what the
// snapshot says of its proof (or of why nothing proves it).
func excludedDetail(e remediate.Exclusion, g snapshot.GPU) string {
	detail := "excluded: " + string(e.Why)
	for _, h := range g.Suspects {
		if h.PID == e.PID && h.Proof != "" {
			return detail + " (" + h.Proof + ")"
		}
	}
	return detail
}

// LeftoverOtherHolder is the Leftover kind of a process the action did not
// target that still holds the GPU.
const LeftoverOtherHolder = "other_holder"

// LeftoverTraced is the Leftover kind of a target that outlived its
// signals in a tracing stop, held by its tracer (Target.Tracer).
const LeftoverTraced = "traced"

func leftoverSummary(ls []remediate.Leftover) string {
	var b strings.Builder
	for i, l := range ls {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%d (%s)", l.PID, l.Detail)
	}
	return b.String()
}

func hasOrphaned(g snapshot.GPU, policy remediate.Policy) bool {
	if policy != remediate.PolicyOrphaned {
		return false
	}
	return slices.ContainsFunc(g.Suspects, func(h snapshot.Holder) bool { return h.Reason == snapshot.ReasonOrphaned })
}

// leftovers names what still holds the memory after a failed cleanup.
func (n *Node) leftovers(a remediate.Action, g snapshot.GPU) []remediate.Leftover {
	var out []remediate.Leftover
	for _, t := range a.Targets {
		if t.Outcome != kill.OutcomeStillAlive {
			continue
		}
		kind, detail := "alive", "survived SIGKILL"
		if tracedStop(t) {
			out = append(out, remediate.Leftover{PID: t.PID, Kind: LeftoverTraced,
				Detail: "held in a tracing stop by its tracer " + t.Tracer.Who() + " (ptrace): it finishes dying when the tracer lets it go or ends"})
			continue
		}
		if p, err := n.cfg.Proc.Process(t.PID); err == nil {
			switch {
			case p.State == "D":
				kind, detail = "d_state", "in uninterruptible sleep (D): it acts on SIGKILL only when its kernel call returns"
			case p.Zombie():
				kind, detail = "zombie", "a zombie whose parent has not reaped it"
			}
		}
		out = append(out, remediate.Leftover{PID: t.PID, Kind: kind, Detail: detail})
	}
	for _, pid := range g.HolderPIDs {
		if slices.ContainsFunc(a.Targets, func(t remediate.Target) bool { return t.PID == pid }) {
			continue
		}
		why := "holds the device node and was not a target"
		for _, e := range a.Excluded {
			if e.PID == pid {
				why = excludedDetail(e, g)
			}
		}
		out = append(out, remediate.Leftover{PID: pid, Kind: "protected", Detail: why})
	}
	if len(out) == 0 {
		out = append(out, remediate.Leftover{Kind: "driver",
			Detail: "no process visible in this PID namespace holds the GPU: the memory is held by a process in another PID namespace or by the driver itself"})
	}
	return out
}

// escalation names what keeps the memory of a failed action whose
// targets are all gone: nothing visible in /proc, or visible holders that
// the plan did not target.
func escalation(ls []remediate.Leftover) string {
	for _, l := range ls {
		if l.PID != 0 {
			return remediate.EscalationUnprovenHolder
		}
	}
	return remediate.EscalationHiddenHolder
}

// deadOwnerUsers are the users whose dead processes left the memory, as
// metric labels, sorted.
func deadOwnerUsers(a remediate.Action) []string {
	var users []string
	for _, o := range a.DeadOwners {
		if u := o.UserLabel(); !slices.Contains(users, u) {
			users = append(users, u)
		}
	}
	if len(users) == 0 {
		users = []string{remediate.UnknownUser}
	}
	slices.Sort(users)
	return users
}

func hiddenHolderNextStep(a remediate.Action) string {
	return "no process visible in /proc holds the GPU, yet its memory stays: the dead owner's context is held where /proc shows no holder " +
		"(a descriptor sent in a UNIX socket message that nobody receives, a process in another PID namespace) or by the driver. " +
		"The dead owner's user: " + strings.Join(deadOwnerUsers(a), ", ") + "; look at that user's processes and their UNIX sockets " +
		"(`ss -xp`), and ask them. If nothing is found, drain the node and reset the GPU (nvidia-smi --gpu-reset -i " + strconv.Itoa(a.GPUIndex) + "). " +
		"This is not counted toward the circuit breaker: other users' cleanups go on"
}

func nextStep(a remediate.Action) string {
	for _, l := range a.Leftover {
		if l.Kind == "d_state" {
			return "a process is stuck in the kernel: drain the node, then reboot it or reset the GPU (nvidia-smi --gpu-reset -i " + strconv.Itoa(a.GPUIndex) + ")"
		}
	}
	return "confirm with `gpu-orphan ps`; if nothing visible holds the GPU, drain the node and reset the GPU (nvidia-smi --gpu-reset -i " + strconv.Itoa(a.GPUIndex) + ")"
}

// applyPlan copies the plan's evidence and targets into the action.
func applyPlan(a *remediate.Action, p decide.Plan, act bool) {
	a.Policy = p.Policy
	a.GPUIndex = p.GPUIndex
	if p.GPUUUID != "" {
		a.GPUUUID = p.GPUUUID
	}
	before := p.Before
	a.Before = &before
	a.Targets = p.Targets
	a.Excluded = p.Excluded
	a.DeadOwners = p.DeadOwners
	a.DryRun = !act
}

func targetSummary(ts []remediate.Target) string {
	s := ""
	for i, t := range ts {
		if i > 0 {
			s += " "
		}
		s += fmt.Sprintf("%d(%s)", t.PID, t.Comm)
	}
	return s
}
