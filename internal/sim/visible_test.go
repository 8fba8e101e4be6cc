package sim

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/gpu-orphan/gpu-orphan/internal/gpu"
)

// TestVisibleAll: a multi-GPU CUDA process, and its workers, hold and map
// the device node of every visible GPU, while its context (and NVML's
// listing) is on one GPU alone. Holding /dev/nvidia1 says nothing about
// GPU 1's memory.
func TestVisibleAll(t *testing.T) {
	t.Parallel()
	root := newNode(t, 2)
	d := newDriver(t, root)
	p := startRun(t, root, "--gpu", "0", "--mib", "1024", "--children", "2", "--visible", "all")
	if len(p.children) != 2 {
		t.Fatalf("children %v, want 2", p.children)
	}
	all := append([]int{p.pid}, p.children...)
	for _, g := range []int{0, 1} {
		path := d.DevicePath(g)
		if h := holders(path, all...); fmt.Sprint(h) != fmt.Sprint(all) {
			t.Errorf("holders of %s %v, want %v", path, h, all)
		}
		for _, pid := range all {
			if n := mapsOf(t, pid, path); n != 1 {
				t.Errorf("process %d maps %s %d times, want once", pid, path, n)
			}
		}
	}
	if err := wantGPU(d, 0, 1032, gpu.Process{PID: uint32(p.pid), UsedBytes: 1024 * gpu.MiB}); err != nil {
		t.Error(err)
	}
	if err := wantGPU(d, 1, 0); err != nil {
		t.Errorf("GPU 1: %v", err)
	}
}

// TestVisibleOwn: the default keeps to the workload's own GPU.
func TestVisibleOwn(t *testing.T) {
	t.Parallel()
	root := newNode(t, 2)
	d := newDriver(t, root)
	p := startRun(t, root, "--gpu", "0", "--mib", "1", "--children", "1")
	all := append([]int{p.pid}, p.children...)
	if h := holders(d.DevicePath(1), all...); len(h) != 0 {
		t.Errorf("holders of %s %v, want none", d.DevicePath(1), h)
	}
	for _, pid := range all {
		if n := mapsOf(t, pid, d.DevicePath(1)); n != 0 {
			t.Errorf("process %d maps %s", pid, d.DevicePath(1))
		}
	}
}

func TestVisibleUsageErrors(t *testing.T) {
	t.Parallel()
	root := newNode(t, 1)
	out, err := exec.Command(simBinary(t), "run", "--root", root, "--gpu", "0", "--mib", "1", "--visible", "none").CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 2 || !strings.Contains(string(out), `invalid --visible "none": want one of own, all`) {
		t.Errorf("run --visible none: %v, %q; want exit 2 naming the flag and its values", err, out)
	}
	// A child told of devices it did not inherit.
	for _, n := range []string{"1", "-1", "64"} {
		out, err := exec.Command(simBinary(t), ChildCommand, OtherDevicesFlag+"="+n).CombinedOutput()
		if err == nil || len(out) == 0 {
			t.Errorf("child %s=%s: %v, %q; want a failure with a message", OtherDevicesFlag, n, err, out)
		}
	}
}

// mapsOf counts the lines of /proc/PID/maps that map path.
func mapsOf(t *testing.T, pid int, path string) int {
	t.Helper()
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, line := range strings.Split(string(data), "\n") {
		if strings.HasSuffix(line, " "+path) {
			n++
		}
	}
	return n
}
