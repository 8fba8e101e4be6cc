package stack

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// helperEnv makes the test binary a grandchild that leaves its parent's
// process group, though not its session, and sleeps.
const helperEnv = "STACK_TEST_OWN_GROUP"

func TestMain(m *testing.M) {
	if os.Getenv(helperEnv) != "" {
		if err := syscall.Setpgid(0, 0); err != nil {
			os.Exit(3)
		}
		time.Sleep(5 * time.Minute)
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// TestStopLeavesNothing: Stop ends every process the stack's daemons
// started, including a grandchild in a process group of its own (which
// SIGTERM to the daemon's group misses) and a daemon that ignores SIGTERM.
func TestStopLeavesNothing(t *testing.T) {
	defer func(d time.Duration) { stopTimeout = d }(stopTimeout)
	stopTimeout = time.Second
	dir := t.TempDir()
	t.Setenv(helperEnv, "1")
	var events []Event
	s := &Stack{cfg: Config{OnEvent: func(ev Event) { events = append(events, ev) }}}
	for name, script := range map[string]string{
		// A child in the daemon's group.
		"plain": "sleep 300 & exec sleep 301",
		// A child that moves to a group of its own: it stays in the
		// session only.
		"own-group": `"` + os.Args[0] + `" & wait`,
		"stubborn":  "trap '' TERM; sleep 303 & while :; do sleep 0.1; done",
	} {
		d, err := startDaemon(name, filepath.Join(dir, name+".log"), "/bin/sh", "-c", script)
		if err != nil {
			t.Fatal(err)
		}
		s.daemons = append(s.daemons, d)
		s.sessions = append(s.sessions, d.pid())
	}
	var started []int
	deadline := time.Now().Add(5 * time.Second)
	for !ownGroup(started) && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
		started, _ = sessionMembers(s.Sessions()...)
	}
	if len(started) < 5 || !ownGroup(started) {
		t.Fatalf("the daemons run %d processes: %v", len(started), started)
	}
	if err := s.Err(); err != nil {
		t.Fatal(err)
	}

	t0 := time.Now()
	if err := s.Stop(); err != nil {
		t.Error(err)
	}
	// A bound on hanging, not a speed test: -race on a loaded 2-CPU
	// machine took 6.3 s for what takes 1 s idle.
	if d := time.Since(t0); d > 30*time.Second {
		t.Errorf("Stop took %s: it hangs", d)
	}
	if left := s.Remaining(); len(left) > 0 {
		t.Errorf("processes %v remain after Stop", left)
	}
	for _, pid := range started {
		if alive(pid) {
			t.Errorf("process %d is alive after Stop", pid)
			syscall.Kill(pid, syscall.SIGKILL)
		}
	}
	var told []string
	for _, ev := range events {
		told = append(told, ev.Text)
	}
	if len(events) != 4 || !slices.ContainsFunc(events, func(ev Event) bool {
		return ev.Warning && strings.HasPrefix(ev.Text, "stubborn")
	}) {
		t.Errorf("events %q, want 3 stopped and a warning for the stubborn one", told)
	}
	if err := s.Stop(); err != nil { // a second Stop does nothing
		t.Error(err)
	}
}

func TestLockDir(t *testing.T) {
	p := filepath.Join(t.TempDir(), "run.pid")
	f, err := lockDir(p)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := lockDir(p); err == nil || !strings.Contains(err.Error(), "another run (pid") {
		t.Errorf("second lock: %v", err)
	}
	f.Close()
	f, err = lockDir(p)
	if err != nil {
		t.Fatalf("after the first was released: %v", err)
	}
	f.Close()
}

func TestPickPort(t *testing.T) {
	a, err := pickPort("a", nil)
	if err != nil {
		t.Fatal(err)
	}
	_, port, _ := strings.Cut(a, ":")
	b, err := pickPort("b", nil, a)
	if err != nil || b == a {
		t.Fatalf("second free port %s, %v", b, err)
	}
	var p int
	for _, c := range port {
		p = p*10 + int(c-'0')
	}
	if got, err := pickPort("c", []int{p, p}, a); err == nil {
		t.Errorf("a taken port was picked: %s", got)
	} else if !strings.Contains(err.Error(), "in use") {
		t.Errorf("error %v", err)
	}
}

// ownGroup reports whether one of pids leads a process group but not a
// session: the helper, once it has moved.
func ownGroup(pids []int) bool {
	for _, pid := range pids {
		pgid, _ := syscall.Getpgid(pid)
		sid, _ := unix.Getsid(pid)
		if pgid == pid && sid != pid {
			return true
		}
	}
	return false
}
