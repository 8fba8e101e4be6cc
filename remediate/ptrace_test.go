package remediate_test

// Issue 24, item 3: ptrace holds a target's exit. A user traces its own
// workers (PTRACE_SEIZE with PTRACE_O_TRACEEXIT; any user may, on a node
// without Yama) and kills its trainers: a traced worker told to die stops
// at the signal or at its exit, its descriptors (and so the GPU context)
// still open, until its tracer lets it go.

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

// traceEnv makes this test binary the tracer of traceMain instead of
// running tests: the PIDs to trace, comma-separated.
const traceEnv = "GPU_ORPHAN_TEST_TRACE"

// traceShareEnv, with traceEnv, names a simulated worker whose device
// descriptor the tracer copies (pidfd_getfd) and maps first: the tracer
// then holds that worker's GPU as an inheritor of its dead owner, proven
// by the open file it shares with the worker.
const traceShareEnv = "GPU_ORPHAN_TEST_TRACE_SHARE"

// tracerComm is the name the tracer gives itself: an escape sequence in
// it must reach no record raw.
const tracerComm = "tr\x1b[2Jace"

func init() {
	if pids := os.Getenv(traceEnv); pids != "" {
		os.Exit(traceMain(pids, os.Getenv(traceShareEnv)))
	}
}

// traceMain seizes each PID with PTRACE_O_TRACEEXIT from this (locked)
// thread and never lets a tracee go: a tracee sent a signal stops at it,
// and one that dies stops at its exit. Its tracees are released when it
// ends.
func traceMain(pidList, share string) int {
	if share != "" {
		pid, err := strconv.Atoi(share)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
		pidfd, err := unix.PidfdOpen(pid, 0)
		if err != nil {
			fmt.Fprintln(os.Stderr, "pidfd_open:", err)
			return 1
		}
		fd, err := unix.PidfdGetfd(pidfd, 3, 0) // the simulated worker's device node
		if err != nil {
			fmt.Fprintln(os.Stderr, "pidfd_getfd:", err)
			return 1
		}
		if _, err := unix.Mmap(fd, 0, 4096, unix.PROT_READ, unix.MAP_SHARED); err != nil {
			fmt.Fprintln(os.Stderr, "mmap:", err)
			return 1
		}
		unix.Close(pidfd)
	}
	// The tracer is this thread: it must live as long as the process.
	runtime.LockOSThread()
	name, err := unix.BytePtrFromString(tracerComm)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	if err := unix.Prctl(unix.PR_SET_NAME, uintptr(unsafe.Pointer(name)), 0, 0, 0); err != nil {
		fmt.Fprintln(os.Stderr, "prctl:", err)
		return 1
	}
	for f := range strings.SplitSeq(pidList, ",") {
		pid, err := strconv.Atoi(f)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
		if _, _, errno := unix.Syscall6(unix.SYS_PTRACE, unix.PTRACE_SEIZE, uintptr(pid), 0, unix.PTRACE_O_TRACEEXIT, 0, 0); errno != 0 {
			fmt.Fprintf(os.Stderr, "PTRACE_SEIZE %d: %v\n", pid, errno)
			return 1
		}
	}
	fmt.Println("traced")
	_, _ = io.Copy(io.Discard, os.Stdin)
	return 0
}

// startTracer runs traceMain as cred, from bin's executable exe, in a
// session of its own, on pids (and, when share is not 0, holding share's
// GPU) and returns its PID once they are traced. It is ended at cleanup,
// which lets its tracees go.
func startTracer(t *testing.T, bin, exe string, cred *syscall.Credential, share int, pids ...int) int {
	t.Helper()
	var list []string
	for _, p := range pids {
		list = append(list, strconv.Itoa(p))
	}
	env := []string{traceEnv + "=" + strings.Join(list, ",")}
	if share != 0 {
		env = append(env, traceShareEnv+"="+strconv.Itoa(share))
	}
	return startHelper(t, filepath.Join(bin, exe), cred, env, "traced", fmt.Sprintf("tracing %v as UID %d", pids, cred.Uid))
}

// wantTracer checks that target pid of a names tracer (its PID, start
// time, UID, user and escaped comm) and whether it is a target too.
func wantTracer(t *testing.T, what string, ts []remediate.Target, pid, tracer int, cred *syscall.Credential, target bool) {
	t.Helper()
	i := slices.IndexFunc(ts, func(tg remediate.Target) bool { return tg.PID == pid })
	if i < 0 {
		t.Errorf("%s: %d is not a target: %v", what, pid, ts)
		return
	}
	tr := ts[i].Tracer
	if tr == nil {
		t.Errorf("%s: target %d names no tracer", what, pid)
		return
	}
	p := readProcess(t, tracer)
	u, err := user.LookupId(strconv.Itoa(int(cred.Uid)))
	if err != nil {
		t.Fatal(err)
	}
	want := remediate.Tracer{PID: tracer, StartTime: p.StartTime, UID: int(cred.Uid), User: u.Username, Comm: `tr\x1b[2Jace`, Target: target}
	if *tr != want {
		t.Errorf("%s: target %d's tracer %+v, want %+v", what, pid, *tr, want)
	}
}

// planTargets are the targets of the plan an action recorded before its
// first signal.
func planTargets(t *testing.T, url string, a remediate.Action) []remediate.Target {
	t.Helper()
	for _, e := range getAction(t, url, a.ID).Events {
		if e.Kind != "plan" {
			continue
		}
		var p struct{ Targets []remediate.Target }
		if err := json.Unmarshal(e.Detail, &p); err != nil {
			t.Fatalf("plan event %s: %v", e.Detail, err)
		}
		return p.Targets
	}
	t.Fatalf("action %s recorded no plan", a.ID)
	return nil
}

// TestPtraceHeldTargetEscalates: a user made by the test traces its own
// workers on three GPUs and kills their trainers. Each cleanup signals the
// worker, which its tracer holds in a tracing stop: the action fails,
// names the tracer (PID, start time, UID, user, escaped comm) in the plan
// and the record, escalates as traced_holder counted for the tracer's user,
// and the breaker (3 failures in an hour, the default) stays closed, so
// that root's 16 GiB orphan on GPU 0 is then cleaned. The tracer, which
// nothing proves a target, is never signalled. (The old code ended the
// three actions failed with no escalation, opened the breaker and held the
// 16 GiB back.)
func TestPtraceHeldTargetEscalates(t *testing.T) {
	skipShort(t)
	t.Parallel()
	cred := testenv.UnprivilegedUser(t)
	u, err := user.LookupId(strconv.Itoa(int(cred.Uid)))
	if err != nil {
		t.Fatal(err)
	}
	root := testenv.SimNode(t, 4)
	openNodeToUsers(t, root)
	bin := sharedBin(t)
	url, _ := startAgent(t, root, filepath.Join(t.TempDir(), "r.db"), "--act", "--remediate.verify-timeout=2s",
		"--limit.cooldown=0s", "--limit.rate=100", "--limit.burst=10")
	var jobs []*testenv.Workload
	var workers []int
	for gpu := 1; gpu <= 3; gpu++ {
		w := startWorkloadAs(t, bin, cred, root, gpu, 1024, 1)
		jobs = append(jobs, w)
		workers = append(workers, w.Children...)
	}
	victim := testenv.StartWorkload(t, root, 0, 16384, 2)
	waitRecorded(t, url, 5)
	tracer := startTracer(t, bin, "helper", cred, 0, workers...)

	for i, w := range jobs {
		gpu := i + 1
		w.KillParent(t)
		a := alertAndWait(t, url, root, gpu, fp(700+i))
		if a.State != remediate.StateFailed || a.Escalation != remediate.EscalationTracedHolder {
			t.Fatalf("GPU %d: action %s (%s), escalation %q; want failed, traced_holder", gpu, a.State, a.Reason, a.Escalation)
		}
		wantTargets(t, a, w.Children...)
		wantTracer(t, fmt.Sprintf("GPU %d's record", gpu), a.Targets, w.Children[0], tracer, cred, false)
		wantTracer(t, fmt.Sprintf("GPU %d's plan", gpu), planTargets(t, url, a), w.Children[0], tracer, cred, false)
		if tg := a.Targets[0]; tg.Outcome != "still_alive" || tg.State != "t" {
			t.Errorf("GPU %d: target outcome %s, state %q; want still_alive in a tracing stop", gpu, tg.Outcome, tg.State)
		}
		if len(a.Leftover) != 1 || a.Leftover[0].Kind != "traced" || !strings.Contains(a.Leftover[0].Detail, strconv.Itoa(tracer)) {
			t.Errorf("GPU %d: leftover %+v, want the worker, traced by %d", gpu, a.Leftover, tracer)
		}
		for _, says := range []string{strconv.Itoa(tracer), u.Username, "not counted toward the circuit breaker"} {
			if !strings.Contains(a.NextStep, says) {
				t.Errorf("GPU %d: the next step does not say %q: %s", gpu, says, a.NextStep)
			}
		}
		if strings.ContainsRune(a.Reason+a.NextStep+a.Leftover[0].Detail, 0x1b) {
			t.Errorf("GPU %d: the tracer's comm reached the record raw: %q", gpu, a.Reason+a.NextStep)
		}
		if got := usedMiB(t, root, gpu); got < 1024 {
			t.Errorf("GPU %d uses %d MiB: the traced worker let go, not the case under test", gpu, got)
		}
	}
	testenv.Eventually(t, 5*time.Second, "three failed actions to be counted", func() bool {
		return metricValue(t, url, "gpu_orphan_remediator_actions_total", map[string]string{"state": "failed"}) == 3
	})
	_, mfs := testenv.Scrape(t, url+"/metrics")
	if v, _ := testenv.Value(mfs, "gpu_orphan_remediator_escalations_total", map[string]string{"user": u.Username, "kind": "traced_holder"}); v != 3 {
		t.Errorf("escalations_total{user=%s,kind=traced_holder} = %v, want 3", u.Username, v)
	}
	if v, _ := testenv.Value(mfs, "gpu_orphan_remediator_breaker_open", nil); v != 0 {
		t.Errorf("breaker_open = %v after three traced holds", v)
	}

	victim.KillParent(t)
	a := alertAndWait(t, url, root, 0, fp(710))
	if a.State != remediate.StateSucceeded {
		t.Fatalf("another user's orphan: %s (%s)", a.State, a.Reason)
	}
	wantTargets(t, a, victim.Children...)
	wantDead(t, "the 16 GiB orphan's worker", victim.Children...)
	wantUsedMiB(t, root, 0, 0)
	if v := metricValue(t, url, "gpu_orphan_remediator_limited_total", map[string]string{"limit": "breaker"}); v != 0 {
		t.Errorf("limited_total{limit=breaker} = %v", v)
	}
	wantAlive(t, "the tracer, which nothing proves a target", tracer)
}

// TestPtraceTracerProvenTarget: the tracer of GPU 1's worker is itself a
// proven target: it shares an open file of GPU 2's device with a worker
// whose trainer died there (an inheritor of that dead owner). GPU 1's plan
// names it as the worker's tracer and targets it too; its end releases the
// worker, and GPU 1's memory comes back. GPU 2's own worker is not this
// action's. (The old code signalled the worker alone, which its tracer
// held: the action failed and the memory stayed.)
func TestPtraceTracerProvenTarget(t *testing.T) {
	skipShort(t)
	t.Parallel()
	cred := testenv.UnprivilegedUser(t)
	root := testenv.SimNode(t, 3)
	openNodeToUsers(t, root)
	bin := sharedBin(t)
	url, _ := startAgent(t, root, filepath.Join(t.TempDir(), "r.db"), "--act", "--limit.cooldown=0s")
	one := startWorkloadAs(t, bin, cred, root, 1, 1024, 1)
	two := startWorkloadAs(t, bin, cred, root, 2, 1024, 1)
	waitRecorded(t, url, 2)
	two.KillParent(t)
	tracer := startTracer(t, bin, "helper", cred, two.Children[0], one.Children...)
	one.KillParent(t)

	a := alertAndWait(t, url, root, 1, fp(720))
	if a.State != remediate.StateSucceeded {
		t.Fatalf("action %s (%s), want succeeded", a.State, a.Reason)
	}
	wantTargets(t, a, one.Children[0], tracer)
	wantTracer(t, "the record", a.Targets, one.Children[0], tracer, cred, true)
	wantTracer(t, "the plan", planTargets(t, url, a), one.Children[0], tracer, cred, true)
	for _, tg := range a.Targets {
		if tg.PID == tracer && tg.Reason != "tracer_of_target" {
			t.Errorf("the tracer's reason %q, want tracer_of_target", tg.Reason)
		}
	}
	wantDead(t, "the tracer, a proven target", tracer)
	wantDead(t, "GPU 1's worker", one.Children...)
	wantUsedMiB(t, root, 1, 0)
	wantAlive(t, "GPU 2's worker, not this action's target", two.Children...)
}

// epilogTraced runs `gpu-orphan epilog --drain` for job, whose only worker
// (on GPU 1, of cred's user, its trainer killed) is traced by a tracer of
// the same user, run from the shared executable exe, in the job's cgroup
// when tracerInJob. It returns the exit status, the output, whether
// scontrol was run, the epilog's actions, the worker and the tracer.
func epilogTraced(t *testing.T, tracerInJob bool, exe string) (code int, out string, drained bool, as []remediate.Action, worker, tracer int, cred *syscall.Credential) {
	t.Helper()
	if os.Getuid() != 0 {
		t.Skip("the epilog runs as root, as slurmd runs it")
	}
	cred = testenv.UnprivilegedUser(t)
	root := testenv.SimNode(t, 2)
	openNodeToUsers(t, root)
	bin := sharedBin(t)
	job := testenv.SlurmJobID()
	cgroup := fmt.Sprintf("slurm/uid_%d/job_%s/step_batch", cred.Uid, job)
	w := startWorkloadAs(t, bin, cred, root, 1, 1024, 1)
	worker = w.Children[0]
	testenv.IntoCgroup(t, testenv.CgroupV1, cgroup, worker)
	w.KillParent(t)
	tracer = startTracer(t, bin, exe, cred, 0, worker)
	if tracerInJob {
		testenv.IntoCgroup(t, testenv.CgroupV1, cgroup, tracer)
	}

	dir := t.TempDir()
	scontrol, argsFile := filepath.Join(dir, "scontrol"), filepath.Join(dir, "args")
	testenv.WriteExecutable(t, scontrol, []byte("#!/bin/sh\nfor a in \"$@\"; do echo \"$a\"; done > "+argsFile+"\n"))
	db := filepath.Join(dir, "remediator.db")
	cmd := exec.Command(testenv.Bin(t, "gpu-orphan"), "--backend=sim", "--sim.root="+root, "epilog", "--store.path="+db,
		"--grace=1s", "--verify-timeout=2s", "--drain", "--slurm.scontrol="+scontrol, "--log.syslog-socket=")
	cmd.Env = []string{"SLURM_JOB_ID=" + job, fmt.Sprintf("SLURM_JOB_UID=%d", cred.Uid), "SLURM_JOB_GPUS=1", "SLURMD_NODENAME=gpu-7"}
	b, err := cmd.CombinedOutput()
	code, out = testenv.ExitCode(t, err), string(b)
	t.Logf("epilog: exit %d: %s", code, strings.TrimSpace(out))
	_, err = os.Stat(argsFile)
	drained = err == nil
	st, err := store.OpenReadOnly(t.Context(), db)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if as, err = st.Actions(t.Context(), store.Filter{}); err != nil {
		t.Fatal(err)
	}
	return code, out, drained, as, worker, tracer, cred
}

// TestPtraceEpilogNoDrain: the job's worker is traced by its user's
// tracer outside the job, which holds it at the signal or its exit. The
// epilog with --drain signals the worker, names the tracer in the record
// (escalation traced_holder), says whose the hold is, and neither drains
// the node nor fails (Slurm drains on any status but 0). (The old code
// exited 1 and drained the node: the user's will.)
func TestPtraceEpilogNoDrain(t *testing.T) {
	skipShort(t)
	t.Parallel()
	code, out, drained, as, worker, tracer, cred := epilogTraced(t, false, "helper")
	if code != 0 || drained || !strings.Contains(out, "not drained") || !strings.Contains(out, "PID "+strconv.Itoa(tracer)) {
		t.Errorf("epilog: exit %d, drained %v, output %q; want 0, not drained, naming tracer %d", code, drained, out, tracer)
	}
	if strings.ContainsRune(out, 0x1b) {
		t.Errorf("the tracer's comm reached the line raw: %q", out)
	}
	if len(as) != 1 || as[0].State != remediate.StateFailed || as[0].Escalation != remediate.EscalationTracedHolder {
		t.Fatalf("actions %+v, want one, failed, traced_holder", as)
	}
	wantTracer(t, "the epilog's record", as[0].Targets, worker, tracer, cred, false)
	wantAlive(t, "the tracer, outside the job", tracer)
}

// TestPtraceEpilogTracerInJob: the tracer is in the ended job's cgroup:
// the epilog signals it too (tracer_of_target), the worker dies, the
// memory comes back, and the epilog exits 0. (The old code signalled the
// worker alone, which the tracer held: exit 1, and the node drained.)
func TestPtraceEpilogTracerInJob(t *testing.T) {
	skipShort(t)
	t.Parallel()
	code, out, drained, as, worker, tracer, cred := epilogTraced(t, true, "helper")
	if code != 0 || drained || strings.Contains(out, "not drained") {
		t.Errorf("epilog: exit %d, drained %v, output %q; want 0, clean", code, drained, out)
	}
	if len(as) != 1 || as[0].State != remediate.StateSucceeded {
		t.Fatalf("actions %+v, want one, succeeded", as)
	}
	wantTargets(t, as[0], worker, tracer)
	wantTracer(t, "the epilog's record", as[0].Targets, worker, tracer, cred, true)
	testenv.WaitGone(t, worker)
	wantDead(t, "the tracer, in the job's cgroup", tracer)
}

// TestPtraceEpilogProtectedTracerInJob: the tracer is in the ended job's
// cgroup, as slurmstepd is (it traces a job's tasks for a parallel
// debugger), and runs a root-owned executable named slurmstepd: the rule
// proves it a target, but the never-touch rules keep it untouched. The
// epilog signals the worker alone, which the tracer holds: failed,
// traced_holder, the node not drained, the tracer alive.
func TestPtraceEpilogProtectedTracerInJob(t *testing.T) {
	skipShort(t)
	t.Parallel()
	code, out, drained, as, worker, tracer, cred := epilogTraced(t, true, "slurmstepd")
	if code != 0 || drained || !strings.Contains(out, "not drained") {
		t.Errorf("epilog: exit %d, drained %v, output %q; want 0, not drained", code, drained, out)
	}
	if len(as) != 1 || as[0].State != remediate.StateFailed || as[0].Escalation != remediate.EscalationTracedHolder {
		t.Fatalf("actions %+v, want one, failed, traced_holder", as)
	}
	wantTargets(t, as[0], worker)
	wantTracer(t, "the epilog's record", as[0].Targets, worker, tracer, cred, false)
	wantAlive(t, "the tracer, protected", tracer)
}
