package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"slices"
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

	cfg := r.DecideConfig()
	snapshots := cleanup.Once{Taker: opened.Taker, OrphanBytes: cfg.MinBytes}
	nodeCfg := cleanup.Config{
		Snapshots: snapshots, Proc: fs, Decide: cfg,
		Ladder:        &kill.Ladder{Grace: r.Grace, Proc: fs, Logger: logger, Groups: fs, Exclude: cfg.Rules().Why},
		Act:           r.Act,
		VerifyTimeout: r.VerifyTimeout,
		Logger:        logger,
	}
	s := snapshots.Refresh(ctx, true)
	plan := cleanup.New(nodeCfg).PlanFrom(s, gpuID)
	// A snapshot that lists GPUs, none of them this one, says so whatever
	// else it failed to see; an empty list is trusted only when healthy.
	if _, found := s.GPUByID(gpuID); !found && (len(s.GPUs) > 0 || plan.SkipReason == decide.SkipGPUNotFound) {
		fmt.Fprintf(os.Stderr, "gpu-orphan: no GPU %s on this node (%s)\n", gpuID, describeGPUs(s))
		return 2
	}
	writePlan(w, plan, r.Act)
	if !plan.Act {
		if plan.SkipReason == decide.SkipSnapshotUnhealthy {
			return 1
		}
		return 0
	}
	if !r.Act {
		fmt.Fprintln(w, "\nDry run: nothing was signalled. Run again with --act to do this.")
		return 0
	}
	// With --store.path the action is recorded as the remediator records
	// its own; without, it is only printed. The store is opened only now,
	// to act: a plan that does not act leaves no database behind.
	var audit auditRecord
	if storePath != "" {
		st, err := store.Open(ctx, storePath)
		if err != nil {
			fmt.Fprintf(os.Stderr, "gpu-orphan: %v\n", err)
			return 1
		}
		defer st.Close()
		audit = st
		nodeCfg.Recorder = st
	}
	node := cleanup.New(nodeCfg)
	a := remediate.Action{Node: hostname(), GPUUUID: plan.GPUUUID, GPUIndex: plan.GPUIndex, Policy: plan.Policy,
		State: remediate.StateRunning, Source: "cli", StartedAt: time.Now()}
	before := plan.Before
	a.Before, a.Targets, a.Excluded = &before, plan.Targets, plan.Excluded
	// One snapshot keeps no history: the dead owners are recorded, their
	// identities unknown.
	a.DeadOwners = plan.DeadOwners
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

// describeGPUs says which GPUs a snapshot shows: "it has GPUs 0-1",
// "it has GPUs 0, 2-3", "it has GPU 0", "it has no GPUs".
func describeGPUs(s *snapshot.Snapshot) string {
	var idx []int
	for _, g := range s.GPUs {
		idx = append(idx, g.Device.Index)
	}
	slices.Sort(idx)
	idx = slices.Compact(idx)
	switch len(idx) {
	case 0:
		return "it has no GPUs"
	case 1:
		return fmt.Sprintf("it has GPU %d", idx[0])
	}
	var runs []string
	for i := 0; i < len(idx); {
		j := i
		for j+1 < len(idx) && idx[j+1] == idx[j]+1 {
			j++
		}
		if j == i {
			runs = append(runs, strconv.Itoa(idx[i]))
		} else {
			runs = append(runs, fmt.Sprintf("%d-%d", idx[i], idx[j]))
		}
		i = j + 1
	}
	return "it has GPUs " + strings.Join(runs, ", ")
}

func hostname() string {
	h, _ := os.Hostname()
	return h
}
