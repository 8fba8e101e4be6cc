package sim

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/gpu"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

// TestZombieLeader: a workload whose main thread has exited, as after
// pthread_exit, reads Z in /proc/PID but is alive: its other threads hold
// the context, and a signal to the PID still kills all of it.
func TestZombieLeader(t *testing.T) {
	t.Parallel()
	for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGKILL} {
		t.Run(sig.String(), func(t *testing.T) {
			t.Parallel()
			root := newNode(t, 1)
			d := newDriver(t, root)
			p := startRun(t, root, "--gpu", "0", "--mib", "2048", "--children", "2", "--zombie-leader")
			owner := gpu.Process{PID: uint32(p.pid), UsedBytes: 2048 * gpu.MiB}
			// The main thread exits just after the ready line.
			testenv.EventuallyNil(t, 5*time.Second, "leader a zombie", func() error {
				st, err := readProcStat(p.pid)
				if err != nil || st.State != "Z" {
					return fmt.Errorf("state %+v, %v", st, err)
				}
				return nil
			})
			// Some time for the runtime to trip on the vanished thread.
			time.Sleep(300 * time.Millisecond)
			checkZombieLeader(t, d, p.pid)
			if err := wantGPU(d, 0, 2056, owner); err != nil {
				t.Fatalf("context of a zombie leader: %v", err)
			}
			for _, c := range p.children {
				if st, err := readProcStat(c); err != nil || st.State == "Z" {
					t.Errorf("child %d: %+v, %v; want alive", c, st, err)
				}
			}

			p.signal(t, sig)
			p.wait()
			if ws := p.cmd.ProcessState.Sys().(syscall.WaitStatus); !ws.Signaled() || ws.Signal() != sig {
				t.Fatalf("workload ended with %v, want death by %v", p.cmd.ProcessState, sig)
			}
			if err := gone(p.pid); err != nil {
				t.Fatalf("reaped but %v", err)
			}
			// The children, which got no signal, keep the context.
			if err := wantGPU(d, 0, 2056, owner); err != nil {
				t.Fatalf("after %v of the leader: %v", sig, err)
			}
			for _, c := range p.children {
				syscall.Kill(c, syscall.SIGKILL)
			}
			testenv.EventuallyNil(t, time.Second, "memory freed after the children's SIGKILL", func() error { return wantGPU(d, 0, 0) })
		})
	}
}

// checkZombieLeader checks what /proc shows of a live process whose leader
// thread has exited: the leader's own entries are empty, and only the
// other threads' task directories show the descriptors and mappings.
func checkZombieLeader(t *testing.T, d *Driver, pid int) {
	t.Helper()
	if n, err := strconv.Atoi(statusField(t, pid, "Threads")); err != nil || n < 2 {
		t.Errorf("Threads: %d, %v; want more than 1", n, err)
	}
	if s := statusField(t, pid, "State"); s != "Z (zombie)" {
		t.Errorf("State: %q, want Z (zombie)", s)
	}
	dev := d.DevicePath(0)
	if fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid)); err != nil || len(fds) != 0 {
		t.Errorf("/proc/%d/fd: %d entries, %v; want empty", pid, len(fds), err)
	}
	if maps, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", pid)); err != nil || len(maps) != 0 {
		t.Errorf("/proc/%d/maps: %q, %v; want empty", pid, maps, err)
	}
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		t.Fatal(err)
	}
	others := 0
	for _, e := range tasks {
		tid, err := strconv.Atoi(e.Name())
		if err != nil || tid == pid {
			continue
		}
		others++
		task := fmt.Sprintf("/proc/%d/task/%d", pid, tid)
		data, err := os.ReadFile(task + "/stat")
		if err != nil {
			t.Fatal(err)
		}
		st, err := parseProcStat(data)
		if err != nil || st.State == "Z" {
			t.Errorf("thread %d: %+v, %v; want alive", tid, st, err)
		}
		// Threads share one table of descriptors and one address space.
		if !linksTo(task+"/fd", dev) {
			t.Errorf("%s/fd does not hold %s", task, dev)
		}
		if maps, err := os.ReadFile(task + "/maps"); err != nil || !strings.Contains(string(maps), " "+dev+"\n") {
			t.Errorf("%s/maps does not map %s (%v)", task, dev, err)
		}
	}
	if others == 0 {
		t.Errorf("/proc/%d/task lists no thread but the leader", pid)
	}
}

// statusField returns a field of /proc/PID/status.
func statusField(t *testing.T, pid int, name string) string {
	t.Helper()
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, name+":"); ok {
			return strings.TrimSpace(v)
		}
	}
	t.Fatalf("no %s in /proc/%d/status", name, pid)
	return ""
}

// linksTo reports whether a descriptor in the fd directory dir names path.
func linksTo(dir, path string) bool {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return false
	}
	for _, e := range ents {
		if l, err := os.Readlink(filepath.Join(dir, e.Name())); err == nil && l == path {
			return true
		}
	}
	return false
}
