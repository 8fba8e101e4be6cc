package exclude

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/gpu-orphan/gpu-orphan/internal/proc"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/remediate"
)

// helperEnv makes this test binary, re-executed, a helper (see init).
const helperEnv = "GPU_ORPHAN_EXCLUDE_HELPER"

// nobody is the unprivileged user a reader without CAP_SYS_PTRACE runs as.
const nobody = 65534

// init runs the helpers before any test, on the main thread: a prctl here
// renames the process as /proc/PID/stat shows it.
func init() {
	what, arg, _ := strings.Cut(os.Getenv(helperEnv), ":")
	switch what {
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
	case "why":
		// Judge processes as this helper's user sees them in /proc.
		fs, err := proc.NewFS("")
		if err != nil {
			fmt.Println(err)
			os.Exit(1)
		}
		rules := Rules{}.WithDefaults()
		for f := range strings.FieldsSeq(arg) {
			pid, _ := strconv.Atoi(f)
			p, err := fs.Process(pid)
			if err != nil {
				fmt.Println(err)
				os.Exit(1)
			}
			fmt.Printf("%d %t %q\n", pid, p.Exe.Known(), rules.Why(p))
		}
		os.Exit(0)
	}
}

// start runs bin with args and the helper environment what, in a session
// of its own; waits for its "ready" line when it is a helper; and kills it
// at cleanup.
func start(t *testing.T, what, bin string, args ...string) int {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), helperEnv+"="+what)
	// A job of its own, not in the test's group or session.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
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
	if what != "" {
		if line, err := bufio.NewReader(out).ReadString('\n'); err != nil || line != "ready\n" {
			t.Fatalf("helper %s: %q, %v", what, line, err)
		}
	}
	return cmd.Process.Pid
}

func copyFile(t *testing.T, from, to string, mode os.FileMode) {
	t.Helper()
	testenv.CopyExecutable(t, from, to, mode)
}

// waitComm waits until pid's comm is comm: it has exec'd, or renamed itself.
func waitComm(t *testing.T, fs proc.FS, pid int, comm string) {
	t.Helper()
	for deadline := time.Now().Add(testenv.Scale(10 * time.Second)); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if p, err := fs.Process(pid); err == nil && p.Comm == comm {
			return
		}
	}
	t.Fatalf("PID %d never showed comm %q", pid, comm)
}

// TestWhyRealProcesses applies the default rules to real processes, as
// root reads them, and as a reader that may not see their executable:
//   - a copy of a binary named nv-fabricmanager (comm "nv-fabricmanage"),
//     installed as root installs a daemon: protected by its executable's
//     name (the old list, by comm, missed it);
//   - a process that renamed itself systemd-worker with prctl: not
//     protected, its executable is this test binary (it was, by comm);
//   - a user's copy named nv-hostengine: not protected (it was, by comm);
//   - read by nobody, who cannot see root's executables, all three are
//     protected by their comm: when in doubt, do not signal.
func TestWhyRealProcesses(t *testing.T) {
	fs, err := proc.NewFS("")
	if err != nil {
		t.Fatal(err)
	}
	sleep, err := exec.LookPath("sleep")
	if err != nil {
		t.Skip("no sleep binary")
	}
	testBin, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	// Outside t.TempDir's 0700 directories, so that nobody can run the
	// reader; 0755, as /usr/bin.
	dir, err := os.MkdirTemp("", "gpu-orphan-exclude-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}

	fabric := filepath.Join(dir, "nv-fabricmanager")
	copyFile(t, sleep, fabric, 0o755)
	daemon := start(t, "", fabric, "60")
	waitComm(t, fs, daemon, "nv-fabricmanage")

	renamed := start(t, "rename:systemd-worker", testBin, "-test.run=^$")
	waitComm(t, fs, renamed, "systemd-worker")

	var usersCopy int
	asRoot := os.Geteuid() == 0
	if asRoot {
		hostengine := filepath.Join(dir, "nv-hostengine")
		copyFile(t, sleep, hostengine, 0o755)
		if err := os.Chown(hostengine, 1000, 1000); err != nil {
			t.Fatal(err)
		}
		usersCopy = start(t, "", hostengine, "60")
		waitComm(t, fs, usersCopy, "nv-hostengine")
	}

	rules := Rules{}.WithDefaults()
	for _, tc := range []struct {
		what string
		pid  int
		want remediate.ExclusionReason
	}{
		{"the root-installed nv-fabricmanager", daemon, WhyProtected},
		{"the worker renamed systemd-worker", renamed, ""},
		{"a user's copy named nv-hostengine", usersCopy, ""},
	} {
		if tc.pid == 0 {
			continue
		}
		p, err := fs.Process(tc.pid)
		if err != nil {
			t.Fatal(err)
		}
		if !p.Exe.Known() {
			t.Fatalf("%s: executable unknown to its own user or root", tc.what)
		}
		if got := rules.Why(p); got != tc.want {
			t.Errorf("%s (comm %q, exe %s): Why = %q, want %q", tc.what, p.Comm, p.Exe.Path, got, tc.want)
		}
	}

	if !asRoot {
		t.Skip("needs root, to read root's processes as nobody")
	}
	reader := filepath.Join(dir, "exclude.test")
	copyFile(t, testBin, reader, 0o755)
	cmd := exec.Command(reader, "-test.run=^$")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), fmt.Sprintf("%s=why:%d %d %d", helperEnv, daemon, renamed, usersCopy))
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: nobody, Gid: nobody}}
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("reader as nobody: %v\n%s", err, out)
	}
	want := fmt.Sprintf("%d false %q\n%d false %q\n%d false %q\n", daemon, WhyProtected, renamed, WhyProtected, usersCopy, WhyProtected)
	if string(out) != want {
		t.Errorf("as nobody (PID, exe known, why):\n%s\nwant:\n%s", out, want)
	}
}
