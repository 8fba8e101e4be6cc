package cleanup

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/proc"
	"github.com/gpu-orphan/gpu-orphan/internal/snapshot"
	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/decide"
	"github.com/gpu-orphan/gpu-orphan/remediate/kill"
)

// A target that another process traces (ptrace(2)) may not finish dying:
// with PTRACE_O_TRACEEXIT its exit stops before its descriptors close, and
// SIGTERM stops it at the signal, each until the tracer lets it go. Any
// user may do this to their own processes. The plan therefore names each
// target's tracer (/proc/PID/status TracerPid), and signals the tracer too
// when it is itself a target by the node's rules: then its end releases
// the tracee. Any other tracer is left alone, and an action whose
// surviving targets it holds is an escalation (traced_holder), the
// tracer's user's, which the circuit breaker does not count.

// TracerRule says whether tracer, a process that traces a target of a plan
// on this node, is a target too, and what proves it; "" when nothing does.
type TracerRule func(s *snapshot.Snapshot, tracer proc.Process, now time.Time) (proof string)

// withTracers names the tracer of each target of an acting plan that is
// traced, and adds the tracers that are targets themselves (reason
// decide.ReasonTracerOfTarget), with a note for each. snap gives the
// snapshot that the rules decide on; it is called only when a tracer is
// not a target already. Targets whose tracer is named are not read again.
func (n *Node) withTracers(plan decide.Plan, snap func() *snapshot.Snapshot) decide.Plan {
	if !plan.Act || n.cfg.Proc.Root() == "" {
		return plan
	}
	targets := slices.Clone(plan.Targets)
	notes := slices.Clone(plan.Notes)
	var s *snapshot.Snapshot
	taken := false
	now := time.Now()
	added := false
	// The list grows as tracers are added: a tracer may be traced too.
	for i := 0; i < len(targets); i++ {
		t := targets[i]
		if t.Tracer != nil {
			continue
		}
		tr, tp := kill.TracerOf(n.cfg.Proc, t.PID, t.StartTime)
		if tr == nil {
			continue
		}
		if slices.ContainsFunc(targets, func(o remediate.Target) bool { return o.PID == tp.PID && o.StartTime == tp.StartTime }) {
			tr.Target = true
			targets[i].Tracer = tr
			continue
		}
		targets[i].Tracer = tr
		if !taken {
			s, taken = snap(), true
		}
		proof := n.tracerProof(s, tp, now)
		why := n.cfg.Decide.Rules().Why(tp)
		switch {
		case proof == "":
			notes = append(notes, fmt.Sprintf("target %d (%s) is traced by %s, which nothing proves a target: it is not signalled, and a hold at the target's exit is the tracer's user's",
				t.PID, t.Comm, tr.Who()))
			continue
		case why != "":
			notes = append(notes, fmt.Sprintf("target %d (%s) is traced by %s, a target (%s) that is never touched: %s", t.PID, t.Comm, tr.Who(), proof, why))
			continue
		}
		targets[i].Tracer.Target = true
		targets = append(targets, remediate.Target{ProcessInfo: remediate.NewProcessInfo(tp), Reason: decide.ReasonTracerOfTarget})
		added = true
		notes = append(notes, fmt.Sprintf("target %d (%s) is traced by %s, itself a target: %s; signalled too, its end lets its tracee die",
			t.PID, t.Comm, tr.Who(), proof))
	}
	if added {
		slices.SortFunc(targets, func(a, b remediate.Target) int { return a.PID - b.PID })
	}
	plan.Targets, plan.Notes = targets, notes
	return plan
}

// tracerProof says what makes tracer a target: a plan of this node's rule
// (decide, or the Planner) for one of the snapshot's GPUs targets it, or
// Config.TracerRule says so.
func (n *Node) tracerProof(s *snapshot.Snapshot, tracer proc.Process, now time.Time) string {
	if s == nil {
		return ""
	}
	for _, g := range s.GPUs {
		var p decide.Plan
		if n.cfg.Planner != nil {
			p = n.cfg.Planner(s, g.Device.UUID, now)
		} else {
			p = decide.Decide(s, g.Device.UUID, n.cfg.Decide, now)
		}
		if !p.Act {
			continue
		}
		for _, t := range p.Targets {
			if t.PID == tracer.PID && t.StartTime == tracer.StartTime {
				return fmt.Sprintf("a target of GPU %d's plan (%s)", p.GPUIndex, t.Reason)
			}
		}
	}
	if n.cfg.TracerRule != nil {
		return n.cfg.TracerRule(s, tracer, now)
	}
	return ""
}

// heldByTracers reports whether some targets outlived the ladder and every
// one that did is in a tracing stop under a named tracer.
func heldByTracers(ts []remediate.Target) bool {
	held := false
	for _, t := range ts {
		switch {
		case targetGone(t):
		case tracedStop(t):
			held = true
		default:
			return false
		}
	}
	return held
}

// tracedStop reports whether t outlived its signals in a tracing stop
// under a named tracer.
func tracedStop(t remediate.Target) bool {
	return t.Outcome == kill.OutcomeStillAlive && t.State == "t" && t.Tracer != nil
}

// tracersWho names, once each, the tracers that hold surviving targets,
// for people.
func tracersWho(ts []remediate.Target) string {
	var seen []remediate.Tracer
	var who []string
	for _, t := range ts {
		if t.Tracer == nil || targetGone(t) {
			continue
		}
		if !slices.ContainsFunc(seen, func(o remediate.Tracer) bool { return o.PID == t.Tracer.PID && o.StartTime == t.Tracer.StartTime }) {
			seen = append(seen, *t.Tracer)
			who = append(who, t.Tracer.Who())
		}
	}
	return strings.Join(who, "; ")
}

func tracedNextStep(a remediate.Action) string {
	return "the targets were signalled, and their tracer holds them in a tracing stop (ptrace: at their exit, or at the signal), their descriptors and so the GPU's memory still open: " +
		tracersWho(a.Targets) + ". Nothing proves the tracer a target, so gpu-orphan does not signal it: the hold is its user's. " +
		"Ask that user to end or detach it; when the tracer ends, its tracees finish dying and the memory comes back. " +
		"This is not counted toward the circuit breaker: other users' cleanups go on"
}
