package sim

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpu-orphan/gpu-orphan/internal/gpu"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

func TestMain(m *testing.M) {
	// Workloads' children are orphaned when a test kills their parent; as
	// subreaper this process inherits them, so it can reap them and tests
	// can watch them vanish from /proc.
	if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
		fmt.Fprintln(os.Stderr, "PR_SET_CHILD_SUBREAPER:", err)
	}
	os.Exit(testenv.Main(m))
}

// simBinary builds cmd/gpu-orphan-sim once, on first use, so that tests
// without processes (and fuzz workers) do not pay for it.
func simBinary(t *testing.T) string { return testenv.Bin(t, "gpu-orphan-sim") }

func newNode(t *testing.T, gpus int) string {
	t.Helper()
	root := t.TempDir()
	if err := Init(root, gpus); err != nil {
		t.Fatal(err)
	}
	return root
}

// simRun is one `gpu-orphan-sim run`, started as a shell starts a job: in a
// process group of its own, which its children share.
type simRun struct {
	cmd      *exec.Cmd
	pid      int
	children []int
	stderr   string
	waited   bool
}

func startRun(t *testing.T, root string, args ...string) *simRun {
	t.Helper()
	p, err := tryRun(t, root, args...)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func tryRun(t *testing.T, root string, args ...string) (*simRun, error) {
	t.Helper()
	p := &simRun{stderr: filepath.Join(t.TempDir(), "stderr")}
	// A file, not a buffer: with a buffer, Wait would also wait for every
	// process that inherited the pipe.
	errFile, err := os.Create(p.stderr)
	if err != nil {
		t.Fatal(err)
	}
	defer errFile.Close()
	p.cmd = exec.Command(simBinary(t), append([]string{"run", "--root", root}, args...)...)
	p.cmd.Stderr = errFile
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	stdout, err := p.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p.pid = p.cmd.Process.Pid
	t.Cleanup(p.cleanup)

	lines := make(chan string, 1)
	go func() {
		line, _ := bufio.NewReader(stdout).ReadString('\n')
		lines <- line
	}()
	line, _, err := testenv.Receive(lines, 10*time.Second)
	if err != nil {
		return nil, fmt.Errorf("no ready line: %w; stderr: %s", err, p.readStderr())
	}
	if line == "" {
		p.wait()
		return nil, fmt.Errorf("run exited (%v) without ready line; stderr: %s", p.cmd.ProcessState, p.readStderr())
	}
	f := strings.Fields(line)
	if len(f) < 2 || f[0] != "ready" || f[1] != strconv.Itoa(p.pid) {
		return nil, fmt.Errorf("ready line %q, want \"ready %d ...\"", line, p.pid)
	}
	for _, s := range f[2:] {
		pid, err := strconv.Atoi(s)
		if err != nil {
			return nil, fmt.Errorf("ready line %q: %w", line, err)
		}
		p.children = append(p.children, pid)
	}
	return p, nil
}

func (p *simRun) readStderr() string {
	b, _ := os.ReadFile(p.stderr)
	return string(b)
}

func (p *simRun) signal(t *testing.T, sig syscall.Signal) {
	t.Helper()
	if err := syscall.Kill(p.pid, sig); err != nil {
		t.Fatalf("kill %d: %v", p.pid, err)
	}
}

// wait reaps the run process itself.
func (p *simRun) wait() {
	if !p.waited {
		p.cmd.Wait()
		p.waited = true
	}
}

// cleanup kills the whole job and reaps what this process inherited.
func (p *simRun) cleanup() {
	syscall.Kill(-p.pid, syscall.SIGKILL)
	p.wait()
	for _, c := range p.children {
		syscall.Kill(c, syscall.SIGKILL)
		reap(c)
	}
}

// reap waits for an orphan this process inherited as subreaper; it is a
// no-op for a process that is not our child (anymore).
func reap(pid int) {
	for {
		_, err := unix.Wait4(pid, nil, 0, nil)
		if !errors.Is(err, unix.EINTR) {
			return
		}
	}
}

func newDriver(t *testing.T, root string) *Driver {
	t.Helper()
	d, err := NewDriver(root)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}

func readGPU(t *testing.T, d *Driver, index int) gpu.Reading {
	t.Helper()
	rs, err := d.Read(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if index >= len(rs) {
		t.Fatalf("read %d GPUs, want GPU %d", len(rs), index)
	}
	if rs[index].Err != nil {
		t.Fatalf("GPU %d: %v", index, rs[index].Err)
	}
	return rs[index]
}

// wantGPU checks GPU index's used memory and process list.
func wantGPU(d *Driver, index int, usedMiB uint64, procs ...gpu.Process) error {
	rs, err := d.Read(context.Background())
	if err != nil {
		return err
	}
	r := rs[index]
	if r.Err != nil {
		return r.Err
	}
	if r.Memory.Used != usedMiB*gpu.MiB {
		return fmt.Errorf("used %d MiB, want %d MiB (processes %v)", r.Memory.Used/gpu.MiB, usedMiB, r.Processes)
	}
	if fmt.Sprint(r.Processes) != fmt.Sprint(procs) && !(len(r.Processes) == 0 && len(procs) == 0) {
		return fmt.Errorf("processes %v, want %v", r.Processes, procs)
	}
	return nil
}

// holders lists which of pids hold path open, as the /proc scanner sees it.
func holders(path string, pids ...int) []int {
	var out []int
	for _, pid := range pids {
		dir := fmt.Sprintf("/proc/%d/fd", pid)
		ents, err := os.ReadDir(dir)
		if err != nil {
			continue
		}
		for _, e := range ents {
			if l, err := os.Readlink(filepath.Join(dir, e.Name())); err == nil && l == path {
				out = append(out, pid)
				break
			}
		}
	}
	return out
}

// gone reports whether pid no longer exists (not even as a zombie).
func gone(pid int) error {
	if _, err := os.Stat(fmt.Sprintf("/proc/%d", pid)); err == nil {
		return fmt.Errorf("/proc/%d exists", pid)
	} else if !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// simCmd is a gpu-orphan-sim command other than run (launch, mps), started
// in a process group of its own; what it prints comes on lines.
type simCmd struct {
	cmd    *exec.Cmd
	pid    int
	lines  chan string
	stderr string
	waited bool
	// also are processes outside its group (a launcher's rank), or that
	// outlive it (an MPS server), for cleanup to kill and reap.
	also []int
}

func startSim(t *testing.T, args ...string) *simCmd {
	t.Helper()
	s := &simCmd{stderr: filepath.Join(t.TempDir(), "stderr"), lines: make(chan string, 16)}
	errFile, err := os.Create(s.stderr)
	if err != nil {
		t.Fatal(err)
	}
	defer errFile.Close()
	// A pipe of our own rather than StdoutPipe, so that Wait neither waits
	// for nor closes it: a launcher's rank writes to it too.
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	s.cmd = exec.Command(simBinary(t), args...)
	s.cmd.Stdout, s.cmd.Stderr = w, errFile
	s.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	err = s.cmd.Start()
	w.Close()
	if err != nil {
		r.Close()
		t.Fatal(err)
	}
	s.pid = s.cmd.Process.Pid
	t.Cleanup(s.cleanup)
	go func() {
		defer r.Close()
		defer close(s.lines)
		br := bufio.NewReader(r)
		for {
			line, err := br.ReadString('\n')
			if line != "" {
				s.lines <- line
			}
			if err != nil {
				return
			}
		}
	}()
	return s
}

// line returns the fields of the next line the command prints.
func (s *simCmd) line(t *testing.T) []string {
	t.Helper()
	l, ok, err := testenv.Receive(s.lines, 10*time.Second)
	if err != nil {
		b, _ := os.ReadFile(s.stderr)
		t.Fatalf("%v printed no line: %v; stderr: %s", s.cmd.Args[1:], err, b)
	}
	if !ok {
		s.wait()
		b, _ := os.ReadFile(s.stderr)
		t.Fatalf("%v printed no more lines (%v); stderr: %s", s.cmd.Args[1:], s.cmd.ProcessState, b)
	}
	return strings.Fields(l)
}

func (s *simCmd) signal(t *testing.T, sig syscall.Signal) {
	t.Helper()
	if err := syscall.Kill(s.pid, sig); err != nil {
		t.Fatalf("kill %d: %v", s.pid, err)
	}
}

func (s *simCmd) wait() {
	if !s.waited {
		s.cmd.Wait()
		s.waited = true
	}
}

func (s *simCmd) cleanup() {
	syscall.Kill(-s.pid, syscall.SIGKILL)
	for _, pid := range s.also {
		syscall.Kill(-pid, syscall.SIGKILL) // a rank leads its own group
		syscall.Kill(pid, syscall.SIGKILL)
	}
	s.wait()
	for _, pid := range s.also {
		reap(pid)
	}
}

// pids parses the PIDs of a line's fields after its first word, which
// must be word.
func pids(t *testing.T, fields []string, word string, n int) []int {
	t.Helper()
	if len(fields) != n+1 || fields[0] != word {
		t.Fatalf("line %q, want %q and %d PIDs", fields, word, n)
	}
	var out []int
	for _, f := range fields[1:] {
		pid, err := strconv.Atoi(f)
		if err != nil || pid <= 0 {
			t.Fatalf("line %q: bad PID %q", fields, f)
		}
		out = append(out, pid)
	}
	return out
}

// fdsOf lists pid's descriptors that name path.
func fdsOf(t *testing.T, pid int, path string) []int {
	t.Helper()
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []int
	for _, e := range ents {
		if l, err := os.Readlink(filepath.Join(dir, e.Name())); err == nil && l == path {
			fd, _ := strconv.Atoi(e.Name())
			out = append(out, fd)
		}
	}
	return out
}

// sameDescription reports whether fd1 of pid1 and fd2 of pid2 are one open
// file description, as after fork or exec (kcmp(2) with KCMP_FILE).
func sameDescription(t *testing.T, pid1, fd1, pid2, fd2 int) bool {
	t.Helper()
	const kcmpFile = 0
	r, _, errno := unix.Syscall6(unix.SYS_KCMP, uintptr(pid1), uintptr(pid2), kcmpFile, uintptr(fd1), uintptr(fd2), 0)
	if errno != 0 {
		t.Fatalf("kcmp(%d, %d, KCMP_FILE, %d, %d): %v", pid1, pid2, fd1, fd2, errno)
	}
	return r == 0
}

// commOf reads /proc/PID/comm.
func commOf(t *testing.T, pid int) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSuffix(string(b), "\n")
}
