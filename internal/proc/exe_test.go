package proc

import (
	"bufio"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

// exeHelperEnv makes this test binary, re-executed, a helper process
// instead of running tests (see init).
const exeHelperEnv = "GPU_ORPHAN_PROC_EXE_HELPER"

// init runs the helpers before any test. Package initialisation runs on
// the main thread, the thread-group leader, so a prctl here renames the
// process as /proc/PID/stat shows it, and SYS_EXIT ends exactly that thread.
func init() {
	what, arg, _ := strings.Cut(os.Getenv(exeHelperEnv), ":")
	switch what {
	case "":
		return
	case "rename":
		// What an orphaned worker does to look like a system daemon.
		name, err := unix.BytePtrFromString(arg)
		if err == nil {
			err = unix.Prctl(unix.PR_SET_NAME, uintptr(unsafe.Pointer(name)), 0, 0, 0)
		}
		if err != nil {
			fmt.Println("prctl:", err)
			os.Exit(1)
		}
		fmt.Println("ready")
		time.Sleep(time.Minute)
		os.Exit(0)
	case "zombie-leader":
		// As gpu-orphan-sim run --zombie-leader: the main thread ends
		// alone (pthread_exit), another thread lives on.
		runtime.GOMAXPROCS(max(runtime.GOMAXPROCS(0), 2))
		debug.SetGCPercent(-1)
		debug.SetMemoryLimit(math.MaxInt64)
		go func() {
			time.Sleep(time.Minute)
			os.Exit(0)
		}()
		fmt.Println("ready")
		_, _, _ = unix.RawSyscall(unix.SYS_EXIT, 0, 0, 0)
	case "read":
		// Read a process as whoever this helper runs as.
		pid, _ := strconv.Atoi(arg)
		res := exeReadResult{}
		fs, err := NewFS("")
		if err == nil {
			var p Process
			p, err = fs.Process(pid)
			res.Comm, res.Known = p.Comm, p.Exe.Known()
		}
		if err != nil {
			res.Err = err.Error()
		}
		_ = json.NewEncoder(os.Stdout).Encode(res)
		os.Exit(0)
	}
}

type exeReadResult struct {
	Comm  string
	Known bool
	Err   string
}

// startExeHelper runs this test binary (or bin, a copy of it) as helper
// what, waits for its "ready" line, and kills it at cleanup.
func startExeHelper(t *testing.T, bin, what string) int {
	t.Helper()
	cmd := exec.Command(bin, "-test.run=^$")
	cmd.Env = append(os.Environ(), exeHelperEnv+"="+what)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil || line != "ready\n" {
		t.Fatalf("helper %s: %q, %v", what, line, err)
	}
	return cmd.Process.Pid
}

// startCopy runs `name 60` from a copy of /bin/sleep at dir/name (through
// link, a path of the same file, when not empty) and returns its process.
func startCopy(t *testing.T, path, link string) *exec.Cmd {
	t.Helper()
	copyFile(t, sleepBin(t), path, 0o755)
	run := path
	if link != "" {
		if err := os.Link(path, link); err != nil {
			t.Fatal(err)
		}
		run = link
	}
	cmd := exec.Command(run, "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	return cmd
}

func sleepBin(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("sleep")
	if err != nil {
		t.Skip("no sleep binary")
	}
	return p
}

func copyFile(t *testing.T, from, to string, mode os.FileMode) {
	t.Helper()
	testenv.CopyExecutable(t, from, to, mode)
}

func fileID(t *testing.T, path string) FileID {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return FileID{Dev: st.Dev, Ino: st.Ino}
}

// waitProcess reads pid until cond holds of it (an exec'd or renamed
// process takes a moment to show so).
func waitProcess(t *testing.T, fs FS, pid int, what string, cond func(Process) bool) Process {
	t.Helper()
	var p Process
	var err error
	for deadline := time.Now().Add(testenv.Scale(10 * time.Second)); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if p, err = fs.Process(pid); err == nil && cond(p) {
			return p
		}
	}
	t.Fatalf("PID %d never showed %s: %+v, %v", pid, what, p, err)
	return p
}

func realFS(t *testing.T) FS {
	t.Helper()
	fs, err := NewFS("")
	if err != nil {
		t.Fatal(err)
	}
	return fs
}

// TestExeCopyUnderAnotherName: a copy of a binary named like a daemon runs
// as that name (comm truncated to 15 bytes), but its Exe is the copy,
// owned by whoever made it, and a hard link to it is the same file.
func TestExeCopyUnderAnotherName(t *testing.T) {
	fs := realFS(t)
	dir := t.TempDir()
	copied := filepath.Join(dir, "nv-fabricmanager")
	cmd := startCopy(t, copied, filepath.Join(dir, "worker"))
	p := waitProcess(t, fs, cmd.Process.Pid, "the exec'd copy", func(p Process) bool { return p.Comm == "worker" })
	if p.Exe.Path != filepath.Join(dir, "worker") || p.Exe.Name() != "worker" || p.Exe.Deleted() {
		t.Errorf("Exe.Path %q, Name %q; want the hard link it exec'd, %s", p.Exe.Path, p.Exe.Name(), filepath.Join(dir, "worker"))
	}
	if want := fileID(t, copied); p.Exe.File != want {
		t.Errorf("Exe.File = %v, want the copy's %v (a hard link is the same file)", p.Exe.File, want)
	}
	if p.Exe.File == fileID(t, sleepBin(t)) {
		t.Error("Exe.File is the original binary's, not the copy's")
	}
	if p.Exe.UID != os.Geteuid() || p.Exe.Mode&0o777 != 0o755 || p.Exe.Mode&unix.S_IFMT != unix.S_IFREG {
		t.Errorf("Exe UID %d, mode %o; want %d and a regular file 0755", p.Exe.UID, p.Exe.Mode, os.Geteuid())
	}

	// Exec'd by its own name, comm is cut to 15 bytes; the path is whole.
	cmd = startCopy(t, filepath.Join(t.TempDir(), "nv-fabricmanager"), "")
	p = waitProcess(t, fs, cmd.Process.Pid, "the exec'd copy", func(p Process) bool { return p.Exe.Name() == "nv-fabricmanager" })
	if p.Comm != "nv-fabricmanage" {
		t.Errorf("Comm %q, want nv-fabricmanage", p.Comm)
	}
}

// TestExeRenamedByPrctl: a process that renames itself with PR_SET_NAME
// changes its comm, not its Exe.
func TestExeRenamedByPrctl(t *testing.T) {
	fs := realFS(t)
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	pid := startExeHelper(t, self, "rename:systemd-worker")
	p := waitProcess(t, fs, pid, "the renamed helper", func(p Process) bool { return p.Comm == "systemd-worker" })
	if p.Exe.File != fileID(t, self) || p.Exe.Path != self || p.Exe.Name() != filepath.Base(self) {
		t.Errorf("Exe %+v, want this test binary %s", p.Exe, self)
	}
}

// TestExeReplacedWhileRunning: a binary replaced while it runs (a package
// upgrade) stays the process's Exe, marked deleted, with its name.
func TestExeReplacedWhileRunning(t *testing.T) {
	fs := realFS(t)
	path := filepath.Join(t.TempDir(), "nv-hostengine")
	cmd := startCopy(t, path, "")
	old := fileID(t, path)
	waitProcess(t, fs, cmd.Process.Pid, "the exec'd copy", func(p Process) bool { return p.Exe.File == old })
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	copyFile(t, sleepBin(t), path, 0o755)
	p, err := fs.Process(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	if p.Exe.File != old || p.Exe.Path != path+" (deleted)" || !p.Exe.Deleted() || p.Exe.Name() != "nv-hostengine" {
		t.Errorf("Exe %+v (name %q); want the old file %v at %q (deleted)", p.Exe, p.Exe.Name(), old, path)
	}
}

// TestExeZombieLeader: when the main thread has exited, /proc/PID/exe is
// empty; the live threads run the same file and are read instead.
func TestExeZombieLeader(t *testing.T) {
	fs := realFS(t)
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	pid := startExeHelper(t, self, "zombie-leader")
	p := waitProcess(t, fs, pid, "an exited main thread", func(p Process) bool { return p.LeaderExited })
	if _, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid)); err == nil {
		t.Log("/proc/PID/exe of an exited leader is readable on this kernel")
	}
	if p.Exe.File != fileID(t, self) || p.Exe.Path != self {
		t.Errorf("Exe %+v, want this test binary %s, read through a live thread", p.Exe, self)
	}
}

// TestExeUnknown: kernel threads have no executable, and another user's
// cannot be read without CAP_SYS_PTRACE. Neither fails Process.
func TestExeUnknown(t *testing.T) {
	fs := realFS(t)
	if p, err := fs.Process(2); err != nil || p.Comm != "kthreadd" {
		t.Logf("no kthreadd to read here (a PID namespace): %+v, %v", p, err)
	} else if p.Exe.Known() || p.Exe != (Exe{}) {
		t.Errorf("kthreadd's Exe = %+v, want unknown", p.Exe)
	}
	if e := fs.exe(1<<22+1, true); e.Known() {
		t.Errorf("exe of a PID that does not exist = %+v", e)
	}
	if p, err := newFixture(t).Process(100); err != nil || p.Exe.Known() {
		t.Errorf("a fixture without exe links: %+v, %v; want unknown, no error", p.Exe, err)
	}

	if os.Geteuid() != 0 {
		t.Skip("needs root, to read a root process as nobody")
	}
	// A copy of this binary that nobody may run, outside the 0700 temp
	// directories.
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("", "gpu-orphan-exe-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "proc.test")
	copyFile(t, self, bin, 0o755)

	target := startCopy(t, filepath.Join(t.TempDir(), "nv-hostengine"), "")
	waitProcess(t, fs, target.Process.Pid, "the exec'd copy", func(p Process) bool { return p.Comm == "nv-hostengine" })
	cmd := exec.Command(bin, "-test.run=^$")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), exeHelperEnv+"=read:"+strconv.Itoa(target.Process.Pid))
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("reader as nobody: %v\n%s", err, out)
	}
	var res exeReadResult
	if err := json.Unmarshal(out, &res); err != nil {
		t.Fatalf("reader as nobody: %v\n%s", err, out)
	}
	if res.Err != "" || res.Known || res.Comm != "nv-hostengine" {
		t.Errorf("root's process read as nobody: %+v; want no error, its comm, and its Exe unknown", res)
	}
}
