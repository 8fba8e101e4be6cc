package proc

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// exitFixture is a procfs holding PID 42, in the Slurm job 77 on a cgroup
// v1 node, whose main thread has the given state and flags, and a second
// thread, 43, with its own: the kernel shows "/" as the v1 path of a thread
// that has begun to exit, and an empty cmdline once it let go of its memory.
func exitFixture(t *testing.T, state string, flags, flags43 uint) FS {
	t.Helper()
	const job = "4:freezer:/slurm/uid_0/job_77/step_0/task_0\n0::/system.slice/slurmd.service\n"
	const lost = "4:freezer:/\n0::/system.slice/slurmd.service\n"
	stat := func(st string, fl uint) string {
		return strings.Replace(statLine("trainer", st), " 4194560 ", " "+strconv.FormatUint(uint64(fl), 10)+" ", 1)
	}
	cg, cmd := job, "trainer\x00--epochs\x0010\x00"
	if inExit(flags) {
		cg, cmd = lost, ""
	}
	cg43, cmd43 := job, "trainer\x00--epochs\x0010\x00"
	if inExit(flags43) {
		cg43, cmd43 = lost, ""
	}
	root := t.TempDir()
	dir := filepath.Join(root, "42")
	if err := os.CopyFS(dir, os.DirFS("testdata/proc/1")); err != nil {
		t.Fatal(err)
	}
	for name, data := range map[string]string{
		"stat": stat(state, flags), "cgroup": cg, "cmdline": cmd,
		"task/42/stat": stat(state, flags), "task/42/cgroup": cg, "task/42/cmdline": cmd,
		"task/43/stat": stat("S", flags43), "task/43/cgroup": cg43, "task/43/cmdline": cmd43,
	} {
		path := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	fs, err := NewFS(root)
	if err != nil {
		t.Fatal(err)
	}
	return fs
}

// TestProcessExiting: a process read while it dies (kill -9 of an owner
// on a Slurm node with cgroup v1) says who it was through a thread that
// has not begun to exit; when every thread has, it is not alive, never a
// live process with its job forgotten.
func TestProcessExiting(t *testing.T) {
	const (
		running = 0x400040 // PF_FORKNOEXEC | PF_RANDOMIZE
		exiting = running | pfExiting
	)
	tests := []struct {
		name           string
		state          string
		flags, flags43 uint
		alive          bool
		job, cmdline   string
		leaderExited   bool
		exitingProcess bool
	}{
		{"running", "S", running, running, true, "77", "trainer --epochs 10", false, false},
		{"main thread exiting, another runs", "R", exiting, running, true, "77", "trainer --epochs 10", false, false},
		{"main thread exited, another runs", "Z", exiting, running, true, "77", "trainer --epochs 10", true, false},
		{"every thread exiting", "R", exiting, exiting, false, "", "", false, true},
		{"main thread exited, the other exiting", "Z", exiting, exiting, false, "", "", false, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			fs := exitFixture(t, tt.state, tt.flags, tt.flags43)
			p, alive := fs.Alive(42)
			if alive != tt.alive || p.SlurmJob != tt.job || p.Cmdline != tt.cmdline || p.LeaderExited != tt.leaderExited || p.Exiting != tt.exitingProcess {
				t.Errorf("Alive(42) = %+v, %v; want alive %v, job %q, cmdline %q, LeaderExited %v, Exiting %v",
					p, alive, tt.alive, tt.job, tt.cmdline, tt.leaderExited, tt.exitingProcess)
			}
		})
	}
}

// TestProcessZombieLeaderCmdline: a process whose main thread exited has
// an empty /proc/PID/cmdline; its live thread says it.
func TestProcessZombieLeaderCmdline(t *testing.T) {
	fs := realFS(t)
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	pid := startExeHelper(t, self, "zombie-leader")
	p := waitProcess(t, fs, pid, "an exited main thread", func(p Process) bool { return p.LeaderExited })
	if !strings.Contains(p.Cmdline, filepath.Base(self)) || p.Exiting {
		t.Errorf("Process(%d) = %+v; want the cmdline of this test binary, read through a live thread", pid, p)
	}
}
