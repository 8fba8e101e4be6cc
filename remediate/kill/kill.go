// Package kill is the signal ladder: SIGTERM (and SIGCONT), a grace
// period, then SIGKILL, each sent through a pidfd to exactly the process
// the plan named, never to a PID that may have been reused.
//
// Measured on Linux 6.18: a pidfd polls readable (POLLIN) as soon as the
// whole thread group has exited, that is when the process becomes a zombie,
// also for processes that are not our children; POLLHUP follows when it is
// reaped. So the pidfd alone tells "exited", and /proc's state is not
// consulted for it: a thread-group leader that called pthread_exit shows
// state Z while its other threads run on and keep every descriptor (and so
// the GPU memory), and its pidfd is rightly not readable. Signalling a
// zombie through its pidfd succeeds; only a reaped process gives ESRCH.
package kill

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/procfs"
	"golang.org/x/sys/unix"

	"github.com/gpu-orphan/gpu-orphan/internal/forks"
	"github.com/gpu-orphan/gpu-orphan/internal/proc"
	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/exclude"
)

// Outcomes (remediate.Target.Outcome).
const (
	OutcomeExitedAfterSIGTERM = "exited_after_sigterm"
	OutcomeExitedAfterSIGKILL = "exited_after_sigkill"
	OutcomeGoneBeforeSignal   = "gone_before_signal"
	OutcomeIdentityChanged    = "identity_changed"
	OutcomeStillAlive         = "still_alive"
	OutcomeError              = "error"
)

// ReasonLateGroupMember is the reason of a target the ladder added: a
// member of a process group killed whole that appeared after the plan.
const ReasonLateGroupMember remediate.TargetReason = "process_group_member_late"

// Defaults for a zero Ladder.
const (
	DefaultGrace       = 5 * time.Second
	DefaultExitTimeout = 5 * time.Second
)

// pollSlice bounds one poll, so that a cancelled context is noticed.
const pollSlice = 100 * time.Millisecond

// GroupLister lists the live processes of a process group, a zombie leader
// whose other threads run among them; proc.FS does.
type GroupLister interface {
	GroupMembers(pgid int) ([]proc.Process, error)
}

// Ladder signals targets. The zero value is not usable: Proc must be set.
type Ladder struct {
	// Grace is how long targets have to exit after SIGTERM.
	Grace time.Duration
	// ExitTimeout is how long targets have to exit after SIGKILL. A
	// process in D state acts on SIGKILL only when its kernel call returns.
	ExitTimeout time.Duration
	// Proc is the procfs that start times are read from.
	Proc proc.FS
	// BeforeSignal, when set, is called before each signal, from the
	// target's goroutine (calls for different targets may overlap): the
	// audit record writes it there, so that no signal is ever sent without
	// its record, even if the remediator dies the moment after. An error
	// leaves the signal unsent.
	BeforeSignal func(pid int, sig unix.Signal) error
	// OnSignal, when set, is called after each signal sent, from the
	// target's goroutine: calls for different targets may overlap.
	OnSignal func(pid int, sig unix.Signal)
	Logger   *slog.Logger

	// Groups, when set, re-lists the process group of each WholeGroup
	// target once after SIGTERM reached it, so that members forked after
	// the plan are killed too.
	Groups GroupLister
	// Exclude says why a late group member must not be touched, or "".
	// Nil means exclude.Rules{}.Why: the fixed rules and the default
	// protected list, with this process as self.
	Exclude func(proc.Process) remediate.ExclusionReason
	// ForkedFrom, when set, reports whether the kernel's fork events
	// showed m forked, fork by fork, from one of targets (the fork
	// record): the only proof that a late group member whose parent is
	// gone was a target's. Without it such a member is left alone.
	ForkedFrom func(m proc.Process, targets []remediate.Target) bool
}

// run is one target on its way down the ladder.
type run struct {
	t  *remediate.Target
	fd int // pidfd; -1 once the outcome is final
	// pgid, for a late group member, is the group it must still be in.
	pgid int
	// deadline ends the grace period.
	deadline time.Time
}

func setDeadline(runs []*run, d time.Time) {
	for _, r := range runs {
		r.deadline = d
	}
}

// Kill signals every target and returns them with Outcome, Signals and
// Error filled in, followed by any group members it added. Targets are
// handled concurrently, so all share one grace period.
func (l *Ladder) Kill(ctx context.Context, targets []remediate.Target) []remediate.Target {
	out := slices.Clone(targets)
	for i := range out {
		out[i].Outcome, out[i].Signals, out[i].Error = "", nil, ""
	}
	pfs, err := procfs.NewFS(l.Proc.Root())
	if err != nil {
		for i := range out {
			fail(&out[i], fmt.Errorf("opening procfs: %w", err))
		}
		return out
	}
	runs := make([]*run, len(out))
	for i := range out {
		runs[i] = &run{t: &out[i], fd: -1}
	}

	parents := l.parentsBefore(out)
	each(runs, func(r *run) { l.terminate(ctx, pfs, r) })
	setDeadline(runs, time.Now().Add(l.grace()))

	// Re-listing scans all of /proc and may take a while on a busy node:
	// late members get a grace period of their own rather than what is
	// left of the first.
	late := l.lateMembers(out, parents)
	lateRuns := make([]*run, len(late))
	for i := range late {
		lateRuns[i] = &run{t: &late[i], fd: -1, pgid: late[i].PGID}
	}
	each(lateRuns, func(r *run) { l.terminate(ctx, pfs, r) })
	setDeadline(lateRuns, time.Now().Add(l.grace()))

	each(append(runs, lateRuns...), func(r *run) { l.finish(ctx, pfs, r) })
	return append(out, late...)
}

func (l *Ladder) grace() time.Duration {
	if l.Grace > 0 {
		return l.Grace
	}
	return DefaultGrace
}

func (l *Ladder) exitTimeout() time.Duration {
	if l.ExitTimeout > 0 {
		return l.ExitTimeout
	}
	return DefaultExitTimeout
}

func (l *Ladder) logger() *slog.Logger {
	if l.Logger != nil {
		return l.Logger
	}
	return slog.New(slog.DiscardHandler)
}

// each runs fn on every run concurrently and waits for all.
func each(runs []*run, fn func(*run)) {
	var wg sync.WaitGroup
	for _, r := range runs {
		wg.Go(func() { fn(r) })
	}
	wg.Wait()
}

// terminate opens the target's pidfd, checks that it is still the process
// the plan named, and sends SIGTERM and SIGCONT. Any final outcome closes
// the pidfd.
func (l *Ladder) terminate(ctx context.Context, pfs procfs.FS, r *run) {
	t := r.t
	if t.PID <= 1 || t.PID == os.Getpid() {
		fail(t, fmt.Errorf("refusing to signal PID %d", t.PID))
		return
	}
	if err := ctx.Err(); err != nil {
		fail(t, fmt.Errorf("before the first signal: %w", err))
		return
	}
	fd, err := unix.PidfdOpen(t.PID, 0)
	if errors.Is(err, unix.ESRCH) {
		t.Outcome = OutcomeGoneBeforeSignal
		return
	}
	if err != nil {
		fail(t, fmt.Errorf("pidfd_open(%d): %w", t.PID, err))
		return
	}
	r.fd = fd
	done := func(outcome string, err error) {
		t.Outcome = outcome
		if err != nil {
			t.Error = err.Error()
		}
		unix.Close(r.fd)
		r.fd = -1
	}

	if exited, err := poll(r.fd, 0); err != nil {
		done(OutcomeError, err)
		return
	} else if exited {
		// A zombie, not yet reaped: it holds nothing any more.
		done(OutcomeGoneBeforeSignal, nil)
		return
	}
	// The pidfd names whoever had the PID when it was opened; the start
	// time says whether that is the process the plan saw.
	st, err := stat(pfs, t.PID)
	if gone(err) {
		done(OutcomeGoneBeforeSignal, nil)
		return
	}
	if err != nil {
		done(OutcomeError, fmt.Errorf("checking identity: %w", err))
		return
	}
	if st.Starttime != t.StartTime {
		done(OutcomeIdentityChanged, fmt.Errorf("PID %d now has start time %d, the plan saw %d", t.PID, st.Starttime, t.StartTime))
		return
	}
	if r.pgid != 0 && st.PGRP != r.pgid {
		done(OutcomeIdentityChanged, fmt.Errorf("PID %d left process group %d for %d", t.PID, r.pgid, st.PGRP))
		return
	}
	// Still not reaped after the read, so the stat was the pidfd's process
	// and not a newcomer that took the PID in between.
	if err := unix.PidfdSendSignal(r.fd, 0, nil, 0); errors.Is(err, unix.ESRCH) {
		done(OutcomeGoneBeforeSignal, nil)
		return
	}

	if err := l.signal(r, unix.SIGTERM); errors.Is(err, unix.ESRCH) {
		done(OutcomeGoneBeforeSignal, nil)
		return
	} else if err != nil {
		done(OutcomeError, err)
		return
	}
	// A stopped process keeps SIGTERM pending until it is continued.
	if err := l.signal(r, unix.SIGCONT); err != nil && !errors.Is(err, unix.ESRCH) {
		l.logger().Warn("Sending SIGCONT failed", "pid", t.PID, "err", err)
	}
}

// finish waits for the target until its grace period ends, then SIGKILLs
// it and waits ExitTimeout more.
func (l *Ladder) finish(ctx context.Context, pfs procfs.FS, r *run) {
	if r.fd < 0 {
		return
	}
	t := r.t
	defer func() {
		unix.Close(r.fd)
		r.fd = -1
	}()
	exited, err := wait(ctx, r.fd, r.deadline)
	switch {
	case exited:
		t.Outcome = OutcomeExitedAfterSIGTERM
		return
	case err != nil:
		l.stillAlive(pfs, t, err)
		return
	}
	if err := l.signal(r, unix.SIGKILL); errors.Is(err, unix.ESRCH) {
		// Reaped between the poll and the signal.
		t.Outcome = OutcomeExitedAfterSIGTERM
		return
	} else if err != nil {
		l.stillAlive(pfs, t, err)
		return
	}
	exited, err = wait(ctx, r.fd, time.Now().Add(l.exitTimeout()))
	if exited {
		t.Outcome = OutcomeExitedAfterSIGKILL
		return
	}
	l.stillAlive(pfs, t, err)
}

// stillAlive records a target that outlived the ladder, and its state.
func (l *Ladder) stillAlive(pfs procfs.FS, t *remediate.Target, err error) {
	t.Outcome = OutcomeStillAlive
	msg := "still alive after SIGKILL"
	if err != nil {
		msg = err.Error()
	}
	if st, serr := stat(pfs, t.PID); serr == nil && st.Starttime == t.StartTime {
		t.State = st.State
		switch st.State {
		case "D":
			msg += "; in D state (uninterruptible sleep): SIGKILL takes effect when its kernel call returns"
		case "Z":
			msg += "; its main thread exited but other threads still run"
		case "t":
			msg += "; in a tracing stop"
			if tr := l.tracer(t); tr != nil {
				t.Tracer = tr
				msg += " by its tracer " + tr.Who() + " (ptrace), which holds it at its exit or at the signal: it ends when the tracer lets it go or ends"
			}
		default:
			msg += "; state " + st.State
		}
	}
	t.Error = msg
	l.logger().Warn("Target outlived the kill ladder", "pid", t.PID, "comm", t.Comm, "err", msg)
}

// tracer names the tracer of t, a target that outlived the ladder in a
// tracing stop; a tracer the plan had named keeps its Target mark.
func (l *Ladder) tracer(t *remediate.Target) *remediate.Tracer {
	if l.Proc.Root() == "" {
		return nil
	}
	tr, _ := TracerOf(l.Proc, t.PID, t.StartTime)
	if tr != nil && t.Tracer != nil && t.Tracer.PID == tr.PID && t.Tracer.StartTime == tr.StartTime {
		tr.Target = t.Tracer.Target
	}
	return tr
}

// signal sends sig through the run's pidfd and records it.
func (l *Ladder) signal(r *run, sig unix.Signal) error {
	if l.BeforeSignal != nil {
		if err := l.BeforeSignal(r.t.PID, sig); err != nil {
			return fmt.Errorf("%s not sent to %d: %w", unix.SignalName(sig), r.t.PID, err)
		}
	}
	if err := unix.PidfdSendSignal(r.fd, sig, nil, 0); err != nil {
		return fmt.Errorf("pidfd_send_signal(%d, %s): %w", r.t.PID, unix.SignalName(sig), err)
	}
	r.t.Signals = append(r.t.Signals, unix.SignalName(sig))
	l.logger().Info("Process signalled", "pid", r.t.PID, "comm", r.t.Comm, "signal", unix.SignalName(sig))
	if l.OnSignal != nil {
		l.OnSignal(r.t.PID, sig)
	}
	return nil
}

// lateMembers re-lists, once, the process group of every WholeGroup target
// that was sent SIGTERM, and returns the live members the plan did not
// know. A group none of whose planned members was verified and signalled
// is left alone: its PGID may by now name another group.
func (l *Ladder) lateMembers(targets []remediate.Target, parents map[member]int) []remediate.Target {
	if l.Groups == nil {
		return nil
	}
	// The fixed rules (PID 1, kernel threads, ourselves, our group and
	// session) hold whatever Exclude says.
	fixed := exclude.Rules{Protected: []string{}}.Why
	excluded := l.Exclude
	if excluded == nil {
		excluded = exclude.Rules{}.Why
	}
	known := map[int]bool{}
	var pgids []int
	for _, t := range targets {
		known[t.PID] = true
		signalled := slices.Contains(t.Signals, unix.SignalName(unix.SIGTERM))
		if t.WholeGroup && signalled && t.PGID > 1 && t.PGID != unix.Getpgrp() && !slices.Contains(pgids, t.PGID) {
			pgids = append(pgids, t.PGID)
		}
	}
	var late []remediate.Target
	for _, pgid := range pgids {
		members, err := l.Groups.GroupMembers(pgid)
		if err != nil {
			l.logger().Warn("Re-listing a process group killed whole failed", "pgid", pgid, "err", err)
			continue
		}
		// The plan's rule holds for newcomers too: a group whose leader
		// lives and is not a target is the user's.
		if i := slices.IndexFunc(members, func(m proc.Process) bool { return m.PID == pgid }); i >= 0 && !known[pgid] {
			l.logger().Warn("Process group not re-listed: its leader is alive and not a target", "pgid", pgid, "leader", members[i].Comm)
			continue
		}
		for _, m := range members {
			if m.PGID != pgid || known[m.PID] || m.Zombie() {
				continue
			}
			known[m.PID] = true
			if !l.forkedByTarget(m, targets, parents) {
				l.logger().Warn("Late group member left alone: no target forked it", "pgid", pgid, "pid", m.PID, "comm", m.Comm, "ppid", m.PPID)
				continue
			}
			why := fixed(m)
			if why == "" {
				why = excluded(m)
			}
			if why != "" {
				l.logger().Warn("Late group member left alone", "pgid", pgid, "pid", m.PID, "comm", m.Comm, "why", why)
				continue
			}
			late = append(late, remediate.Target{ProcessInfo: remediate.NewProcessInfo(m), Reason: ReasonLateGroupMember, WholeGroup: true})
		}
	}
	return late
}

// member is a process by PID and start time.
type member struct {
	pid   int
	start uint64
}

// parentsBefore lists the groups of the WholeGroup targets before any
// signal, and returns each member's parent then. While the targets live,
// a member whose parent is one was forked by it (or adopted by it, a
// subreaper, from its own line); once SIGTERM has ended them, their
// children name init or a subreaper.
func (l *Ladder) parentsBefore(targets []remediate.Target) map[member]int {
	if l.Groups == nil {
		return nil
	}
	parents := map[member]int{}
	var listed []int
	for _, t := range targets {
		if !t.WholeGroup || t.PGID <= 1 || slices.Contains(listed, t.PGID) {
			continue
		}
		listed = append(listed, t.PGID)
		members, err := l.Groups.GroupMembers(t.PGID)
		if err != nil {
			continue // re-listed after SIGTERM, without its parents before
		}
		for _, m := range members {
			parents[member{m.PID, m.StartTime}] = m.PPID
		}
	}
	return parents
}

// forkedByTarget reports whether m was forked by a target of its group:
// its parent is one, or was before the signals (it started after it), or,
// its parent gone (it was
// reparented to init or a subreaper), the fork record shows it forked from
// one. Its group and its start time alone prove nothing: a process of the
// session that joined the group, or a child of the dead leader's, started
// after the targets too.
func (l *Ladder) forkedByTarget(m proc.Process, targets []remediate.Target, parents map[member]int) bool {
	before, listed := parents[member{m.PID, m.StartTime}]
	for _, t := range targets {
		if t.PGID == m.PGID && (t.PID == m.PPID || (listed && t.PID == before)) {
			return m.StartTime >= t.StartTime
		}
	}
	if processAlive(m.PPID) || l.ForkedFrom == nil {
		return false
	}
	return l.ForkedFrom(m, targets)
}

// ForkedFromRecord is Ladder.ForkedFrom through a fork record fed by the
// kernel's process events; nil when rec is (no events: nothing proves it).
func ForkedFromRecord(rec *forks.Record) func(proc.Process, []remediate.Target) bool {
	if rec == nil {
		return nil
	}
	return func(m proc.Process, targets []remediate.Target) bool {
		keys := make([]forks.Key, 0, len(targets))
		for _, t := range targets {
			keys = append(keys, forks.Key{PID: t.PID, Start: t.StartTime})
		}
		return rec.ForkedFrom(forks.Key{PID: m.PID, Start: m.StartTime}, keys)
	}
}

// processAlive reports whether pid names a process (any, even a zombie).
func processAlive(pid int) bool {
	if pid <= 1 {
		return false
	}
	err := unix.Kill(pid, 0)
	return err == nil || err == unix.EPERM
}

// wait polls the pidfd until the process exits, deadline passes, or ctx
// ends (an error).
func wait(ctx context.Context, fd int, deadline time.Time) (bool, error) {
	for {
		if err := ctx.Err(); err != nil {
			exited, _ := poll(fd, 0)
			return exited, fmt.Errorf("waiting for exit: %w", err)
		}
		left := time.Until(deadline)
		exited, err := poll(fd, min(max(left, 0), pollSlice))
		if exited || err != nil || left <= pollSlice {
			return exited, err
		}
	}
}

// poll reports whether the pidfd is readable (the process has exited)
// within timeout.
func poll(fd int, timeout time.Duration) (bool, error) {
	fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
	ms := int((timeout + time.Millisecond - 1) / time.Millisecond)
	start := time.Now()
	for {
		n, err := unix.Poll(fds, ms)
		if errors.Is(err, unix.EINTR) {
			ms = max(0, int((timeout-time.Since(start)+time.Millisecond-1)/time.Millisecond))
			continue
		}
		if err != nil {
			return false, fmt.Errorf("polling pidfd: %w", err)
		}
		if n == 0 {
			return false, nil
		}
		if fds[0].Revents&unix.POLLNVAL != 0 {
			return false, errors.New("polling pidfd: invalid descriptor")
		}
		return fds[0].Revents&(unix.POLLIN|unix.POLLHUP) != 0, nil
	}
}

func fail(t *remediate.Target, err error) {
	t.Outcome, t.Error = OutcomeError, err.Error()
}

func stat(pfs procfs.FS, pid int) (procfs.ProcStat, error) {
	p, err := pfs.Proc(pid)
	if err != nil {
		return procfs.ProcStat{}, err
	}
	return p.Stat()
}

// gone reports whether err says the process no longer exists.
func gone(err error) bool {
	return errors.Is(err, os.ErrNotExist) || errors.Is(err, unix.ESRCH)
}
