package sim

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/gpu"
)

// Real processes and real signals: each test starts `gpu-orphan-sim run`
// and checks what the driver reads as the workload lives and dies.

func TestWorkloadKilled(t *testing.T) {
	t.Parallel()
	root := newNode(t, 2)
	d := newDriver(t, root)
	p := startRun(t, root, "--gpu", "1", "--mib", "4096")
	if len(p.children) != 0 {
		t.Fatalf("children %v, want none", p.children)
	}
	r := readGPU(t, d, 1)
	if want := []gpu.Process{{PID: uint32(p.pid), UsedBytes: 4096 * gpu.MiB}}; fmt.Sprint(r.Processes) != fmt.Sprint(want) {
		t.Errorf("processes %v, want %v", r.Processes, want)
	}
	if r.Memory.Used != (4096+8)*gpu.MiB || r.Memory.Free != (143771-615-4104)*gpu.MiB || r.Memory.Reserved != 615*gpu.MiB {
		t.Errorf("memory %+v", r.Memory)
	}
	if err := wantGPU(d, 0, 0); err != nil {
		t.Error(err)
	}
	if h := holders(d.DevicePath(1), p.pid); len(h) != 1 {
		t.Errorf("workload does not hold %s", d.DevicePath(1))
	}

	// Not reaped: a killed process's descriptors close before it is a zombie.
	p.signal(t, syscall.SIGKILL)
	eventually(t, time.Second, "memory freed after SIGKILL", func() error { return wantGPU(d, 1, 0) })
}

// TestForkedChildrenKeepContext is the case the project exists for: the
// creator is dead and gone, NVML still names it, and its children hold the
// memory without being listed.
func TestForkedChildrenKeepContext(t *testing.T) {
	t.Parallel()
	root := newNode(t, 1)
	d := newDriver(t, root)
	p := startRun(t, root, "--gpu", "0", "--mib", "6144", "--children", "2")
	if len(p.children) != 2 {
		t.Fatalf("children %v, want 2", p.children)
	}
	owner := gpu.Process{PID: uint32(p.pid), UsedBytes: 6144 * gpu.MiB}
	if err := wantGPU(d, 0, 6152, owner); err != nil {
		t.Fatal(err)
	}
	all := append([]int{p.pid}, p.children...)
	if h := holders(d.DevicePath(0), all...); len(h) != 3 {
		t.Errorf("holders of the device node %v, want %v", h, all)
	}
	for _, c := range p.children {
		if st, err := readProcStat(c); err != nil {
			t.Error(err)
		} else if pg, _ := syscall.Getpgid(c); pg != p.pid {
			t.Errorf("child %d in process group %d, want the parent's %d (state %s)", c, pg, p.pid, st.State)
		}
	}

	p.signal(t, syscall.SIGKILL)
	p.wait()
	if err := gone(p.pid); err != nil {
		t.Fatalf("parent reaped but %v", err)
	}
	if err := wantGPU(d, 0, 6152, owner); err != nil {
		t.Fatalf("after the creator died: %v", err)
	}
	if h := holders(d.DevicePath(0), all...); fmt.Sprint(h) != fmt.Sprint(p.children) {
		t.Errorf("holders of the device node %v, want the children %v", h, p.children)
	}

	for _, c := range p.children {
		if err := syscall.Kill(c, syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, time.Second, "memory freed after the children's SIGKILL", func() error { return wantGPU(d, 0, 0) })
}

func TestSIGTERM(t *testing.T) {
	t.Parallel()
	for _, ignore := range []bool{false, true} {
		t.Run("ignore="+strconv.FormatBool(ignore), func(t *testing.T) {
			t.Parallel()
			root := newNode(t, 1)
			d := newDriver(t, root)
			args := []string{"--gpu", "0", "--mib", "1024", "--children", "2"}
			if ignore {
				args = append(args, "--ignore-sigterm")
			}
			p := startRun(t, root, args...)
			owner := gpu.Process{PID: uint32(p.pid), UsedBytes: 1024 * gpu.MiB}

			// As systemd or kubelet stop a job: SIGTERM to the whole group.
			if err := syscall.Kill(-p.pid, syscall.SIGTERM); err != nil {
				t.Fatal(err)
			}
			p.wait()
			if ws := p.cmd.ProcessState.Sys().(syscall.WaitStatus); !ws.Signaled() || ws.Signal() != syscall.SIGTERM {
				t.Fatalf("workload ended with %v, want death by SIGTERM", p.cmd.ProcessState)
			}
			if !ignore {
				eventually(t, time.Second, "memory freed after SIGTERM", func() error { return wantGPU(d, 0, 0) })
				return
			}
			// An ignored signal is dropped when sent, so the children are
			// past it by now.
			for _, c := range p.children {
				if !ignoresSIGTERM(t, c) {
					t.Errorf("child %d does not ignore SIGTERM", c)
				}
				if st, err := readProcStat(c); err != nil || st.State == "Z" {
					t.Errorf("child %d died of SIGTERM: %+v %v", c, st, err)
				}
			}
			if err := wantGPU(d, 0, 1032, owner); err != nil {
				t.Fatalf("after SIGTERM: %v", err)
			}
			for _, c := range p.children {
				syscall.Kill(c, syscall.SIGKILL)
			}
			eventually(t, time.Second, "memory freed after SIGKILL", func() error { return wantGPU(d, 0, 0) })
			for _, c := range p.children {
				reap(c)
				if err := gone(c); err != nil {
					t.Error(err)
				}
			}
		})
	}
}

// ignoresSIGTERM reads the SigIgn mask of /proc/PID/status.
func ignoresSIGTERM(t *testing.T, pid int) bool {
	t.Helper()
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(data), "\n") {
		if mask, ok := strings.CutPrefix(line, "SigIgn:"); ok {
			m, err := strconv.ParseUint(strings.TrimSpace(mask), 16, 64)
			if err != nil {
				t.Fatal(err)
			}
			return m&(1<<(uint(syscall.SIGTERM)-1)) != 0
		}
	}
	t.Fatalf("no SigIgn in /proc/%d/status", pid)
	return false
}

func TestOutOfMemory(t *testing.T) {
	t.Parallel()
	root := newNode(t, 1)
	d := newDriver(t, root)

	oom := func(mib string) {
		t.Helper()
		out, err := exec.Command(simBinary(t), "run", "--root", root, "--gpu", "0", "--mib", mib).CombinedOutput()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 1 || !strings.Contains(string(out), "CUDA out of memory") {
			t.Errorf("run --mib %s: %v, %q; want exit 1 and CUDA out of memory", mib, err, out)
		}
	}
	oom("200000")
	oom("18446744073709551615") // would overflow in bytes

	// 143771 - 615 - 8 = 143148 MiB fit exactly; then nothing else does.
	big := startRun(t, root, "--gpu", "0", "--mib", "143148")
	if r := readGPU(t, d, 0); r.Memory.Free != 0 {
		t.Errorf("free %d bytes, want 0", r.Memory.Free)
	}
	oom("0")
	big.signal(t, syscall.SIGKILL)
	big.wait()
	startRun(t, root, "--gpu", "0", "--mib", "4096")
	if r := readGPU(t, d, 0); r.Memory.Used != 4104*gpu.MiB {
		t.Errorf("used %d MiB after the big workload died, want 4104", r.Memory.Used/gpu.MiB)
	}
}

func TestRunUsageErrors(t *testing.T) {
	t.Parallel()
	root := newNode(t, 1)
	for _, args := range [][]string{
		{"run", "--root", root, "--gpu", "1", "--mib", "1"},
		{"run", "--root", root, "--gpu", "0", "--mib", "1", "--children", "-1"},
		{"run", "--root", t.TempDir(), "--gpu", "0", "--mib", "1"},
		{"child"}, // without inherited descriptors
	} {
		out, err := exec.Command(simBinary(t), args...).CombinedOutput()
		if err == nil || len(out) == 0 {
			t.Errorf("%v: %v, %q; want a failure with a message", args, err, out)
		}
	}
	out, err := exec.Command(simBinary(t), "status", "--root", root).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "GPU 0 GPU-") {
		t.Errorf("status: %v\n%s", err, out)
	}
}
