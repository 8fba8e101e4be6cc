package main

// The prolog and the epilog as Slurm runs them, without a Slurm: the real
// binary, the job in the environment, its processes in a job's cgroup made
// by hand (cgroup v1, as slurmd's proctrack/cgroup makes them). The tests
// with a real slurmctld and slurmd are in ./slurmtest.

import (
	"bytes"
	"encoding/json"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/gpu"
	"github.com/gpu-orphan/gpu-orphan/internal/sim"
	"github.com/gpu-orphan/gpu-orphan/internal/snapshot"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/hooks"
	"github.com/gpu-orphan/gpu-orphan/remediate/jobend"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

// runHook runs the gpu-orphan binary with env added to a clean
// environment, as slurmd runs its prolog and epilog (no PATH among them).
func runHook(t *testing.T, env []string, args ...string) (int, string) {
	t.Helper()
	cmd := exec.Command(testenv.Bin(t, "gpu-orphan"), args...)
	cmd.Env = append([]string{}, env...) // nil would be ours
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	code := testenv.ExitCode(t, cmd.Run())
	return code, out.String()
}

// jobCgroup is where slurmd's proctrack/cgroup (v1) puts a batch job.
func jobCgroup(job string) string { return "slurm/uid_0/job_" + job + "/step_batch" }

// intoJob moves each pid into the job's cgroup.
func intoJob(t *testing.T, job string, pids ...int) {
	t.Helper()
	for _, pid := range pids {
		testenv.IntoCgroup(t, testenv.CgroupV1, jobCgroup(job), pid)
	}
}

// fakeScontrol is an scontrol that writes its arguments, one a line, to
// the file it returns.
func fakeScontrol(t *testing.T) (bin, args string) {
	t.Helper()
	dir := t.TempDir()
	bin, args = filepath.Join(dir, "scontrol"), filepath.Join(dir, "args")
	script := "#!/bin/sh\nfor a in \"$@\"; do echo \"$a\"; done > " + args + "\n"
	testenv.WriteExecutable(t, bin, []byte(script))
	return bin, args
}

// actions are the audit store's actions, each with its events.
func actions(t *testing.T, path string) ([]remediate.Action, map[string][]store.Event) {
	t.Helper()
	as, events, err := readActions(t, path)
	if err != nil {
		t.Fatal(err)
	}
	return as, events
}

// readActions reads the audit store's actions, each with its events.
func readActions(t *testing.T, path string) ([]remediate.Action, map[string][]store.Event, error) {
	ctx := t.Context()
	st, err := store.OpenReadOnly(ctx, path)
	if err != nil {
		return nil, nil, err
	}
	defer st.Close()
	as, err := st.Actions(ctx, store.Filter{})
	if err != nil {
		return nil, nil, err
	}
	events := map[string][]store.Event{}
	for _, a := range as {
		if events[a.ID], err = st.Events(ctx, a.ID); err != nil {
			return nil, nil, err
		}
	}
	return as, events, nil
}

// slurmJobEvent returns the job that an action's slurm_job event names.
func slurmJobEvent(es []store.Event) string {
	for _, e := range es {
		if e.Kind == "slurm_job" {
			return string(e.Detail)
		}
	}
	return ""
}

func requireRoot(t *testing.T) {
	t.Helper()
	if os.Getuid() != 0 {
		t.Skip("the prolog and epilog run as root, as slurmd runs them: their tests make job cgroups and signal other users' processes")
	}
}

// TestEpilogSignalsOnlyTheJob: job A's trainer is killed and its two
// workers keep its context, in A's cgroup; job B's healthy trainer and
// worker run on the same GPU. A's epilog signals A's workers only (by the
// cgroup: nothing else proves they inherited the context, since the
// trainer led no group of its own), the memory comes back, B runs on
// untouched, and the store has the action, source epilog, naming job A.
func TestEpilogSignalsOnlyTheJob(t *testing.T) {
	t.Parallel()
	requireRoot(t)
	root := testenv.SimNode(t, 2)
	jobA, jobB := testenv.SlurmJobID(), testenv.SlurmJobID()
	dir := t.TempDir()
	// A job script leads its session; the trainer is one of its processes.
	script := testenv.StartScript(t, `
"$SIM" run --root "$ROOT" --gpu 0 --mib 1024 --children 2 > "$DIR/ready" &
until [ -s "$DIR/ready" ]; do sleep 0.05; done
cat "$DIR/ready"
read _ parent _ < "$DIR/ready"
{ kill -9 "$parent"; wait "$parent"; } 2>/dev/null
echo done $$; sleep 600
`, "SIM="+testenv.Bin(t, "gpu-orphan-sim"), "ROOT="+root, "DIR="+dir)
	a := script.Ready(t)
	intoJob(t, jobA, a.Children...)
	script.Line(t, "done")
	b := testenv.StartWorkload(t, root, 0, 512, 1)
	intoJob(t, jobB, append([]int{b.PID}, b.Children...)...)
	if used := usedMiB(t, root, 0); used != 1024+8+512+8 {
		t.Fatalf("GPU 0 uses %d MiB before the epilog, want both jobs' 1552", used)
	}

	db := filepath.Join(t.TempDir(), "remediator.db")
	testenv.Bin(t, "gpu-orphan") // built before the clock starts
	start := time.Now()
	code, out := runHook(t, []string{"SLURM_JOB_ID=" + jobA, "SLURM_JOB_UID=0", "SLURM_JOB_GPUS=0"},
		"--backend=sim", "--sim.root="+root, "epilog", "--store.path="+db, "--grace=1s", "--log.syslog-socket=")
	took := time.Since(start)
	if code != 0 || !strings.Contains(out, "gpu-orphan epilog: job "+jobA+": signalled 2 processes on GPU 0") || !strings.Contains(out, "GPU 0 clean") {
		t.Fatalf("epilog of job A: exit %d\n%s", code, out)
	}
	t.Logf("epilog %.2f s from start to exit: %s", took.Seconds(), strings.TrimSpace(out))
	for _, c := range a.Children {
		testenv.WaitGone(t, c)
	}
	for _, pid := range append([]int{b.PID}, b.Children...) {
		if !testenv.Alive(pid) {
			t.Errorf("job B's %d was signalled by job A's epilog", pid)
		}
	}
	if used := usedMiB(t, root, 0); used != 512+8 {
		t.Errorf("GPU 0 uses %d MiB after the epilog, want job B's 520", used)
	}

	as, events := actions(t, db)
	if len(as) != 1 {
		t.Fatalf("%d actions recorded, want 1: %+v", len(as), as)
	}
	act := as[0]
	if act.Source != "epilog" || act.Policy != jobend.Policy || act.State != remediate.StateSucceeded || act.FreedBytes != 1032*gpu.MiB {
		t.Errorf("action: source %s, policy %s, state %s, freed %d MiB", act.Source, act.Policy, act.State, act.FreedBytes/gpu.MiB)
	}
	var targets []int
	for _, tg := range act.Targets {
		targets = append(targets, tg.PID)
		if tg.Reason != jobend.ReasonJobCgroup {
			t.Errorf("target %d: reason %s, want %s", tg.PID, tg.Reason, jobend.ReasonJobCgroup)
		}
	}
	slices.Sort(targets)
	if want := slices.Sorted(slices.Values(a.Children)); !slices.Equal(targets, want) {
		t.Errorf("targets %v, want job A's workers %v", targets, want)
	}
	for _, pid := range append([]int{b.PID}, b.Children...) {
		if !slices.ContainsFunc(act.Excluded, func(e remediate.Exclusion) bool { return e.PID == pid && e.Why == jobend.WhyNotInJob }) {
			t.Errorf("job B's %d is not listed as left alone (not_in_job): %+v", pid, act.Excluded)
		}
	}
	if ev := slurmJobEvent(events[act.ID]); !strings.Contains(ev, `"job_id":"`+jobA+`"`) || !strings.Contains(ev, `"hook":"epilog"`) {
		t.Errorf("the record does not name job A: slurm_job event %q", ev)
	}
	if j := act.Job; j == nil || j.SlurmJob != jobA || j.UID == nil || *j.UID != 0 || j.User != "root" {
		t.Errorf("the action's job %+v, want job A (%s) of root (UID 0)", j, jobA)
	}
	// gpu-orphan report counts the cleanup for job A and its user, though
	// its targets were live processes and no dead owner was known.
	for by, key := range map[string]string{"slurm_job": jobA, "user": "root", "source": "epilog"} {
		code, stdout, stderr := runBin(t, "report", "--store.path="+db, "--by="+by, "-o", "csv")
		if lines := strings.Split(strings.TrimSpace(stdout), "\n"); code != 0 || len(lines) != 2 || !strings.HasPrefix(lines[1], key+",1,") {
			t.Errorf("report --by=%s: exit %d, %s\n%s\nwant one row, %s", by, code, stderr, stdout, key)
		}
	}

	// Job B's end: its processes, live owners, are targets now.
	code, out = runHook(t, []string{"SLURM_JOB_ID=" + jobB, "SLURM_JOB_UID=0"},
		"--backend=sim", "--sim.root="+root, "epilog", "--store.path="+db, "--grace=1s", "--log.syslog-socket=")
	if code != 0 || !strings.Contains(out, "signalled 2 processes on GPU 0") {
		t.Fatalf("epilog of job B: exit %d\n%s", code, out)
	}
	for _, pid := range append([]int{b.PID}, b.Children...) {
		// B's trainer is this test's child: a zombie until reaped.
		testenv.Eventually(t, 10*time.Second, "job B's "+strconv.Itoa(pid)+" to exit", func() bool { return !testenv.Alive(pid) })
	}
}

// TestEpilogOtherOrphanStays: on the job's GPU, an orphan that is no
// process of the job's (a fork orphan outside any job) is left alone, and
// the epilog fails, saying so in one line, and drains the node with
// --drain; the job's own orphan is cleaned.
func TestEpilogOtherOrphanStays(t *testing.T) {
	t.Parallel()
	requireRoot(t)
	root := testenv.SimNode(t, 2)
	job := testenv.SlurmJobID()
	mine := testenv.StartWorkload(t, root, 1, 1024, 1)
	intoJob(t, job, mine.Children...)
	mine.KillParent(t)
	other := testenv.StartWorkload(t, root, 1, 2048, 2)
	other.KillParent(t)

	scontrol, argsFile := fakeScontrol(t)
	db := filepath.Join(t.TempDir(), "remediator.db")
	code, out := runHook(t, []string{"SLURM_JOB_ID=" + job, "SLURM_JOB_UID=0", "SLURM_JOB_GPUS=1", "SLURMD_NODENAME=gpu-7"},
		"--backend=sim", "--sim.root="+root, "epilog", "--store.path="+db, "--grace=1s", "--verify-timeout=2s",
		"--drain", "--slurm.scontrol="+scontrol, "--log.syslog-socket=")
	wantLine := "gpu-orphan epilog: job " + job + ": GPU 1 holds 2 GiB with no owner (held by " +
		strconv.Itoa(other.Children[0]) + " (gpu-orphan-sim), " + strconv.Itoa(other.Children[1]) + " (gpu-orphan-sim); see `gpu-orphan ps`)"
	if code != 1 || !strings.Contains(out, wantLine) || strings.Count(strings.TrimSpace(out), "\n") != 0 {
		t.Errorf("epilog: exit %d, output\n%s\nwant exit 1 and one line beginning %q", code, out, wantLine)
	}
	testenv.WaitGone(t, mine.Children[0])
	for _, c := range other.Children {
		if !testenv.Alive(c) {
			t.Errorf("%d, no process of job %s, was signalled", c, job)
		}
	}
	args, err := os.ReadFile(argsFile)
	if want := "update\nnodename=gpu-7\nstate=drain\nreason=gpu-orphan: GPU 1 holds 2 GiB with no owner\n"; err != nil || string(args) != want {
		t.Errorf("scontrol was run with %q (%v), want %q", args, err, want)
	}
	as, events := actions(t, db)
	if len(as) != 1 || len(as[0].Targets) != 1 || as[0].Targets[0].PID != mine.Children[0] {
		t.Fatalf("actions %+v, want one, on job %s's worker", as, job)
	}
	var kinds []string
	for _, e := range events[as[0].ID] {
		kinds = append(kinds, e.Kind)
	}
	if !slices.Contains(kinds, "epilog_failed") || !slices.Contains(kinds, "drain") {
		t.Errorf("events %v: want the failure and the drain recorded", kinds)
	}
}

// TestEpilogRespawnedWorker: the job's workers respawn on SIGTERM, so the
// first plan's targets are gone while their replacements, in the job's
// cgroup too, hold the context. The cleanup re-plans only under the job-end
// rule: the replacements are signalled, and another orphan on the same GPU
// (no process of the job's, but ripe for the dead-owner rule: its workers
// are in the group their dead trainer led) is not. Under the remediator's
// rule, the cleanup's own re-plan would have signalled it.
func TestEpilogRespawnedWorker(t *testing.T) {
	t.Parallel()
	requireRoot(t)
	root := testenv.SimNode(t, 2)
	job := testenv.SlurmJobID()
	mine := testenv.StartWorkload(t, root, 1, 1024, 2, "--respawn-on-sigterm")
	intoJob(t, job, mine.Children...)
	mine.KillParent(t)
	other := testenv.StartWorkload(t, root, 1, 2048, 1)
	other.KillParent(t)

	code, out := runHook(t, []string{"SLURM_JOB_ID=" + job, "SLURM_JOB_GPUS=1"}, "--backend=sim", "--sim.root="+root, "epilog",
		"--store.path=", "--grace=1s", "--verify-timeout=2s", "--log.syslog-socket=")
	if code != 1 || !strings.Contains(out, "GPU 1 holds 2 GiB with no owner (held by "+strconv.Itoa(other.Children[0])+" (gpu-orphan-sim)") {
		t.Errorf("epilog: exit %d\n%s\nwant 1, the other orphan named", code, out)
	}
	if !testenv.Alive(other.Children[0]) {
		t.Errorf("%d, another job's orphan, was signalled", other.Children[0])
	}
	procs, err := os.ReadFile(filepath.Join(testenv.CgroupV1, jobCgroup(job), "cgroup.procs"))
	if err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 10*time.Second, "the job's workers and their replacements to exit", func() bool {
		for p := range strings.FieldsSeq(string(procs)) {
			if pid, _ := strconv.Atoi(p); testenv.Alive(pid) {
				return false
			}
		}
		procs, _ = os.ReadFile(filepath.Join(testenv.CgroupV1, jobCgroup(job), "cgroup.procs"))
		return strings.TrimSpace(string(procs)) == ""
	})
	if used := usedMiB(t, root, 1); used != 2048+8 {
		t.Errorf("GPU 1 uses %d MiB, want the other orphan's 2056", used)
	}
}

// TestEpilogRecordedDescent: the job's trainer runs in the job's cgroup,
// its workers (forked before it was put there) outside it, as workers that
// a container runtime or `systemd-run` took out of the job are. A running
// remediator records in its store that they inherited the trainer's
// context (they share its open file of the device while it lives: it
// started after the forks, so no fork event tells) and that the trainer is
// the job's. The trainer dies; the epilog, reading that lineage, signals
// the workers, while the remediator runs on. Without the lineage, nothing
// proves they are the job's: they are left alone, and the epilog fails.
func TestEpilogRecordedDescent(t *testing.T) {
	t.Parallel()
	requireRoot(t)
	root := testenv.SimNode(t, 2)
	job := testenv.SlurmJobID()
	w := testenv.StartWorkload(t, root, 0, 1024, 2)
	intoJob(t, job, w.PID)

	db := filepath.Join(t.TempDir(), "remediator.db")
	testenv.Daemon(t, testenv.Bin(t, "gpu-orphan-remediator"), "--backend=sim", "--sim.root="+root, "--store.path="+db,
		"--web.listen-address="+testenv.FreeAddr(t), "--auth.insecure-none", "--collector.interval=100ms", "--log.level=debug")
	// The proof must be in the store before the trainer dies: once it is
	// dead, no snapshot can see the workers share its open file. A record
	// of descent alone is no proof (a descendant may have opened the
	// device itself), so that is not what is waited for.
	testenv.Eventually(t, 30*time.Second, "the remediator to record in its store that the workers inherited job "+job+"'s trainer's context", func() bool {
		return recordedInheritors(t, db, job, w.PID, w.Children...)
	})
	w.KillParent(t)

	empty := filepath.Join(t.TempDir(), "empty.db")
	env := []string{"SLURM_JOB_ID=" + job, "SLURM_JOB_UID=0", "SLURM_JOB_GPUS=0"}
	code, out := runHook(t, env, "--backend=sim", "--sim.root="+root, "epilog", "--store.path="+empty, "--grace=1s", "--log.syslog-socket=")
	if code != 1 || !strings.Contains(out, "GPU 0 holds 1 GiB with no owner") {
		t.Errorf("epilog without the lineage: exit %d, want 1\n%s", code, out)
	}
	for _, c := range w.Children {
		if !testenv.Alive(c) {
			t.Fatalf("worker %d, outside the job's cgroup, was signalled with no recorded descent", c)
		}
	}

	code, out = runHook(t, env, "--backend=sim", "--sim.root="+root, "epilog", "--store.path="+db, "--grace=1s", "--log.syslog-socket=")
	if code != 0 || !strings.Contains(out, "signalled 2 processes on GPU 0") {
		t.Fatalf("epilog with the remediator's lineage: exit %d\n%s", code, out)
	}
	for _, c := range w.Children {
		testenv.WaitGone(t, c)
	}
	as, _ := actions(t, db)
	i := slices.IndexFunc(as, func(a remediate.Action) bool { return a.Source == "epilog" })
	if i < 0 {
		t.Fatalf("no epilog action in the remediator's store: %+v", as)
	}
	for _, tg := range as[i].Targets {
		if tg.Reason != jobend.ReasonJobDescent {
			t.Errorf("target %d: reason %s, want %s", tg.PID, tg.Reason, jobend.ReasonJobDescent)
		}
	}
	if len(as[i].DeadOwners) != 1 || as[i].DeadOwners[0].SlurmJob != job || int(as[i].DeadOwners[0].PID) != w.PID {
		t.Errorf("dead owners %+v, want the trainer %d of job %s, named by the lineage", as[i].DeadOwners, w.PID, job)
	}
}

// recordedInheritors reports whether the remediator's store at path holds
// a lineage of this boot in which owner, remembered as a process of job,
// has each of pids as a proven inheritor of its context: what the epilog
// needs to read there to signal them once owner is dead.
func recordedInheritors(t *testing.T, path, job string, owner int, pids ...int) bool {
	t.Helper()
	st, err := store.OpenReadOnly(t.Context(), path)
	if err != nil {
		return false
	}
	defer st.Close()
	data, ok, err := st.GetState(t.Context(), hooks.LineageState)
	if err != nil || !ok {
		return false
	}
	var saved struct {
		Owners []struct {
			Identity snapshot.Identity `json:"identity"`
		} `json:"owners"`
		Inherited []struct {
			OwnerPID   int         `json:"owner_pid"`
			OwnerStart uint64      `json:"owner_start"`
			Procs      [][2]uint64 `json:"procs"`
		} `json:"inherited"`
	}
	if json.Unmarshal(data, &saved) != nil {
		return false
	}
	// The trainer as the remediator remembers it, by PID and start time.
	var start uint64
	for _, o := range saved.Owners {
		if o.Identity.PID == owner && o.Identity.SlurmJob == job {
			start = o.Identity.StartTime
		}
	}
	if start == 0 {
		return false
	}
	for _, pid := range pids {
		found := false
		for _, d := range saved.Inherited {
			for _, p := range d.Procs {
				found = found || (d.OwnerPID == owner && d.OwnerStart == start && int(p[0]) == pid)
			}
		}
		if !found {
			return false
		}
	}
	return true
}

// TestPrologCleansDeadOwner: a fork orphan from before holds the job's GPU;
// the prolog cleans it under the normal rules (its workers are in the dead
// trainer's process group), and the job may start. A GPU that is not the
// job's is not looked at.
func TestPrologCleansDeadOwner(t *testing.T) {
	t.Parallel()
	requireRoot(t)
	root := testenv.SimNode(t, 2)
	stale := testenv.StartWorkload(t, root, 1, 1024, 2)
	untouched := testenv.StartWorkload(t, root, 0, 512, 1)
	// The node agent (a dry run) saw the jobs alive; the prolog reads in its
	// store who inherited the dead owners' contexts.
	db := filepath.Join(t.TempDir(), "remediator.db")
	testenv.NodeAgent(t, root, db)
	stale.KillParent(t)
	untouched.KillParent(t)
	waitInherited(t, db, stale.Children...)
	job := testenv.SlurmJobID()
	code, out := runHook(t, []string{"SLURM_JOB_ID=" + job, "SLURM_JOB_UID=0", "CUDA_VISIBLE_DEVICES=1"},
		"--backend=sim", "--sim.root="+root, "prolog", "--store.path="+db, "--grace=1s", "--log.syslog-socket=")
	if code != 0 || !strings.Contains(out, "gpu-orphan prolog: job "+job+": signalled 2 processes on GPU 1") || !strings.Contains(out, "GPU 1 clean") {
		t.Fatalf("prolog: exit %d\n%s", code, out)
	}
	for _, c := range stale.Children {
		testenv.WaitGone(t, c)
	}
	if !testenv.Alive(untouched.Children[0]) {
		t.Errorf("the orphan on GPU 0, not the job's GPU, was signalled")
	}
	as, events := actions(t, db)
	if len(as) != 1 || as[0].Source != "prolog" || as[0].Policy != remediate.PolicyDeadOwner || as[0].State != remediate.StateSucceeded {
		t.Fatalf("actions %+v, want one by the prolog, dead-owner, succeeded", as)
	}
	if ev := slurmJobEvent(events[as[0].ID]); !strings.Contains(ev, `"job_id":"`+job+`"`) || !strings.Contains(ev, `"hook":"prolog"`) {
		t.Errorf("slurm_job event %q", ev)
	}
	if j := as[0].Job; j == nil || j.SlurmJob != job || j.UID == nil || *j.UID != 0 || j.User != "root" {
		t.Errorf("the action's job %+v, want %s of root (UID 0)", j, job)
	}
}

// TestPrologLeak: memory that no process holds cannot be cleaned: the
// prolog fails with the reason, drains with it, records the failure, and
// says it on syslog too.
func TestPrologLeak(t *testing.T) {
	t.Parallel()
	requireRoot(t)
	root := testenv.SimNode(t, 2)
	if err := sim.WriteFaults(root, sim.Faults{GPU: sim.AllGPUs, Leaks: []sim.Leak{{GPU: 1, Bytes: 40 << 30}}}); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(t.TempDir(), "log")
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: sock, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	scontrol, argsFile := fakeScontrol(t)
	db := filepath.Join(t.TempDir(), "remediator.db")
	job := testenv.SlurmJobID()
	code, out := runHook(t, []string{"SLURM_JOB_ID=" + job, "SLURM_JOB_GPUS=0,1", "SLURMD_NODENAME=gpu-7"},
		"--backend=sim", "--sim.root="+root, "prolog", "--store.path="+db, "--drain", "--slurm.scontrol="+scontrol, "--log.syslog-socket="+sock)
	want := "gpu-orphan prolog: job " + job + ": GPU 1 holds 40 GiB with no owner (no process holds it: a driver-level leak, which a GPU reset gives back (docs/runbook.md)); drained node gpu-7"
	if code != 1 || !strings.HasPrefix(out, want) {
		t.Errorf("prolog: exit %d\n%s\nwant exit 1 and %q", code, out, want)
	}
	if args, _ := os.ReadFile(argsFile); !strings.Contains(string(args), "reason=gpu-orphan: GPU 1 holds 40 GiB with no owner\n") {
		t.Errorf("scontrol args %q", args)
	}
	if err := conn.SetReadDeadline(time.Now().Add(5 * time.Second)); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4096)
	n, err := conn.Read(buf)
	if err != nil || !strings.Contains(string(buf[:n]), "gpu-orphan-prolog") || !strings.Contains(string(buf[:n]), "job "+job+": GPU 1 holds 40 GiB with no owner") ||
		!strings.HasPrefix(string(buf[:n]), "<27>") {
		t.Errorf("syslog got %q (%v), want the line at daemon.err (<27>)", buf[:n], err)
	}
	as, _ := actions(t, db)
	if len(as) != 1 || as[0].Source != "prolog" || as[0].State != remediate.StateFailed || as[0].GPUIndex != 1 ||
		as[0].Before == nil || as[0].Before.UnownedBytes != 40<<30 || len(as[0].Targets) != 0 {
		t.Errorf("actions %+v, want the prolog's failure on GPU 1 with its evidence and no targets", as)
	}
	// The failure record names the job too; slurmd gave no SLURM_JOB_UID.
	if len(as) == 1 && (as[0].Job == nil || *as[0].Job != (remediate.JobRef{SlurmJob: job})) {
		t.Errorf("the failure's job %+v, want %s with no user", as[0].Job, job)
	}
}

// TestPrologNothingToCheck: a job given no GPU is not checked: the prolog
// does not even open the driver (a bad --sim.root does not matter).
func TestPrologNothingToCheck(t *testing.T) {
	t.Parallel()
	code, out := runHook(t, []string{"SLURM_JOB_ID=12"}, "--backend=sim", "--sim.root=/nonexistent", "prolog", "--store.path=", "--log.syslog-socket=")
	if code != 0 || out != "gpu-orphan prolog: job 12: no GPUs to check (the job has none)\n" {
		t.Errorf("prolog of a job without GPUs: exit %d, %q", code, out)
	}
	code, out = runHook(t, []string{"SLURM_JOB_ID=12", "CUDA_VISIBLE_DEVICES=NoDevFiles"}, "--backend=sim", "--sim.root=/nonexistent", "prolog", "--store.path=", "--log.syslog-socket=")
	if code != 0 {
		t.Errorf("prolog with CUDA_VISIBLE_DEVICES=NoDevFiles: exit %d, %q", code, out)
	}
}

// TestHookBadInput: what Slurm should have given and did not, or GPUs
// this node does not have: exit 2, one line naming it.
func TestHookBadInput(t *testing.T) {
	t.Parallel()
	root := testenv.SimNode(t, 2)
	for _, tc := range []struct {
		hook string
		env  []string
		want string
	}{
		{"epilog", nil, "gpu-orphan epilog: no job: SLURM_JOB_ID is not set"},
		{"prolog", []string{"SLURM_JOB_ID=abc"}, `gpu-orphan prolog: job "abc": want a Slurm job ID, a number`},
		{"epilog", []string{"SLURM_JOB_ID=5", "SLURM_JOB_UID=bob"}, `gpu-orphan epilog: job 5: user "bob": want a UID`},
		{"prolog", []string{"SLURM_JOB_ID=5", "SLURM_JOB_GPUS=0,x"}, `gpu-orphan prolog: SLURM_JOB_GPUS="0,x": "x" is neither a GPU index nor a UUID`},
		{"prolog", []string{"SLURM_JOB_ID=5", "SLURM_JOB_GPUS=7"}, "gpu-orphan prolog: job 5: the job's GPU 7 is not on this node (it has GPUs 0-1)"},
		{"epilog", []string{"SLURM_JOB_ID=5", "GPU_DEVICE_ORDINAL=GPU-nope"}, "gpu-orphan epilog: job 5: the job's GPU GPU-nope is not on this node (it has GPUs 0-1)"},
	} {
		code, out := runHook(t, tc.env, "--backend=sim", "--sim.root="+root, tc.hook, "--store.path=", "--log.syslog-socket=")
		if code != 2 || !strings.HasPrefix(out, tc.want) || strings.Count(out, "\n") != 1 {
			t.Errorf("%s with %v: exit %d, %q; want 2 and one line %q", tc.hook, tc.env, code, out, tc.want)
		}
	}
}

// TestHookDriverFails: a driver that cannot be read is no bad input: the
// GPUs cannot be checked, exit 1, and the node is drained.
func TestHookDriverFails(t *testing.T) {
	t.Parallel()
	root := testenv.SimNode(t, 2)
	if err := sim.WriteFaults(root, sim.Faults{Error: "GPU is lost", GPU: sim.AllGPUs}); err != nil {
		t.Fatal(err)
	}
	scontrol, argsFile := fakeScontrol(t)
	for _, hook := range []string{"prolog", "epilog"} {
		code, out := runHook(t, []string{"SLURM_JOB_ID=5", "SLURM_JOB_GPUS=0", "SLURMD_NODENAME=gpu-7"}, "--backend=sim", "--sim.root="+root, hook,
			"--store.path=", "--log.syslog-socket=", "--drain", "--slurm.scontrol="+scontrol)
		if want := "gpu-orphan " + hook + ": job 5: the GPUs cannot be read (reading GPUs through sim: GPU is lost); drained node gpu-7"; code != 1 || !strings.HasPrefix(out, want) {
			t.Errorf("%s: exit %d, %q; want 1 and %q", hook, code, out, want)
		}
		if args, _ := os.ReadFile(argsFile); !strings.Contains(string(args), "reason=gpu-orphan: the GPUs cannot be read\n") {
			t.Errorf("%s drained with %q", hook, args)
		}
	}
}

// TestEpilogRefusesWithoutRecord: an audit store that cannot be opened
// (here its directory, which others may write to) means nothing is
// signalled, and the epilog fails saying why and what to run.
func TestEpilogRefusesWithoutRecord(t *testing.T) {
	t.Parallel()
	requireRoot(t)
	root := testenv.SimNode(t, 2)
	job := testenv.SlurmJobID()
	w := testenv.StartWorkload(t, root, 0, 256, 1)
	intoJob(t, job, w.Children...)
	w.KillParent(t)
	dir := filepath.Join(t.TempDir(), "gpu-orphan")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o777); err != nil {
		t.Fatal(err)
	}
	code, out := runHook(t, []string{"SLURM_JOB_ID=" + job, "SLURM_JOB_GPUS=0"}, "--backend=sim", "--sim.root="+root, "epilog",
		"--store.path="+filepath.Join(dir, "remediator.db"), "--log.syslog-socket=")
	if want := "processes hold GPU 0, and nothing was signalled (refusing to signal without an audit record: the store directory " + dir +
		" has mode 0777, so users other than its owner could replace the audit database: run `chmod 0700 " + dir + "`)"; code != 1 || !strings.Contains(out, want) {
		t.Errorf("epilog without its store: exit %d\n%s\nwant exit 1 and %q", code, out, want)
	}
	if !testenv.Alive(w.Children[0]) {
		t.Errorf("worker %d signalled without a record", w.Children[0])
	}
}
