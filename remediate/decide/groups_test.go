package decide

import (
	"os/exec"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/proc"
)

// TestProcGroups lists a real process group: a shell and its two sleeps,
// in a group of their own.
func TestProcGroups(t *testing.T) {
	fs, err := proc.NewFS("")
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("sh", "-c", "sleep 60 & sleep 60 & wait")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pgid := cmd.Process.Pid
	t.Cleanup(func() {
		_ = syscall.Kill(-pgid, syscall.SIGKILL) // test cleanup of our own children
		_ = cmd.Wait()
	})

	g := ProcGroups{FS: fs}
	var members []proc.Process
	// The shell forks its sleeps after Start returns, and a forked child is
	// called "sh" until it has exec'd sleep.
	var comms []string
	for range 200 {
		if members, err = g.Members(pgid); err != nil {
			t.Fatal(err)
		}
		comms = comms[:0]
		for _, m := range members {
			comms = append(comms, m.Comm)
		}
		slices.Sort(comms)
		if slices.Equal(comms, []string{"sh", "sleep", "sleep"}) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	for _, m := range members {
		if m.PGID != pgid || m.StartTime == 0 {
			t.Errorf("member %+v: wrong group or no start time", m)
		}
	}
	if !slices.Equal(comms, []string{"sh", "sleep", "sleep"}) {
		t.Errorf("members of group %d: %v, want sh and two sleeps", pgid, comms)
	}

	if self, err := g.Members(syscall.Getpgrp()); err != nil || slices.ContainsFunc(self, func(p proc.Process) bool { return p.PGID == pgid }) {
		t.Errorf("our own group lists the child group's members (err %v)", err)
	}
	if _, err := g.Members(0); err == nil {
		t.Error("Members(0) should fail")
	}
}
