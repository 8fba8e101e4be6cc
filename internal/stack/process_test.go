package stack

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpu-orphan/gpu-orphan/internal/stack/freeport"
)

// helperEnv makes the test binary a grandchild that leaves its parent's
// process group, though not its session, and sleeps.
const helperEnv = "STACK_TEST_OWN_GROUP"

// serveEnv makes the test binary a daemon that binds its own port, as
// Prometheus does: it serves /-/ready on --web.listen-address=ADDR, or
// exits 1 with Go's error when it cannot bind it. With serveEnv=LOSE:FILE
// it loses a race once: the first run creates FILE and exits as though
// another process had bound the port first; with serveEnv=LOSE it always
// does.
const serveEnv = "STACK_TEST_SERVE"

func TestMain(m *testing.M) {
	if os.Getenv(helperEnv) != "" {
		if err := syscall.Setpgid(0, 0); err != nil {
			os.Exit(3)
		}
		time.Sleep(5 * time.Minute)
		os.Exit(0)
	}
	if mode := os.Getenv(serveEnv); mode != "" {
		addr := strings.TrimPrefix(os.Args[1], "--web.listen-address=")
		lost := mode == "LOSE"
		if marker, once := strings.CutPrefix(mode, "LOSE:"); once {
			f, err := os.OpenFile(marker, os.O_CREATE|os.O_EXCL, 0o600)
			if lost = err == nil; lost {
				f.Close()
			}
		}
		if lost {
			fmt.Fprintf(os.Stderr, "msg=\"Error starting web server\" err=\"listen tcp %s: bind: address already in use\"\n", addr)
			os.Exit(1)
		}
		fmt.Fprintln(os.Stderr, http.ListenAndServe(addr, http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {})))
		os.Exit(1)
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
		d, err := startDaemon(name, filepath.Join(dir, name+".log"), exec.Command("/bin/sh", "-c", script))
		if err != nil {
			t.Fatal(err)
		}
		s.daemons = append(s.daemons, d)
		s.sessions = append(s.sessions, d.pid())
	}
	var started []int
	// A bound on hanging: the helper (this test binary, -race) may take
	// seconds to start on a loaded machine; the wait ends when it has moved.
	deadline := time.Now().Add(time.Minute)
	for (len(started) < 5 || !ownGroup(started)) && time.Now().Before(deadline) {
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

// TestListen: a port that is set is listened on, or the next; none set
// takes any; all taken is an error that says so.
func TestListen(t *testing.T) {
	a, err := listen("a", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	taken := a.Addr().(*net.TCPAddr).Port
	free, err := freeport.Reserve("127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	defer free.Release()
	b, err := listen("b", []int{taken, free.Port})
	if err != nil {
		t.Fatal(err)
	}
	if got := b.Addr().String(); got != free.Addr {
		t.Errorf("listening on %s, want the second port %s", got, free.Addr)
	}
	b.Close()
	if got, err := listen("c", []int{taken, taken}); err == nil {
		t.Errorf("a taken port was listened on: %s", got.Addr())
	} else if !strings.Contains(err.Error(), "c: port "+fmt.Sprint(taken)+" and "+fmt.Sprint(taken)+" in use") {
		t.Errorf("error %v", err)
	}
}

// serving is a Stack with nothing started but a log directory, and a
// daemon binary (the test binary as serveEnv makes it) in mode.
func serving(t *testing.T, mode string) (*Stack, string) {
	t.Helper()
	t.Setenv(serveEnv, mode)
	s := &Stack{Logs: t.TempDir()}
	t.Cleanup(func() {
		if err := s.Stop(); err != nil {
			t.Error(err)
		}
	})
	return s, os.Args[0]
}

func listenArg(addr string) []string { return []string{"--web.listen-address=" + addr} }

// TestStartBound: a daemon that binds its own port, and loses it to
// another process between the stack's choice and its bind, is started
// again on another port, and only the one that serves is kept.
func TestStartBound(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	t.Run("free port lost once", func(t *testing.T) {
		s, bin := serving(t, "LOSE:"+filepath.Join(t.TempDir(), "lost"))
		var asked []string
		addr, err := s.startBound(ctx, "d", "D", bin, nil, func(addr string) []string {
			asked = append(asked, addr)
			return listenArg(addr)
		})
		if err != nil {
			t.Fatal(err)
		}
		if len(asked) != 2 || addr != asked[1] || asked[0] == asked[1] {
			t.Errorf("started on %v, serving on %s; want a second port after the first was lost", asked, addr)
		}
		lo, hi, err := freeport.EphemeralRange()
		if err != nil {
			t.Fatal(err)
		}
		for _, a := range asked {
			_, p, _ := net.SplitHostPort(a)
			if port, _ := strconv.Atoi(p); port >= lo && port <= hi {
				t.Errorf("port %d is in the ephemeral range %d-%d", port, lo, hi)
			}
		}
		if n := len(s.daemons); n != 1 || len(s.sessions) != 1 || s.Err() != nil {
			t.Errorf("%d daemons kept (%v), want the one that serves", n, s.Err())
		}
	})
	t.Run("free ports always lost", func(t *testing.T) {
		s, bin := serving(t, "LOSE")
		_, err := s.startBound(ctx, "d", "D", bin, nil, listenArg)
		if err == nil || !strings.Contains(err.Error(), "were each taken") {
			t.Errorf("error %v, want one that says every port was taken", err)
		}
		if len(s.daemons) != 0 {
			t.Errorf("%d daemons kept", len(s.daemons))
		}
	})
	t.Run("set ports, the first taken", func(t *testing.T) {
		s, bin := serving(t, "1")
		held, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer held.Close()
		free, err := freeport.Reserve("127.0.0.1")
		if err != nil {
			t.Fatal(err)
		}
		free.Release()
		taken := held.Addr().(*net.TCPAddr).Port
		addr, err := s.startBound(ctx, "d", "D", bin, []int{taken, free.Port}, listenArg)
		if err != nil || addr != free.Addr {
			t.Errorf("serving on %s, %v; want %s", addr, err, free.Addr)
		}
		if _, err := s.startBound(ctx, "e", "E", bin, []int{taken}, listenArg); err == nil || !strings.Contains(err.Error(), "E: port "+strconv.Itoa(taken)+" in use") {
			t.Errorf("error %v, want one that says the port is in use", err)
		}
	})
	t.Run("other failures are not retried", func(t *testing.T) {
		s, bin := serving(t, "1")
		var starts int
		_, err := s.startBound(ctx, "d", "D", bin, nil, func(string) []string {
			starts++
			return listenArg("127.0.0.1:-1")
		})
		if err == nil || starts != 1 || !strings.Contains(err.Error(), "exited") {
			t.Errorf("%d starts, error %v; want one start and its exit", starts, err)
		}
	})
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
