package sim

import (
	"errors"
	"fmt"
	"io/fs"
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
	testenv.EventuallyNil(t, time.Second, "memory freed after SIGKILL", func() error { return wantGPU(d, 1, 0) })
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
	testenv.EventuallyNil(t, time.Second, "memory freed after the children's SIGKILL", func() error { return wantGPU(d, 0, 0) })
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
				testenv.EventuallyNil(t, time.Second, "memory freed after SIGTERM", func() error { return wantGPU(d, 0, 0) })
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
			testenv.EventuallyNil(t, time.Second, "memory freed after SIGKILL", func() error { return wantGPU(d, 0, 0) })
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
		{"run", "--root", root, "--gpu", "0", "--mib", "1", "--children", "1", "--closing-children", "2"},
		{"run", "--root", root, "--gpu", "0", "--mib", "1", "--child-comm", "sixteen-bytes-xx"},
		{"launch", "--root", root, "--gpu", "1"},
		{"mps", "--root", root, "--gpu", "1"},
		{"child"},                                                  // without inherited descriptors
		{"mps-server"},                                             // without its flags
		{"mps-server", "--root", root, "--gpu", "0", "--mib", "1"}, // nor its control daemon
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

// TestHelper: a double-forked helper of a live trainer is reparented to the
// nearest subreaper (this test, see TestMain) or PID 1, stays in the
// trainer's group and session, and shares the trainer's own open files:
// it alone keeps the context once the trainer and its worker are dead.
func TestHelper(t *testing.T) {
	t.Parallel()
	root := newNode(t, 1)
	d := newDriver(t, root)
	w := testenv.StartWorkload(t, root, 0, 1024, 1, testenv.HelperFlag)
	if w.Helper <= 0 || len(w.Children) != 1 {
		t.Fatalf("helper %d, children %v; want a helper and one child", w.Helper, w.Children)
	}
	if ppid := statusField(t, w.Helper, "PPid"); ppid != strconv.Itoa(os.Getpid()) && ppid != "1" {
		t.Errorf("helper's parent %s, want this subreaper %d or 1", ppid, os.Getpid())
	}
	if pg, err := syscall.Getpgid(w.Helper); err != nil || pg != w.PID {
		t.Errorf("helper in group %d (%v), want the trainer's %d", pg, err, w.PID)
	}
	if sid, err := unix.Getsid(w.Helper); err != nil || sid != w.PID {
		t.Errorf("helper in session %d (%v), want the trainer's %d", sid, err, w.PID)
	}
	ctxs, err := listContexts(d.Node())
	if err != nil || len(ctxs) != 1 {
		t.Fatalf("contexts %v, %v; want one", ctxs, err)
	}
	dev := d.DevicePath(0)
	for _, path := range []string{dev, ctxs[0].Path, d.Node().UVMPath()} {
		tf, hf := fdsOf(t, w.PID, path), fdsOf(t, w.Helper, path)
		if len(tf) != 1 || len(hf) != 1 {
			t.Errorf("descriptors of %s: trainer %v, helper %v; want one each", path, tf, hf)
		} else if !sameDescription(t, w.PID, tf[0], w.Helper, hf[0]) {
			t.Errorf("the helper's %s is not the trainer's open file", path)
		}
	}
	if n := mapsOf(t, w.Helper, dev); n != 1 {
		t.Errorf("helper maps %s %d times, want once", dev, n)
	}
	owner := gpu.Process{PID: uint32(w.PID), UsedBytes: 1024 * gpu.MiB}
	if err := wantGPU(d, 0, 1032, owner); err != nil {
		t.Fatal(err)
	}

	w.KillParent(t)
	syscall.Kill(w.Children[0], syscall.SIGKILL)
	reap(w.Children[0]) // ours as subreaper once the trainer died
	if err := gone(w.Children[0]); err != nil {
		t.Fatalf("worker killed and reaped but %v", err)
	}
	if err := wantGPU(d, 0, 1032, owner); err != nil {
		t.Fatalf("with the helper alone: %v", err)
	}
	syscall.Kill(w.Helper, syscall.SIGKILL)
	testenv.EventuallyNil(t, time.Second, "memory freed after the helper's SIGKILL", func() error { return wantGPU(d, 0, 0) })
}

// TestChildComm: workers that rename themselves show the new name in
// /proc/PID/comm, while /proc/PID/exe still names the binary.
func TestChildComm(t *testing.T) {
	t.Parallel()
	root := newNode(t, 1)
	p := startRun(t, root, "--gpu", "0", "--mib", "1", "--children", "2", "--child-comm", "pt_data_worker")
	exe, err := filepath.EvalSymlinks(simBinary(t))
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range p.children {
		if comm := commOf(t, c); comm != "pt_data_worker" {
			t.Errorf("child %d is named %q, want pt_data_worker", c, comm)
		}
		if l, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", c)); err != nil || l != exe {
			t.Errorf("child %d runs %q (%v), want %s", c, l, err, exe)
		}
	}
	if comm := commOf(t, p.pid); comm != "gpu-orphan-sim" {
		t.Errorf("workload is named %q, want gpu-orphan-sim", comm)
	}
}

// TestClosingChild is the H200's "mappings alone hold nothing": a child
// that closed every inherited descriptor but kept its mapping of the device
// does not keep the dead trainer's context once its sibling is killed.
func TestClosingChild(t *testing.T) {
	t.Parallel()
	root := newNode(t, 1)
	d := newDriver(t, root)
	p := startRun(t, root, "--gpu", "0", "--mib", "2048", "--children", "2", "--closing-children", "1")
	if len(p.children) != 2 {
		t.Fatalf("children %v, want 2", p.children)
	}
	closing, sibling := p.children[0], p.children[1]
	dev := d.DevicePath(0)
	// Nothing of the node is open in the closing child: no device, no
	// context, no uvm.
	if open := openUnder(t, closing, d.Node().Root); len(open) != 0 {
		t.Errorf("closing child still holds %v", open)
	}
	if len(openUnder(t, sibling, d.Node().Root)) == 0 {
		t.Errorf("sibling holds nothing of the node")
	}
	for _, c := range p.children {
		if n := mapsOf(t, c, dev); n != 1 {
			t.Errorf("child %d maps %s %d times, want once", c, dev, n)
		}
	}
	owner := gpu.Process{PID: uint32(p.pid), UsedBytes: 2048 * gpu.MiB}

	p.signal(t, syscall.SIGKILL)
	p.wait()
	if err := wantGPU(d, 0, 2056, owner); err != nil {
		t.Fatalf("after the trainer's kill -9, the sibling holds the context: %v", err)
	}
	syscall.Kill(sibling, syscall.SIGKILL)
	testenv.EventuallyNil(t, time.Second, "memory freed after the sibling's SIGKILL", func() error { return wantGPU(d, 0, 0) })
	if ctxs, err := listContexts(d.Node()); err != nil || len(ctxs) != 0 {
		t.Errorf("contexts %v, %v; want none", ctxs, err)
	}
	if st, err := readProcStat(closing); err != nil || st.State == "Z" {
		t.Fatalf("closing child %d: %+v, %v; want alive", closing, st, err)
	}
	if n := mapsOf(t, closing, dev); n != 1 {
		t.Errorf("closing child maps %s %d times, want once still", dev, n)
	}
}

// openUnder lists what pid holds open under dir.
func openUnder(t *testing.T, pid int, dir string) []string {
	t.Helper()
	fd := fmt.Sprintf("/proc/%d/fd", pid)
	ents, err := os.ReadDir(fd)
	if errors.Is(err, fs.ErrNotExist) {
		return nil // exited meanwhile: it holds nothing
	}
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		if l, err := os.Readlink(filepath.Join(fd, e.Name())); err == nil && strings.HasPrefix(l, dir+"/") {
			out = append(out, l)
		}
	}
	return out
}

// TestRespawnOnSIGTERM: a self-healing worker told to stop with SIGTERM
// starts a replacement with its descriptors and exits; the replacement
// keeps the dead trainer's context, and dies of SIGTERM itself.
func TestRespawnOnSIGTERM(t *testing.T) {
	t.Parallel()
	root := newNode(t, 1)
	d := newDriver(t, root)
	p := startRun(t, root, "--gpu", "0", "--mib", "1024", "--children", "1", "--respawn-on-sigterm")
	worker := p.children[0]
	owner := gpu.Process{PID: uint32(p.pid), UsedBytes: 1024 * gpu.MiB}
	p.signal(t, syscall.SIGKILL)
	p.wait()
	before, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", worker, worker))
	if err != nil || len(strings.TrimSpace(string(before))) != 0 {
		t.Fatalf("the worker has children before SIGTERM: %q, %v", before, err)
	}
	syscall.Kill(worker, syscall.SIGTERM)
	testenv.EventuallyNil(t, 5*time.Second, "the worker to exit", func() error {
		if st, err := readProcStat(worker); err == nil && st.State != "Z" {
			return fmt.Errorf("worker %d still %s", worker, st.State)
		}
		return nil
	})
	var replacement int
	testenv.EventuallyNil(t, 5*time.Second, "a replacement holding the node", func() error {
		replacement = 0
		entries, _ := os.ReadDir("/proc")
		for _, e := range entries {
			pid, err := strconv.Atoi(e.Name())
			if err != nil || pid == worker {
				continue
			}
			if st, err := readProcStat(pid); err == nil && st.State != "Z" && len(openUnder(t, pid, d.Node().Root)) > 0 {
				replacement = pid
			}
		}
		if replacement == 0 {
			return fmt.Errorf("nobody holds the node")
		}
		return nil
	})
	t.Cleanup(func() { syscall.Kill(replacement, syscall.SIGKILL) })
	if err := wantGPU(d, 0, 1032, owner); err != nil {
		t.Fatalf("the replacement keeps the dead trainer's context: %v", err)
	}
	syscall.Kill(replacement, syscall.SIGTERM)
	testenv.EventuallyNil(t, 5*time.Second, "memory freed after the replacement's SIGTERM", func() error { return wantGPU(d, 0, 0) })
}
