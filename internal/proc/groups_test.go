package proc

import (
	"os"
	"os/exec"
	"slices"
	"syscall"
	"testing"
	"time"
)

func TestParseStat(t *testing.T) {
	for _, tc := range []struct {
		line      string
		wantState byte
		wantPGRP  int
		wantOK    bool
	}{
		{"4242 (python3) S 1 4200 4200 0 -1 4194560 ...", 'S', 4200, true},
		{"4242 (a b) c) Z 1 77 77 0", 'Z', 77, true},
		{"4242 (x) S 1", 0, 0, false},
		{"4242 x S 1 2 3", 0, 0, false},
		{"4242 (x) SS 1 2 3", 0, 0, false},
	} {
		state, pgrp, ok := parseStat([]byte(tc.line))
		if state != tc.wantState || pgrp != tc.wantPGRP || ok != tc.wantOK {
			t.Errorf("parseStat(%q) = %c, %d, %v", tc.line, state, pgrp, ok)
		}
	}
}

// TestGroupMembers lists a real process group: a shell and its two sleeps,
// in a group of their own.
func TestGroupMembers(t *testing.T) {
	fs, err := NewFS("")
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

	var members []Process
	// The shell forks its sleeps after Start returns, and a forked child is
	// called "sh" until it has exec'd sleep.
	var comms []string
	for range 200 {
		if members, err = fs.GroupMembers(pgid); err != nil {
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

	if self, err := fs.GroupMembers(syscall.Getpgrp()); err != nil || slices.ContainsFunc(self, func(p Process) bool { return p.PGID == pgid }) {
		t.Errorf("our own group lists the child group's members (err %v)", err)
	}
	if _, err := fs.GroupMembers(0); err == nil {
		t.Error("Members(0) should fail")
	}
}

func TestReadStatOwnProcess(t *testing.T) {
	fs, err := NewFS("/proc")
	if err != nil {
		t.Fatal(err)
	}
	st, err := fs.ReadStat(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	p, err := fs.Process(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if st.PPID != p.PPID || st.PGRP != p.PGID || st.StartTime != p.StartTime || st.StartTime == 0 {
		t.Errorf("ReadStat = %+v, want the PPID %d, group %d and start time %d that Process reads", st, p.PPID, p.PGID, p.StartTime)
	}
}
