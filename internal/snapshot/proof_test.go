package snapshot

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-orphan/gpu-orphan/internal/forks"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

// The proof rules of issue 15, each with real processes: a holder is an
// inheritor of a dead owner only when the kernel's records prove it.

// switchable is GPU 0 of a mock driver whose report the test changes.
type switchable struct {
	mu sync.Mutex
	g  gpu0
}

func (s *switchable) get() gpu0 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.g
}

func (s *switchable) set(g gpu0) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.g = g
}

func newLoop(t *testing.T, d testDriver) *Loop {
	t.Helper()
	taker := NewTaker(Config{Driver: d, Proc: procFS(t), ScanUnownedBytes: 256 * mib, ExcludePIDs: []int{os.Getpid()}})
	return NewLoop(taker, time.Hour, 256*mib)
}

// followingLoop is newLoop with the fork record fed by the kernel's process
// events, as the daemons run it; its first snapshot is taken, so that the
// record knows the GPU's device node before the test's processes start.
func followingLoop(t *testing.T, d testDriver) *Loop {
	t.Helper()
	loop := newLoop(t, d)
	rec := forks.New(procFS(t))
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	st := forks.Follow(ctx, rec, slog.New(slog.DiscardHandler))
	if !st.Up() {
		t.Skipf("the kernel's process events are unavailable here: %s", st.Why)
	}
	loop.FollowForks(rec, st)
	loop.Refresh(context.Background(), false)
	return loop
}

// waitApplied waits until loop's fork record applied every process event
// sent before now: a parent killed before the record applied its
// children's forks cannot be compared with, and on a loaded machine the
// record applies events late.
func waitApplied(t *testing.T, loop *Loop) {
	t.Helper()
	limit := time.Duration(float64(10*time.Second) * testenv.Slowness())
	if !loop.events.CatchUp(context.Background(), limit) {
		t.Fatalf("the fork record did not apply the process events within %v", limit)
	}
}

func suspectOf(g GPU, pid int) (Holder, bool) {
	for _, h := range g.Suspects {
		if h.PID == pid {
			return h, true
		}
	}
	return Holder{}, false
}

// sessionOf lists the processes of session sid but its leader.
func sessionOf(t *testing.T, sid int) map[int]int {
	t.Helper()
	fs := procFS(t)
	out := map[int]int{} // pid -> ppid
	pids, _ := fs.PIDs()
	for _, p := range pids {
		if pr, err := fs.Process(p); err == nil && pr.SID == sid && p != sid && !pr.Zombie() {
			out[p] = pr.PPID
		}
	}
	return out
}

// scriptedTrainer starts a job script (leading its session and group) whose
// child, the trainer, holds dev and forks a worker that maps it, and
// returns the trainer's and the worker's PIDs once the worker maps dev.
func scriptedTrainer(t *testing.T, dev string) (trainer, worker int) {
	t.Helper()
	script := exec.Command("sh", "-c", `sh -c 'exec 3<"$1"; "$0" & wait' "$0" "$1" & wait`, os.Args[0], dev)
	script.Env = testenv.MapperEnviron()
	script.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := script.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Kill(-script.Process.Pid, syscall.SIGKILL); script.Wait() })
	testenv.Eventually(t, 5*time.Second, "the trainer and its worker", func() bool {
		procs := sessionOf(t, script.Process.Pid)
		for pid, ppid := range procs {
			if ppid == script.Process.Pid {
				trainer = pid
			}
		}
		for pid, ppid := range procs {
			if trainer != 0 && ppid == trainer {
				worker = pid
			}
		}
		return worker != 0
	})
	waitMapped(t, worker, dev)
	return trainer, worker
}

// TestProofDescentAtFork: a trainer that leads neither its group nor its
// session (a job script does) forks a worker (which runs exec and keeps the
// trainer's open file) and dies before any snapshot saw the worker. The
// fork record proves that the worker holds the trainer's files; a snapshot
// without it calls the worker unexplained and says why: a missed orphan,
// never a wrong kill.
func TestProofDescentAtFork(t *testing.T) {
	nv := &switchable{}
	d := newDriverFunc(t, nv.get)
	dev := d.DevicePath(0)
	loop := followingLoop(t, d)
	trainer, worker := scriptedTrainer(t, dev)

	waitApplied(t, loop)
	syscall.Kill(trainer, syscall.SIGKILL)
	testenv.Eventually(t, 5*time.Second, "the trainer to be reaped", func() bool { return !testenv.Alive(trainer) })
	nv.set(gpu0{usedMiB: 4714, procs: []nvml.ProcessInfo{listed(trainer, 4706)}})
	s := loop.Refresh(context.Background(), false)
	h, ok := suspectOf(s.GPUs[0], worker)
	if !ok || h.Reason != ReasonInheritedFromDeadOwner || h.Proof != ProofDescentAtFork || h.DeadOwner != trainer {
		t.Errorf("with the fork record: worker %d is %+v, want inherited from %d by %s", worker, h, trainer, ProofDescentAtFork)
	}

	// Without the fork record: the group and session are the live
	// script's, and nothing else ties the worker to the trainer.
	alone := take(t, d)
	if h, _ := suspectOf(alone.GPUs[0], worker); h.Reason != ReasonUnexplained || h.Proof != NoProofEventsUnavailable {
		t.Errorf("without the fork record: worker %d is %+v, want unexplained, %s", worker, h, NoProofEventsUnavailable)
	}
}

// TestProofStartedBefore: a daemon that maps the GPU and started before the
// owner that died (MPS control, a monitoring agent) cannot have inherited
// from it.
func TestProofStartedBefore(t *testing.T) {
	nv := &switchable{}
	d := newDriverFunc(t, nv.get)
	dev := d.DevicePath(0)
	daemon := holder(t, dev, true).Process.Pid
	time.Sleep(20 * time.Millisecond) // start times are in clock ticks (10 ms)
	owner := holder(t, dev, true)
	loop := newLoop(t, d)
	nv.set(gpu0{usedMiB: 4714, procs: []nvml.ProcessInfo{listed(owner.Process.Pid, 4706)}})
	loop.Refresh(context.Background(), false)
	owner.Process.Kill()
	owner.Wait()
	s := loop.Refresh(context.Background(), false)
	h, ok := suspectOf(s.GPUs[0], daemon)
	if !ok || h.Reason != ReasonUnexplained || h.Proof != NoProofStartedBefore {
		t.Errorf("daemon %d: %+v, want unexplained, %s", daemon, h, NoProofStartedBefore)
	}
}

// TestLiveHelperSharesFile: in one job script's session and group, a
// trainer D forks a worker W, and starts a second trainer L with a context
// of its own, whose double-forked helper H (reparented to init) holds L's
// open file. D dies. W inherited D's context (D's group). H is in D's group
// too, but it shares L's open file (kcmp): it holds L's live context and is
// never a suspect.
func TestLiveHelperSharesFile(t *testing.T) {
	nv := &switchable{}
	d := newDriverFunc(t, nv.get)
	dev := d.DevicePath(0)
	loop := followingLoop(t, d)
	inner := `exec 3<"$1"; ( "$0" & ); exec sleep 300`
	script := exec.Command("sh", "-c", `exec 3<"$1"; "$0" & sh -c '`+inner+`' "$0" "$1" & wait`, os.Args[0], dev)
	script.Env = testenv.MapperEnviron()
	script.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := script.Start(); err != nil {
		t.Fatal(err)
	}
	dead := script.Process.Pid
	held := &testenv.Workload{Cmd: script, PID: dead}
	t.Cleanup(func() { held.Kill(); script.Process.Kill(); script.Wait() })
	var worker, live, helper int
	testenv.Eventually(t, 5*time.Second, "the worker, the second trainer and its helper", func() bool {
		worker, live, helper = 0, 0, 0
		for pid, ppid := range sessionOf(t, dead) {
			b, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/comm")
			switch comm := strings.TrimSpace(string(b)); {
			case comm == "sleep":
				live = pid
			case ppid == dead && comm != "sh":
				worker = pid
			case ppid != dead:
				helper = pid
			}
		}
		return worker != 0 && live != 0 && helper != 0
	})
	held.Children = []int{worker, live, helper}
	held.Hold()
	waitMapped(t, worker, dev)
	waitMapped(t, helper, dev)
	waitApplied(t, loop)
	script.Process.Signal(syscall.SIGKILL)
	script.Wait()

	nv.set(gpu0{usedMiB: 6354, procs: []nvml.ProcessInfo{listed(dead, 4000), listed(live, 2340)}})
	s := loop.Refresh(context.Background(), false)
	g := s.GPUs[0]
	if h, _ := suspectOf(g, worker); h.Reason != ReasonInheritedFromDeadOwner || h.Proof != ProofDescentAtFork {
		t.Errorf("worker %d: %+v, want inherited from the dead trainer at fork", worker, h)
	}
	if h, ok := suspectOf(g, helper); ok {
		t.Errorf("the live trainer's helper %d is a suspect: %+v", helper, h)
	}
	i := slices.IndexFunc(g.Holders, func(h Holding) bool { return h.PID == helper })
	if i < 0 || !slices.Contains(g.Holders[i].LiveJobs, JobLink{OwnerPID: live, GPU: g.Device.UUID, How: JobSharesFile}) {
		t.Errorf("the helper is not tied to the live trainer %d by a shared open file: %+v", live, g.Holders)
	}
}

// TestReusedPIDHoldingTheGPU (finding 8 of issue 15): the dead owner's PID
// is recreated for a process that holds the same GPU, while the dead
// owner's worker still holds its context. The listed PID is a dead owner,
// not the newcomer.
func TestReusedPIDHoldingTheGPU(t *testing.T) {
	nv := &switchable{}
	d := newDriverFunc(t, nv.get)
	dev := d.DevicePath(0)
	// The owner is not a group leader, so its worker is proven by descent.
	loop := followingLoop(t, d)
	owner, worker := scriptedTrainer(t, dev)
	nv.set(gpu0{usedMiB: 4714, procs: []nvml.ProcessInfo{listed(owner, 4706)}})
	loop.Refresh(context.Background(), false)

	waitApplied(t, loop)
	syscall.Kill(owner, syscall.SIGKILL)
	testenv.WaitGone(t, owner)
	newcomer := testenv.StartWithPID(t, owner, func() *exec.Cmd {
		f, err := os.Open(dev)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		c := exec.Command(os.Args[0])
		c.Env = testenv.MapperEnviron()
		c.ExtraFiles = []*os.File{f}
		c.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
		return c
	})
	t.Cleanup(func() { newcomer.Process.Kill(); newcomer.Wait() })
	waitMapped(t, owner, dev)

	s := loop.Refresh(context.Background(), false)
	o := s.GPUs[0].Owners[0]
	if o.Alive || o.ReusedBy == nil || o.ReusedBy.PID != owner {
		t.Fatalf("owner %d: alive %v, reused by %v; want dead, its PID reused by the newcomer", owner, o.Alive, o.ReusedBy)
	}
	if got := s.GPUs[0].UnownedBytes / mib; got != 4714 {
		t.Errorf("no live owner: %d MiB, want all 4714", got)
	}
	if h, _ := suspectOf(s.GPUs[0], worker); h.Reason != ReasonInheritedFromDeadOwner {
		t.Errorf("the dead owner's worker %d: %+v, want inherited", worker, h)
	}
	if h, _ := suspectOf(s.GPUs[0], owner); h.Reason == ReasonInheritedFromDeadOwner {
		t.Errorf("the newcomer %d with the dead owner's PID is called its inheritor: %+v", owner, h)
	}
}

// TestDeadOwnersHaveTheirOwnClocks (finding 7 of issue 15): a second
// owner that dies later on the same GPU is dated from its own death.
func TestDeadOwnersHaveTheirOwnClocks(t *testing.T) {
	nv := &switchable{}
	d := newDriverFunc(t, nv.get)
	loop := newLoop(t, d)
	first, second := deadPID(t), deadPID(t)
	nv.set(gpu0{usedMiB: 4714, procs: []nvml.ProcessInfo{listed(first, 4706)}})
	s1 := loop.Refresh(context.Background(), false)
	time.Sleep(10 * time.Millisecond)
	nv.set(gpu0{usedMiB: 9428, procs: []nvml.ProcessInfo{listed(first, 4706), listed(second, 4706)}})
	s2 := loop.Refresh(context.Background(), false)
	a, _ := s2.GPUs[0].Owner(first)
	b, _ := s2.GPUs[0].Owner(second)
	if !a.DeadSince.Equal(s1.Taken) || !b.DeadSince.Equal(s2.Taken) {
		t.Errorf("dead since %v and %v, want %v and %v", a.DeadSince, b.DeadSince, s1.Taken, s2.Taken)
	}
}

// TestProofExecedSiblings: a trainer's workers ran exec, and the record
// could not check that they kept its files (here it knows no GPU device to
// check against, as when the trainer died before the check). Two of them
// share an open file of the device: both hold the trainer's. One alone
// stays unproven (exec_since_fork).
func TestProofExecedSiblings(t *testing.T) {
	for _, n := range []int{1, 2} {
		t.Run(strconv.Itoa(n), func(t *testing.T) {
			d := newDriver(t, gpu0{})
			rec := forks.New(procFS(t))
			ctx, cancel := context.WithCancel(context.Background())
			t.Cleanup(cancel)
			if st := forks.Follow(ctx, rec, slog.New(slog.DiscardHandler)); !st.Up() {
				t.Skipf("the kernel's process events are unavailable here: %s", st.Why)
			}
			mem := NewLineage()
			mem.UseForks(rec)
			trainer, workers := forkOrphan(t, d.DevicePath(0), n, false)
			d = withGPU0(t, d, gpu0{usedMiB: 6762, procs: []nvml.ProcessInfo{listed(trainer, 6754)}})
			var s *Snapshot
			testenv.Eventually(t, 5*time.Second, "the workers' execs to be recorded", func() bool {
				s = takeWith(t, d, mem)
				h, _ := suspectOf(s.GPUs[0], workers[0])
				return h.Proof != NoProofNotAtFork && h.Proof != NoProof
			})
			for _, w := range workers {
				h, _ := suspectOf(s.GPUs[0], w)
				switch {
				case n == 2 && (h.Reason != ReasonInheritedFromDeadOwner || h.Proof != ProofExecedSiblingsShare):
					t.Errorf("worker %d of 2: %s %s, want inherited, %s", w, h.Reason, h.Proof, ProofExecedSiblingsShare)
				case n == 1 && (h.Reason != ReasonUnexplained || h.Proof != NoProofExeced):
					t.Errorf("the only worker %d: %s %s, want unexplained, %s", w, h.Reason, h.Proof, NoProofExeced)
				}
			}
		})
	}
}

// TestProofCloneParent: a fork event names the new process's real parent,
// not the caller of clone. A trainer's child runs a program of its own,
// which opens and maps the GPU itself (it called cuInit, as a launcher
// does, and has no context for NVML to list), and clones a helper with
// CLONE_PARENT: the event names the trainer as the helper's parent, though
// the helper holds the program's files, not the trainer's. The trainer
// dies. The helper is not proven to have inherited its context (killing it
// frees nothing of the trainer's, and breaks the live program); a worker
// that the trainer forked meanwhile, which does hold its files (kcmp at
// the fork), is. (Before the rule, the helper was descent_at_fork.)
func TestProofCloneParent(t *testing.T) {
	nv := &switchable{}
	d := newDriverFunc(t, nv.get)
	dev := d.DevicePath(0)
	loop := followingLoop(t, d)

	// The trainer opens the device (fd 3). The program starts without
	// it, opens its own and clones its helper; then the trainer forks
	// the worker (which runs exec and keeps fd 3, as gpu-orphan-sim's
	// workers do) while the program lives.
	script := exec.Command("sh", "-c", `exec 3<"$1"
`+testenv.CloneParentEnv+`="$1" "$0" 3<&- &
read -r go
`+testenv.MapperEnv+`=1 "$0" &
wait`, os.Args[0], dev)
	script.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	stdin, err := script.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := script.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := script.Start(); err != nil {
		t.Fatal(err)
	}
	trainer := script.Process.Pid
	t.Cleanup(func() { syscall.Kill(-trainer, syscall.SIGKILL); script.Wait() })
	var program, helper int
	if _, err := fmt.Fscanf(bufio.NewReader(stdout), "clone %d %d\n", &program, &helper); err != nil {
		t.Fatalf("the program's line: %v", err)
	}
	if _, err := io.WriteString(stdin, "go\n"); err != nil {
		t.Fatal(err)
	}
	worker := 0
	testenv.Eventually(t, 5*time.Second, "the trainer's worker", func() bool {
		for pid, ppid := range sessionOf(t, trainer) {
			if ppid == trainer && pid != program && pid != helper {
				worker = pid
			}
		}
		return worker != 0
	})
	waitMapped(t, worker, dev)
	waitMapped(t, helper, dev)
	if st, err := procFS(t).ReadStat(helper); err != nil || st.PPID != trainer {
		t.Fatalf("the helper's parent is %d (%v), want the trainer %d: CLONE_PARENT", st.PPID, err, trainer)
	}

	syscall.Kill(trainer, syscall.SIGKILL)
	testenv.Eventually(t, 5*time.Second, "the trainer to be reaped", func() bool { return !testenv.Alive(trainer) })
	nv.set(gpu0{usedMiB: 4714, procs: []nvml.ProcessInfo{listed(trainer, 4706)}})
	s := refreshRecorded(t, loop, worker, helper)
	if h, ok := suspectOf(s.GPUs[0], worker); !ok || h.Reason != ReasonInheritedFromDeadOwner || h.Proof != ProofDescentAtFork {
		t.Errorf("the trainer's worker %d is %+v, want inherited by %s", worker, h, ProofDescentAtFork)
	}
	if h, ok := suspectOf(s.GPUs[0], helper); !ok || h.Reason != ReasonUnexplained || h.Proof != NoProofForkerUnsure {
		t.Errorf("the program's helper %d is %+v, want unexplained, %s", helper, h, NoProofForkerUnsure)
	}
}

// TestProofForkedBeforeTheGPU: a trainer forks a worker before it opens the
// GPU; the worker opens and maps the GPU itself (it called cuInit: no
// context for NVML to list) and forks a child; none runs exec. The trainer
// dies. Fork by fork, without exec, both descend from it, but a fork
// copies only what the parent holds then: neither holds the trainer's
// files, and neither is proven. (Before the rule, both were
// descent_at_fork.)
func TestProofForkedBeforeTheGPU(t *testing.T) {
	nv := &switchable{}
	d := newDriverFunc(t, nv.get)
	dev := d.DevicePath(0)
	loop := followingLoop(t, d)

	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), testenv.PreforkEnv+"="+dev)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	trainer := cmd.Process.Pid
	t.Cleanup(func() { syscall.Kill(-trainer, syscall.SIGKILL); cmd.Wait() })
	var worker, child int
	if _, err := fmt.Fscanf(bufio.NewReader(stdout), "prefork %d %d\n", &worker, &child); err != nil {
		t.Fatalf("the trainer's line: %v", err)
	}
	waitMapped(t, worker, dev)
	waitMapped(t, child, dev)
	waitMapped(t, trainer, dev)

	syscall.Kill(trainer, syscall.SIGKILL)
	cmd.Wait() // reaped: its PID names no process
	nv.set(gpu0{usedMiB: 4714, procs: []nvml.ProcessInfo{listed(trainer, 4706)}})
	s := refreshRecorded(t, loop, worker, child)
	for _, pid := range []int{worker, child} {
		if h, ok := suspectOf(s.GPUs[0], pid); !ok || h.Reason != ReasonUnexplained || h.Proof != NoProofForkerUnsure {
			t.Errorf("%d is %+v, want unexplained, %s", pid, h, NoProofForkerUnsure)
		}
	}
}

// refreshRecorded takes snapshots until the fork record has caught up with
// the events of pids (it follows them on its own goroutine): until each is
// judged by the record rather than by its group and session alone.
func refreshRecorded(t *testing.T, loop *Loop, pids ...int) *Snapshot {
	t.Helper()
	var s *Snapshot
	testenv.Eventually(t, 5*time.Second, "the fork record to know the holders", func() bool {
		s = loop.Refresh(context.Background(), false)
		for _, pid := range pids {
			if h, ok := suspectOf(s.GPUs[0], pid); ok && h.Proof == NoProofMembershipOnly {
				return false
			}
		}
		return true
	})
	return s
}
