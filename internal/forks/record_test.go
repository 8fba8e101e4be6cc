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

	"github.com/gpu-orphan/gpu-orphan/internal/proc"
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
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(10 * time.Millisecond) {
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
