// Package hooks runs Slurm's prolog and epilog (`gpu-orphan prolog`,
// `gpu-orphan epilog`) and the act step of `gpu-orphan clean`: the job that
// Slurm names in the environment, the snapshot loop with the remediator's
// recorded lineage, the audit record, the GPU's turn that the node agent
// takes too (store.Store.WaitTurn), the actions left running by a process
// that is gone (store.Store.ResolveStranded), the verdict on the job's
// GPUs, the one line for the node's log, and the drain. The command line
// (cmd/gpu-orphan) parses the flags and calls it.
package hooks

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"log/syslog"
	"os"
	"os/exec"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/cli"
	"github.com/gpu-orphan/gpu-orphan/internal/gpu"
	"github.com/gpu-orphan/gpu-orphan/internal/proc"
	"github.com/gpu-orphan/gpu-orphan/internal/slurm"
	"github.com/gpu-orphan/gpu-orphan/internal/snapshot"
	"github.com/gpu-orphan/gpu-orphan/internal/termsafe"
	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/cleanup"
	"github.com/gpu-orphan/gpu-orphan/remediate/decide"
	"github.com/gpu-orphan/gpu-orphan/remediate/exclude"
	"github.com/gpu-orphan/gpu-orphan/remediate/jobend"
	"github.com/gpu-orphan/gpu-orphan/remediate/kill"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

// The exit statuses of `gpu-orphan prolog` and `gpu-orphan epilog`, as
// Slurm reads them: any status but 0 drains the node (and requeues the
// job, for the prolog).
const (
	// ExitClean: the job's GPUs are clean, cleaned, or the job has none.
	ExitClean = 0
	// ExitHeld: memory is still held, or could not be checked; the one
	// line says why.
	ExitHeld = 1
	// ExitBadInput: a wrong flag, or an environment that names no job or
	// GPUs this node does not have.
	ExitBadInput = 2
)

// ExitHelp says what the exit statuses mean, for --help.
const ExitHelp = "Exit status: 0 when the job's GPUs are clean (or were cleaned, and the memory verified back); " +
	"1 when memory is still held, or could not be checked, which its one line says; 2 for a wrong flag, or an environment that names no job, or GPUs this node does not have. " +
	"Slurm drains the node on any status but 0 (docs/slurm.md)."

// LineageState is the name under which the remediator keeps its recorded
// lineage in its store (remediate/app).
const LineageState = "lineage"

// Options are the flags of prolog and epilog (cmd/gpu-orphan parses them).
type Options struct {
	JobID, JobUID, Node, GPUs string
	StorePath                 string
	Drain                     bool
	Scontrol                  string
	Timeout                   time.Duration
	Grace, VerifyTimeout      time.Duration
	MinAge                    time.Duration
	MinBytes                  uint64
	Protect                   []string
	SyslogSocket              string
}

// hook is one run of a prolog or epilog.
type hook struct {
	name   string // "prolog" or "epilog"
	o      *Options
	logger *slog.Logger
	stderr io.Writer
	job    jobend.Job
	// gpus are the job's GPUs as the flag or the environment name them;
	// all means every GPU of the node.
	gpus []string
	all  bool

	fs   proc.FS
	loop *snapshot.Loop
	// st is the audit store; storeErr says why there is none when
	// --store.path names one.
	st       *store.Store
	storeErr error
	cfg      decide.Config
	actions  []remediate.Action
	// waited are, per action ID, the other actions (the node agent's, another
	// hook's) whose turn on the GPU it waited for.
	waited map[string][]store.Turn
}

// jobGPUSources are the variables that name a job's GPUs in a prolog's or
// an epilog's environment, in the order they are read: Slurm 22.05 sets
// all three for a job given GRES (measured, docs/slurm.md).
var jobGPUSources = []string{"SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL"}

// ParseJobGPUs reads the job's GPUs from the flag, else from the
// environment: the list, whether it means every GPU, and where it came
// from.
func ParseJobGPUs(flag string, getenv func(string) string) (ids []string, all bool, from string, err error) {
	v, from := flag, "--slurm.gpus"
	if v == "" {
		for _, name := range jobGPUSources {
			if v = strings.TrimSpace(getenv(name)); v != "" {
				from = name
				break
			}
		}
	}
	switch v {
	case "", "none":
		return nil, false, from, nil
	case "all":
		return nil, true, from, nil
	case "NoDevFiles":
		// Slurm's word for GRES without device files.
		return nil, false, from, nil
	}
	for id := range strings.SplitSeq(v, ",") {
		id = strings.TrimSpace(id)
		_, numErr := strconv.ParseUint(id, 10, 16)
		if numErr != nil && !strings.HasPrefix(id, "GPU-") && !strings.HasPrefix(id, "MIG-") {
			return nil, false, from, fmt.Errorf("%s=%q: %q is neither a GPU index nor a UUID", from, v, id)
		}
		if !slices.Contains(ids, id) {
			ids = append(ids, id)
		}
	}
	return ids, false, from, nil
}

// newHook reads the job from the options; a job it cannot read is bad
// input.
func newHook(name string, o *Options, logger *slog.Logger) (*hook, error) {
	h := &hook{name: name, o: o, logger: logger, stderr: os.Stderr}
	if o.JobID == "" {
		return nil, fmt.Errorf("no job: SLURM_JOB_ID is not set (Slurm sets it for its Prolog and Epilog; by hand, give --slurm.job-id)")
	}
	if _, err := strconv.ParseUint(o.JobID, 10, 64); err != nil {
		return nil, fmt.Errorf("job %q: want a Slurm job ID, a number", o.JobID)
	}
	h.job = jobend.Job{ID: o.JobID, UID: -1}
	if o.JobUID != "" {
		uid, err := strconv.Atoi(o.JobUID)
		if err != nil || uid < 0 {
			return nil, fmt.Errorf("job %s: user %q: want a UID", o.JobID, o.JobUID)
		}
		h.job.UID = uid
	}
	var err error
	var from string
	h.gpus, h.all, from, err = ParseJobGPUs(o.GPUs, os.Getenv)
	if err != nil {
		return nil, err
	}
	logger.Debug("The job", "job", h.job.ID, "uid", h.job.UID, "gpus", h.gpus, "all", h.all, "from", from)
	h.cfg = decide.Config{
		Policy:    remediate.PolicyDeadOwner,
		MinAge:    o.MinAge,
		MinBytes:  o.MinBytes,
		Protected: append(slices.Clone(exclude.DefaultProtected), o.Protect...),
		Self:      exclude.CurrentSelf(),
	}.Resolved()
	return h, nil
}

// open opens the backend and the store, and restores the lineage that the
// remediator recorded: who each dead owner was, whose it was, and who
// descended from it. It returns a close function.
func (h *hook) open(ctx context.Context, backend *cli.Backend) (func(), error) {
	opened, err := backend.Open(h.logger)
	if err != nil {
		return nil, err
	}
	h.fs = opened.Proc
	// Signals take our own PIDs, the snapshot the procfs's.
	if err := h.fs.CheckOwnPIDNamespace(); err != nil {
		opened.Driver.Close()
		return nil, fmt.Errorf("--path.procfs=%s: %w", h.fs.Root(), err)
	}
	h.loop = snapshot.NewLoop(opened.Taker, time.Second, h.o.MinBytes)
	closers := []func(){func() { opened.Driver.Close() }}
	if h.o.StorePath != "" {
		// Its directory as the remediator makes and checks it: a node
		// where no remediator ran yet has none.
		st, err := OpenStore(ctx, h.o.StorePath)
		if err != nil {
			h.storeErr = err
			h.logger.Warn("The audit store cannot be opened: nothing will be signalled", "path", h.o.StorePath, "err", err)
		} else {
			h.st = st
			closers = append(closers, func() { st.Close() })
			h.restoreLineage(ctx)
			ResolveStranded(ctx, st, h.logger)
		}
	}
	return func() {
		for _, c := range slices.Backward(closers) {
			c()
		}
	}, nil
}

// OpenStore opens the audit store at path to write to it, making its
// directory first as the remediator does (store.MakeDir: 0700, checked).
func OpenStore(ctx context.Context, path string) (*store.Store, error) {
	if err := store.MakeDir(path); err != nil {
		return nil, err
	}
	return store.Open(ctx, path)
}

// restoreLineage reads the remediator's recorded lineage, if there is one
// of this boot; what it cannot read it reports and goes on without, as
// the remediator does at start-up. The remediator keeps writing it: the
// hook never does.
func (h *hook) restoreLineage(ctx context.Context) {
	found, err := RestoreAgentLineage(ctx, h.st, h.loop.Lineage(), h.fs)
	switch {
	case err != nil:
		h.logger.Warn("Ignoring the remediator's recorded lineage", "err", err)
	case !found:
		h.logger.Debug("No recorded lineage in the store: dead owners are unknown, and only the job's cgroup tells its processes")
	default:
		h.logger.Debug("Restored the remediator's recorded lineage", "owners", h.loop.Lineage().Owners(),
			"recorded_descendants", h.loop.Lineage().RecordedDescendants())
	}
}

// unreadable is the problem of a snapshot that lists no GPU because a
// source failed (the driver): nothing can be checked, nor signalled.
// begin is what both hooks do first: open the backend, take a snapshot, and
// resolve the job's GPUs. done is true when the hook has ended there, code
// being its exit status; otherwise closeAll releases what begin opened.
func (h *hook) begin(ctx context.Context, backend *cli.Backend) (s *snapshot.Snapshot, gpus []string, closeAll func(), code int, done bool) {
	closeAll, err := h.open(ctx, backend)
	if err != nil {
		return nil, nil, nil, h.finish("", []problem{{short: "the GPUs cannot be read", detail: err.Error()}}), true
	}
	s = h.loop.Refresh(ctx, true)
	if ps := unreadable(s); ps != nil {
		code = h.finish("", ps)
		closeAll()
		return nil, nil, nil, code, true
	}
	if gpus, err = h.resolveGPUs(s); err != nil {
		fmt.Fprintf(os.Stderr, "gpu-orphan %s: job %s: %v\n", h.name, h.job.ID, err)
		closeAll()
		return nil, nil, nil, ExitBadInput, true
	}
	return s, gpus, closeAll, 0, false
}

func unreadable(s *snapshot.Snapshot) []problem {
	if len(s.GPUs) > 0 || s.Healthy() {
		return nil
	}
	return []problem{{short: "the GPUs cannot be read", detail: sourceErrors(s)}}
}

// resolveGPUs returns the UUIDs of the job's GPUs in s; an ID that names
// no GPU of this node is bad input.
func (h *hook) resolveGPUs(s *snapshot.Snapshot) ([]string, error) {
	var out []string
	if h.all {
		for _, g := range s.GPUs {
			out = append(out, g.Device.UUID)
		}
		return out, nil
	}
	for _, id := range h.gpus {
		g, ok := s.GPUByID(id)
		if !ok {
			return nil, fmt.Errorf("the job's GPU %s is not on this node (%s)", id, DescribeGPUs(s))
		}
		if !slices.Contains(out, g.Device.UUID) {
			out = append(out, g.Device.UUID)
		}
	}
	return out, nil
}

// sourceErrors says which sources of a snapshot failed.
func sourceErrors(s *snapshot.Snapshot) string {
	var errs []string
	for _, src := range s.Sources {
		if src.Err != nil {
			errs = append(errs, src.Err.Error())
		}
	}
	if len(errs) == 0 {
		return "no GPU"
	}
	return strings.Join(errs, "; ")
}

// act records the action, takes the GPU's turn (Act), then runs the plan
// through node.Act. Without a store that opened (when --store.path names
// one), it signals nothing.
func (h *hook) act(ctx context.Context, node *cleanup.Node, plan decide.Plan, startedAt time.Time, replan func() decide.Plan) (remediate.Action, error) {
	a := remediate.Action{Node: Hostname(), GPUUUID: plan.GPUUUID, GPUIndex: plan.GPUIndex, Policy: plan.Policy,
		State: remediate.StateRunning, Source: h.name, StartedAt: startedAt}
	a = withPlan(a, plan)
	if err := h.record(ctx, &a); err != nil {
		return a, err
	}
	h.logger.Info("Signalling", "job", h.job.ID, "gpu", plan.GPUIndex, "action", a.ID, "targets", len(plan.Targets))
	a, waited, err := Act(ctx, h.st, node, a, plan, replan, h.logger)
	if len(waited) > 0 {
		if h.waited == nil {
			h.waited = map[string][]store.Turn{}
		}
		h.waited[a.ID] = waited
	}
	h.actions = append(h.actions, a)
	return a, err
}

// TurnPoll is how often a hook waiting for a GPU's turn looks again.
const TurnPoll = 200 * time.Millisecond

// Act runs a recorded, running action's plan on this node, one action per
// GPU at a time with the node agent and the other hooks: it takes the
// GPU's turn in the store (store.Store.WaitTurn, which the agent's queue
// takes too), waiting while another action holds it, bounded by ctx. After
// a wait it plans again from a fresh snapshot (replan): the other action
// has probably freed the memory, which this one then neither signals nor
// counts; a plan with nothing to do ends the action skipped. It returns
// the action, and the turns it waited for. Without a store (st nil) it
// only acts.
func Act(ctx context.Context, st *store.Store, node *cleanup.Node, a remediate.Action, plan decide.Plan,
	replan func() decide.Plan, logger *slog.Logger) (remediate.Action, []store.Turn, error) {
	if st != nil {
		waited, err := st.WaitTurn(ctx, a.GPUUUID, a.ID, a.Source, TurnPoll)
		if err != nil {
			now := time.Now()
			a.State, a.FinishedAt = remediate.StateFailed, &now
			a.Reason = "nothing was signalled: the GPU's turn was not given: " + err.Error()
			if len(waited) > 0 {
				a.Reason = "nothing was signalled: waited for " + waited[len(waited)-1].Who() + " on this GPU until " + err.Error()
			}
			uctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), store.BusyTimeout+time.Second)
			defer cancel()
			if uerr := st.Update(uctx, a); uerr != nil {
				logger.Error("Recording an action's end", "action", a.ID, "err", uerr)
			}
			return a, waited, errors.New(a.Reason)
		}
		defer func() {
			if err := st.ReleaseTurn(a.GPUUUID, a.ID); err != nil {
				logger.Error("Giving back the GPU's turn", "action", a.ID, "err", err)
			}
		}()
		if len(waited) > 0 {
			w := waited[len(waited)-1]
			logger.Warn("Waited for another action on this GPU: planning again from a fresh snapshot", "action", a.ID,
				"gpu", a.GPUIndex, "waited_for", w.ActionID, "by", store.SourceName(w.Source), "pid", w.Holder.PID)
			if replan != nil {
				plan = replan()
			}
			if !plan.Act {
				now := time.Now()
				before := plan.Before
				a.Before, a.After, a.Targets, a.Excluded, a.DeadOwners = &before, &before, []remediate.Target{}, plan.Excluded, plan.DeadOwners
				a.State, a.FinishedAt = remediate.StateSkipped, &now
				a.Reason = "after waiting for " + w.Who() + ": " + plan.SkipText()
				if err := st.Update(ctx, a); err != nil {
					return a, waited, fmt.Errorf("recording the action: %w", err)
				}
				return a, waited, nil
			}
			a = withPlan(a, plan)
			return node.Act(ctx, a, plan), waited, nil
		}
	}
	return node.Act(ctx, withPlan(a, plan), plan), nil, nil
}

// withPlan copies the plan's evidence and targets into the action.
func withPlan(a remediate.Action, plan decide.Plan) remediate.Action {
	before := plan.Before
	a.Before, a.Targets, a.Excluded, a.DeadOwners = &before, plan.Targets, plan.Excluded, plan.DeadOwners
	if plan.GPUUUID != "" {
		a.GPUUUID, a.GPUIndex = plan.GPUUUID, plan.GPUIndex
	}
	a.Policy = plan.Policy
	return a
}

// ResolveStranded resolves, as the next reader of st, the running actions
// whose process is gone (a hook killed during its grace, a remediator that
// died), and says so: the node agent takes them up again.
func ResolveStranded(ctx context.Context, st *store.Store, logger *slog.Logger) {
	interrupted, resumed, err := st.ResolveStranded(ctx, false)
	if err != nil {
		logger.Warn("Cannot resolve the actions whose process is gone", "err", err)
		return
	}
	for _, a := range interrupted {
		next := ""
		for _, r := range resumed {
			if r.RetryOf == a.ID {
				next = r.ID
			}
		}
		logger.Warn("An action was left running by a process that is gone: marked interrupted", "action", a.ID, "source", a.Source,
			"gpu", a.GPUIndex, "reason", a.Reason, "next_action", next)
	}
}

// record inserts a new action, with the job it is for; it is an error to
// act without a record when a store was asked for.
func (h *hook) record(ctx context.Context, a *remediate.Action) error {
	a.Job = h.jobRef()
	if h.storeErr != nil {
		return fmt.Errorf("refusing to signal without an audit record: %w", h.storeErr)
	}
	if h.st == nil {
		return nil
	}
	id, err := h.st.Insert(ctx, *a)
	if err != nil {
		return fmt.Errorf("refusing to signal without an audit record: %w", err)
	}
	a.ID = id
	detail := map[string]any{"job_id": h.job.ID, "hook": h.name, "gpus": h.gpus}
	if h.job.UID >= 0 {
		detail["job_uid"] = h.job.UID
	}
	if err := h.st.AddEvent(ctx, id, "slurm_job", detail); err != nil {
		return fmt.Errorf("refusing to signal without an audit record: %w", err)
	}
	return nil
}

// nodeLogger is the logger of the cleanup a hook runs: at the default
// level (warn) the hook's one line says how it ended, and the cleanup's
// own warnings, which a remediator's log would carry, are left out; at
// info or debug, everything is logged.
func (h *hook) nodeLogger() *slog.Logger {
	if h.logger.Enabled(context.Background(), slog.LevelInfo) {
		return h.logger
	}
	return slog.New(minLevel{h.logger.Handler(), slog.LevelError})
}

// minLevel drops the records below min.
type minLevel struct {
	slog.Handler
	min slog.Level
}

func (m minLevel) Enabled(ctx context.Context, l slog.Level) bool {
	return l >= m.min && m.Handler.Enabled(ctx, l)
}

func (m minLevel) WithAttrs(as []slog.Attr) slog.Handler {
	return minLevel{m.Handler.WithAttrs(as), m.min}
}

func (m minLevel) WithGroup(name string) slog.Handler {
	return minLevel{m.Handler.WithGroup(name), m.min}
}

// ladder is the kill ladder of a hook; groups re-lists whole process
// groups (the prolog's normal rules), which the epilog never signals.
func (h *hook) ladder(groups kill.GroupLister) *kill.Ladder {
	return &kill.Ladder{Grace: h.o.Grace, Proc: h.fs, Logger: h.nodeLogger(), Groups: groups, Exclude: h.cfg.Rules().Why}
}

// problem is one reason the job's GPUs are not clean: short for the drain
// reason, with detail for the log.
type problem struct {
	short, detail string
	// gpu is the GPU's memory, when the problem is one GPU's.
	gpu *remediate.MemoryEvidence
	// uuid and index name that GPU.
	uuid  string
	index int
	// traced: what holds the memory is targets of this run held in a
	// tracing stop by a tracer that is not a target (escalation
	// traced_holder): its user's doing, which does not drain the node.
	traced bool
}

// unowned is the problem of a GPU whose memory with no live owner stays
// above min-bytes; g must be accountable.
func unowned(g snapshot.GPU, taken time.Time) problem {
	ev := remediate.NewMemoryEvidence(g, taken, taken)
	p := problem{short: fmt.Sprintf("GPU %d holds %s with no owner", g.Device.Index, size(g.UnexplainedBytes)),
		gpu: &ev, uuid: g.Device.UUID, index: g.Device.Index}
	var holders []string
	for _, h := range g.Holders {
		if h.Mapped && len(h.LiveJobGPUs) == 0 {
			holders = append(holders, fmt.Sprintf("%d (%s)", h.PID, h.Comm))
		}
	}
	switch {
	case len(holders) > 0:
		p.detail = "held by " + strings.Join(holders, ", ") + "; see `gpu-orphan ps`"
	case g.DeadOwnerListed():
		p.detail = "NVML lists dead owners and no visible process holds their contexts"
	default:
		p.detail = "no process holds it: a driver-level leak, which a GPU reset gives back (docs/runbook.md)"
	}
	return p
}

// check looks at the GPUs (UUIDs) in a fresh snapshot: the problems with
// them, and the job's processes (by the job-end rule, epilog only) that
// still hold any GPU. It looks again for up to settle while there are
// problems, as memory comes back a little after its last holder exits.
func (h *hook) check(ctx context.Context, uuids []string, jobToo bool, settle time.Duration) []problem {
	deadline := time.Now().Add(settle)
	for {
		s := h.loop.Refresh(ctx, true)
		var ps []problem
		if jobToo {
			ps = append(ps, h.jobLeft(s)...)
		}
		for _, id := range uuids {
			g, ok := s.GPUByID(id)
			switch {
			case !ok:
				ps = append(ps, problem{short: "GPU " + id + " cannot be read", detail: sourceErrors(s)})
			case !g.Accountable():
				why := g.Unsupported
				if g.Err != nil {
					why = g.Err.Error()
				}
				ps = append(ps, problem{short: fmt.Sprintf("GPU %d cannot be checked", g.Device.Index), detail: why})
			case g.UnexplainedBytes > h.o.MinBytes:
				p := unowned(g, s.Taken)
				p.traced = h.heldByTracers(g)
				ps = append(ps, p)
			}
		}
		if !s.Healthy() && len(ps) == 0 {
			ps = append(ps, problem{short: "the GPUs cannot be checked", detail: sourceErrors(s)})
		}
		if len(ps) == 0 || time.Now().After(deadline) || ctx.Err() != nil {
			return ps
		}
		select {
		case <-ctx.Done():
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// jobLeft names the job's processes that still hold a GPU.
func (h *hook) jobLeft(s *snapshot.Snapshot) []problem {
	var ps []problem
	for _, g := range s.GPUs {
		for _, hd := range g.Holders {
			if r, _, _ := jobend.Member(g, hd.Process, h.job); r != "" {
				state := ""
				tr, traced := h.tracedTargets()[hd.PID]
				switch {
				case traced:
					state = ", held in a tracing stop by its tracer " + tr.Who() + ", which is not the job's: the hold is the tracer's user's (escalation traced_holder)"
				case hd.State == "D":
					state = ", in uninterruptible sleep (D): it dies only when its kernel call returns"
				case h.cfg.Rules().Why(hd.Process) != "":
					state = ", never touched: " + string(h.cfg.Rules().Why(hd.Process))
				}
				ps = append(ps, problem{
					short:  fmt.Sprintf("PID %d of job %s still holds GPU %d", hd.PID, h.job.ID, g.Device.Index),
					detail: fmt.Sprintf("%s, %s%s", hd.Comm, r, state),
					traced: traced,
				})
			}
		}
	}
	return ps
}

// tracedTargets are the targets of this run's actions that escalated as
// traced_holder and outlived their signals, by PID, with their tracers.
func (h *hook) tracedTargets() map[int]remediate.Tracer {
	out := map[int]remediate.Tracer{}
	for _, a := range h.actions {
		if a.Escalation != remediate.EscalationTracedHolder {
			continue
		}
		for _, t := range a.Targets {
			if t.Tracer != nil && t.Outcome == kill.OutcomeStillAlive {
				out[t.PID] = *t.Tracer
			}
		}
	}
	return out
}

// heldByTracers reports whether the processes that hold g's memory (map
// it, in no live job) are all targets held by their tracers.
func (h *hook) heldByTracers(g snapshot.GPU) bool {
	traced := h.tracedTargets()
	held := false
	for _, hd := range g.Holders {
		if !hd.Mapped || len(hd.LiveJobGPUs) > 0 {
			continue
		}
		if _, ok := traced[hd.PID]; !ok {
			return false
		}
		held = true
	}
	return held
}

// finish says how it ended, in one line on stderr and to syslog, drains
// the node when asked and the GPUs are not clean, records that, and
// returns the exit status. When every problem is a hold of a tracer that
// is not a target, it neither drains nor fails: any user may trace their
// own processes, and must not drain the node at will (the record says
// whose the hold is).
func (h *hook) finish(ok string, problems []problem) int {
	line := fmt.Sprintf("job %s: %s", h.job.ID, ok)
	status := ExitClean
	traced := len(problems) > 0 && !slices.ContainsFunc(problems, func(p problem) bool { return !p.traced })
	if len(problems) > 0 {
		status = ExitHeld
		var parts []string
		for _, p := range problems {
			s := p.short
			if p.detail != "" {
				s += " (" + p.detail + ")"
			}
			parts = append(parts, s)
		}
		line = fmt.Sprintf("job %s: %s", h.job.ID, strings.Join(parts, "; "))
		reason := slurm.ReasonPrefix + termsafe.Escape(problems[0].short)
		if len(problems) > 1 {
			reason += fmt.Sprintf(" (and %d more)", len(problems)-1)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		h.recordFailure(ctx, line, problems)
		if traced {
			status = ExitClean
			line += "; not drained: the job's processes that hold it are held by a tracer that is not the job's, whose user must end it (escalation traced_holder)"
		} else if h.o.Drain {
			if err := h.drainNode(ctx, reason); err != nil {
				line += "; not drained: " + err.Error()
			} else {
				line += fmt.Sprintf("; drained node %s: %q", h.o.Node, reason)
				h.event(ctx, "drain", map[string]any{"node": h.o.Node, "reason": reason})
			}
		}
	}
	// The line names processes by their comm, which their user chose:
	// escaped, a comm with an escape sequence or a newline can neither
	// drive the terminal nor forge a second line in slurmd's or syslog's
	// log.
	line = termsafe.Escape(line)
	fmt.Fprintf(h.stderr, "gpu-orphan %s: %s\n", h.name, line)
	h.syslog(len(problems) == 0, line)
	return status
}

// recordFailure makes sure the audit store holds the failure: on the
// actions of this run, or, when nothing was signalled, as an action of its
// own, failed, with no targets.
func (h *hook) recordFailure(ctx context.Context, line string, problems []problem) {
	if h.st == nil {
		return
	}
	if len(h.actions) > 0 {
		h.event(ctx, h.name+"_failed", map[string]any{"reason": line})
		return
	}
	now := time.Now()
	a := remediate.Action{Node: Hostname(), GPUIndex: -1, Policy: jobend.Policy, State: remediate.StateFailed, Source: h.name,
		StartedAt: now, FinishedAt: &now, Reason: line}
	for _, p := range problems {
		if p.gpu != nil {
			a.GPUUUID, a.GPUIndex, a.Before, a.After = p.uuid, p.index, p.gpu, p.gpu
			break
		}
	}
	if h.name == "prolog" {
		a.Policy = remediate.PolicyDeadOwner
	}
	if err := h.record(ctx, &a); err != nil {
		h.logger.Error("Recording the failure", "err", err)
		return
	}
	h.actions = append(h.actions, a)
}

// event adds an event to every action of this run.
func (h *hook) event(ctx context.Context, kind string, detail any) {
	if h.st == nil {
		return
	}
	for _, a := range h.actions {
		if a.ID == "" {
			continue
		}
		if err := h.st.AddEvent(ctx, a.ID, kind, detail); err != nil {
			h.logger.Error("Recording an event", "action", a.ID, "kind", kind, "err", err)
		}
	}
}

// drainNode drains this node with reason, through scontrol.
func (h *hook) drainNode(ctx context.Context, reason string) error {
	if h.o.Node == "" {
		return errors.New("no node name (SLURMD_NODENAME, or --slurm.node)")
	}
	bin, err := slurm.Look(h.o.Scontrol, "--slurm.scontrol")
	if err != nil {
		return err
	}
	out, err := exec.CommandContext(ctx, bin, "update", "nodename="+h.o.Node, "state=drain", "reason="+reason).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s update nodename=%s state=drain: %w: %s", bin, h.o.Node, err, strings.TrimSpace(string(out)))
	}
	return nil
}

// syslog sends the line to the syslog socket, if there is one: slurmd
// logs a failing prolog's or epilog's output, not a succeeding one's.
func (h *hook) syslog(ok bool, line string) {
	if h.o.SyslogSocket == "" {
		return
	}
	prio := syslog.LOG_DAEMON | syslog.LOG_INFO
	if !ok {
		prio = syslog.LOG_DAEMON | syslog.LOG_ERR
	}
	w, err := syslog.Dial("unixgram", h.o.SyslogSocket, prio, "gpu-orphan-"+h.name)
	if err != nil {
		h.logger.Debug("No syslog", "socket", h.o.SyslogSocket, "err", err)
		return
	}
	defer w.Close()
	if ok {
		err = w.Info(line)
	} else {
		err = w.Err(line)
	}
	if err != nil {
		h.logger.Debug("No syslog", "socket", h.o.SyslogSocket, "err", err)
	}
}

// Context is the context of a hook's work: its time budget, less a
// reserve for the record and the drain that follow, and cancelled by
// SIGTERM or SIGINT.
func Context(timeout time.Duration) (context.Context, context.CancelFunc) {
	reserve := min(5*time.Second, timeout/4)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	ctx, cancel := context.WithTimeout(ctx, timeout-reserve)
	return ctx, func() { cancel(); stop() }
}

// size is a number of bytes as a person reads it: MiB below a GiB, GiB
// (one decimal, when not whole) above.
func size(b uint64) string {
	if b < 1<<30 {
		return fmt.Sprintf("%d MiB", b/gpu.MiB)
	}
	s := strconv.FormatFloat(float64(b)/(1<<30), 'f', 1, 64)
	return strings.TrimSuffix(s, ".0") + " GiB"
}

// gpuList names GPUs by index, for the line: "GPU 0", "GPUs 0, 1".
func gpuList(s *snapshot.Snapshot, uuids []string) string {
	var idx []string
	for _, id := range uuids {
		if g, ok := s.GPUByID(id); ok {
			idx = append(idx, strconv.Itoa(g.Device.Index))
		} else {
			idx = append(idx, id)
		}
	}
	if len(idx) == 1 {
		return "GPU " + idx[0]
	}
	return "GPUs " + strings.Join(idx, ", ")
}

// actedLine says what the actions of this run did, and whose actions on
// the same GPU they waited for.
func (h *hook) actedLine() string {
	var parts []string
	for _, a := range h.actions {
		if w := h.waited[a.ID]; len(w) > 0 && a.State == remediate.StateSkipped {
			s := fmt.Sprintf("waited for %s on GPU %d, which left nothing to signal", w[len(w)-1].Who(), a.GPUIndex)
			if a.ID != "" {
				s += " (action " + a.ID + ")"
			}
			parts = append(parts, s)
			continue
		}
		var pids []string
		for _, t := range a.Targets {
			pids = append(pids, strconv.Itoa(t.PID))
		}
		s := fmt.Sprintf("signalled %d processes on GPU %d (PIDs %s), %s", len(a.Targets), a.GPUIndex, strings.Join(pids, ", "), a.State)
		if a.State == remediate.StateSucceeded {
			s += fmt.Sprintf(": %s back %.2f s after the first signal", size(a.FreedBytes), a.VerifySeconds)
		}
		if a.ID != "" {
			s += " (action " + a.ID + ")"
		}
		if w := h.waited[a.ID]; len(w) > 0 {
			s += ", after waiting for " + w[len(w)-1].Who()
		}
		parts = append(parts, s)
	}
	return strings.Join(parts, "; ")
}
