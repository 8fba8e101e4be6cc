package testenv

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// StartWithPID starts the command that newCmd builds with exactly pid, by
// setting /proc/sys/kernel/ns_last_pid (as CRIU restores PIDs), retrying
// while other processes take the PID first. It skips the test where the
// kernel does not let us choose (no CAP_SYS_ADMIN over the PID namespace).
// The process is killed at cleanup.
func StartWithPID(t testing.TB, pid int, newCmd func() *exec.Cmd) *exec.Cmd {
	t.Helper()
	const lastPID = "/proc/sys/kernel/ns_last_pid"
	for range 200 {
		if err := os.WriteFile(lastPID, []byte(strconv.Itoa(pid-1)), 0); err != nil {
			if errors.Is(err, os.ErrPermission) || errors.Is(err, syscall.EROFS) || errors.Is(err, syscall.EPERM) {
				t.Skipf("cannot choose PIDs here (%v): run as root to prove PID reuse", err)
			}
			t.Fatalf("writing %s: %v", lastPID, err)
		}
		cmd := newCmd()
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		if cmd.Process.Pid == pid {
			t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
			return cmd
		}
		cmd.Process.Kill()
		cmd.Wait()
	}
	t.Skipf("other processes took PID %d 200 times in a row", pid)
	return nil
}

// Script is a shell script run as a job: in a session and process group of
// its own, which it leads.
type Script struct {
	Cmd   *exec.Cmd
	lines *bufio.Reader
}

// StartScript runs script with bash as a scheduler starts a job script
// (setsid). env is added to the environment. Everything the script starts
// is killed at cleanup.
//
// The script's standard error goes to the test's, less bash's notices of
// its jobs that were killed or terminated ("bash: line 1: 4242 Killed
// gpu-orphan-sim run ..."): the remediator and the cleanups end them on
// purpose, and a `make test` full of them looks like a failure.
func StartScript(t testing.TB, script string, env ...string) *Script {
	t.Helper()
	cmd := exec.Command("bash", "-c", script)
	cmd.Env = append(os.Environ(), env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	// An *os.File, not a Writer: Wait must not wait for the descriptor's
	// other holders (the workload's children, which may outlive the
	// script). The filter ends when the last of them closes it.
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = w
	go filterJobNotices(r, os.Stderr)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	err = cmd.Start()
	w.Close()
	if err != nil {
		t.Fatal(err)
	}
	s := &Script{Cmd: cmd, lines: bufio.NewReader(stdout)}
	t.Cleanup(func() {
		syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		cmd.Wait()
	})
	return s
}

// jobNotice is a line in which bash reports that a job of the script
// ended by SIGKILL or SIGTERM, which the tests and the remediator send.
var jobNotice = regexp.MustCompile(`^bash: (line \d+: )?\s*\d+ (Killed|Terminated)\s`)

// filterJobNotices copies r to w by lines, less bash's job notices, until
// r ends.
func filterJobNotices(r io.ReadCloser, w io.Writer) {
	defer r.Close()
	br := bufio.NewReader(r)
	for {
		line, err := br.ReadString('\n')
		if line != "" && !jobNotice.MatchString(line) {
			io.WriteString(w, line)
		}
		if err != nil {
			return
		}
	}
}

// Ready reads the next "ready PID CHILD..." line that a `gpu-orphan-sim
// run` inside the script printed, and returns its workload. Its children
// are killed at cleanup (they leave the script's group only if asked to).
func (s *Script) Ready(t testing.TB) *Workload {
	t.Helper()
	return s.Line(t, "ready")
}

// Line reads the script's next line, which must be word followed by PIDs
// ("ready PID CHILD...", "launcher PID", "helper PID"): the first PID is
// the Workload's PID, the others its children. Each is killed at cleanup.
func (s *Script) Line(t testing.TB, word string) *Workload {
	t.Helper()
	type result struct {
		line string
		err  error
	}
	ch := make(chan result, 1)
	go func() {
		line, err := s.lines.ReadString('\n')
		ch <- result{line, err}
	}()
	var r result
	select {
	case r = <-ch:
	case <-time.After(30 * time.Second):
		t.Fatalf("the script never printed its %q line", word)
	}
	if r.err != nil {
		t.Fatalf("the script never printed its %q line: %v", word, r.err)
	}
	fields := strings.Fields(r.line)
	if len(fields) < 2 || fields[0] != word {
		t.Fatalf("unexpected line %q, want %q and PIDs", r.line, word)
	}
	w := &Workload{Ready: time.Now()}
	for i, f := range fields[1:] {
		pid, err := strconv.Atoi(f)
		if err != nil {
			t.Fatalf("bad pid in %q", r.line)
		}
		if i == 0 {
			w.PID = pid
		} else {
			w.Children = append(w.Children, pid)
		}
	}
	t.Cleanup(func() {
		for _, pid := range append([]int{w.PID}, w.Children...) {
			syscall.Kill(pid, syscall.SIGKILL)
		}
	})
	return w
}

// WaitGone waits until pid no longer exists (reaped), or fails the test.
func WaitGone(t testing.TB, pid int) {
	t.Helper()
	Eventually(t, 10*time.Second, "PID "+strconv.Itoa(pid)+" to be reaped", func() bool {
		_, err := os.Stat("/proc/" + strconv.Itoa(pid))
		return errors.Is(err, os.ErrNotExist)
	})
}

// ExitCode is the exit status of a command that ran, from Run's or Wait's
// error; a command that could not run fails the test.
func ExitCode(t testing.TB, err error) int {
	t.Helper()
	var exit *exec.ExitError
	switch {
	case errors.As(err, &exit):
		return exit.ExitCode()
	case err != nil:
		t.Fatal(err)
	}
	return 0
}

// CopyExecutable copies the executable from to the new file to, with mode.
// cp writes it, not this process: a test process that opened the file for
// writing while another test forked would leave the descriptor in that
// child until it execs, and running the copy in that window fails with
// "text file busy" (golang.org/issue/22315), as parallel tests do.
func CopyExecutable(t testing.TB, from, to string, mode os.FileMode) {
	t.Helper()
	if _, err := os.Lstat(to); err == nil {
		t.Fatalf("copying %s: %s exists", from, to)
	}
	copyWith(t, exec.Command("cp", "--", from, to), to, mode)
}

// WriteExecutable writes a new executable (a script) at path, as
// CopyExecutable copies one: through cp, never through a descriptor of
// this process.
func WriteExecutable(t testing.TB, path string, content []byte) {
	t.Helper()
	if _, err := os.Lstat(path); err == nil {
		t.Fatalf("%s exists", path)
	}
	cmd := exec.Command("cp", "/dev/stdin", path)
	cmd.Stdin = bytes.NewReader(content)
	copyWith(t, cmd, path, 0o755)
}

func copyWith(t testing.TB, cp *exec.Cmd, to string, mode os.FileMode) {
	t.Helper()
	if out, err := cp.CombinedOutput(); err != nil {
		t.Fatalf("%s: %v: %s", strings.Join(cp.Args, " "), err, out)
	}
	if err := os.Chmod(to, mode); err != nil {
		t.Fatal(err)
	}
}
