package sim

import (
	"fmt"
	"strconv"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpu-orphan/gpu-orphan/internal/gpu"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

// TestLauncherAlone: a cuInit-only process holds and maps the device node,
// but has no context: NVML does not list it and no memory is used.
func TestLauncherAlone(t *testing.T) {
	t.Parallel()
	for _, visible := range []string{"own", "all"} {
		t.Run(visible, func(t *testing.T) {
			t.Parallel()
			root := newNode(t, 2)
			d := newDriver(t, root)
			l := startSim(t, "launch", "--root", root, "--gpu", "1", "--visible", visible)
			if pid := pids(t, l.line(t), "launcher", 1)[0]; pid != l.pid {
				t.Fatalf("launcher line names %d, want %d", pid, l.pid)
			}
			for path, want := range map[string]int{d.DevicePath(1): 1, d.Node().UVMPath(): 1, d.DevicePath(0): map[string]int{"own": 0, "all": 1}[visible]} {
				if n := len(fdsOf(t, l.pid, path)); n != want {
					t.Errorf("launcher holds %s through %d descriptors, want %d", path, n, want)
				}
			}
			if n := mapsOf(t, l.pid, d.DevicePath(1)); n != 1 {
				t.Errorf("launcher maps %s %d times, want once", d.DevicePath(1), n)
			}
			for g := range 2 {
				if err := wantGPU(d, g, 0); err != nil {
					t.Errorf("GPU %d: %v", g, err)
				}
			}
			if ctxs, err := listContexts(d.Node()); err != nil || len(ctxs) != 0 {
				t.Errorf("contexts %v, %v; want none", ctxs, err)
			}
			l.signal(t, syscall.SIGKILL)
			l.wait()
			if err := gone(l.pid); err != nil {
				t.Error(err)
			}
		})
	}
}

// TestLauncherRank: torchrun starting a rank. The rank, in a session of its
// own, makes its own context and is the one NVML lists; the launcher's
// descriptors are not inherited; the launcher exits with the rank's status.
func TestLauncherRank(t *testing.T) {
	t.Parallel()
	root := newNode(t, 1)
	d := newDriver(t, root)
	l := startSim(t, "launch", "--root", root, "--gpu", "0", "--",
		simBinary(t), "run", "--root", root, "--gpu", "0", "--mib", "1024", "--children", "1")
	if pid := pids(t, l.line(t), "launcher", 1)[0]; pid != l.pid {
		t.Fatalf("launcher line names %d, want %d", pid, l.pid)
	}
	ready := pids(t, l.line(t), "ready", 2)
	rank, worker := ready[0], ready[1]
	l.also = ready

	if ppid := statusField(t, rank, "PPid"); ppid != strconv.Itoa(l.pid) {
		t.Errorf("rank's parent %s, want the launcher %d", ppid, l.pid)
	}
	for _, pid := range ready {
		if sid, err := unix.Getsid(pid); err != nil || sid != rank {
			t.Errorf("process %d in session %d (%v), want the rank's own %d", pid, sid, err, rank)
		}
		if pg, err := syscall.Getpgid(pid); err != nil || pg != rank {
			t.Errorf("process %d in group %d (%v), want the rank's own %d", pid, pg, err, rank)
		}
	}
	owner := gpu.Process{PID: uint32(rank), UsedBytes: 1024 * gpu.MiB}
	if err := wantGPU(d, 0, 1032, owner); err != nil {
		t.Fatalf("NVML must list the rank alone: %v", err)
	}
	dev := d.DevicePath(0)
	all := []int{l.pid, rank, worker}
	if h := holders(dev, all...); fmt.Sprint(h) != fmt.Sprint(all) {
		t.Errorf("holders of %s %v, want %v", dev, h, all)
	}
	// One descriptor of the device node, the rank's own: the launcher's
	// were close-on-exec.
	lfds, rfds := fdsOf(t, l.pid, dev), fdsOf(t, rank, dev)
	if len(lfds) != 1 || len(rfds) != 1 {
		t.Fatalf("descriptors of %s: launcher %v, rank %v; want one each", dev, lfds, rfds)
	}
	if sameDescription(t, l.pid, lfds[0], rank, rfds[0]) {
		t.Error("the rank holds the launcher's open device node, want its own")
	}

	if err := syscall.Kill(rank, syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	l.wait()
	if code := l.cmd.ProcessState.ExitCode(); code != 128+int(syscall.SIGTERM) {
		t.Errorf("launcher %v, want exit status 143, the rank's death by SIGTERM", l.cmd.ProcessState)
	}
	// The rank's worker, which got no signal, holds its context.
	if err := wantGPU(d, 0, 1032, owner); err != nil {
		t.Fatalf("after the rank's SIGTERM: %v", err)
	}
	syscall.Kill(worker, syscall.SIGKILL)
	testenv.EventuallyNil(t, time.Second, "memory freed after the worker's SIGKILL", func() error { return wantGPU(d, 0, 0) })
}
