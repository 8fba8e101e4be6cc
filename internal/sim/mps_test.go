package sim

import (
	"errors"
	"os/exec"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpu-orphan/gpu-orphan/internal/gpu"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

// TestMPS follows the H200's measurement: the control daemon holds the
// device unlisted, the server owns 66 MiB, a client is listed with its own
// memory and stays listed after its kill -9 while its workers live; then
// only the server's memory remains. The server dies with the daemon.
func TestMPS(t *testing.T) {
	t.Parallel()
	root := newNode(t, 1)
	d := newDriver(t, root)
	m := startSim(t, "mps", "--root", root, "--gpu", "0")
	ready := pids(t, m.line(t), "ready", 2)
	control, server := ready[0], ready[1]
	m.also = []int{server}
	if control != m.pid {
		t.Fatalf("ready line names control %d, want %d", control, m.pid)
	}
	if ppid := statusField(t, server, "PPid"); ppid != strconv.Itoa(control) {
		t.Errorf("server's parent %s, want the control daemon %d", ppid, control)
	}
	dev := d.DevicePath(0)
	for _, pid := range ready {
		if c := commOf(t, pid); c != MPSComm {
			t.Errorf("process %d is named %q, want %q", pid, c, MPSComm)
		}
		if h := holders(dev, pid); len(h) != 1 {
			t.Errorf("process %d does not hold %s", pid, dev)
		}
		if n := mapsOf(t, pid, dev); n != 1 {
			t.Errorf("process %d maps %s %d times, want once", pid, dev, n)
		}
	}
	srv := gpu.Process{PID: uint32(server), UsedBytes: DefaultMPSServerMiB * gpu.MiB}
	if err := wantGPU(d, 0, 66+8, srv); err != nil {
		t.Fatalf("NVML must list the server alone: %v", err)
	}

	client := startRun(t, root, "--gpu", "0", "--mib", "2658", "--children", "2")
	owners := []gpu.Process{srv, {PID: uint32(client.pid), UsedBytes: 2658 * gpu.MiB}}
	sort.Slice(owners, func(i, j int) bool { return owners[i].PID < owners[j].PID })
	if err := wantGPU(d, 0, 74+2666, owners...); err != nil {
		t.Fatalf("with a client: %v", err)
	}
	client.signal(t, syscall.SIGKILL)
	client.wait()
	if err := gone(client.pid); err != nil {
		t.Fatalf("client reaped but %v", err)
	}
	if err := wantGPU(d, 0, 74+2666, owners...); err != nil {
		t.Fatalf("after the client's kill -9, NVML must still list it: %v", err)
	}
	for _, c := range client.children {
		syscall.Kill(c, syscall.SIGKILL)
	}
	testenv.EventuallyNil(t, time.Second, "only the server's memory after the workers' SIGKILL", func() error { return wantGPU(d, 0, 74, srv) })

	m.signal(t, syscall.SIGKILL)
	m.wait()
	testenv.EventuallyNil(t, 2*time.Second, "the server dead with its control daemon", func() error {
		_, _ = unix.Wait4(server, nil, unix.WNOHANG, nil) // ours to reap as subreaper, if it is ours
		return gone(server)
	})
	testenv.EventuallyNil(t, time.Second, "memory freed", func() error { return wantGPU(d, 0, 0) })
}

// TestMPSServerOutOfMemory: a server that cannot make its context says
// why, through the control daemon, which exits 1.
func TestMPSServerOutOfMemory(t *testing.T) {
	t.Parallel()
	root := newNode(t, 1)
	out, err := exec.Command(simBinary(t), "mps", "--root", root, "--gpu", "0", "--server-mib", "200000").CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 1 || !strings.Contains(string(out), "CUDA out of memory") {
		t.Errorf("mps --server-mib 200000: %v, %q; want exit 1 and CUDA out of memory", err, out)
	}
	if err := wantGPU(newDriver(t, root), 0, 0); err != nil {
		t.Errorf("after a failed start: %v", err)
	}
}
