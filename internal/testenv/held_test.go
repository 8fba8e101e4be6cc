package testenv

import (
	"os/exec"
	"syscall"
	"testing"
	"time"
)

// TestHeldNeverReachesAReusedPID: once the held process is reaped, Kill and
// KillGroup do nothing, even for a live process group whose ID is the old
// PID (as after a PID wraps); while it is not, they kill it and its group.
func TestHeldNeverReachesAReusedPID(t *testing.T) {
	first := exec.Command("sleep", "60")
	first.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := first.Start(); err != nil {
		t.Fatal(err)
	}
	h := Hold(first.Process.Pid)
	if h == nil || !h.Alive() {
		t.Fatal("cannot hold a live child")
	}
	defer h.Release()
	first.Process.Kill()
	first.Wait()
	if h.Alive() {
		t.Fatal("a reaped process is still alive through its pidfd")
	}

	// A new group, standing in for one that reused the PID.
	other := exec.Command("sleep", "60")
	other.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := other.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { other.Process.Kill(); other.Wait() }()
	o := Hold(other.Process.Pid)
	defer o.Release()
	h.Kill()
	h.pid = other.Process.Pid // as if the PID had been reused
	if KillGroup(other.Process.Pid, h) {
		t.Error("KillGroup killed a group through a reaped member")
	}
	time.Sleep(50 * time.Millisecond)
	if !o.Alive() {
		t.Fatal("the other process was killed")
	}
	if !KillGroup(other.Process.Pid, o) {
		t.Fatal("KillGroup did not kill the group of a live member")
	}
	other.Wait()
	if o.Alive() {
		t.Error("the group's member survived KillGroup")
	}
}
