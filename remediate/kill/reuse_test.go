package kill

import (
	"context"
	"errors"
	"os"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/remediate"
)

// TestPIDReuseIsNeverSignalled makes a PID really be reused between the
// decision and the kill: target A is recorded, A exits and is reaped, and
// an innocent process B is created with A's very PID (through
// /proc/sys/kernel/ns_last_pid, as CRIU restores PIDs). The ladder must
// not reach B.
func TestPIDReuseIsNeverSignalled(t *testing.T) {
	fs := procFS(t)
	a := start(t, "", "sleep", "300")
	target := targetOf(t, fs, a.pid())
	pid := a.pid()
	if err := a.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	<-a.done // reaped: the PID is free

	b := reusePID(t, pid)
	if b == nil {
		return // skipped
	}
	bStat, err := fs.Process(pid)
	if err != nil {
		t.Fatal(err)
	}
	if bStat.StartTime == target.StartTime {
		t.Skipf("the clock did not tick between A and B (start time %d); cannot tell them apart", bStat.StartTime)
	}

	var sigs signals
	got := (&Ladder{Grace: grace, Proc: fs, OnSignal: sigs.record}).Kill(context.Background(), []remediate.Target{target})
	if got[0].Outcome != OutcomeIdentityChanged {
		t.Errorf("outcome %q (%s), want %q", got[0].Outcome, got[0].Error, OutcomeIdentityChanged)
	}
	if len(got[0].Signals) > 0 || len(sigs.list()) > 0 {
		t.Errorf("signals sent to a reused PID: %v %v", got[0].Signals, sigs.list())
	}
	if b.exited(200 * time.Millisecond) {
		t.Fatal("the innocent process that reused the PID was killed")
	}
}

// reusePID starts `sleep` with exactly pid, retrying while other processes
// on the machine take the PID first. It skips the test where the kernel
// does not let us choose (no CAP_SYS_ADMIN over the PID namespace).
func reusePID(t *testing.T, pid int) *child {
	t.Helper()
	const lastPID = "/proc/sys/kernel/ns_last_pid"
	for range 50 {
		if err := os.WriteFile(lastPID, []byte(strconv.Itoa(pid-1)), 0); err != nil {
			if errors.Is(err, os.ErrPermission) || errors.Is(err, syscall.EROFS) || errors.Is(err, syscall.EPERM) {
				t.Skipf("cannot choose PIDs here (%v): run as root to prove PID reuse", err)
			}
			t.Fatalf("writing %s: %v", lastPID, err)
		}
		c := start(t, "", "sleep", "300")
		if c.pid() == pid {
			return c
		}
		c.cmd.Process.Kill()
		<-c.done
	}
	t.Skipf("another process took PID %d 50 times in a row", pid)
	return nil
}
