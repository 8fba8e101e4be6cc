package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/cli"
	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/cleanup"
	"github.com/gpu-orphan/gpu-orphan/remediate/decide"
	"github.com/gpu-orphan/gpu-orphan/remediate/kill"
	"github.com/gpu-orphan/gpu-orphan/remediate/remediateflag"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

// auditRecord is the audit database that --store.path opens.
type auditRecord interface {
	cleanup.EventRecorder
	Insert(ctx context.Context, a remediate.Action) (string, error)
}

// runClean runs the remediator's decision and kill ladder by hand: the
// plan first, then (with --act) the signals and the verified result.
func runClean(logger *slog.Logger, backend *cli.Backend, r *remediateflag.Remediation, gpuID, storePath string) int {
	w := os.Stdout
	opened, err := backend.Open(logger)
	if err != nil {
		fmt.Fprintf(os.Stderr, "gpu-orphan: %v\n", err)
		return 1
	}
	defer opened.Driver.Close()
	fs := opened.Proc
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	// With --store.path the action is recorded as the remediator records
	// its own; without, it is only printed.
	var audit auditRecord
	if storePath != "" {
		st, err := store.Open(ctx, storePath)
		if err != nil {
			fmt.Fprintf(os.Stderr, "gpu-orphan: %v\n", err)
			return 1
		}
		defer st.Close()
		audit = st
	}
	cfg := r.DecideConfig()
	node := cleanup.New(cleanup.Config{
		Snapshots: cleanup.Once{Taker: opened.Taker, OrphanBytes: cfg.MinBytes}, Proc: fs, Decide: cfg,
		Ladder:        &kill.Ladder{Grace: r.Grace, Proc: fs, Logger: logger, Groups: fs, Exclude: cfg.Rules().Why},
		Act:           r.Act,
		VerifyTimeout: r.VerifyTimeout,
		Recorder:      audit,
		Logger:        logger,
	})
	plan := node.Plan(ctx, gpuID)
	writePlan(w, plan, r.Act)
	if !plan.Act {
		if plan.SkipReason == decide.SkipGPUNotFound || plan.SkipReason == decide.SkipSnapshotUnhealthy {
			return 1
		}
		return 0
	}
	if !r.Act {
		fmt.Fprintln(w, "\nDry run: nothing was signalled. Run again with --act to do this.")
		return 0
	}
	a := remediate.Action{Node: hostname(), GPUUUID: plan.GPUUUID, GPUIndex: plan.GPUIndex, Policy: plan.Policy,
		State: remediate.StateRunning, Source: "cli", StartedAt: time.Now()}
	before := plan.Before
	a.Before, a.Targets, a.Excluded = &before, plan.Targets, plan.Excluded
	if audit != nil {
		id, err := audit.Insert(ctx, a)
		if err != nil {
			fmt.Fprintf(os.Stderr, "gpu-orphan: refusing to act without a record: %v\n", err)
			return 1
		}
		a.ID = id
	}
	fmt.Fprintf(w, "\nSignalling (SIGTERM, then SIGKILL after %s)...\n", r.Grace)
	a = node.Act(ctx, a, plan)
	writeResult(w, a)
	if a.State != remediate.StateSucceeded {
		return 1
	}
	return 0
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
			fmt.Fprintf(tw, "  %d\t%d\t%d\t%d\t%s\t%s\t%s\t%v\n", t.PID, t.PPID, t.PGID, t.SID, t.User, truncate(t.Command, 40), t.Reason, t.WholeGroup)
		}
		tw.Flush()
	}
	for _, n := range p.Notes {
		fmt.Fprintf(w, "  note: %s\n", n)
	}
	if len(p.Excluded) > 0 {
		fmt.Fprintln(w, "\nLeft alone:")
		tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		for _, e := range p.Excluded {
			fmt.Fprintf(tw, "  %d\t%s\t%s\t%s\n", e.PID, e.User, truncate(e.Command, 40), e.Why)
		}
		tw.Flush()
	}
}

func writeResult(w io.Writer, a remediate.Action) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	for _, t := range a.Targets {
		fmt.Fprintf(tw, "  %d\t%s\t%s\t%s\n", t.PID, t.Outcome, strings.Join(t.Signals, ","), t.Error)
	}
	tw.Flush()
	switch a.State {
	case remediate.StateSucceeded:
		fmt.Fprintf(w, "\nMemory back: %s freed, verified %.1f s after the first signal.\n", mib(a.FreedBytes), a.VerifySeconds)
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

func hostname() string {
	h, _ := os.Hostname()
	return h
}
