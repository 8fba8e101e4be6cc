// Package jobend decides, when a Slurm job has ended, which of its
// processes still hold a GPU: the epilog's rule (`gpu-orphan epilog`). It
// is pure, as package decide is: a snapshot, the job and a configuration go
// in, a decide.Plan comes out, which cleanup.Node.Act carries out.
//
// A process belongs to the job only on positive proof from what the kernel
// records:
//   - its cgroup: any line of /proc/PID/cgroup names the job
//     (.../job_<id>/..., cgroup v1 or v2, as proc.Process.SlurmJob reads
//     it), which a process cannot leave for another job's;
//   - or recorded descent: the snapshot proves that it holds the context
//     of a dead owner (snapshot.ReasonInheritedFromDeadOwner), and the
//     lineage that a remediator recorded while that owner lived names the
//     owner a process of the job (its cgroup named the job then), and it
//     runs as the job's user.
//
// Nothing else: not the job's user alone, not the environment (which any
// process may set), not the policy. Once the job is over, what belongs to
// it is a target whatever it holds, a live owner included; what does not
// belong to it is never a target, and is listed as left alone. The
// never-touch rules of package exclude still apply.
package jobend

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/proc"
	"github.com/gpu-orphan/gpu-orphan/internal/snapshot"
	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/decide"
)

// Policy is the policy that a job-end plan records: not one of
// remediate.Policies, which a remediator may be configured with, but the
// job-end rule above.
const Policy remediate.Policy = "job-end"

// Why a process is a target of a job-end plan.
const (
	// ReasonJobCgroup: the process is in the ended job's cgroup.
	ReasonJobCgroup remediate.TargetReason = "slurm_job_cgroup"
	// ReasonJobDescent: the process holds the context of a dead owner that
	// the recorded lineage names a process of the job.
	ReasonJobDescent remediate.TargetReason = "slurm_job_descent"
)

// Why a holder of the GPU is left alone by a job-end plan.
const (
	// WhyNotInJob: nothing proves that the process belongs to the job.
	WhyNotInJob remediate.ExclusionReason = "not_in_job"
	// WhyNotJobUser: it holds the context of a dead process of the job,
	// but it runs as another user than the job's: it was handed the
	// context rather than born with it, and is not the job's to end.
	WhyNotJobUser remediate.ExclusionReason = "not_job_user"
)

// Job is the job that ended.
type Job struct {
	// ID is SLURM_JOB_ID.
	ID string
	// UID is SLURM_JOB_UID; negative when unknown.
	UID int
}

// Member says whether p, a holder of GPU g, belongs to the job, and why.
// proof names the evidence for the record: the cgroup path, or the dead
// owner and the snapshot's proof of inheritance.
func Member(g snapshot.GPU, p proc.Process, job Job) (reason remediate.TargetReason, proof string, why remediate.ExclusionReason) {
	if job.ID == "" {
		return "", "", WhyNotInJob
	}
	if p.SlurmJob == job.ID {
		return ReasonJobCgroup, "cgroup " + p.Cgroup, ""
	}
	for _, h := range g.Suspects {
		if h.PID != p.PID || h.StartTime != p.StartTime || h.Reason != snapshot.ReasonInheritedFromDeadOwner {
			continue
		}
		o, ok := g.Owner(h.DeadOwner)
		if !ok || o.Alive || o.Identity == nil || o.Identity.SlurmJob != job.ID {
			continue
		}
		if job.UID >= 0 && p.UID != job.UID {
			return "", "", WhyNotJobUser
		}
		return ReasonJobDescent, fmt.Sprintf("holds the context of dead PID %d of job %s (%s, recorded in cgroup %s)",
			o.PID, job.ID, h.Proof, o.Identity.Cgroup), ""
	}
	return "", "", WhyNotInJob
}

// GPUs returns the UUIDs of the GPUs that the job's processes hold, in the
// snapshot's order: a job's process is the job's on any GPU, whichever
// GPUs Slurm gave the job.
func GPUs(s *snapshot.Snapshot, job Job) []string {
	if s == nil {
		return nil
	}
	var out []string
	for _, g := range s.GPUs {
		for _, h := range g.Holders {
			if r, _, _ := Member(g, h.Process, job); r != "" {
				out = append(out, g.Device.UUID)
				break
			}
		}
	}
	return out
}

// Plan decides what the end of job leaves on GPU gpuID (its UUID or index):
// every process that belongs to the job and holds the GPU's device node is
// a target, unless a never-touch rule (cfg.Rules) protects it; every other
// holder is left alone, and named. It acts on a snapshot that it can trust
// only: healthy, with every process's descriptors read, and the GPU
// scanned. cfg's Policy and MinAge play no part; its MinBytes is for the
// verification that follows. now dates the evidence.
func Plan(s *snapshot.Snapshot, gpuID string, job Job, cfg decide.Config, now time.Time) decide.Plan {
	p := decide.Plan{Policy: Policy}
	skip := func(reason decide.SkipReason, detail string) decide.Plan {
		p.Act, p.SkipReason, p.SkipDetail = false, reason, detail
		return p
	}
	if s == nil {
		return skip(decide.SkipSnapshotUnhealthy, "")
	}
	g, found := s.GPUByID(gpuID)
	if found {
		p.GPUUUID, p.GPUIndex = g.Device.UUID, g.Device.Index
		p.Before = remediate.NewMemoryEvidence(g, s.Taken, now)
	}
	// A holder we could not see may be the job's, or anyone's.
	if s.FDScanDenied > 0 {
		return skip(decide.SkipScanIncomplete, fmt.Sprintf("the descriptors of %d processes could not be read; run it as root", s.FDScanDenied))
	}
	if !s.Healthy() {
		return skip(decide.SkipSnapshotUnhealthy, "")
	}
	if !found {
		return skip(decide.SkipGPUNotFound, "")
	}
	if g.Err != nil {
		return skip(decide.SkipGPUReadFailed, g.Err.Error())
	}
	if g.Unsupported != "" {
		return skip(decide.SkipAccountingUnsupported, g.Unsupported)
	}
	if !g.Scanned {
		return skip(decide.SkipNotScanned, "")
	}
	rules := cfg.Rules()
	var inJob, byDescent int
	targeted := map[int]bool{}
	for _, h := range g.Holders {
		reason, proof, why := Member(g, h.Process, job)
		if reason != "" {
			if r := rules.Why(h.Process); r != "" {
				why = r
			}
		}
		if why != "" {
			p.Excluded = append(p.Excluded, remediate.Exclusion{ProcessInfo: remediate.NewProcessInfo(h.Process), Why: why})
			continue
		}
		targeted[h.PID] = true
		inJob++
		if reason == ReasonJobDescent {
			byDescent++
			p.Notes = append(p.Notes, fmt.Sprintf("PID %d: %s", h.PID, proof))
		}
		p.Targets = append(p.Targets, remediate.Target{ProcessInfo: remediate.NewProcessInfo(h.Process), Reason: reason})
	}
	// The dead owners whose memory the plan is about: those of the job, as
	// the lineage names them, and those whose context a target holds.
	for _, d := range remediate.NewDeadOwners(g) {
		if d.SlurmJob == job.ID || slices.ContainsFunc(g.Suspects, func(h snapshot.Holder) bool {
			return targeted[h.PID] && h.DeadOwner == int(d.PID) && h.Reason == snapshot.ReasonInheritedFromDeadOwner
		}) {
			p.DeadOwners = append(p.DeadOwners, d)
		}
	}
	slices.SortFunc(p.Targets, func(a, b remediate.Target) int { return a.PID - b.PID })
	slices.SortFunc(p.Excluded, func(a, b remediate.Exclusion) int { return a.PID - b.PID })
	if len(p.Targets) == 0 {
		return skip(decide.SkipNoTargets, noTargetsDetail(job, p.Excluded))
	}
	p.Notes = append([]string{fmt.Sprintf("Slurm job %s has ended: %d of its processes hold the GPU (%d by its cgroup, %d by recorded descent)",
		job.ID, inJob, inJob-byDescent, byDescent)}, p.Notes...)
	p.Act = true
	return p
}

// noTargetsDetail says why nothing of the job is signalled.
func noTargetsDetail(job Job, excluded []remediate.Exclusion) string {
	var protected []string
	for _, e := range excluded {
		if e.Why != WhyNotInJob && e.Why != WhyNotJobUser {
			protected = append(protected, fmt.Sprintf("%d (%s, %s)", e.PID, e.Comm, e.Why))
		}
	}
	if len(protected) > 0 {
		return fmt.Sprintf("the processes of job %s that hold the GPU are never touched: %s", job.ID, strings.Join(protected, ", "))
	}
	return fmt.Sprintf("no process of job %s holds the GPU", job.ID)
}
