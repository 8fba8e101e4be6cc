package jobend

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/gpu"
	"github.com/gpu-orphan/gpu-orphan/internal/proc"
	"github.com/gpu-orphan/gpu-orphan/internal/snapshot"
	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/decide"
	"github.com/gpu-orphan/gpu-orphan/remediate/exclude"
)

const (
	uuid0 = "GPU-00000000-0000-0000-0000-000000000000"
	uuid1 = "GPU-11111111-1111-1111-1111-111111111111"
	// The ended job, and another that runs on.
	job    = "81234"
	other  = "81235"
	jobUID = 1000
)

var (
	now = time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)
	cfg = decide.Config{MinBytes: 256 << 20, Self: exclude.Self{PID: 9000, PGID: 9000, SID: 9000}}.Resolved()
)

// process is a live process; cgroup is a v1 freezer path, "" for none.
func process(pid int, comm string, uid int, cgroup string) proc.Process {
	p := proc.Process{PID: pid, PPID: 1, PGID: pid, SID: pid, State: "S", StartTime: uint64(pid) * 10,
		UID: uid, User: fmt.Sprint(uid), Comm: comm, Cmdline: comm, Cgroup: cgroup}
	if j, s, ok := strings.Cut(strings.TrimPrefix(cgroup, "/slurm/uid_1000/job_"), "/step_"); ok {
		p.SlurmJob, p.SlurmStep = j, s
	}
	return p
}

func jobCgroup(j string) string { return "/slurm/uid_1000/job_" + j + "/step_batch" }

// node is GPU 0 after job 81234 ended: its trainer 100 died, its two
// workers (101, 102, in the job's cgroup) keep the trainer's context; job
// 81235 runs a healthy trainer 200 with a worker 201; a worker 301 whose
// trainer 300 of job 81234 died escaped the job's cgroup, and the recorded
// lineage proves it holds 300's context; 400 maps the GPU and nothing
// proves whose it is. GPU 1 has only job 81235's 210.
func node() *snapshot.Snapshot {
	workers := []proc.Process{process(101, "pt_data_worker", jobUID, jobCgroup(job)), process(102, "pt_data_worker", jobUID, jobCgroup(job))}
	healthy := process(200, "python3", 2000, jobCgroup(other))
	helper := process(201, "pt_data_worker", 2000, jobCgroup(other))
	escaped := process(301, "pt_data_worker", jobUID, "/user.slice")
	stranger := process(400, "python3", 3000, "/user.slice")
	g0 := snapshot.GPU{
		Device: gpu.Device{Index: 0, UUID: uuid0, Minor: 0},
		Memory: gpu.Memory{Used: 10 << 30},
		Owners: []snapshot.Owner{
			{PID: 100, UsedBytes: 4 << 30, Identity: &snapshot.Identity{PID: 100, SlurmJob: job, Cgroup: jobCgroup(job), UID: jobUID}},
			{PID: 200, UsedBytes: 2 << 30, Alive: true, Process: &healthy},
			{PID: 300, UsedBytes: 2 << 30, Identity: &snapshot.Identity{PID: 300, SlurmJob: job, Cgroup: jobCgroup(job), UID: jobUID}},
			{PID: 500, UsedBytes: 1 << 30},
		},
		UnownedBytes: 7 << 30, UnexplainedBytes: 7 << 30,
		Scanned:    true,
		HolderPIDs: []int{101, 102, 200, 201, 301, 400},
		Holders: []snapshot.Holding{
			{Process: workers[0], Mapped: true}, {Process: workers[1], Mapped: true},
			{Process: healthy, Mapped: true, LiveJobGPUs: []string{uuid0}},
			{Process: helper, Mapped: true, LiveJobGPUs: []string{uuid0}},
			{Process: escaped, Mapped: true},
			{Process: stranger, Mapped: true},
		},
		Suspects: []snapshot.Holder{
			{Process: workers[0], Reason: snapshot.ReasonInheritedFromDeadOwner, DeadOwner: 100, Proof: snapshot.ProofDescentAtFork},
			{Process: workers[1], Reason: snapshot.ReasonInheritedFromDeadOwner, DeadOwner: 100, Proof: snapshot.ProofDescentAtFork},
			{Process: escaped, Reason: snapshot.ReasonInheritedFromDeadOwner, DeadOwner: 300, Proof: snapshot.ProofDescentAtFork},
			{Process: stranger, Reason: snapshot.ReasonUnexplained, Proof: snapshot.NoProof},
		},
	}
	elsewhere := process(210, "python3", 2000, jobCgroup(other))
	g1 := snapshot.GPU{
		Device:  gpu.Device{Index: 1, UUID: uuid1, Minor: 1},
		Owners:  []snapshot.Owner{{PID: 210, UsedBytes: 1 << 30, Alive: true, Process: &elsewhere}},
		Scanned: true, HolderPIDs: []int{210},
		Holders: []snapshot.Holding{{Process: elsewhere, Mapped: true, LiveJobGPUs: []string{uuid1}}},
	}
	return &snapshot.Snapshot{Taken: now, Driver: "sim", GPUs: []snapshot.GPU{g0, g1}, HostPIDsVisible: true}
}

func pids[T any](xs []T, pid func(T) int) []int {
	var out []int
	for _, x := range xs {
		out = append(out, pid(x))
	}
	return out
}

func targetPIDs(p decide.Plan) []int {
	return pids(p.Targets, func(t remediate.Target) int { return t.PID })
}

func why(p decide.Plan, pid int) remediate.ExclusionReason {
	for _, e := range p.Excluded {
		if e.PID == pid {
			return e.Why
		}
	}
	return ""
}

// TestPlan: the job's processes, by its cgroup and by recorded descent,
// are targets; the healthy job beside them, the unexplained holder and
// everyone else are left alone and named.
func TestPlan(t *testing.T) {
	p := Plan(node(), "0", Job{ID: job, UID: jobUID}, cfg, now)
	if !p.Act || p.Policy != Policy || p.GPUUUID != uuid0 || p.GPUIndex != 0 {
		t.Fatalf("plan: act %v, policy %s, GPU %s %d (%s)", p.Act, p.Policy, p.GPUUUID, p.GPUIndex, p.SkipText())
	}
	if got := targetPIDs(p); !slices.Equal(got, []int{101, 102, 301}) {
		t.Errorf("targets %v, want the job's workers 101 and 102 and the escaped 301", got)
	}
	for _, tg := range p.Targets {
		want := ReasonJobCgroup
		if tg.PID == 301 {
			want = ReasonJobDescent
		}
		if tg.Reason != want || tg.WholeGroup {
			t.Errorf("target %d: reason %s, whole group %v; want %s, alone", tg.PID, tg.Reason, tg.WholeGroup, want)
		}
	}
	for _, pid := range []int{200, 201, 400} {
		if w := why(p, pid); w != WhyNotInJob {
			t.Errorf("%d left alone as %q, want %s", pid, w, WhyNotInJob)
		}
	}
	if got := pids(p.DeadOwners, func(d remediate.DeadOwner) int { return int(d.PID) }); !slices.Equal(got, []int{100, 300}) {
		t.Errorf("dead owners %v, want the job's 100 and 300 (not 500, whose context nothing of the job holds)", got)
	}
	if len(p.Notes) != 2 || !strings.Contains(p.Notes[0], "3 of its processes hold the GPU (2 by its cgroup, 1 by recorded descent)") ||
		!strings.Contains(p.Notes[1], "PID 301: holds the context of dead PID 300 of job 81234 (descent_at_fork") {
		t.Errorf("notes %q", p.Notes)
	}
	if p.Before.UsedBytes != 10<<30 || !p.Before.At.Equal(now) {
		t.Errorf("evidence %+v", p.Before)
	}
	// Nothing of job 81234 holds GPU 1: its healthy holder is another
	// job's.
	p1 := Plan(node(), uuid1, Job{ID: job, UID: jobUID}, cfg, now)
	if p1.Act || p1.SkipReason != decide.SkipNoTargets || why(p1, 210) != WhyNotInJob ||
		p1.SkipDetail != "no process of job 81234 holds the GPU" {
		t.Errorf("GPU 1: act %v, %s, excluded %v", p1.Act, p1.SkipText(), p1.Excluded)
	}
}

// TestPlanOtherJob: the end of the job running beside is the end of its
// own processes only, live owners included.
func TestPlanOtherJob(t *testing.T) {
	p := Plan(node(), uuid0, Job{ID: other, UID: 2000}, cfg, now)
	if got := targetPIDs(p); !p.Act || !slices.Equal(got, []int{200, 201}) {
		t.Fatalf("targets %v (%s), want job 81235's live owner and its helper", got, p.SkipText())
	}
	for _, pid := range []int{101, 102, 301, 400} {
		if w := why(p, pid); w != WhyNotInJob {
			t.Errorf("%d left alone as %q, want %s", pid, w, WhyNotInJob)
		}
	}
	if len(p.DeadOwners) != 0 {
		t.Errorf("dead owners %v: none is job 81235's", p.DeadOwners)
	}
}

// TestMemberProof: recorded descent counts only from a dead owner that
// the lineage names a process of the job, to a holder of the job's user.
func TestMemberProof(t *testing.T) {
	for _, tc := range []struct {
		name   string
		change func(g *snapshot.GPU)
		job    Job
		reason remediate.TargetReason
		why    remediate.ExclusionReason
	}{
		{name: "recorded", job: Job{ID: job, UID: jobUID}, reason: ReasonJobDescent},
		{name: "job user unknown", job: Job{ID: job, UID: -1}, reason: ReasonJobDescent},
		{name: "another user", job: Job{ID: job, UID: 4242}, why: WhyNotJobUser},
		{name: "another job", job: Job{ID: "81299", UID: jobUID}, why: WhyNotInJob},
		{name: "no job", job: Job{UID: jobUID}, why: WhyNotInJob},
		{name: "owner never seen", job: Job{ID: job, UID: jobUID}, why: WhyNotInJob,
			change: func(g *snapshot.GPU) { g.Owners[2].Identity = nil }},
		{name: "owner seen outside the job", job: Job{ID: job, UID: jobUID}, why: WhyNotInJob,
			change: func(g *snapshot.GPU) { g.Owners[2].Identity = &snapshot.Identity{PID: 300, UID: jobUID} }},
		{name: "owner alive", job: Job{ID: job, UID: jobUID}, why: WhyNotInJob,
			change: func(g *snapshot.GPU) { g.Owners[2].Alive = true }},
		{name: "unexplained, not inherited", job: Job{ID: job, UID: jobUID}, why: WhyNotInJob,
			change: func(g *snapshot.GPU) { g.Suspects[2].Reason = snapshot.ReasonUnexplained }},
		{name: "PID reused since the snapshot proved it", job: Job{ID: job, UID: jobUID}, why: WhyNotInJob,
			change: func(g *snapshot.GPU) { g.Suspects[2].StartTime++ }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := node().GPUs[0]
			if tc.change != nil {
				tc.change(&g)
			}
			reason, proof, why := Member(g, g.Holders[4].Process, tc.job)
			if reason != tc.reason || why != tc.why {
				t.Errorf("Member(301): %q %q (%s), want %q %q", reason, why, proof, tc.reason, tc.why)
			}
		})
	}
	// By the cgroup, the user does not matter: a setuid helper of the job
	// is the job's.
	g := node().GPUs[0]
	if reason, proof, _ := Member(g, g.Holders[0].Process, Job{ID: job, UID: 4242}); reason != ReasonJobCgroup || proof != "cgroup "+jobCgroup(job) {
		t.Errorf("Member(101) of another user's job: %q %q", reason, proof)
	}
}

// TestPlanNeverTouch: a process of the job that a never-touch rule
// protects is left alone, with the rule, and said so when nothing else of
// the job is there.
func TestPlanNeverTouch(t *testing.T) {
	s := node()
	g := &s.GPUs[0]
	mps := process(103, "nvidia-cuda-mps", jobUID, jobCgroup(job))
	self := process(104, "gpu-orphan-sim", jobUID, jobCgroup(job))
	self.SID = cfg.Self.SID
	zombie := process(105, "python3", jobUID, jobCgroup(job))
	zombie.State = "Z"
	g.Holders = []snapshot.Holding{{Process: mps, Mapped: true}, {Process: self, Mapped: true}, {Process: zombie}}
	g.Suspects = nil
	p := Plan(s, uuid0, Job{ID: job, UID: jobUID}, cfg, now)
	if p.Act || p.SkipReason != decide.SkipNoTargets {
		t.Fatalf("act %v, %s; want no targets", p.Act, p.SkipText())
	}
	for pid, want := range map[int]remediate.ExclusionReason{103: exclude.WhyProtected, 104: exclude.WhyOwnSession, 105: exclude.WhyZombie} {
		if w := why(p, pid); w != want {
			t.Errorf("%d left alone as %q, want %s", pid, w, want)
		}
	}
	if !strings.Contains(p.SkipDetail, "never touched: 103 (nvidia-cuda-mps, protected), 104 (gpu-orphan-sim, own_session), 105 (python3, zombie)") {
		t.Errorf("detail %q", p.SkipDetail)
	}
}

// TestPlanSkips: it acts on a snapshot it can trust only.
func TestPlanSkips(t *testing.T) {
	for _, tc := range []struct {
		name   string
		gpu    string
		change func(s *snapshot.Snapshot)
		want   decide.SkipReason
	}{
		{name: "nil", want: decide.SkipSnapshotUnhealthy, change: nil},
		{name: "descriptors unread", gpu: "0", want: decide.SkipScanIncomplete, change: func(s *snapshot.Snapshot) { s.FDScanDenied = 3 }},
		{name: "failed source", gpu: "0", want: decide.SkipSnapshotUnhealthy,
			change: func(s *snapshot.Snapshot) { s.Sources = []snapshot.Source{{Name: "nvml", Err: errors.New("boom")}} }},
		{name: "no such GPU", gpu: "7", want: decide.SkipGPUNotFound},
		{name: "read failed", gpu: "0", want: decide.SkipGPUReadFailed, change: func(s *snapshot.Snapshot) { s.GPUs[0].Err = errors.New("Unknown Error") }},
		{name: "MIG", gpu: "0", want: decide.SkipAccountingUnsupported, change: func(s *snapshot.Snapshot) { s.GPUs[0].Unsupported = "mig" }},
		{name: "not scanned", gpu: "0", want: decide.SkipNotScanned, change: func(s *snapshot.Snapshot) { s.GPUs[0].Scanned = false }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var s *snapshot.Snapshot
			if tc.name != "nil" {
				s = node()
				if tc.change != nil {
					tc.change(s)
				}
			}
			p := Plan(s, tc.gpu, Job{ID: job, UID: jobUID}, cfg, now)
			if p.Act || p.SkipReason != tc.want || len(p.Targets) != 0 {
				t.Errorf("act %v, %s, targets %v; want %s", p.Act, p.SkipText(), p.Targets, tc.want)
			}
		})
	}
}

func TestGPUs(t *testing.T) {
	if got := GPUs(node(), Job{ID: job, UID: jobUID}); !slices.Equal(got, []string{uuid0}) {
		t.Errorf("job %s holds %v, want GPU 0 only", job, got)
	}
	if got := GPUs(node(), Job{ID: other, UID: 2000}); !slices.Equal(got, []string{uuid0, uuid1}) {
		t.Errorf("job %s holds %v, want both GPUs", other, got)
	}
	if got := GPUs(node(), Job{ID: "1", UID: 0}); got != nil {
		t.Errorf("job 1 holds %v, want none", got)
	}
	if got := GPUs(nil, Job{ID: job}); got != nil {
		t.Errorf("nil snapshot: %v", got)
	}
}
