package kill

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/proc"
	"github.com/gpu-orphan/gpu-orphan/remediate"

	"github.com/gpu-orphan/gpu-orphan/internal/stack/slowness"
)

// helperEnv makes the test binary act as a helper process instead of
// running tests.
const helperEnv = "GPU_ORPHAN_KILL_HELPER"

func TestMain(m *testing.M) {
	switch os.Getenv(helperEnv) {
	case "":
		os.Exit(m.Run())
	case "ignore-term":
		signal.Ignore(syscall.SIGTERM)
		fmt.Println("ready")
		for {
			time.Sleep(time.Hour)
		}
	case "leader-exit":
		// The main thread exits alone (exit, not exit_group): the leader
		// shows state Z while the other threads keep the process alive.
		runtime.LockOSThread()
		go func() {
			for {
				time.Sleep(time.Hour)
			}
		}()
		time.Sleep(50 * time.Millisecond) // let the runtime start its threads
		fmt.Println("ready")
		_, _, _ = syscall.RawSyscall(syscall.SYS_EXIT, 0, 0, 0) // ends this thread: no return, no error
	}
	os.Exit(2)
}

// child is a process the test started, reaped in the background so that it
// does not linger as a zombie.
type child struct {
	cmd  *exec.Cmd
	done chan struct{}
	out  *bufio.Reader
}

// start runs argv in a session (and process group) of its own, so that it
// is nobody the fixed rules protect.
func start(t *testing.T, env string, argv ...string) *child {
	t.Helper()
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if env != "" {
		cmd.Env = append(os.Environ(), helperEnv+"="+env)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	c := &child{cmd: cmd, done: make(chan struct{}), out: bufio.NewReader(stdout)}
	go func() {
		// Wait closes stdout only after the process exits; read nothing
		// more than the tests ask for.
		_ = cmd.Wait()
		close(c.done)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill() // the test's own child; the ladder never does this
		<-c.done
	})
	return c
}

// startHelper runs the test binary in a helper mode and waits until it is
// ready (its signal dispositions are set).
func startHelper(t *testing.T, mode string) *child {
	t.Helper()
	c := start(t, mode, os.Args[0])
	if line := c.readLine(t); line != "ready" {
		t.Fatalf("helper %s said %q", mode, line)
	}
	return c
}

func (c *child) readLine(t *testing.T) string {
	t.Helper()
	line, err := c.out.ReadString('\n')
	if err != nil {
		t.Fatalf("reading from child %d: %v", c.cmd.Process.Pid, err)
	}
	return strings.TrimSpace(line)
}

func (c *child) pid() int { return c.cmd.Process.Pid }

func (c *child) exited(within time.Duration) bool {
	select {
	case <-c.done:
		return true
	case <-time.After(within):
		return false
	}
}

func procFS(t *testing.T) proc.FS {
	t.Helper()
	fs, err := proc.NewFS("")
	if err != nil {
		t.Fatal(err)
	}
	return fs
}

// targetOf is the plan's view of pid: its identity read now.
func targetOf(t *testing.T, fs proc.FS, pid int) remediate.Target {
	t.Helper()
	p, err := fs.Process(pid)
	if err != nil {
		t.Fatal(err)
	}
	return remediate.Target{ProcessInfo: remediate.NewProcessInfo(p), Reason: "inherited_from_dead_owner"}
}

// state is field 3 of /proc/PID/stat, "" when the process is gone.
func state(pid int) string {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return ""
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	return f[0]
}

// waitState waits until pid is in state want.
func waitState(t *testing.T, pid int, want string) {
	t.Helper()
	for deadline := time.Now().Add(slowness.Scale(5*time.Second, slowness.Factor())); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if state(pid) == want {
			return
		}
	}
	t.Fatalf("process %d never reached state %s (now %q)", pid, want, state(pid))
}
