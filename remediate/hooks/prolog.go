package hooks

import (
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/cli"
	"github.com/gpu-orphan/gpu-orphan/remediate/cleanup"
	"github.com/gpu-orphan/gpu-orphan/remediate/decide"
)

// PrologHelp is the prolog's --help.
const PrologHelp = "Slurm's Prolog: before a job starts, its GPUs must be clean: no memory with no live owner above --min-bytes. " +
	"When one is not, it cleans it up under the remediator's normal rules (policy dead-owner: the proven inheritors of dead owners, " +
	"their whole process groups where the group rule allows), verifies, and records it in the remediator's store (source prolog); " +
	"when memory is still held, it fails, so that Slurm requeues the job and drains the node. It reads the job's GPUs from SLURM_JOB_GPUS " +
	"(or CUDA_VISIBLE_DEVICES, GPU_DEVICE_ORDINAL); a job with none is not checked. One line on stderr, and to syslog, says how it ended. " + ExitHelp

// RunProlog is `gpu-orphan prolog`: it returns the exit status.
func RunProlog(logger *slog.Logger, backend *cli.Backend, o *Options) int {
	h, err := newHook("prolog", o, logger)
	if err != nil {
		fmt.Fprintf(os.Stderr, "gpu-orphan prolog: %v\n", err)
		return ExitBadInput
	}
	if len(h.gpus) == 0 && !h.all {
		return h.finish("no GPUs to check (the job has none)", nil)
	}
	start := time.Now()
	ctx, cancel := Context(o.Timeout)
	defer cancel()
	s, gpus, closeAll, code, done := h.begin(ctx, backend)
	if done {
		return code
	}
	defer closeAll()
	node := cleanup.New(h.nodeConfig(h.fs))
	var problems []problem
	for _, uuid := range gpus {
		g, ok := s.GPUByID(uuid)
		if !ok || !g.Accountable() || g.UnexplainedBytes <= o.MinBytes {
			continue // check, below, says what it cannot read
		}
		// A dirty GPU: the normal rules, not the job-end one. It belongs
		// to no job yet; whose the memory was, the dead owners say.
		plan := node.PlanFrom(s, uuid)
		h.logger.Info("Plan", "job", h.job.ID, "gpu", plan.GPUIndex, "act", plan.Act, "skip", plan.SkipText(), "targets", len(plan.Targets))
		if !plan.Act {
			// With no targets, unowned says who holds the memory, if anyone.
			p := unowned(g, s.Taken)
			if plan.SkipReason != decide.SkipNoTargets {
				p.detail += "; nothing signalled: " + plan.SkipText()
			}
			problems = append(problems, p)
			continue
		}
		if _, err := h.act(ctx, node, plan, start, func() decide.Plan { return node.Plan(ctx, uuid) }); err != nil {
			return h.finish("", []problem{{short: fmt.Sprintf("GPU %d holds %s with no owner, and nothing was signalled", g.Device.Index, size(g.UnexplainedBytes)), detail: err.Error()}})
		}
	}
	if len(problems) == 0 {
		problems = h.check(ctx, gpus, false, 2*time.Second)
	}
	if ctx.Err() != nil && len(problems) > 0 {
		problems = append(problems, problem{short: "timed out", detail: fmt.Sprintf("--timeout=%s", o.Timeout)})
	}
	if len(problems) > 0 {
		return h.finish("", problems)
	}
	ok := gpuList(s, gpus) + " clean"
	if len(h.actions) > 0 {
		ok = h.actedLine() + "; " + ok
	}
	ok += fmt.Sprintf(" (%.2f s)", time.Since(start).Seconds())
	return h.finish(ok, nil)
}
