package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/cli"
	"github.com/gpu-orphan/gpu-orphan/internal/snapshot"
	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/cleanup"
	"github.com/gpu-orphan/gpu-orphan/remediate/decide"
	"github.com/gpu-orphan/gpu-orphan/remediate/exclude"
	"github.com/gpu-orphan/gpu-orphan/remediate/hooks"
	"github.com/gpu-orphan/gpu-orphan/remediate/kill"
	"github.com/gpu-orphan/gpu-orphan/remediate/remediateflag"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

// The exit statuses of `gpu-orphan clean`, as its --help lists them.
const (
	// exitClean: the GPU is clean, or was cleaned and the memory verified
	// back; or, without --act, the plan would clean it.
	exitClean = 0
	// exitWouldNot: there is something clean would not or could not do,
	// and it says what, and what to do instead.
	exitWouldNot = 1
	// exitBadInput: a wrong flag or argument.
	exitBadInput = 2
)

// cleanExitHelp is the exit status convention, for --help.
const cleanExitHelp = "Exit status: 0 when the GPU is clean, or was cleaned and the memory verified back (without --act: when the plan would clean it); 1 when there is something it would not or could not do, which it explains, with what to do instead; 2 for a wrong flag or argument."

// Waiting for --min-age: clean measures ages as the remediator does, with
// a snapshot.Loop whose clocks start at its first snapshot, except a dead
// owner's, which runs from the death that the node agent's store recorded. It looks again every pollInterval, for up
// to the min-age plus waitMargin; a min-age above maxMinAge is the
// remediator's job.
const (
	pollInterval = 250 * time.Millisecond
	waitMargin   = 10 * time.Second
	maxMinAge    = 2 * time.Minute
)

// runClean runs the remediator's decision and kill ladder by hand: the
// plan first, then (with --act) the signals and the verified result. It
// applies the remediator's rules and clocks, and what it will not do it
// says, with what to do instead, exiting 1.
func runClean(logger *slog.Logger, backend *cli.Backend, r *remediateflag.Remediation, gpuID, storePath string) int {
	w := os.Stdout
	if r.MinAge > maxMinAge {
		fmt.Fprintf(os.Stderr, "gpu-orphan: --min-age=%s is longer than clean waits (%s): leave it to the remediator (--remediate.min-age), or give a smaller --min-age\n", r.MinAge, maxMinAge)
		return exitBadInput
	}
	opened, err := backend.Open(logger)
	if err != nil {
		fmt.Fprintf(os.Stderr, "gpu-orphan: %v\n", err)
		return exitWouldNot
	}
	defer opened.Driver.Close()
	fs := opened.Proc
	// Signals take PIDs of our own namespace, the plan those of the
	// procfs: acting across the two would signal the wrong processes.
	if err := fs.CheckOwnPIDNamespace(); err != nil {
		if r.Act {
			fmt.Fprintf(os.Stderr, "gpu-orphan: refusing to act: --path.procfs=%s: %v\n", fs.Root(), err)
			return exitWouldNot
		}
		fmt.Fprintf(os.Stderr, "gpu-orphan: warning: --path.procfs=%s: %v\nThe plan below may name the wrong processes, and --act would refuse.\n\n", fs.Root(), err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	cfg := r.DecideConfig()
	loop := snapshot.NewLoop(opened.Taker, pollInterval, cfg.MinBytes)
	// The proof that a holder inherited a dead owner's context is the node
	// agent's: it saw the forks. Its store, or the default one.
	lineagePath := storePath
	if lineagePath == "" {
		lineagePath = defaultStorePath
	}
	lineageNote := readAgentLineage(ctx, loop.Lineage(), fs, lineagePath, logger)
	nodeCfg := cleanup.Config{
		Snapshots: loop, Proc: fs, Decide: cfg,
		Ladder:        &kill.Ladder{Grace: r.Grace, Proc: fs, Logger: logger, Groups: fs, Exclude: cfg.Rules().Why},
		Act:           r.Act,
		VerifyTimeout: r.VerifyTimeout,
		Logger:        logger,
	}
	planner := cleanup.New(nodeCfg)
	s := loop.Refresh(ctx, true)
	plan := planner.PlanFrom(s, gpuID)
	// A snapshot that lists GPUs, none of them this one, says so whatever
	// else it failed to see; an empty list is trusted only when healthy.
	if _, found := s.GPUByID(gpuID); !found && (len(s.GPUs) > 0 || plan.SkipReason == decide.SkipGPUNotFound) {
		fmt.Fprintf(os.Stderr, "gpu-orphan: no GPU %s on this node (%s)\n", gpuID, hooks.DescribeGPUs(s))
		return exitBadInput
	}
	if plan.SkipReason == decide.SkipTooYoung {
		var interrupted bool
		plan, interrupted = waitForMinAge(ctx, w, loop, planner, gpuID, r.MinAge, plan)
		if interrupted {
			fmt.Fprintln(os.Stderr, "gpu-orphan: interrupted while waiting for --min-age: nothing was signalled")
			return exitWouldNot
		}
	}
	// With --store.path the action is recorded as the remediator records
	// its own; without, it is only printed. The store is opened only to
	// act, so that a plan that does not act leaves no database behind, but
	// before the plan is printed: a plan that says "Will signal" is one
	// that runs.
	var audit *store.Store
	if storePath != "" && r.Act && plan.Act && len(ownExcluded(plan)) == 0 {
		st, err := hooks.OpenStore(ctx, storePath)
		if err != nil {
			fmt.Fprintf(os.Stderr, "gpu-orphan: nothing was signalled: the audit store %s cannot be opened: %v\n", storePath, err)
			return exitWouldNot
		}
		defer st.Close()
		audit = st
		nodeCfg.Recorder = st
		hooks.ResolveStranded(ctx, st, logger)
	}
	fmt.Fprintln(w, lineageNote)
	writePlan(w, plan, r.Act)
	if own := ownExcluded(plan); len(own) > 0 {
		fmt.Fprint(os.Stderr, ownSessionText(own, cfg.Rules().WithDefaults().Self))
		return exitWouldNot
	}
	if !plan.Act {
		if plan.SkipReason == decide.SkipBelowThreshold {
			return exitClean
		}
		fmt.Fprintf(os.Stderr, "gpu-orphan: %s\n", skipAdvice(plan, r.MinAge))
		return exitWouldNot
	}
	if !r.Act {
		fmt.Fprintln(w, "\nDry run: nothing was signalled. Run again with --act to do this.")
		return exitClean
	}
	node := cleanup.New(nodeCfg)
	a := remediate.Action{Node: hooks.Hostname(), GPUUUID: plan.GPUUUID, GPUIndex: plan.GPUIndex, Policy: plan.Policy,
		State: remediate.StateRunning, Source: "cli", StartedAt: time.Now()}
	before := plan.Before
	a.Before, a.Targets, a.Excluded = &before, plan.Targets, plan.Excluded
	// The loop knows only the owners it saw alive since this command
	// started: the dead owners are recorded, their identities unknown.
	a.DeadOwners = plan.DeadOwners
	if audit != nil {
		id, err := audit.Insert(ctx, a)
		if err != nil {
			fmt.Fprintf(os.Stderr, "gpu-orphan: nothing was signalled: the action cannot be recorded in the audit store %s: %v\n", storePath, err)
			return exitWouldNot
		}
		a.ID = id
	}
	fmt.Fprintf(w, "\nSignalling (SIGTERM, then SIGKILL after %s)...\n", r.Grace)
	// One action per GPU at a time with the node agent and the hooks: after
	// waiting for another's turn, it plans again from a fresh snapshot.
	a, waited, err := hooks.Act(ctx, audit, node, a, plan, func() decide.Plan { return node.Plan(ctx, gpuID) }, logger)
	if len(waited) > 0 {
		fmt.Fprintf(w, "Waited for %s on this GPU; planned again from a fresh snapshot.\n", waited[len(waited)-1].Who())
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "gpu-orphan: %v\n", err)
		return exitWouldNot
	}
	if a.State == remediate.StateSkipped {
		fmt.Fprintf(w, "\nNothing left to do: %s\n", a.Reason)
		if a.ID != "" {
			fmt.Fprintf(w, "Recorded as action %s.\n", a.ID)
		}
		if a.After != nil && a.After.UnownedBytes <= cfg.MinBytes {
			return exitClean
		}
		return exitWouldNot
	}
	writeResult(w, a)
	if a.State != remediate.StateSucceeded {
		return exitWouldNot
	}
	if len(a.Leftover) > 0 {
		fmt.Fprintln(os.Stderr, "gpu-orphan: the GPU is not clean: its targets are gone, but processes it did not target still hold memory (above). "+
			"Look at them with `gpu-orphan ps`; if one should die, kill it by hand, or run clean again with --policy all-holders.")
		return exitWouldNot
	}
	return exitClean
}

// waitForMinAge looks again every pollInterval while the plan is too
// young, up to min-age plus waitMargin from now, and returns the last plan;
// interrupted when ctx ended first.
func waitForMinAge(ctx context.Context, w io.Writer, loop *snapshot.Loop, node *cleanup.Node, gpuID string, minAge time.Duration, plan decide.Plan) (decide.Plan, bool) {
	bound := minAge + waitMargin
	fmt.Fprintf(w, "Waiting: GPU %d has %s with no live owner, not yet --min-age=%s old as this command measures it "+
		"(a dead owner's age from its death as the node agent recorded it, anything else from this command's first snapshot). Looking again every %s, for up to %s.\n\n",
		plan.GPUIndex, mib(plan.Before.UnownedBytes), minAge, pollInterval, bound)
	deadline := time.Now().Add(bound)
	tick := time.NewTicker(pollInterval)
	defer tick.Stop()
	for plan.SkipReason == decide.SkipTooYoung && time.Now().Before(deadline) {
		select {
		case <-ctx.Done():
			return plan, true
		case <-tick.C:
		}
		plan = node.PlanFrom(loop.Refresh(ctx, true), gpuID)
	}
	return plan, ctx.Err() != nil
}

// ownExcluded returns the would-be targets that the plan leaves alone
// because they are in this command's own process group or session.
func ownExcluded(p decide.Plan) []remediate.Exclusion {
	var own []remediate.Exclusion
	for _, e := range p.Excluded {
		if e.Why == exclude.WhyOwnGroup || e.Why == exclude.WhyOwnSession {
			own = append(own, e)
		}
	}
	return own
}

// ownSessionText says why clean will not signal its own session's
// processes, and what to do instead.
func ownSessionText(own []remediate.Exclusion, self exclude.Self) string {
	pids := make([]string, len(own))
	var group, session bool
	for i, e := range own {
		pids[i] = strconv.Itoa(e.PID)
		group = group || e.Why == exclude.WhyOwnGroup
		session = session || e.Why == exclude.WhyOwnSession
	}
	var where string
	switch {
	case group && session:
		where = fmt.Sprintf("process group (PGID %d) or session (SID %d)", self.PGID, self.SID)
	case group:
		where = fmt.Sprintf("process group (PGID %d)", self.PGID)
	default:
		where = fmt.Sprintf("session (SID %d)", self.SID)
	}
	return fmt.Sprintf("gpu-orphan: refusing: %d holders of this GPU (PIDs %s) are in this command's own %s, "+
		"which it never signals, lest it kill the shell that runs it; nothing was signalled. "+
		"Run it from another session: another terminal or login, or `setsid -w gpu-orphan clean ...`.\n",
		len(own), strings.Join(pids, ", "), where)
}

// skipAdvice says why a plan that does not act on a GPU that is not clean
// does nothing, and what to do instead.
func skipAdvice(p decide.Plan, minAge time.Duration) string {
	switch p.SkipReason {
	case decide.SkipTooYoung:
		return fmt.Sprintf("nothing was signalled: the memory with no live owner was still younger than --min-age=%s after waiting %s "+
			"(its clock started again: what held it changed while this command waited). Run it again, or leave it to the remediator.", minAge, minAge+waitMargin)
	case decide.SkipNoTargets:
		return fmt.Sprintf("nothing was signalled: %s has no live owner, but policy %s allows signalling none of its holders (any left alone are listed above, with why). "+
			"`gpu-orphan ps` shows who holds the GPU: if one should die, kill it by hand, or use --policy all-holders; "+
			"if no process holds it, the driver keeps the memory (docs/runbook.md, \"When it cannot clean\").", mib(p.Before.UnownedBytes), p.Policy)
	case decide.SkipSnapshotUnhealthy:
		return "nothing was signalled: a source of the snapshot failed, and nothing is done on a snapshot it cannot trust. `gpu-orphan ps` names the source and its error."
	case decide.SkipGPUReadFailed, decide.SkipAccountingUnsupported, decide.SkipScanIncomplete:
		return "nothing was signalled: " + p.SkipText() + ". `gpu-orphan ps` shows what it can of this GPU."
	}
	return "nothing was signalled: " + p.SkipText()
}

func writePlan(w io.Writer, p decide.Plan, act bool) {
	fmt.Fprintf(w, "GPU %d  %s  policy %s\n", p.GPUIndex, p.GPUUUID, p.Policy)
	b := p.Before
	fmt.Fprintf(w, "  used %s   owned by live processes %s   owned by dead PIDs %s   NO LIVE OWNER %s",
		mib(b.UsedBytes), mib(b.OwnedLiveBytes), mib(b.OwnedDeadBytes), mib(b.UnownedBytes))
	if len(b.DeadOwnerPIDs) > 0 {
		fmt.Fprintf(w, "   dead owner PIDs %v", b.DeadOwnerPIDs)
	}
	fmt.Fprintln(w)
	if !p.Act {
		fmt.Fprintf(w, "\nNothing to do: %s\n", p.SkipText())
	}
	if len(p.Targets) > 0 {
		verb := "Would signal"
		if act {
			verb = "Will signal"
		}
		fmt.Fprintf(w, "\n%s:\n", verb)
		tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "  PID\tPPID\tPGID\tSID\tUSER\tCOMMAND\tREASON\tWHOLE GROUP")
		for _, t := range p.Targets {
			fmt.Fprintf(tw, "  %d\t%d\t%d\t%d\t%s\t%s\t%s\t%v\n", t.PID, t.PPID, t.PGID, t.SID, esc(t.User), truncate(esc(t.Command), 40), t.Reason, t.WholeGroup)
		}
		tw.Flush()
	}
	for _, n := range p.Notes {
		fmt.Fprintf(w, "  note: %s\n", esc(n))
	}
	if len(p.Excluded) > 0 {
		fmt.Fprintln(w, "\nLeft alone:")
		tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		for _, e := range p.Excluded {
			fmt.Fprintf(tw, "  %d\t%s\t%s\t%s\n", e.PID, esc(e.User), truncate(esc(e.Command), 40), esc(string(e.Why)))
		}
		tw.Flush()
	}
}

func writeResult(w io.Writer, a remediate.Action) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	for _, t := range a.Targets {
		fmt.Fprintf(tw, "  %d\t%s\t%s\t%s\n", t.PID, t.Outcome, strings.Join(t.Signals, ","), esc(t.Error))
	}
	tw.Flush()
	switch a.State {
	case remediate.StateSucceeded:
		fmt.Fprintf(w, "\nMemory back: %s freed, verified %.1f s after the first signal.\n", mib(a.FreedBytes), a.VerifySeconds)
		if len(a.Leftover) > 0 {
			fmt.Fprintf(w, "But %s\n", a.Reason)
		}
	default:
		fmt.Fprintf(w, "\nFAILED: %s\n", a.Reason)
		for _, l := range a.Leftover {
			fmt.Fprintf(w, "  left: pid %d %s: %s\n", l.PID, l.Kind, l.Detail)
		}
		if a.NextStep != "" {
			fmt.Fprintf(w, "Next step: %s\n", a.NextStep)
		}
	}
	if a.ID != "" {
		fmt.Fprintf(w, "Recorded as action %s.\n", a.ID)
	}
}
