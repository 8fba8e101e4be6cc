package kill

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpu-orphan/gpu-orphan/internal/forks"
	"github.com/gpu-orphan/gpu-orphan/internal/proc"
	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/exclude"
)

const grace = 300 * time.Millisecond

// signals records OnSignal calls.
type signals struct {
	mu  sync.Mutex
	got []string
}

func (s *signals) record(pid int, sig unix.Signal) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.got = append(s.got, fmt.Sprintf("%d:%s", pid, unix.SignalName(sig)))
}

func (s *signals) list() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.got)
}

func expect(pid int, sigs ...string) []string {
	var out []string
	for _, s := range sigs {
		out = append(out, strconv.Itoa(pid)+":"+s)
	}
	return out
}

// TestLadder takes single real processes down the ladder.
func TestLadder(t *testing.T) {
	fs := procFS(t)
	for _, tc := range []struct {
		name string
		// setup starts the process and returns the target the plan names.
		setup       func(t *testing.T) (*child, remediate.Target)
		wantOutcome string
		wantSignals []string
		// contOptional: the process may die, and be reaped, between
		// SIGTERM and SIGCONT, whose delivery then fails with ESRCH.
		contOptional bool
		// wantAlive: the process must survive the ladder.
		wantAlive bool
		minTime   time.Duration
	}{
		{
			name: "SIGTERM suffices",
			setup: func(t *testing.T) (*child, remediate.Target) {
				c := start(t, "", "sleep", "100")
				return c, targetOf(t, fs, c.pid())
			},
			wantOutcome:  OutcomeExitedAfterSIGTERM,
			wantSignals:  []string{"SIGTERM", "SIGCONT"},
			contOptional: true,
		},
		{
			name: "SIGTERM ignored: SIGKILL after the grace period",
			setup: func(t *testing.T) (*child, remediate.Target) {
				c := startHelper(t, "ignore-term")
				return c, targetOf(t, fs, c.pid())
			},
			wantOutcome: OutcomeExitedAfterSIGKILL,
			wantSignals: []string{"SIGTERM", "SIGCONT", "SIGKILL"},
			minTime:     grace,
		},
		{
			name: "a stopped process still dies of SIGTERM (SIGCONT)",
			setup: func(t *testing.T) (*child, remediate.Target) {
				c := start(t, "", "sleep", "100")
				if err := c.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
					t.Fatal(err)
				}
				waitState(t, c.pid(), "T")
				return c, targetOf(t, fs, c.pid())
			},
			wantOutcome: OutcomeExitedAfterSIGTERM,
			wantSignals: []string{"SIGTERM", "SIGCONT"},
		},
		{
			name: "gone before the ladder",
			setup: func(t *testing.T) (*child, remediate.Target) {
				c := start(t, "", "sleep", "100")
				tg := targetOf(t, fs, c.pid())
				_ = c.cmd.Process.Kill()
				<-c.done
				return c, tg
			},
			wantOutcome: OutcomeGoneBeforeSignal,
		},
		{
			name: "PID reused: another start time is never signalled",
			setup: func(t *testing.T) (*child, remediate.Target) {
				c := start(t, "", "sleep", "100")
				tg := targetOf(t, fs, c.pid())
				tg.StartTime++ // the plan saw an earlier process with this PID
				return c, tg
			},
			wantOutcome: OutcomeIdentityChanged,
			wantAlive:   true,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, tg := tc.setup(t)
			var sigs signals
			l := &Ladder{Grace: grace, ExitTimeout: 2 * time.Second, Proc: fs, OnSignal: sigs.record}
			begin := time.Now()
			got := l.Kill(context.Background(), []remediate.Target{tg})
			took := time.Since(begin)
			if len(got) != 1 {
				t.Fatalf("Kill returned %d targets, want 1", len(got))
			}
			r := got[0]
			if r.Outcome != tc.wantOutcome {
				t.Errorf("outcome %q (error %q), want %q", r.Outcome, r.Error, tc.wantOutcome)
			}
			wantSignals := tc.wantSignals
			if tc.contOptional && !slices.Contains(r.Signals, "SIGCONT") {
				wantSignals = slices.DeleteFunc(slices.Clone(wantSignals), func(s string) bool { return s == "SIGCONT" })
			}
			if !slices.Equal(r.Signals, wantSignals) {
				t.Errorf("Signals = %v, want %v", r.Signals, wantSignals)
			}
			if want := expect(tg.PID, wantSignals...); !slices.Equal(sigs.list(), want) {
				t.Errorf("OnSignal got %v, want %v", sigs.list(), want)
			}
			if took < tc.minTime {
				t.Errorf("took %v, less than %v", took, tc.minTime)
			}
			if tc.wantAlive {
				if c.exited(200 * time.Millisecond) {
					t.Errorf("process %d died; it must not have been signalled", c.pid())
				}
				if s := state(c.pid()); s != "S" {
					t.Errorf("process %d is in state %q, want S", c.pid(), s)
				}
			} else if !c.exited(2 * time.Second) {
				t.Errorf("process %d is still alive", c.pid())
			}
		})
	}
}

// grandchild starts `sh -c script` where the script puts a sleep in the
// background, prints its PID and execs into a sleep that never reaps it:
// the background sleep is not our child, and becomes a zombie that no one
// reaps while the test runs.
func grandchild(t *testing.T, trap string) (*child, int) {
	c := start(t, "", "sh", "-c", trap+"sleep 100 & echo $!; exec sleep 100")
	pid, err := strconv.Atoi(c.readLine(t))
	if err != nil {
		t.Fatal(err)
	}
	waitState(t, pid, "S")
	return c, pid
}

// TestLadderNonChild: the ladder works on processes it cannot wait for,
// which is every process it kills in production.
func TestLadderNonChild(t *testing.T) {
	fs := procFS(t)
	for _, tc := range []struct {
		name        string
		trap        string
		wantOutcome string
		wantSignals []string
	}{
		{"SIGTERM suffices", "", OutcomeExitedAfterSIGTERM, []string{"SIGTERM", "SIGCONT"}},
		// An ignored signal stays ignored across fork and exec.
		{"SIGTERM ignored", `trap "" TERM; `, OutcomeExitedAfterSIGKILL, []string{"SIGTERM", "SIGCONT", "SIGKILL"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, pid := grandchild(t, tc.trap)
			l := &Ladder{Grace: grace, ExitTimeout: 2 * time.Second, Proc: fs}
			got := l.Kill(context.Background(), []remediate.Target{targetOf(t, fs, pid)})
			// The target is not our child: nobody reaps it, so SIGCONT
			// always reaches it (a zombie can be signalled).
			if got[0].Outcome != tc.wantOutcome || !slices.Equal(got[0].Signals, tc.wantSignals) {
				t.Errorf("outcome %q signals %v (error %q), want %q %v", got[0].Outcome, got[0].Signals, got[0].Error, tc.wantOutcome, tc.wantSignals)
			}
			// Counted as exited while still an unreaped zombie.
			if s := state(pid); s != "Z" {
				t.Errorf("state %q, want Z (exited, not reaped)", s)
			}
		})
	}

	t.Run("an unreaped zombie is gone before any signal", func(t *testing.T) {
		_, pid := grandchild(t, "")
		tg := targetOf(t, fs, pid)
		killForTest(t, pid)
		waitState(t, pid, "Z")
		got := (&Ladder{Grace: grace, Proc: fs}).Kill(context.Background(), []remediate.Target{tg})
		if got[0].Outcome != OutcomeGoneBeforeSignal || len(got[0].Signals) != 0 {
			t.Errorf("outcome %q signals %v, want %q and none", got[0].Outcome, got[0].Signals, OutcomeGoneBeforeSignal)
		}
	})
}

// killForTest SIGKILLs a process the test set up, through a pidfd.
func killForTest(t *testing.T, pid int) {
	t.Helper()
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if err := unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0); err != nil {
		t.Fatal(err)
	}
}

// TestPidfdExitSemantics pins down the kernel behaviour the ladder rests
// on: a pidfd is readable once the whole thread group has exited, which
// for a non-child is when it becomes a zombie; a leader in state Z whose
// other threads run is not exited, and its pidfd says so.
func TestPidfdExitSemantics(t *testing.T) {
	t.Run("readable at zombie, non-child", func(t *testing.T) {
		_, pid := grandchild(t, "")
		fd, err := unix.PidfdOpen(pid, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Close(fd)
		if exited, _ := poll(fd, 0); exited {
			t.Fatal("pidfd of a sleeping process is readable")
		}
		if err := unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0); err != nil {
			t.Fatal(err)
		}
		exited, err := poll(fd, 2*time.Second)
		if err != nil || !exited {
			t.Fatalf("pidfd not readable after SIGKILL: %v", err)
		}
		if s := state(pid); s != "Z" {
			t.Errorf("state %q, want Z: readable before reaping", s)
		}
		// A zombie is still signallable: only reaping gives ESRCH.
		if err := unix.PidfdSendSignal(fd, 0, nil, 0); err != nil {
			t.Errorf("signal 0 to a zombie: %v", err)
		}
	})
	t.Run("zombie leader with live threads is not exited", func(t *testing.T) {
		c := startHelper(t, "leader-exit")
		waitState(t, c.pid(), "Z")
		fd, err := unix.PidfdOpen(c.pid(), 0)
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Close(fd)
		if exited, _ := poll(fd, 100*time.Millisecond); exited {
			t.Fatal("pidfd readable although threads still run")
		}
		fs := procFS(t)
		got := (&Ladder{Grace: grace, Proc: fs}).Kill(context.Background(), []remediate.Target{targetOf(t, fs, c.pid())})
		if got[0].Outcome != OutcomeExitedAfterSIGTERM {
			t.Errorf("outcome %q (error %q), want %q", got[0].Outcome, got[0].Error, OutcomeExitedAfterSIGTERM)
		}
	})
}

// TestLadderConcurrent: targets share one grace period.
func TestLadderConcurrent(t *testing.T) {
	fs := procFS(t)
	var targets []remediate.Target
	var children []*child
	for range 3 {
		c := startHelper(t, "ignore-term")
		children = append(children, c)
		targets = append(targets, targetOf(t, fs, c.pid()))
	}
	begin := time.Now()
	got := (&Ladder{Grace: grace, ExitTimeout: 2 * time.Second, Proc: fs}).Kill(context.Background(), targets)
	took := time.Since(begin)
	for _, r := range got {
		if r.Outcome != OutcomeExitedAfterSIGKILL {
			t.Errorf("%d: outcome %q (error %q)", r.PID, r.Outcome, r.Error)
		}
	}
	if took < grace || took > 2*grace {
		t.Errorf("three targets took %v; one shared grace period of %v expected", took, grace)
	}
	for _, c := range children {
		if !c.exited(2 * time.Second) {
			t.Errorf("%d still alive", c.pid())
		}
	}
}

// TestLadderLateGroupMembers: members of a group killed whole that the plan
// did not know are brought in; processes outside the group, and members
// that Exclude names, are not touched.
func TestLadderLateGroupMembers(t *testing.T) {
	fs := procFS(t)
	// A shell (leader of its group and session) with three background
	// sleeps; the plan knows only the shell.
	leader := start(t, "", "sh", "-c", "sleep 100 & echo $!; sleep 100 & echo $!; sleep 100 & echo $!; wait")
	var sleeps []int
	for range 3 {
		pid, err := strconv.Atoi(leader.readLine(t))
		if err != nil {
			t.Fatal(err)
		}
		waitState(t, pid, "S")
		sleeps = append(sleeps, pid)
	}
	protectedPID := sleeps[2]
	t.Cleanup(func() { killIfAlive(protectedPID) })
	outsider := start(t, "", "sleep", "100")

	tg := targetOf(t, fs, leader.pid())
	tg.WholeGroup = true
	l := &Ladder{
		Grace: grace, ExitTimeout: 2 * time.Second, Proc: fs,
		Groups: fs,
		Exclude: func(p proc.Process) remediate.ExclusionReason {
			if p.PID == protectedPID {
				return exclude.WhyProtected
			}
			return ""
		},
	}
	begin := time.Now()
	got := l.Kill(context.Background(), []remediate.Target{tg})
	t.Logf("ladder with one group re-listing took %v", time.Since(begin))

	outcomes := map[int]string{}
	for _, r := range got {
		outcomes[r.PID] = r.Outcome
		if r.PID != tg.PID && (r.Reason != ReasonLateGroupMember || !r.WholeGroup || r.PGID != tg.PGID) {
			t.Errorf("late member %d: reason %q whole %v pgid %d", r.PID, r.Reason, r.WholeGroup, r.PGID)
		}
	}
	want := map[int]string{
		leader.pid(): OutcomeExitedAfterSIGTERM,
		sleeps[0]:    OutcomeExitedAfterSIGTERM,
		sleeps[1]:    OutcomeExitedAfterSIGTERM,
	}
	if !maps.Equal(outcomes, want) {
		t.Errorf("outcomes %v, want %v", outcomes, want)
	}
	if !leader.exited(2 * time.Second) {
		t.Error("leader still alive")
	}
	if s := state(protectedPID); s != "S" {
		t.Errorf("excluded member %d is in state %q, want S (untouched)", protectedPID, s)
	}
	if outsider.exited(100 * time.Millisecond) {
		t.Error("a process outside the group died")
	}
}

// TestLadderLateMembersLiveLeader: the group rule holds for newcomers too.
// When a group's leader is alive and not a target (a job script that
// waits), re-listing adds no member: neither the leader nor its other
// children are signalled, only the planned target.
func TestLadderLateMembersLiveLeader(t *testing.T) {
	fs := procFS(t)
	leader := start(t, "", "sh", "-c", "sleep 100 & echo $!; sleep 100 & echo $!; wait")
	var sleeps []int
	for range 2 {
		pid, err := strconv.Atoi(leader.readLine(t))
		if err != nil {
			t.Fatal(err)
		}
		waitState(t, pid, "S")
		sleeps = append(sleeps, pid)
	}
	t.Cleanup(func() { killIfAlive(sleeps[1]) })
	tg := targetOf(t, fs, sleeps[0])
	tg.WholeGroup = true
	got := (&Ladder{Grace: grace, ExitTimeout: 2 * time.Second, Proc: fs, Groups: fs}).Kill(context.Background(), []remediate.Target{tg})
	if len(got) != 1 || got[0].PID != sleeps[0] || got[0].Outcome != OutcomeExitedAfterSIGTERM {
		t.Fatalf("got %+v, want only the planned target, exited after SIGTERM", got)
	}
	if leader.exited(200 * time.Millisecond) {
		t.Error("the live leader, not a target, was signalled")
	}
	if s := state(sleeps[1]); s != "S" {
		t.Errorf("the leader's other child is in state %q, want S (untouched)", s)
	}
}

// TestLadderStaleGroup: a group whose planned member turned out to be
// another process is not re-listed.
func TestLadderStaleGroup(t *testing.T) {
	fs := procFS(t)
	leader := start(t, "", "sh", "-c", "sleep 100 & echo $!; wait")
	member, err := strconv.Atoi(leader.readLine(t))
	if err != nil {
		t.Fatal(err)
	}
	waitState(t, member, "S")
	tg := targetOf(t, fs, leader.pid())
	tg.WholeGroup = true
	tg.StartTime++
	got := (&Ladder{Grace: grace, Proc: fs, Groups: fs}).Kill(context.Background(), []remediate.Target{tg})
	if len(got) != 1 || got[0].Outcome != OutcomeIdentityChanged {
		t.Fatalf("got %+v, want the one target, identity_changed", got)
	}
	if leader.exited(100*time.Millisecond) || state(member) != "S" {
		t.Error("a member of the stale group was signalled")
	}
}

// TestLadderRefuses: never PID 1, never ourselves, nothing once ctx ended.
func TestLadderRefuses(t *testing.T) {
	fs := procFS(t)
	c := start(t, "", "sleep", "100")
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	for _, tc := range []struct {
		name string
		ctx  context.Context
		tg   remediate.Target
	}{
		{"PID 1", context.Background(), remediate.Target{ProcessInfo: remediate.ProcessInfo{PID: 1}}},
		{"ourselves", context.Background(), targetOf(t, fs, os.Getpid())},
		{"context ended", ctx, targetOf(t, fs, c.pid())},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var sigs signals
			got := (&Ladder{Grace: grace, Proc: fs, OnSignal: sigs.record}).Kill(tc.ctx, []remediate.Target{tc.tg})
			if got[0].Outcome != OutcomeError || got[0].Error == "" || len(got[0].Signals) > 0 || len(sigs.list()) > 0 {
				t.Errorf("outcome %q error %q signals %v", got[0].Outcome, got[0].Error, got[0].Signals)
			}
		})
	}
	if c.exited(100 * time.Millisecond) {
		t.Error("a process was signalled after the context ended")
	}
}

// TestLadderCancelDuringGrace: an ended context stops the ladder before
// SIGKILL, and says the target is still alive.
func TestLadderCancelDuringGrace(t *testing.T) {
	fs := procFS(t)
	c := startHelper(t, "ignore-term")
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	got := (&Ladder{Grace: 5 * time.Second, Proc: fs}).Kill(ctx, []remediate.Target{targetOf(t, fs, c.pid())})
	if got[0].Outcome != OutcomeStillAlive || slices.Contains(got[0].Signals, "SIGKILL") {
		t.Errorf("outcome %q signals %v (error %q)", got[0].Outcome, got[0].Signals, got[0].Error)
	}
	if c.exited(100 * time.Millisecond) {
		t.Error("target died without SIGKILL")
	}
}

func killIfAlive(pid int) {
	if fd, err := unix.PidfdOpen(pid, 0); err == nil {
		_ = unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0)
		unix.Close(fd)
	}
}

// TestLadderLateMembersReparented: in a group killed whole whose leader
// (the dead trainer's job script) is gone, two late members were
// reparented to init: Z, forked by the target W (through a subshell), and
// Y, forked by the leader after W. Both started after the target; only
// the kernel's fork events tell them apart. Z is brought in, Y is left
// alone. (Before: a member whose parent was gone and that started after
// the first target was taken for a target's, and Y was killed.)
func TestLadderLateMembersReparented(t *testing.T) {
	fs := procFS(t)
	rec := forks.New(fs)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	st := forks.Follow(ctx, rec, slog.New(slog.DiscardHandler))
	if !st.Up() {
		t.Skipf("the kernel's process events are unavailable here: %s", st.Why)
	}
	// The leader L starts W, which starts Z through a subshell and
	// becomes a sleep; then L starts Y through a subshell, and stops
	// until the test has read them and kills it.
	leader := start(t, "", "sh", "-c", `sh -c '(sleep 100 & echo Z $!); echo W $$; exec sleep 100' & `+
		`(sleep 100 & echo Y $!); kill -STOP $$`)
	pids := map[string]int{}
	for range 3 {
		f := strings.Fields(leader.readLine(t))
		pid, err := strconv.Atoi(f[1])
		if err != nil {
			t.Fatal(err)
		}
		pids[f[0]] = pid
		t.Cleanup(func() { killIfAlive(pid) })
	}
	if err := leader.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	if !leader.exited(10 * time.Second) {
		t.Fatal("the leader did not exit")
	}
	for _, k := range []string{"W", "Z", "Y"} {
		waitState(t, pids[k], "S")
	}
	if !st.CatchUp(ctx, 10*time.Second) {
		t.Fatal("the fork record did not catch up")
	}
	w := targetOf(t, fs, pids["W"])
	w.WholeGroup = true
	for _, k := range []string{"Z", "Y"} {
		if p, err := fs.Process(pids[k]); err != nil || p.PGID != w.PGID || p.StartTime < w.StartTime || processAlive(p.PPID) {
			t.Fatalf("%s: %+v (%v): want in W's group, started after it, its parent gone", k, p, err)
		}
	}

	l := &Ladder{Grace: grace, ExitTimeout: 2 * time.Second, Proc: fs, Groups: fs, ForkedFrom: ForkedFromRecord(rec)}
	got := l.Kill(context.Background(), []remediate.Target{w})
	outcomes := map[int]string{}
	for _, r := range got {
		outcomes[r.PID] = r.Outcome
	}
	want := map[int]string{pids["W"]: OutcomeExitedAfterSIGTERM, pids["Z"]: OutcomeExitedAfterSIGTERM}
	if !maps.Equal(outcomes, want) {
		t.Errorf("outcomes %v, want %v (W %d, Z %d; Y %d left alone)", outcomes, want, pids["W"], pids["Z"], pids["Y"])
	}
	if s := state(pids["Y"]); s != "S" {
		t.Errorf("Y, the dead leader's, not a target's, is in state %q, want S (untouched)", s)
	}

	// Without the fork record nothing proves Z a target's either.
	if ForkedFromRecord(nil) != nil {
		t.Error("ForkedFromRecord(nil) is not nil")
	}
}
