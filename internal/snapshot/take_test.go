package snapshot

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh200"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"

	"github.com/gpu-orphan/gpu-orphan/internal/forks"
	"github.com/gpu-orphan/gpu-orphan/internal/gpu"
	"github.com/gpu-orphan/gpu-orphan/internal/proc"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

const mib = gpu.MiB

// testDriver is the real NVML driver over go-nvml's 8× H200 mock, with the
// device nodes moved into a temp dir (so real test processes can hold
// them) and, optionally, a foreign PID namespace.
type testDriver struct {
	*gpu.NVMLDriver
	devDir string
	pidNS  string
}

func (d testDriver) DevicePath(minor int) string {
	return filepath.Join(d.devDir, "nvidia"+strconv.Itoa(minor))
}

func (d testDriver) DeviceNode(minor int) (proc.Device, error) {
	return proc.StatDevice(d.DevicePath(minor))
}

func (d testDriver) PIDNamespace() string {
	if d.pidNS != "" {
		return d.pidNS
	}
	return d.NVMLDriver.PIDNamespace()
}

// gpu0 is what NVML reports for GPU 0; the other seven GPUs are idle.
type gpu0 struct {
	usedMiB uint64
	procs   []nvml.ProcessInfo
	memRet  nvml.Return
	migOn   bool
}

func newDriver(t testing.TB, g gpu0) testDriver {
	t.Helper()
	return newDriverFunc(t, func() gpu0 { return g })
}

// newDriverFunc is newDriver with GPU 0 reporting what get returns at each
// read, for tests of what a Loop sees change.
func newDriverFunc(t testing.TB, get func() gpu0) testDriver {
	t.Helper()
	s := dgxh200.New()
	for i, nd := range s.Devices {
		d := nd.(*server.Device)
		read := func() gpu0 { return gpu0{} }
		if i == 0 {
			read = get
			if get().migOn {
				d.MigMode = nvml.DEVICE_MIG_ENABLE
				d.GetMaxMigDeviceCountFunc = func() (int, nvml.Return) { return 0, nvml.ERROR_NOT_SUPPORTED }
			}
		}
		d.GetMemoryInfo_v2Func = func() (nvml.Memory_v2, nvml.Return) {
			g := read()
			used, ret := g.usedMiB, g.memRet
			return nvml.Memory_v2{Total: 143771 * mib, Reserved: 615 * mib, Used: used * mib, Free: (143771 - 615 - used) * mib}, ret
		}
		d.GetComputeRunningProcessesFunc = func() ([]nvml.ProcessInfo, nvml.Return) { return read().procs, nvml.SUCCESS }
		d.GetGraphicsRunningProcessesFunc = func() ([]nvml.ProcessInfo, nvml.Return) { return nil, nvml.ERROR_NOT_SUPPORTED }
		d.GetMPSComputeRunningProcessesFunc = func() ([]nvml.ProcessInfo, nvml.Return) { return nil, nvml.ERROR_NOT_SUPPORTED }
	}
	dir := t.TempDir()
	for _, name := range []string{"nvidia0", "nvidia1", "nvidia2", "nvidia3", "nvidia4", "nvidia5", "nvidia6", "nvidia7", "nvidia-uvm"} {
		if err := os.WriteFile(filepath.Join(dir, name), make([]byte, 4096), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return testDriver{NVMLDriver: gpu.NewNVMLDriver(s, nil), devDir: dir}
}

func listed(pid int, usedMiB uint64) nvml.ProcessInfo {
	return nvml.ProcessInfo{Pid: uint32(pid), UsedGpuMemory: usedMiB * mib}
}

func TestMain(m *testing.M) {
	testenv.RunMapperIfAsked()
	os.Exit(m.Run())
}

// holder starts a real process that holds path open (as an inherited
// descriptor) and maps it, as a process with a CUDA context does, and, with
// setsid, leads its own session.
func holder(t *testing.T, path string, setsid bool) *exec.Cmd {
	t.Helper()
	if path == "" {
		return holderOf(t, setsid)
	}
	cmd := exec.Command(os.Args[0])
	cmd.Env = testenv.MapperEnviron()
	return startHolder(t, cmd, setsid, path)
}

// holderOf starts a process that holds paths open without mapping them, as
// nvidia-smi or DCGM hold a device node.
func holderOf(t *testing.T, setsid bool, paths ...string) *exec.Cmd {
	t.Helper()
	return startHolder(t, exec.Command("sleep", "300"), setsid, paths...)
}

func startHolder(t *testing.T, cmd *exec.Cmd, setsid bool, paths ...string) *exec.Cmd {
	t.Helper()
	for _, path := range paths {
		f, err := os.Open(path)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		cmd.ExtraFiles = append(cmd.ExtraFiles, f)
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: setsid}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	if len(paths) > 0 && cmd.Path != "sleep" && !strings.HasSuffix(cmd.Path, "/sleep") {
		waitMapped(t, cmd.Process.Pid, paths[0])
	}
	return cmd
}

// waitMapped waits until pid has mapped path.
func waitMapped(t *testing.T, pid int, path string) {
	t.Helper()
	fs := procFS(t)
	dev, err := proc.StatDevice(path)
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(testenv.Scale(5 * time.Second)); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if h, held, _ := fs.HoldingOf(pid, dev); held {
			if ok, _ := fs.Maps(h); ok {
				return
			}
		}
	}
	t.Fatalf("process %d never mapped %s", pid, path)
}

// deadPID returns the PID of a process that has exited and been reaped.
func deadPID(t *testing.T) int {
	t.Helper()
	cmd := exec.Command("true")
	if err := cmd.Run(); err != nil {
		t.Fatal(err)
	}
	return cmd.Process.Pid
}

// forkOrphan starts a creator (a shell, in a session of its own) that
// holds dev and forks n workers that inherit and map it, then kills the
// creator with SIGKILL: docs/facts.md's fork orphan. With zombie, the
// creator exits on its own and is left unreaped. It returns the dead
// creator's PID and the workers'.
func forkOrphan(t *testing.T, dev string, n int, zombie bool) (int, []int) {
	t.Helper()
	end, lines := "exec 4<&-; wait", n
	if zombie {
		// Its workers run exec: the creator lives until their execs were
		// checked against its open files (the fork record caught up: the
		// test then writes a line on fd 5), then exits.
		end, lines = "read -r _ <&4; exec 4<&-; read -r _ <&5; exit 0", n+1
	}
	// No $(seq): a subshell of the session would be taken for a worker.
	// Each worker runs its program (and a zombie creator goes on) only when
	// the test says so (a line each on fd 4), once all are forked: a fork
	// after a sibling's exec is of a parent with a child running its own
	// program (it may have cloned with CLONE_PARENT), which the fork record
	// rightly doubts where it cannot check; the order must not depend on
	// the scheduler.
	script := `exec 3<"$1"; for i in ` + strings.Repeat("x ", n) + `; do { read -r _ <&4; exec "$0" 4<&- 5<&-; } & done; ` + end
	gate, release, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	exitGate, exitRelease, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer exitRelease.Close()
	creator := exec.Command("sh", "-c", script, os.Args[0], dev)
	creator.Env = testenv.MapperEnviron()
	creator.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	creator.ExtraFiles = []*os.File{nil, gate, exitGate} // fds 4 and 5
	if err := creator.Start(); err != nil {
		t.Fatal(err)
	}
	gate.Close()
	exitGate.Close()
	defer release.Close()
	pid := creator.Process.Pid
	var workers []int
	held := &testenv.Workload{Cmd: creator, PID: pid}
	t.Cleanup(func() {
		held.Kill()
		creator.Process.Kill()
		creator.Wait()
	})
	fs := procFS(t)
	for deadline := time.Now().Add(testenv.Scale(5 * time.Second)); len(workers) < n; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the creator's %d workers never started: %v", n, workers)
		}
		// In a session of its own, every process of the session is ours.
		workers = workers[:0]
		pids, _ := fs.PIDs()
		for _, p := range pids {
			if st, err := fs.Process(p); err == nil && st.SID == pid && p != pid && st.Comm != "sleep" {
				workers = append(workers, p)
			}
		}
	}
	held.Children = workers
	if _, err := release.WriteString(strings.Repeat("go\n", lines)); err != nil {
		t.Fatal(err)
	}
	held.Hold()
	for _, w := range workers {
		waitMapped(t, w, dev)
	}
	// The workers' forks and execs applied before the creator dies, as a
	// daemon's snapshot after a death has them (the death's exit event
	// comes after them): a loaded machine's follower may lag behind.
	if st, ok := followed.Load(t); ok {
		limit := testenv.Scale(10 * time.Second)
		if !st.(*forks.Status).CatchUp(context.Background(), limit) {
			t.Fatalf("the fork record did not apply the workers' execs within %v", limit)
		}
	}
	if zombie {
		if _, err := exitRelease.WriteString("go\n"); err != nil {
			t.Fatal(err)
		}
		for deadline := time.Now().Add(testenv.Scale(5 * time.Second)); ; time.Sleep(5 * time.Millisecond) {
			if p, err := fs.Process(pid); err == nil && p.Zombie() {
				break
			}
			if time.Now().After(deadline) {
				t.Fatal("the creator never became a zombie")
			}
		}
		return pid, workers
	}
	if err := creator.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	creator.Wait()
	return pid, workers
}

// orphanedPID returns a live process whose session leader has died and
// which was reparented out of its session, as docs/facts.md's "spawn child S
// with its own context, then SIGKILL of parent" row.
func orphanedPID(t *testing.T, path string) int {
	t.Helper()
	// sleep must not keep the stdout pipe, or Output waits for it.
	script := "sleep 300 >/dev/null 2>&1 & echo $!"
	if path != "" {
		script = "sleep 300 >/dev/null 2>&1 3<" + path + " & echo $!"
	}
	cmd := exec.Command("sh", "-c", script)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	out, err := cmd.Output()
	if err != nil {
		t.Fatal(err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(out)))
	if err != nil {
		t.Fatal(err)
	}
	h := testenv.Hold(pid) // alive: sleep 300
	t.Cleanup(func() { h.Kill(); h.Release() })
	return pid
}

func procFS(t testing.TB) proc.FS {
	t.Helper()
	fs, err := proc.NewFS("/proc")
	if err != nil {
		t.Fatal(err)
	}
	return fs
}

func take(t *testing.T, d gpu.Driver) *Snapshot {
	t.Helper()
	taker := NewTaker(Config{Driver: d, Proc: procFS(t), ScanUnownedBytes: 256 * mib, ExcludePIDs: []int{os.Getpid()}})
	return taker.Take(context.Background(), false)
}

// takeWith is take with what a Loop remembers.
func takeWith(t *testing.T, d gpu.Driver, mem *Lineage) *Snapshot {
	t.Helper()
	taker := NewTaker(Config{Driver: d, Proc: procFS(t), ScanUnownedBytes: 256 * mib, ExcludePIDs: []int{os.Getpid()}})
	return taker.TakeWith(context.Background(), false, mem)
}

// followed is each test's followedLineage's events status, which
// forkOrphan lets catch up before its zombie creator exits.
var followed sync.Map // *testing.T -> *forks.Status

// followedLineage is a Lineage whose fork record the kernel's process
// events feed, checking execs against d's GPU 0, as the daemons run it.
func followedLineage(t *testing.T, d testDriver) *Lineage {
	t.Helper()
	rec := forks.New(procFS(t))
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	st := forks.Follow(ctx, rec, slog.New(slog.DiscardHandler))
	if !st.Up() {
		t.Skipf("the kernel's process events are unavailable here: %s", st.Why)
	}
	followed.Store(t, st)
	t.Cleanup(func() { followed.Delete(t) })
	dev, err := d.DeviceNode(0)
	if err != nil {
		t.Fatal(err)
	}
	rec.SetDevices([]proc.Device{dev})
	mem := NewLineage()
	mem.UseForks(rec)
	return mem
}

func suspectReasons(g GPU) map[int]string {
	m := map[int]string{}
	for _, h := range g.Suspects {
		m[h.PID] = h.Reason
	}
	return m
}

// TestAccountingFacts walks every row of docs/facts.md's table as NVML reports
// it, with real live, dead and orphaned processes behind the PIDs.
func TestAccountingFacts(t *testing.T) {
	type want struct {
		live, dead, unattributed, unowned uint64 // MiB
		scanned                           bool
		suspects                          map[int]string
	}
	tests := []struct {
		name  string
		setup func(t *testing.T, devPath string) (gpu0, want)
	}{
		{"idle", func(t *testing.T, _ string) (gpu0, want) {
			return gpu0{}, want{suspects: map[int]string{}}
		}},
		{"one process that allocated 4096", func(t *testing.T, dev string) (gpu0, want) {
			a := holder(t, dev, false).Process.Pid
			return gpu0{usedMiB: 4714, procs: []nvml.ProcessInfo{listed(a, 4706)}},
				want{live: 4706, unattributed: 8, unowned: 8, suspects: map[int]string{}}
		}},
		{"after SIGKILL of that process", func(t *testing.T, _ string) (gpu0, want) {
			return gpu0{usedMiB: 0}, want{suspects: map[int]string{}}
		}},
		{"fork after CUDA init, both alive", func(t *testing.T, dev string) (gpu0, want) {
			p := holder(t, dev, true)
			holder(t, dev, false)
			return gpu0{usedMiB: 6762, procs: []nvml.ProcessInfo{listed(p.Process.Pid, 6754)}},
				want{live: 6754, unattributed: 8, unowned: 8, suspects: map[int]string{}}
		}},
		{"fork, after SIGKILL of the creator: dead PID listed, child holds", func(t *testing.T, dev string) (gpu0, want) {
			p, c := forkOrphan(t, dev, 1, false)
			holder(t, "", false) // holds nothing: never a suspect
			return gpu0{usedMiB: 6762, procs: []nvml.ProcessInfo{listed(p, 6754)}},
				want{dead: 6754, unattributed: 8, unowned: 6762, scanned: true, suspects: map[int]string{c[0]: ReasonInheritedFromDeadOwner}}
		}},
		{"an unrelated mapper beside a dead owner is unexplained, not inherited", func(t *testing.T, dev string) (gpu0, want) {
			p, c := forkOrphan(t, dev, 1, false)
			stranger := holder(t, dev, true).Process.Pid // its own session: nothing ties it to p
			return gpu0{usedMiB: 6762, procs: []nvml.ProcessInfo{listed(p, 6754)}},
				want{dead: 6754, unattributed: 8, unowned: 6762, scanned: true, suspects: map[int]string{c[0]: ReasonInheritedFromDeadOwner, stranger: ReasonUnexplained}}
		}},
		{"a zombie creator counts as dead", func(t *testing.T, dev string) (gpu0, want) {
			z, c := forkOrphan(t, dev, 1, true)
			return gpu0{usedMiB: 6762, procs: []nvml.ProcessInfo{listed(z, 6754)}},
				want{dead: 6754, unattributed: 8, unowned: 6762, scanned: true, suspects: map[int]string{c[0]: ReasonInheritedFromDeadOwner}}
		}},
		{"spawned child with its own context, parent killed: orphaned", func(t *testing.T, dev string) (gpu0, want) {
			s := orphanedPID(t, dev)
			return gpu0{usedMiB: 2666, procs: []nvml.ProcessInfo{listed(s, 2658)}},
				want{live: 2658, unattributed: 8, unowned: 8, scanned: true, suspects: map[int]string{s: ReasonOrphaned}}
		}},
		{"trainer with 4 forked workers, trainer killed", func(t *testing.T, dev string) (gpu0, want) {
			trainer, workers := forkOrphan(t, dev, 4, false)
			sus := map[int]string{}
			for _, w := range workers {
				sus[w] = ReasonInheritedFromDeadOwner
			}
			return gpu0{usedMiB: 5740, procs: []nvml.ProcessInfo{listed(trainer, 5732)}},
				want{dead: 5732, unattributed: 8, unowned: 5740, scanned: true, suspects: sus}
		}},
		{"a live job's forked worker is never a suspect, even beside a dead owner", func(t *testing.T, dev string) (gpu0, want) {
			// The live owner is a shell that holds the device (a live owner
			// holds its context) and forked a worker that inherited it.
			live := exec.Command("sh", "-c", "exec 3<"+dev+"; \"$0\" & wait", os.Args[0])
			live.Env = testenv.MapperEnviron()
			live.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
			if err := live.Start(); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { syscall.Kill(-live.Process.Pid, syscall.SIGKILL); live.Wait() })
			children := fmt.Sprintf("/proc/%d/task/%d/children", live.Process.Pid, live.Process.Pid)
			for deadline := time.Now().Add(testenv.Scale(5 * time.Second)); ; time.Sleep(5 * time.Millisecond) {
				if b, _ := os.ReadFile(children); len(strings.TrimSpace(string(b))) > 0 {
					worker, _ := strconv.Atoi(strings.Fields(string(b))[0])
					waitMapped(t, worker, dev)
					break // the worker is running and maps the device
				}
				if time.Now().After(deadline) {
					t.Fatal("the live owner's worker never started")
				}
			}
			dead, c := forkOrphan(t, dev, 1, false)
			return gpu0{usedMiB: 6354, procs: []nvml.ProcessInfo{listed(live.Process.Pid, 4000), listed(dead, 2340)}},
				want{live: 4000, dead: 2340, unattributed: 14, unowned: 2354, scanned: true, suspects: map[int]string{c[0]: ReasonInheritedFromDeadOwner}}
		}},
		{"an NVML-only holder (descriptor, no mapping: nvidia-smi, DCGM) is never a suspect", func(t *testing.T, dev string) (gpu0, want) {
			p, c := forkOrphan(t, dev, 1, false)
			holderOf(t, true, dev, filepath.Join(filepath.Dir(dev), "nvidia-uvm")) // as the exporter holds them on the H200
			return gpu0{usedMiB: 6762, procs: []nvml.ProcessInfo{listed(p, 6754)}},
				want{dead: 6754, unattributed: 8, unowned: 6762, scanned: true, suspects: map[int]string{c[0]: ReasonInheritedFromDeadOwner}}
		}},
		{"live owner and dead owner on one GPU: the live one is no suspect", func(t *testing.T, dev string) (gpu0, want) {
			live := holder(t, dev, true).Process.Pid
			dead, c := forkOrphan(t, dev, 1, false)
			return gpu0{usedMiB: 6354, procs: []nvml.ProcessInfo{listed(live, 4000), listed(dead, 2340)}},
				want{live: 4000, dead: 2340, unattributed: 14, unowned: 2354, scanned: true, suspects: map[int]string{c[0]: ReasonInheritedFromDeadOwner}}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := newDriver(t, gpu0{})
			mem := followedLineage(t, d)
			g0, w := tt.setup(t, d.DevicePath(0))
			d = withGPU0(t, d, g0)
			s := takeWith(t, d, mem)
			if !s.Healthy() {
				t.Fatalf("unhealthy snapshot: %+v", s.Sources)
			}
			if len(s.GPUs) != 8 {
				t.Fatalf("got %d GPUs, want 8", len(s.GPUs))
			}
			g := s.GPUs[0]
			got := want{g.OwnedLiveBytes / mib, g.OwnedDeadBytes / mib, g.UnattributedBytes / mib, g.UnownedBytes / mib, g.Scanned, suspectReasons(g)}
			if got.live != w.live || got.dead != w.dead || got.unattributed != w.unattributed || got.unowned != w.unowned || got.scanned != w.scanned {
				t.Errorf("accounting = %+v, want %+v", got, w)
			}
			if len(got.suspects) != len(w.suspects) {
				t.Errorf("suspects = %v, want %v", got.suspects, w.suspects)
			}
			for pid, reason := range w.suspects {
				if got.suspects[pid] != reason {
					t.Errorf("suspect %d reason = %q, want %q (all: %v)", pid, got.suspects[pid], reason, got.suspects)
				}
			}
			for _, other := range s.GPUs[1:] {
				if other.UnownedBytes != 0 || other.Scanned {
					t.Errorf("idle GPU %d: unowned %d, scanned %v", other.Device.Index, other.UnownedBytes, other.Scanned)
				}
			}
		})
	}
}

// withGPU0 rebuilds the driver's mock with GPU 0 reporting g, keeping the
// device directory that the test processes already hold.
func withGPU0(t *testing.T, d testDriver, g gpu0) testDriver {
	nd := newDriver(t, g)
	nd.devDir = d.devDir
	return nd
}

func TestAccountingWithholds(t *testing.T) {
	dead := deadPID(t)
	fork := gpu0{usedMiB: 6762, procs: []nvml.ProcessInfo{listed(dead, 6754)}}

	t.Run("foreign PID namespace: nothing is called orphaned", func(t *testing.T) {
		d := newDriver(t, fork)
		d.pidNS = "pid:[4026531999]"
		s := take(t, d)
		g := s.GPUs[0]
		if s.HostPIDsVisible || g.Unsupported != UnsupportedForeignPIDNamespace || g.Accountable() {
			t.Fatalf("visible=%v unsupported=%q", s.HostPIDsVisible, g.Unsupported)
		}
		if g.UnownedBytes != 0 || g.OwnedDeadBytes != 0 || g.Scanned {
			t.Errorf("a foreign namespace must not produce orphan numbers: %+v", g)
		}
	})
	t.Run("MIG without per-instance support is withheld", func(t *testing.T) {
		g := fork
		g.migOn = true
		s := take(t, newDriver(t, g))
		if s.GPUs[0].Unsupported != "mig" || s.GPUs[0].UnownedBytes != 0 {
			t.Fatalf("GPU 0 = %+v", s.GPUs[0])
		}
		if !s.GPUs[1].Accountable() {
			t.Errorf("GPU 1 must still count")
		}
	})
	t.Run("an NVML error on one GPU fails only that GPU", func(t *testing.T) {
		g := fork
		g.memRet = nvml.ERROR_GPU_IS_LOST
		s := take(t, newDriver(t, g))
		if s.GPUs[0].Err == nil || s.GPUs[0].Accountable() {
			t.Fatalf("GPU 0 = %+v", s.GPUs[0])
		}
		if !s.GPUs[3].Accountable() {
			t.Errorf("GPU 3 must still count")
		}
	})
}

// hungDriver never answers until released, like an NVML call stuck in
// the kernel.
type hungDriver struct {
	gpu.Driver
	release chan struct{}
}

func (h hungDriver) Read(ctx context.Context) ([]gpu.Reading, error) {
	<-h.release
	return nil, errors.New("released")
}

// TestTakeDriverDeadline runs under CPU load: a caller preempted between
// starting its clock and starting the driver call once made the next caller
// wait on the hung call and time out instead of failing fast. Prove a fix
// with go test -run TestTakeDriverDeadline -count=200 ./internal/snapshot/.
func TestTakeDriverDeadline(t *testing.T) {
	busyCPUs(t)
	h := hungDriver{Driver: newDriver(t, gpu0{}), release: make(chan struct{})}
	defer close(h.release)
	taker := NewTaker(Config{Driver: h, Proc: procFS(t), DriverTimeout: 50 * time.Millisecond})
	s := taker.Take(context.Background(), false)
	if s.Healthy() || !errors.Is(s.Sources[0].Err, context.DeadlineExceeded) {
		t.Fatalf("want a deadline error, got %+v", s.Sources)
	}
	// While the first call is stuck, later calls fail fast instead of piling up.
	s = taker.Take(context.Background(), false)
	if !errors.Is(s.Sources[0].Err, ErrDriverHung) {
		t.Fatalf("want ErrDriverHung, got %+v", s.Sources)
	}
	if len(s.GPUs) != 0 {
		t.Errorf("a failed read must report no GPUs")
	}
}

// busyCPUs loads the machine as stress(1) would until the test ends: twice
// as many spinning goroutines as Ps, so that the scheduler preempts the
// test's goroutines at any point, and as many spinning processes as CPUs,
// so that the kernel takes the Ps' threads off their CPUs too.
func busyCPUs(t *testing.T) {
	t.Helper()
	var stop atomic.Bool
	var wg sync.WaitGroup
	for range 2 * runtime.GOMAXPROCS(0) {
		wg.Go(func() {
			for !stop.Load() { // spin: that is the load
			}
		})
	}
	var spinners []*exec.Cmd
	for range runtime.NumCPU() {
		cmd := exec.Command("sh", "-c", "while :; do :; done")
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		spinners = append(spinners, cmd)
	}
	t.Cleanup(func() {
		stop.Store(true)
		wg.Wait()
		for _, cmd := range spinners {
			cmd.Process.Kill()
			cmd.Wait()
		}
	})
}

func TestLoopAge(t *testing.T) {
	dead := deadPID(t)
	d := newDriver(t, gpu0{usedMiB: 6762, procs: []nvml.ProcessInfo{listed(dead, 6754)}})
	loop := NewLoop(NewTaker(Config{Driver: d, Proc: procFS(t)}), time.Hour, 256*mib)
	first := loop.Refresh(context.Background(), false)
	since := first.GPUs[0].UnownedSince
	if since.IsZero() || !first.GPUs[1].UnownedSince.IsZero() {
		t.Fatalf("GPU 0 since=%v, GPU 1 since=%v", since, first.GPUs[1].UnownedSince)
	}
	second := loop.Refresh(context.Background(), false)
	if !second.GPUs[0].UnownedSince.Equal(since) {
		t.Errorf("the age clock restarted: %v then %v", since, second.GPUs[0].UnownedSince)
	}
	if loop.Latest() != second {
		t.Errorf("Latest is not the newest snapshot")
	}
	// Memory back: the clock stops.
	loop.taker = NewTaker(Config{Driver: newDriver(t, gpu0{}), Proc: procFS(t)})
	third := loop.Refresh(context.Background(), false)
	if !third.GPUs[0].UnownedSince.IsZero() {
		t.Errorf("clock still running after the memory came back")
	}
}

func TestGPUByID(t *testing.T) {
	s := take(t, newDriver(t, gpu0{}))
	g, ok := s.GPUByID("3")
	if !ok || g.Device.Index != 3 {
		t.Fatalf("by index: %v %+v", ok, g.Device)
	}
	if g2, ok := s.GPUByID(g.Device.UUID); !ok || g2.Device.Index != 3 {
		t.Fatalf("by uuid: %v", ok)
	}
	if _, ok := s.GPUByID("../../etc"); ok {
		t.Fatal("found a GPU by a bogus id")
	}
}

// TestConcurrentTakesShareTheRead: the background loop, a decision and a
// verification may take snapshots at once; none of them may fail for it.
func TestConcurrentTakesShareTheRead(t *testing.T) {
	taker := NewTaker(Config{Driver: newDriver(t, gpu0{}), Proc: procFS(t), DriverTimeout: 5 * time.Second})
	errs := make(chan error, 20)
	for range 20 {
		go func() {
			s := taker.Take(context.Background(), false)
			if !s.Healthy() || len(s.GPUs) != 8 {
				errs <- fmt.Errorf("unhealthy concurrent snapshot: %+v", s.Sources)
				return
			}
			errs <- nil
		}()
	}
	for range 20 {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
}

// TestLoopDatesALateSnapshot: when a refresh that started later finished
// first (a decision's forced scan beside the background tick), the earlier
// one is not made the latest, but its caller still gets it dated: an
// undated orphan looks new, and a plan made on it skips too_young however
// old the orphan is (TestLoadIntakeBurst: one firing key's action skipped
// too_young after its wait ran out).
func TestLoopDatesALateSnapshot(t *testing.T) {
	dead := deadPID(t)
	d := newDriver(t, gpu0{usedMiB: 6762, procs: []nvml.ProcessInfo{listed(dead, 6754)}})
	loop := NewLoop(NewTaker(Config{Driver: d, Proc: procFS(t)}), time.Hour, 256*mib)
	first := loop.Refresh(context.Background(), true)
	since, deadSince := first.GPUs[0].UnownedSince, first.GPUs[0].Owners[0].DeadSince
	if since.IsZero() || deadSince.IsZero() {
		t.Fatalf("first snapshot undated: unowned since %v, dead since %v", since, deadSince)
	}
	// A refresh that started after the next one and finished before it.
	newer := *first
	newer.Taken = time.Now().Add(time.Hour)
	loop.mu.Lock()
	loop.latest = &newer
	loop.mu.Unlock()

	late := loop.Refresh(context.Background(), true)
	if loop.Latest() != &newer {
		t.Errorf("an older snapshot replaced the latest")
	}
	g := late.GPUs[0]
	if !g.UnownedSince.Equal(since) || len(g.Owners) != 1 || !g.Owners[0].DeadSince.Equal(deadSince) {
		t.Errorf("late snapshot: unowned since %v, owners %+v; want unowned since %v, dead since %v", g.UnownedSince, g.Owners, since, deadSince)
	}
	// And the clocks did not move.
	loop.mu.Lock()
	loop.latest = first
	loop.mu.Unlock()
	again := loop.Refresh(context.Background(), true)
	if !again.GPUs[0].UnownedSince.Equal(since) || !again.GPUs[0].Owners[0].DeadSince.Equal(deadSince) {
		t.Errorf("the clocks moved: unowned since %v, dead since %v", again.GPUs[0].UnownedSince, again.GPUs[0].Owners[0].DeadSince)
	}
}
