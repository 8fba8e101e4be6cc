package forks

import (
	"bufio"
	"context"
	"errors"
	"log/slog"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpu-orphan/gpu-orphan/internal/proc"
	"github.com/gpu-orphan/gpu-orphan/internal/procevents"
	"github.com/gpu-orphan/gpu-orphan/internal/stack/slowness"
)

// following returns a record fed by the kernel's process events.
func following(t *testing.T) *Record {
	t.Helper()
	fs, err := proc.NewFS("/proc")
	if err != nil {
		t.Fatal(err)
	}
	rec := New(fs)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	if st := Follow(ctx, rec, slog.New(slog.DiscardHandler)); !st.Up() {
		t.Skipf("the kernel's process events are unavailable here: %s", st.Why)
	}
	return rec
}

// shell runs script with bash in a session of its own and returns it with
// the first PID it prints.
func shell(t *testing.T, script string) (*exec.Cmd, int) {
	t.Helper()
	cmd := exec.Command("bash", "-c", script)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL); cmd.Wait() })
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		t.Fatalf("the script printed no PID: %v", err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(line))
	if err != nil {
		t.Fatal(err)
	}
	return cmd, pid
}

func key(t *testing.T, pid int) Key {
	t.Helper()
	fs, _ := proc.NewFS("/proc")
	st, err := fs.ReadStat(pid)
	if err != nil {
		t.Fatal(err)
	}
	return Key{pid, st.StartTime}
}

// eventually polls cond for up to 10 s.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	// Stretched by the machine's measured slowness (another make test
	// beside this one delays the follower too).
	for deadline := time.Now().Add(slowness.Scale(10*time.Second, slowness.Factor())); !cond(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// TestRecordNoCapPruned (issue 22, finding 5): a parent that forks 1500
// short-lived workers (DataLoader workers re-forked every epoch) and then
// one more: the last is still proven its descendant at fork, after the
// parent's death, and the record's size comes back to what lives.
func TestRecordNoCapPruned(t *testing.T) {
	rec := following(t)
	cmd, late := shell(t, `for i in $(seq 1100); do ( : ) & done; wait; ( sleep 100006; : ) & echo $!; wait`)
	parent := key(t, cmd.Process.Pid)
	worker := key(t, late)
	eventually(t, "the fork of the last worker to be recorded", func() bool {
		_, err := rec.Inherits(worker, parent.PID, parent.Start)
		return !errors.Is(err, ErrNotRecorded)
	})
	syscall.Kill(cmd.Process.Pid, syscall.SIGKILL)
	cmd.Wait()
	owner, err := rec.Inherits(worker, parent.PID, parent.Start)
	if err != nil || owner != parent {
		t.Fatalf("the worker forked after 1100 others: %v (owner %v), want proven from %v", err, owner, parent)
	}
	// The dead parent is kept while its worker lives, the 1100 are gone.
	// Counted among the parent's children, not node-wide: other tests'
	// processes come and go meanwhile.
	eventually(t, "the record to shrink back", func() bool {
		rec.FlushExits(time.Now().Add(time.Second))
		return childrenOf(rec, parent) == 1
	})
	if _, err := rec.Inherits(worker, parent.PID, 0); err != nil {
		t.Errorf("without the owner's start time: %v, want proven (the one dead process with that PID)", err)
	}
}

// TestRecordResyncDropsProof: after lost events the record is read again
// from /proc, and what it had proven is proof no more: an exec may have
// been missed. Lost events never make a target.
func TestRecordResyncDropsProof(t *testing.T) {
	rec := following(t)
	cmd, late := shell(t, `( sleep 100006; : ) & echo $!; wait`)
	parent, worker := key(t, cmd.Process.Pid), key(t, late)
	eventually(t, "the worker's fork to be recorded", func() bool {
		_, err := rec.Inherits(worker, parent.PID, parent.Start)
		return !errors.Is(err, ErrNotRecorded)
	})
	syscall.Kill(cmd.Process.Pid, syscall.SIGKILL)
	cmd.Wait()
	if _, err := rec.Inherits(worker, parent.PID, parent.Start); err != nil {
		t.Fatalf("before the resync: %v, want proven", err)
	}
	if err := rec.Resync(); err != nil {
		t.Fatal(err)
	}
	if _, err := rec.Inherits(worker, parent.PID, parent.Start); !errors.Is(err, ErrNotAtFork) {
		t.Errorf("after the resync: %v, want %v", err, ErrNotAtFork)
	}
	if rec.Counts().Resyncs != 1 {
		t.Errorf("resyncs = %d, want 1", rec.Counts().Resyncs)
	}
}

// TestRecordExecDropsFiles (issue 22, finding 2): a child that runs exec,
// whose parent holds no GPU file it could have kept, is not proven: the
// exec may have dropped what it inherited, and what it holds it opened.
func TestRecordExecDropsFiles(t *testing.T) {
	rec := following(t)
	dev, err := os.CreateTemp(t.TempDir(), "nvidia")
	if err != nil {
		t.Fatal(err)
	}
	dev.Close()
	d, err := proc.StatDevice(dev.Name())
	if err != nil {
		t.Fatal(err)
	}
	rec.SetDevices([]proc.Device{d})
	cmd, child := shell(t, `( exec sleep 100005 ) & echo $!; wait`)
	parent, k := key(t, cmd.Process.Pid), key(t, child)
	eventually(t, "the child's exec to be recorded", func() bool {
		_, err := rec.Inherits(k, parent.PID, parent.Start)
		return errors.Is(err, ErrExeced)
	})
	syscall.Kill(cmd.Process.Pid, syscall.SIGKILL)
	cmd.Wait()
	if _, err := rec.Inherits(k, parent.PID, parent.Start); !errors.Is(err, ErrExeced) {
		t.Errorf("a child that ran exec: %v, want %v", err, ErrExeced)
	}
}

// childrenOf counts the record's entries forked from parent.
func childrenOf(r *Record, parent Key) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, e := range r.live {
		if e.parent != nil && e.parent.key() == parent {
			n++
		}
	}
	for e := range r.dead {
		if e.parent != nil && e.parent.key() == parent {
			n++
		}
	}
	return n
}

// monotonic is CLOCK_MONOTONIC in ns, the clock of the events' times.
func monotonic(t *testing.T) uint64 {
	t.Helper()
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		t.Fatal(err)
	}
	return uint64(ts.Nano())
}

// sleeper starts a real process that lives until the test ends.
func sleeper(t *testing.T) Key {
	t.Helper()
	cmd := exec.Command("sleep", "100007")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	return key(t, cmd.Process.Pid)
}

// A start time read when asked is the recorded process's only if that
// process started by its fork event: a process that took the PID later
// (the recorded one died, its exit event not applied yet) is not taken
// for it, and gets none of its descent.
func TestRecordLazyStartRefusesLaterProcess(t *testing.T) {
	fs, err := proc.NewFS("/proc")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name   string
		before bool // the fork event was sent before the real process started
	}{
		{"fork event before the process in /proc started: another process", true},
		{"fork event after it started: the same process", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rec := New(fs)
			if err := rec.Seed(); err != nil {
				t.Fatal(err)
			}
			ts := monotonic(t)
			// Start times count 10 ms ticks: the real process must start
			// in a later tick than the event for the two to differ.
			time.Sleep(20 * time.Millisecond)
			x := sleeper(t)
			if !tc.before {
				ts = monotonic(t)
			}
			// Its fork event as the kernel would send it: the test forked
			// it at ts.
			rec.ApplyBatch([]procevents.Event{{Kind: procevents.Fork, ParentPID: os.Getpid(), TID: x.PID, PID: x.PID, Timestamp: ts}}, time.Now())
			n := rec.lookup(x)
			rec.mu.Unlock()
			if tc.before && n != nil {
				t.Errorf("%v, started after the recorded fork of PID %d, was taken for the recorded process", x, x.PID)
			}
			if !tc.before && n == nil {
				t.Errorf("%v, started before its recorded fork event, was not found", x)
			}
		})
	}
}

// An exit event counted against a process that has children is checked in
// /proc before the process is taken for dead: an earlier process's exit
// event can come after a new process took its PID.
func TestRecordStrayExitChecked(t *testing.T) {
	fs, err := proc.NewFS("/proc")
	if err != nil {
		t.Fatal(err)
	}
	rec := New(fs)
	if err := rec.Seed(); err != nil {
		t.Fatal(err)
	}
	// Started after the seeding: the record knows them by their forks.
	x, y := sleeper(t), sleeper(t)
	ts := monotonic(t)
	rec.ApplyBatch([]procevents.Event{
		{Kind: procevents.Fork, ParentPID: os.Getpid(), TID: x.PID, PID: x.PID, Timestamp: ts},
		{Kind: procevents.Fork, ParentPID: x.PID, TID: y.PID, PID: y.PID, Timestamp: ts},
		// An exit event with x's PID, which x did not send.
		{Kind: procevents.Exit, TID: x.PID, PID: x.PID, Timestamp: ts},
	}, time.Now())
	rec.FlushExits(time.Now().Add(time.Second))
	n := rec.lookup(x)
	rec.mu.Unlock()
	if n == nil || n.dead {
		t.Fatalf("%v, alive, was taken for dead on an exit event it did not send", x)
	}
	if _, ok := rec.ExecedChild(y); ok {
		t.Errorf("y ran no exec")
	}
	if p, err := rec.lineTo(y, x.PID, x.Start); err != nil || p.key() != x {
		t.Errorf("y's line: %v %v, want its parent %v", p.key(), err, x)
	}
}

// The rule that stands where no file can be read (no GPU known yet, or
// the parent held none lately): a fork event names the real parent, so a
// child forked while another child of the parent ran its own program (exec)
// may have been cloned by that one with CLONE_PARENT, and holds its files;
// as may one forked after a process on the parent's line died leaving
// children, which the parent may have adopted (a subreaper). Processes
// seen only as the parent's own forks leave it sure.
func TestRecordForkerRule(t *testing.T) {
	fs, err := proc.NewFS("/proc")
	if err != nil {
		t.Fatal(err)
	}
	rec := New(fs)
	if err := rec.Seed(); err != nil {
		t.Fatal(err)
	}
	p, x, c, d, y, z, e := sleeper(t), sleeper(t), sleeper(t), sleeper(t), sleeper(t), sleeper(t), sleeper(t)
	ts := monotonic(t)
	fork := func(parent, child Key) procevents.Event {
		return procevents.Event{Kind: procevents.Fork, ParentPID: parent.PID, TID: child.PID, PID: child.PID, Timestamp: ts}
	}
	exit := func(k Key) procevents.Event {
		return procevents.Event{Kind: procevents.Exit, TID: k.PID, PID: k.PID, Timestamp: ts}
	}
	apply := func(evs ...procevents.Event) { rec.ApplyBatch(evs, time.Now()) }
	wantLine := func(what string, k Key, want error) {
		t.Helper()
		if _, err := rec.lineTo(k, p.PID, p.Start); !errors.Is(err, want) {
			t.Errorf("%s: %v, want %v", what, err, want)
		}
	}

	apply(fork(Key{PID: os.Getpid()}, p), fork(p, x), procevents.Event{Kind: procevents.Exec, PID: x.PID, TID: x.PID, Timestamp: ts}, fork(p, c))
	wantLine("forked while a child ran its own program", c, ErrForkerUnsure)
	apply(exit(x), exit(c), fork(p, d))
	wantLine("forked once that child and its possible clone were gone", d, nil)
	apply(fork(p, y), fork(y, z), exit(y), fork(p, e))
	wantLine("forked after a child died leaving a child of its own", e, ErrForkerUnsure)
	wantLine("the child left behind", z, nil)
}

// TestCatchUpAppliesBurst: a decision that catches up first sees the fork
// of a child just made, even behind a burst of forks that the follower
// applies in batches (a worker's replacement forked on SIGTERM was seen
// unproven by a re-plan on a loaded machine).
func TestCatchUpAppliesBurst(t *testing.T) {
	fs, err := proc.NewFS("/proc")
	if err != nil {
		t.Fatal(err)
	}
	rec := New(fs)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	st := Follow(ctx, rec, slog.New(slog.DiscardHandler))
	if !st.Up() {
		t.Skipf("the kernel's process events are unavailable here: %s", st.Why)
	}
	cmd, late := shell(t, `for i in $(seq 400); do ( : ) & done; ( sleep 100007; : ) & echo $!; wait`)
	parent, worker := key(t, cmd.Process.Pid), key(t, late)
	if !st.CatchUp(ctx, slowness.Scale(10*time.Second, slowness.Factor())) {
		t.Fatal("CatchUp: the record did not catch up")
	}
	if !st.Applied().After(time.Now().Add(-time.Minute)) {
		t.Errorf("applied %v, want a recent event", st.Applied())
	}
	if _, err := rec.Inherits(worker, parent.PID, parent.Start); errors.Is(err, ErrNotRecorded) {
		t.Fatalf("the worker forked after 400 others, right after CatchUp: %v, want its fork recorded", err)
	}
	var off Status
	if off.CatchUp(ctx, time.Second) {
		t.Error("a record that does not follow the events caught up")
	}
}
