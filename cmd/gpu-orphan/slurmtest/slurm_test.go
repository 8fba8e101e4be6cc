package slurmtest

import (
	"encoding/json"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/sim"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/jobend"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

// orphanJob leaves a fork orphan on its GPU: its trainer is killed with
// -9, and its two workers keep the trainer's context. They run in a
// cgroup below the step's, as a container runtime's processes do:
// Slurm 22.05's proctrack/cgroup (cgroup/v1) signals the processes of the
// step's own cgroup only, so they outlive the job (measured, docs/slurm.md),
// and their cgroup path still names the job. With HOLD set, the job waits
// for that file before it ends.
const orphanJob = `set -eu
gpu=${SLURM_JOB_GPUS:-0}
cg=/sys/fs/cgroup/freezer$(grep -E '^[0-9]+:freezer:' /proc/self/cgroup | cut -d: -f3)
mkdir "$cg/runtime"
ready="$DIR/ready-$SLURM_JOB_ID"
( echo $BASHPID > "$cg/runtime/cgroup.procs"; exec "$SIM" run --root "$ROOT" --gpu "$gpu" --mib 1024 --children 2 ) > "$ready" &
until [ -s "$ready" ]; do sleep 0.05; done
read _ parent workers < "$ready"
kill -9 "$parent"
wait "$parent" 2>/dev/null || true
echo "orphan $gpu $workers"
while [ -n "${HOLD:-}" ] && [ ! -e "$DIR/$HOLD" ]; do sleep 0.1; done
`

// healthyJob runs a trainer with a worker on GPU 0 until it is cancelled.
const healthyJob = `set -eu
ready="$DIR/ready-$SLURM_JOB_ID"
"$SIM" run --root "$ROOT" --gpu 0 --mib 512 --children 1 > "$ready" &
until [ -s "$ready" ]; do sleep 0.05; done
echo "healthy $(cut -d' ' -f2- "$ready")"
wait
`

// plainJob says that it ran, and on which GPU.
const plainJob = `echo "ran ${SLURM_JOB_GPUS:-none}"
`

// jobActions are the actions of the audit store that the prolog or the
// epilog (hook) recorded for the job.
func jobActions(t *testing.T, c *cluster, hook, job string) []remediate.Action {
	t.Helper()
	st, err := store.OpenReadOnly(t.Context(), c.db)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	all, err := st.Actions(t.Context(), store.Filter{})
	if err != nil {
		t.Fatal(err)
	}
	var out []remediate.Action
	for _, a := range all {
		es, err := st.Events(t.Context(), a.ID)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range es {
			var d struct {
				JobID string `json:"job_id"`
				Hook  string `json:"hook"`
			}
			if e.Kind == "slurm_job" && json.Unmarshal(e.Detail, &d) == nil && d.JobID == job && d.Hook == hook {
				out = append(out, a)
			}
		}
	}
	return out
}

func pids(t *testing.T, fields []string) []int {
	t.Helper()
	var out []int
	for _, f := range fields {
		p, err := strconv.Atoi(f)
		if err != nil {
			t.Fatalf("PIDs %q: %v", fields, err)
		}
		out = append(out, p)
	}
	return out
}

func waitExited(t *testing.T, pids ...int) {
	t.Helper()
	for _, pid := range pids {
		testenv.Eventually(t, 10*time.Second, "PID "+strconv.Itoa(pid)+" to exit", func() bool { return !testenv.Alive(pid) })
	}
}

// TestSlurmEpilogCleansOrphan: a job that leaves a fork orphan. Slurm
// ends the job, its processes outlive it; the epilog signals them, the
// memory is back, the node stays idle, and the audit record names the job.
func TestSlurmEpilogCleansOrphan(t *testing.T) {
	c := getCluster(t)
	job := c.submit(t, orphanJob, []string{"--gres=gpu:1"})
	f := c.jobLine(t, job, "orphan")
	gpu, workers := f[0], pids(t, f[1:])
	if gpu != "0" || len(workers) != 2 {
		t.Fatalf("the job says GPU %s, workers %v; want GPU 0 (SLURM_JOB_GPUS) and two", gpu, workers)
	}
	prio, line := c.syslog.hookLine(t, "epilog", job, 60*time.Second)
	c.waitJob(t, job, "COMPLETED", 30*time.Second)
	if prio != "<30>" || !strings.Contains(line, "signalled 2 processes on GPU 0") || !strings.Contains(line, "1 GiB back") || !strings.Contains(line, "GPU 0 clean") {
		t.Errorf("the epilog's line: %s %q", prio, line)
	}
	waitExited(t, workers...)
	if used := c.usedMiB(t, 0); used != 0 {
		t.Errorf("GPU 0 uses %d MiB after the epilog, want 0", used)
	}
	if state, reason, err := c.nodeState(); state != "idle" || err != nil {
		t.Errorf("node %s: %s (%s, %v), want idle", c.node, state, reason, err)
	}
	as := jobActions(t, c, "epilog", job)
	if len(as) != 1 {
		t.Fatalf("%d epilog actions name job %s, want 1", len(as), job)
	}
	a := as[0]
	var targets []int
	for _, tg := range a.Targets {
		targets = append(targets, tg.PID)
		if tg.Reason != jobend.ReasonJobCgroup || tg.Outcome == "" {
			t.Errorf("target %d: reason %s, outcome %s", tg.PID, tg.Reason, tg.Outcome)
		}
	}
	slices.Sort(targets)
	if a.Source != "epilog" || a.State != remediate.StateSucceeded || !slices.Equal(targets, slices.Sorted(slices.Values(workers))) ||
		a.FreedBytes != 1032<<20 || a.After == nil {
		t.Fatalf("action: source %s, state %s, targets %v (want %v), freed %d", a.Source, a.State, targets, workers, a.FreedBytes)
	}
	// The record names the job and its user as slurmd gave them
	// (SLURM_JOB_ID, SLURM_JOB_UID: the tests submit as root), and
	// gpu-orphan report counts the cleanup for that job.
	if j := a.Job; j == nil || j.SlurmJob != job || j.UID == nil || *j.UID != 0 || j.User != "root" {
		t.Errorf("the action's job %+v, want job %s of root (UID 0)", j, job)
	}
	out, err := exec.Command(c.cli, "report", "--store.path="+c.db, "--by=slurm_job", "-o", "csv").CombinedOutput()
	if err != nil || !slices.ContainsFunc(strings.Split(string(out), "\n"), func(l string) bool { return strings.HasPrefix(l, job+",1,") }) {
		t.Errorf("gpu-orphan report --by slurm_job (%v) does not show job %s with its event:\n%s", err, job, out)
	}
	t.Logf("epilog of job %s: from its start to the memory back %.3f s (first signal to memory back %.3f s); its line: %s",
		job, a.After.At.Sub(a.StartedAt).Seconds(), a.VerifySeconds, line)
}

// TestSlurmEpilogOnlyTheEndedJob: job B's healthy trainer and worker run
// on GPU 0 (B asked for no GRES, as a job on a shared GPU); job A, given
// GPU 0, ends leaving an orphan there. A's epilog signals A's processes
// only: B runs on, its memory in place. When B is cancelled, Slurm ends
// its processes and B's epilog finds nothing of it left.
func TestSlurmEpilogOnlyTheEndedJob(t *testing.T) {
	c := getCluster(t)
	jobB := c.submit(t, healthyJob, nil)
	healthy := pids(t, c.jobLine(t, jobB, "healthy"))
	jobA := c.submit(t, orphanJob, []string{"--gres=gpu:1"})
	t.Cleanup(func() { _, _ = c.run("scancel", jobB) }) // it may be over already
	f := c.jobLine(t, jobA, "orphan")
	if f[0] != "0" {
		t.Fatalf("job A got GPU %s, want 0, B's", f[0])
	}
	workers := pids(t, f[1:])
	_, line := c.syslog.hookLine(t, "epilog", jobA, 60*time.Second)
	if !strings.Contains(line, "signalled 2 processes on GPU 0") || !strings.Contains(line, "GPU 0 clean") {
		t.Errorf("job A's epilog: %q", line)
	}
	waitExited(t, workers...)
	for _, pid := range healthy {
		if !testenv.Alive(pid) {
			t.Errorf("job B's %d was signalled at job A's end", pid)
		}
	}
	if used := c.usedMiB(t, 0); used != 512+8 {
		t.Errorf("GPU 0 uses %d MiB after A's epilog, want B's 520", used)
	}
	as := jobActions(t, c, "epilog", jobA)
	if len(as) != 1 {
		t.Fatalf("%d epilog actions for job A", len(as))
	}
	for _, tg := range as[0].Targets {
		if slices.Contains(healthy, tg.PID) {
			t.Errorf("job B's %d is a target of A's epilog", tg.PID)
		}
	}
	for _, pid := range healthy {
		if !slices.ContainsFunc(as[0].Excluded, func(e remediate.Exclusion) bool { return e.PID == pid && e.Why == jobend.WhyNotInJob }) {
			t.Errorf("job B's %d is not named as left alone (not_in_job)", pid)
		}
	}

	c.must(t, "scancel", jobB)
	_, line = c.syslog.hookLine(t, "epilog", jobB, 60*time.Second)
	if !strings.Contains(line, "nothing of the job holds a GPU") {
		t.Errorf("job B's epilog, after Slurm ended its processes: %q", line)
	}
	waitExited(t, healthy...)
	if used := c.usedMiB(t, 0); used != 0 {
		t.Errorf("GPU 0 uses %d MiB after B ended, want 0", used)
	}
}

// TestSlurmEpilogLeakDrains: while a job runs, the driver leaks 40 GiB on
// its GPU, memory that no process holds. At the job's end the epilog
// cleans the job's orphan, but the leak stays: it fails, and sinfo shows
// the node drained with gpu-orphan's reason; slurmd's log has its line.
func TestSlurmEpilogLeakDrains(t *testing.T) {
	c := getCluster(t)
	t.Cleanup(func() {
		if err := sim.ClearFaults(c.simRoot); err != nil {
			t.Error(err)
		}
		c.resume(t)
	})
	job := c.submit(t, orphanJob, []string{"--gres=gpu:1"}, "HOLD=leak-go")
	workers := pids(t, c.jobLine(t, job, "orphan")[1:])
	if err := sim.WriteFaults(c.simRoot, sim.Faults{GPU: sim.AllGPUs, Leaks: []sim.Leak{{GPU: 0, Bytes: 40 << 30}}}); err != nil {
		t.Fatal(err)
	}
	c.release(t, "leak-go")
	prio, line := c.syslog.hookLine(t, "epilog", job, 60*time.Second)
	want := "job " + job + ": GPU 0 holds 40 GiB with no owner (no process holds it: a driver-level leak"
	if prio != "<27>" || !strings.HasPrefix(line, want) {
		t.Errorf("the epilog's line: %s %q, want daemon.err (<27>) and %q", prio, line, want)
	}
	waitExited(t, workers...)
	reason := "gpu-orphan: GPU 0 holds 40 GiB with no owner"
	testenv.Eventually(t, 30*time.Second, "sinfo to show the node drained", func() bool {
		state, r, _ := c.nodeState()
		return state == "drained" && r == reason
	})
	out := c.must(t, "sinfo", "-h", "-R", "-o", "%E|%N")
	if !strings.Contains(out, reason+"|"+c.node) {
		t.Errorf("sinfo -R: %q, want %q for %s", out, reason, c.node)
	}
	slurmd, _ := os.ReadFile(c.dir + "/log/slurmd.log")
	if !strings.Contains(string(slurmd), "epilog failed: rc:1 output:gpu-orphan epilog: "+want) {
		t.Errorf("slurmd's log does not have the epilog's line %q", want)
	}
	as := jobActions(t, c, "epilog", job)
	if len(as) != 1 || len(as[0].Targets) != 2 {
		t.Fatalf("epilog actions %+v, want one on the job's two workers", as)
	}

	// The node's exporter, asking the real sinfo, reports the drain for
	// GPUOrphanNodeOutOfScheduling, and stops once a person resumes it.
	t.Setenv("SLURM_CONF", c.conf)
	addr := testenv.FreeAddr(t)
	testenv.Daemon(t, testenv.Bin(t, "gpu-orphan-exporter"), "--backend=sim", "--sim.root="+c.simRoot, "--web.listen-address="+addr,
		"--collector.slurm-drain", "--slurm.node="+c.node, "--slurm.sinfo="+c.bins["sinfo"], "--slurm.max-age=1s")
	drained := func() (float64, string) {
		resp, err := http.Get("http://" + addr + "/metrics")
		if err != nil {
			return -1, ""
		}
		resp.Body.Close()
		_, mfs := testenv.Scrape(t, "http://"+addr+"/metrics")
		for _, m := range testenv.Series(mfs, "gpu_orphan_slurm_node_drained", nil) {
			return m.GetGauge().GetValue(), testenv.Label(m, "reason")
		}
		return -1, ""
	}
	testenv.Eventually(t, 20*time.Second, "gpu_orphan_slurm_node_drained 1 with gpu-orphan's reason", func() bool {
		v, r := drained()
		return v == 1 && r == reason
	})
	c.resume(t)
	testenv.Eventually(t, 20*time.Second, "gpu_orphan_slurm_node_drained 0 once resumed", func() bool {
		v, r := drained()
		return v == 0 && r == ""
	})
}

// TestSlurmPrologCleansStaleOrphan: a fork orphan from before (outside
// Slurm) holds GPU 0. A job given GPU 0: its prolog cleans the orphan
// under the normal rules, and the job runs.
func TestSlurmPrologCleansStaleOrphan(t *testing.T) {
	c := getCluster(t)
	stale := testenv.StartWorkload(t, c.simRoot, 0, 2048, 2)
	// The node agent (a dry run) runs on the node: a snapshot of it sees
	// the workers share the live owner's open file, and the prolog reads
	// that proof in the store they share.
	agent := testenv.NodeAgent(t, c.simRoot, c.db)
	testenv.Eventually(t, 20*time.Second, "the node agent to see the stale job's workers", func() bool {
		_, mfs := testenv.Scrape(t, agent+"/metrics")
		v, _ := testenv.Value(mfs, "gpu_orphan_remediator_recorded_descendants", nil)
		return v >= 2
	})
	stale.KillParent(t)
	job := c.submit(t, plainJob, []string{"--gres=gpu:1"})
	_, line := c.syslog.hookLine(t, "prolog", job, 60*time.Second)
	if !strings.Contains(line, "signalled 2 processes on GPU 0") || !strings.Contains(line, "2 GiB back") || !strings.Contains(line, "GPU 0 clean") {
		t.Errorf("the prolog's line: %q", line)
	}
	c.waitJob(t, job, "COMPLETED", 60*time.Second)
	if ran := c.jobLine(t, job, "ran"); len(ran) != 1 || ran[0] != "0" {
		t.Errorf("the job ran on GPU %v, want 0", ran)
	}
	waitExited(t, stale.Children...)
	if used := c.usedMiB(t, 0); used != 0 {
		t.Errorf("GPU 0 uses %d MiB, want 0", used)
	}
	as := jobActions(t, c, "prolog", job)
	if len(as) != 1 || as[0].Source != "prolog" || as[0].Policy != remediate.PolicyDeadOwner || as[0].State != remediate.StateSucceeded {
		t.Fatalf("prolog actions %+v", as)
	}
}

// TestSlurmPrologLeakRequeues: GPU 0 leaks 40 GiB that nothing can give
// back. A job given GPU 0: its prolog fails, Slurm requeues the job and
// the node is drained with gpu-orphan's reason. Once the GPU is reset
// (the fault cleared) and the node resumed, the requeued job runs.
func TestSlurmPrologLeakRequeues(t *testing.T) {
	c := getCluster(t)
	if err := sim.WriteFaults(c.simRoot, sim.Faults{GPU: sim.AllGPUs, Leaks: []sim.Leak{{GPU: 0, Bytes: 40 << 30}}}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := sim.ClearFaults(c.simRoot); err != nil {
			t.Error(err)
		}
	})
	job := c.submit(t, plainJob, []string{"--gres=gpu:1"})
	t.Cleanup(func() { _, _ = c.run("scancel", job) }) // it may be over already
	prio, line := c.syslog.hookLine(t, "prolog", job, 60*time.Second)
	if prio != "<27>" || !strings.HasPrefix(line, "job "+job+": GPU 0 holds 40 GiB with no owner") {
		t.Errorf("the prolog's line: %s %q", prio, line)
	}
	reason := "gpu-orphan: GPU 0 holds 40 GiB with no owner"
	testenv.Eventually(t, 30*time.Second, "the node drained and the job requeued", func() bool {
		state, r, _ := c.nodeState()
		return state == "drained" && r == reason && c.jobField(t, job, "JobState") == "PENDING" && c.jobField(t, job, "Restarts") == "1"
	})
	as := jobActions(t, c, "prolog", job)
	if len(as) != 1 || as[0].State != remediate.StateFailed || as[0].GPUIndex != 0 {
		t.Fatalf("prolog actions %+v, want its failure on GPU 0", as)
	}

	if err := sim.ClearFaults(c.simRoot); err != nil {
		t.Fatal(err)
	}
	c.must(t, "scontrol", "update", "nodename="+c.node, "state=resume")
	start := time.Now()
	c.waitJob(t, job, "COMPLETED", 90*time.Second)
	t.Logf("the requeued job ran %.1f s after the node was resumed", time.Since(start).Seconds())
	if ran := c.jobLine(t, job, "ran"); len(ran) != 1 || ran[0] != "0" {
		t.Errorf("the requeued job ran on GPU %v, want 0", ran)
	}
}
