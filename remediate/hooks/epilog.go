package hooks

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/cli"
	"github.com/gpu-orphan/gpu-orphan/internal/proc"
	"github.com/gpu-orphan/gpu-orphan/internal/snapshot"
	"github.com/gpu-orphan/gpu-orphan/remediate/cleanup"
	"github.com/gpu-orphan/gpu-orphan/remediate/decide"
	"github.com/gpu-orphan/gpu-orphan/remediate/jobend"
	"github.com/gpu-orphan/gpu-orphan/remediate/kill"
)

// EpilogHelp is the epilog's --help.
const EpilogHelp = "Slurm's Epilog: when a job ends, signal its processes that still hold a GPU (those in the job's cgroup, and those that hold the context of a dead process of the job, " +
	"as the remediator's recorded lineage names it; whatever the policy, and nothing outside the job), verify that the memory came back, and record it in the remediator's store (source epilog). " +
	"It reads the job from SLURM_JOB_ID, SLURM_JOB_UID and SLURM_JOB_GPUS (or CUDA_VISIBLE_DEVICES, GPU_DEVICE_ORDINAL), and checks the job's GPUs and every GPU its processes held: " +
	"memory with no live owner above --min-bytes left there fails it. One line on stderr, and to syslog, says how it ended. " + ExitHelp

// maxEpilogRounds bounds the plans one epilog makes: holders of the job
// that appear while it signals (a worker's replacement) get another.
const maxEpilogRounds = 3

// RunEpilog is `gpu-orphan epilog`: it returns the exit status.
func RunEpilog(logger *slog.Logger, backend *cli.Backend, o *Options) int {
	h, err := newHook("epilog", o, logger)
	if err != nil {
		fmt.Fprintf(os.Stderr, "gpu-orphan epilog: %v\n", err)
		return ExitBadInput
	}
	start := time.Now()
	ctx, cancel := Context(o.Timeout)
	defer cancel()
	s, jobGPUs, closeAll, code, done := h.begin(ctx, backend)
	if done {
		return code
	}
	defer closeAll()
	// The job-end rule decides every plan, the node's own re-plans (for
	// holders a plan did not name) included: nothing outside the job is
	// ever a target.
	cfg := h.nodeConfig(nil)
	cfg.Planner = func(s *snapshot.Snapshot, gpuID string, now time.Time) decide.Plan {
		return jobend.Plan(s, gpuID, h.job, h.cfg, now)
	}
	// A tracer of the job's processes that is in the job's cgroup is the
	// job's to end too (its end lets its tracees die).
	cfg.TracerRule = func(_ *snapshot.Snapshot, p proc.Process, _ time.Time) string {
		if p.SlurmJob != h.job.ID {
			return ""
		}
		return "a process of job " + h.job.ID + " (cgroup " + p.Cgroup + ")"
	}
	node := cleanup.New(cfg)
	checked := slices.Clone(jobGPUs)
	var problems []problem
	for round := 1; round <= maxEpilogRounds && ctx.Err() == nil; round++ {
		held := jobend.GPUs(s, h.job)
		if len(held) == 0 {
			break
		}
		for _, uuid := range held {
			if !slices.Contains(checked, uuid) {
				checked = append(checked, uuid)
			}
			plan := jobend.Plan(s, uuid, h.job, h.cfg, time.Now())
			h.logger.Info("Job-end plan", "job", h.job.ID, "gpu", plan.GPUIndex, "act", plan.Act, "skip", plan.SkipText(), "targets", len(plan.Targets))
			if !plan.Act {
				if plan.SkipReason != decide.SkipNoTargets {
					problems = append(problems, problem{short: fmt.Sprintf("GPU %d cannot be cleaned", plan.GPUIndex), detail: plan.SkipText()})
				}
				continue
			}
			replan := func() decide.Plan { return jobend.Plan(h.loop.Refresh(ctx, true), uuid, h.job, h.cfg, time.Now()) }
			if _, err := h.act(ctx, node, plan, start, replan); err != nil {
				return h.finish("", []problem{{short: fmt.Sprintf("job %s's processes hold GPU %d, and nothing was signalled", h.job.ID, plan.GPUIndex), detail: err.Error()}})
			}
		}
		// A target held by its tracer would only be signalled again.
		if len(problems) > 0 || len(h.tracedTargets()) > 0 {
			break
		}
		s = h.loop.Refresh(ctx, true)
	}
	if len(problems) == 0 {
		// Memory comes back a little after its last holder exits: what the
		// job's end just freed may still be on its way.
		problems = h.check(ctx, checked, true, 2*time.Second)
	}
	if ctx.Err() != nil && len(problems) > 0 {
		problems = append(problems, problem{short: "timed out", detail: fmt.Sprintf("--timeout=%s: %v", o.Timeout, context.Cause(ctx))})
	}
	if len(problems) > 0 {
		return h.finish("", problems)
	}
	ok := "nothing of the job holds a GPU"
	if len(h.actions) > 0 {
		ok = h.actedLine()
	}
	if len(checked) > 0 {
		ok += "; " + gpuList(s, checked) + " clean"
	}
	ok += fmt.Sprintf(" (%.2f s)", time.Since(start).Seconds())
	return h.finish(ok, nil)
}

// nodeConfig is the cleanup both hooks run: this hook's snapshots, rules,
// kill ladder (groups re-lists whole process groups; nil for none) and
// record, acting.
func (h *hook) nodeConfig(groups kill.GroupLister) cleanup.Config {
	return cleanup.Config{
		Snapshots: h.loop, Proc: h.fs, Decide: h.cfg,
		Ladder: h.ladder(groups), Act: true, VerifyTimeout: h.o.VerifyTimeout,
		Recorder: h.recorder(), Logger: h.nodeLogger(),
	}
}

// recorder is the store as the node's recorder, or nil: a nil *Store in
// the interface would not be nil.
func (h *hook) recorder() cleanup.EventRecorder {
	if h.st == nil {
		return nil
	}
	return h.st
}
