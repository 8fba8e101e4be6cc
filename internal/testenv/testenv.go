// Package testenv builds the project's binaries and runs real processes on
// a simulated GPU node, for integration tests.
package testenv

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/stack/freeport"
	"github.com/gpu-orphan/gpu-orphan/internal/stack/slowness"
)

var (
	buildMu sync.Mutex
	binDir  string
	built   = map[string]error{}
)

// Bin returns the path of a project binary (for example
// "gpu-orphan-exporter"), building it from cmd/ once per test process.
func Bin(t testing.TB, name string) string {
	t.Helper()
	buildMu.Lock()
	defer buildMu.Unlock()
	err, ok := built[name]
	if !ok {
		err = build(name)
		built[name] = err
	}
	if err != nil {
		t.Fatal(err)
	}
	return filepath.Join(binDir, name)
}

func build(name string) error {
	root, err := ModuleRoot()
	if err != nil {
		return err
	}
	if binDir == "" {
		if binDir, err = os.MkdirTemp("", "gpu-orphan-bin-"); err != nil {
			return err
		}
	}
	cmd := exec.Command("go", buildArgs(name, filepath.Join(binDir, name))...)
	cmd.Dir = root
	cmd.Env = buildEnv(os.Environ())
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build ./cmd/%s: %v\n%s", name, err, out)
	}
	return nil
}

// buildArgs are the arguments of go for building cmd/name into out: with
// -race when the tests run with -race, so that the daemons they start are
// checked for data races too.
func buildArgs(name, out string) []string {
	args := []string{"build"}
	if RaceEnabled {
		args = append(args, "-race")
	}
	return append(args, "-o", out, "./cmd/"+name)
}

// cgoCFlags is the Makefile's CGO_CFLAGS: go env's default (-O2 -g) without
// the 29 -Wdeprecated-declarations warnings of go-nvml's cgo.
const cgoCFlags = "-O2 -g -Wno-deprecated-declarations"

// buildEnv is env with CGO_CFLAGS set as the Makefile sets it, unless it is
// set already (`make test` exports it).
func buildEnv(env []string) []string {
	for _, kv := range env {
		if strings.HasPrefix(kv, "CGO_CFLAGS=") {
			return env
		}
	}
	return append(env, "CGO_CFLAGS="+cgoCFlags)
}

// Main runs a package's tests and then removes the binaries Bin built.
// Call it from TestMain: os.Exit(testenv.Main(m)).
func Main(m *testing.M) int {
	code := m.Run()
	if binDir != "" {
		os.RemoveAll(binDir)
	}
	return code
}

// ModuleRoot is the directory of the module github.com/gpu-orphan/gpu-orphan
// (the repository's root, which holds cmd/ and alerts/), asked from the
// module of the test that calls it: the root module itself, or test/, whose
// go.mod replaces it with ../.
func ModuleRoot() (string, error) {
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", "github.com/gpu-orphan/gpu-orphan").Output()
	if err != nil {
		return "", fmt.Errorf("go list -m github.com/gpu-orphan/gpu-orphan: %w", err)
	}
	dir := strings.TrimSpace(string(out))
	if dir == "" {
		return "", fmt.Errorf("go list -m github.com/gpu-orphan/gpu-orphan: no directory")
	}
	return dir, nil
}

// SimNode creates a simulated node of n GPUs in a temp dir.
func SimNode(t testing.TB, gpus int) string {
	t.Helper()
	root := filepath.Join(t.TempDir(), "node")
	out, err := exec.Command(Bin(t, "gpu-orphan-sim"), "init", "--root", root, "--gpus", strconv.Itoa(gpus)).CombinedOutput()
	if err != nil {
		t.Fatalf("gpu-orphan-sim init: %v\n%s", err, out)
	}
	return root
}

// Workload is a running `gpu-orphan-sim run`: the creator of a context and
// its forked children.
type Workload struct {
	Cmd      *exec.Cmd
	PID      int
	Children []int
	// Helper is the double-forked helper of `run --helper`, 0 without one:
	// reparented to PID 1 (or the nearest subreaper), in the workload's
	// group and session, sharing its descriptors.
	Helper int
	// held are the processes above, held since they were seen alive: the
	// cleanup kills through them (Held), never by a PID that may be
	// another's by then.
	held []*Held
	// Ready is when the workload said it was ready: its forks were done.
	Ready time.Time
}

// Hold holds the workload's processes, seen alive now, for Kill.
func (w *Workload) Hold() {
	for _, pid := range append([]int{w.PID, w.Helper}, w.Children...) {
		if pid <= 0 {
			continue
		}
		if h := Hold(pid); h != nil {
			w.held = append(w.held, h)
		}
	}
}

// Kill kills what is left of the workload: its process group while one of
// its held processes is still in it, and each held process.
func (w *Workload) Kill() {
	KillGroup(w.Cmd.Process.Pid, w.held...)
	for _, h := range w.held {
		h.Kill()
		h.Release()
	}
	w.held = nil
}

// HelperFlag is the extra argument of StartWorkload that starts a helper
// (Workload.Helper).
const HelperFlag = "--helper"

// StartWorkload runs a workload in its own session, as a scheduler starts
// a job (and so that it never shares the test's session or group). With
// HelperFlag among extra, it reads the helper's PID too.
func StartWorkload(t testing.TB, root string, gpu int, mib, children int, extra ...string) *Workload {
	t.Helper()
	args := append([]string{"run", "--root", root, "--gpu", strconv.Itoa(gpu), "--mib", strconv.Itoa(mib), "--children", strconv.Itoa(children)}, extra...)
	return StartWorkloadCmd(t, exec.Command(Bin(t, "gpu-orphan-sim"), args...))
}

// StartWorkloadCmd is StartWorkload for a `gpu-orphan-sim run` command the
// caller built (another argv[0], another user's credentials): it runs it
// in a session of its own, reads its ready line (and its helper's, with
// HelperFlag among its arguments), holds its processes, and kills them at
// cleanup.
func StartWorkloadCmd(t testing.TB, cmd *exec.Cmd) *Workload {
	t.Helper()
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Setsid = true
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	w := &Workload{Cmd: cmd}
	t.Cleanup(func() {
		w.Kill()
		cmd.Process.Kill() // our child: os.Process never reaches another
		cmd.Wait()
		if w.Helper > 0 {
			// Reaped here when this process is the subreaper it went to;
			// ECHILD at once otherwise.
			for {
				if _, err := syscall.Wait4(w.Helper, nil, 0, nil); !errors.Is(err, syscall.EINTR) {
					break
				}
			}
		}
	})
	out := bufio.NewReader(stdout)
	line, err := out.ReadString('\n')
	if err != nil {
		t.Fatalf("workload never got ready: %v", err)
	}
	fields := strings.Fields(line)
	if len(fields) < 2 || fields[0] != "ready" {
		t.Fatalf("unexpected workload line %q", line)
	}
	for i, f := range fields[1:] {
		pid, err := strconv.Atoi(f)
		if err != nil {
			t.Fatalf("bad pid in %q", line)
		}
		if i == 0 {
			w.PID = pid
		} else {
			w.Children = append(w.Children, pid)
		}
	}
	if slices.Contains(cmd.Args[1:], HelperFlag) {
		line, err := out.ReadString('\n')
		if err != nil {
			t.Fatalf("workload printed no helper line: %v", err)
		}
		f, ok := strings.CutPrefix(strings.TrimSpace(line), "helper ")
		pid, err := strconv.Atoi(f)
		if !ok || err != nil || pid <= 0 {
			t.Fatalf("unexpected helper line %q", line)
		}
		w.Helper = pid
	}
	w.Ready = time.Now()
	w.Hold()
	return w
}

// KillParent kills the creator with SIGKILL and reaps it, leaving the
// children holding its context: docs/facts.md's fork-orphan case.
// It first waits for the test's daemons to apply the process events up to
// the workload's ready line (WaitEventsApplied).
func (w *Workload) KillParent(t testing.TB) {
	t.Helper()
	WaitEventsApplied(t, w.Ready)
	if err := w.Cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	w.Cmd.Wait()
}

// Alive reports whether pid exists and is not a zombie.
func Alive(pid int) bool {
	f := statFields(pid)
	return len(f) > 0 && f[0] != "Z"
}

// statFields are the fields of /proc/PID/stat after the command name,
// from the state on (field 3); nil when the process is gone.
func statFields(pid int) []string {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return nil
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return nil
	}
	return strings.Fields(s[i+1:])
}

// FreeAddr returns a loopback address for a daemon that binds it itself:
// a port below the kernel's ephemeral range, where no outgoing connection
// takes ports, that no other FreeAddr on the machine hands out until the
// test ends (freeport.Reserve). A port from 127.0.0.1:0, closed again,
// lies in that range, and any connection made before the daemon binds it
// may take it. Better still, where the daemon takes a socket handed down
// (ours do, with --web.systemd-socket): PassListener.
func FreeAddr(t testing.TB) string {
	t.Helper()
	p, err := freeport.Reserve("127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Release)
	return p.Addr
}

// PassListener listens on 127.0.0.1:0 and hands the socket to cmd, which
// must not have started, as systemd hands one to a service
// (freeport.Pass): nothing can take the port, since it is never closed.
// It returns the address. The daemon (any of ours) serves on it with
// --web.systemd-socket, which the caller adds to cmd's arguments; start
// cmd with DaemonCmd or Start.
func PassListener(t testing.TB, cmd *exec.Cmd) string {
	t.Helper()
	return PassListenerOn(t, cmd, "127.0.0.1")
}

// PassListenerOn is PassListener on ip: HostIP, for a daemon that an
// EndpointSlice names.
func PassListenerOn(t testing.TB, cmd *exec.Cmd, ip string) string {
	t.Helper()
	l, err := freeport.Listen(ip)
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	f, err := freeport.Pass(cmd, l)
	if err != nil {
		t.Fatal(err)
	}
	// The child has its own copy once started: DaemonCmd closes this one
	// then, so that the socket ends with the daemon; otherwise it goes at
	// cleanup.
	passed.Store(cmd, f)
	t.Cleanup(func() {
		passed.Delete(cmd)
		f.Close()
	})
	return addr
}

// passed holds the socket PassListener handed to a command, until it has
// started.
var passed sync.Map // *exec.Cmd -> *os.File

// HostIP is an IPv4 address of this machine outside the loopback range,
// for a listener that an EndpointSlice names: kube-apiserver refuses a
// loopback address in one. It skips the test when there is none.
func HostIP(t testing.TB) string {
	t.Helper()
	ifs, err := net.Interfaces()
	if err != nil {
		t.Fatal(err)
	}
	for _, i := range ifs {
		if i.Flags&net.FlagUp == 0 || i.Flags&net.FlagLoopback != 0 {
			continue
		}
		addrs, _ := i.Addrs()
		for _, a := range addrs {
			if n, ok := a.(*net.IPNet); ok && n.IP.To4() != nil && n.IP.IsGlobalUnicast() {
				return n.IP.String()
			}
		}
	}
	t.Skip("this machine has no IPv4 address outside the loopback range for the agents to listen on (an EndpointSlice may not name 127.0.0.1)")
	return ""
}

// Eventually polls cond every 20ms until it holds or timeout passes.
//
// The timeout is what the wait takes on an idle machine: it is stretched by
// the machine's slowness (Slowness), measured again at each poll, so that
// a load that comes during the wait stretches it too. A condition that
// holds still ends the wait at once.
func Eventually(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	EventuallyNil(t, timeout, what, func() error {
		if cond() {
			return nil
		}
		return errNotYet
	})
}

var errNotYet = errors.New("not yet")

// EventuallyNil is Eventually for a check that says why it does not hold
// yet: its last error is in the failure.
func EventuallyNil(t testing.TB, timeout time.Duration, what string, check func() error) {
	t.Helper()
	start, factor := time.Now(), Slowness()
	for {
		err := check()
		if err == nil {
			return
		}
		factor = max(factor, Slowness())
		if time.Since(start) > scale(timeout, factor) {
			why := ""
			if err != errNotYet {
				why = ": " + err.Error()
			}
			t.Fatalf("timed out after %s waiting for %s%s%s", timeout, what, stretched(timeout, factor), why)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Receive waits for a value from ch for as long as what it waits for takes
// on an idle machine, stretched as Eventually stretches it. ok is false
// when ch was closed; err says how long it waited when nothing came.
func Receive[T any](ch <-chan T, timeout time.Duration) (v T, ok bool, err error) {
	start, factor := time.Now(), Slowness()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case v, ok = <-ch:
			return v, ok, nil
		case <-tick.C:
			factor = max(factor, Slowness())
			if time.Since(start) > scale(timeout, factor) {
				return v, false, fmt.Errorf("nothing within %s%s", timeout, stretched(timeout, factor))
			}
		}
	}
}

// SlownessEnv sets Slowness instead of the load (CI on a machine whose
// load average is someone else's, for instance).
const SlownessEnv = slowness.Env

// Slowness is how many times slower than when idle this machine runs the
// tests' processes now, from 1 to 10 (slowness.Factor): the runnable tasks
// per CPU, from the load average of the last minute; SlownessEnv sets it
// instead. With 2 CPUs under a load of 7 (a `make test` beside another),
// 3.5: a wait of 5 s idle gets 17.5 s.
func Slowness() float64 { return slowness.Factor() }

// Scale is d stretched by Slowness: a test's own deadline, for what takes
// d on an idle machine.
func Scale(d time.Duration) time.Duration { return slowness.Scale(d, Slowness()) }

func scale(d time.Duration, factor float64) time.Duration { return slowness.Scale(d, factor) }

// stretched says how much longer than timeout a wait was given, if it was.
func stretched(timeout time.Duration, factor float64) string {
	if factor <= 1 {
		return ""
	}
	return fmt.Sprintf(" (stretched to %s: the machine ran %.1f times slower than idle; testenv.Slowness)",
		scale(timeout, factor).Round(100*time.Millisecond), factor)
}

// Daemon starts a long-running binary, logging to a file kept for failed
// tests, and stops it with SIGTERM at cleanup. A data race that a -race
// build reports in the log fails the test.
func Daemon(t testing.TB, bin string, args ...string) *exec.Cmd {
	t.Helper()
	return DaemonCmd(t, exec.Command(bin, args...))
}

// DaemonCmd is Daemon for a command already made, with its own environment
// for instance.
func DaemonCmd(t testing.TB, cmd *exec.Cmd) *exec.Cmd {
	t.Helper()
	bin := freeport.Program(cmd)
	followsEventsFromArgs(t, cmd.Args)
	logPath := filepath.Join(t.TempDir(), filepath.Base(bin)+".log")
	logf, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	err = cmd.Start()
	if f, ok := passed.LoadAndDelete(cmd); ok {
		f.(*os.File).Close()
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
			<-done
		}
		logf.Close()
		b, _ := os.ReadFile(logPath)
		if bytes.Contains(b, []byte("WARNING: DATA RACE")) {
			t.Errorf("%s (built with -race) found a data race", filepath.Base(bin))
		}
		if t.Failed() {
			t.Logf("%s log:\n%s", filepath.Base(bin), b)
		}
	})
	return cmd
}
