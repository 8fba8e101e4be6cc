// Package remediate turns Alertmanager's alerts into verified, rate-limited
// cleanup of the processes that hold orphaned GPU memory. The steps live in
// subpackages named after them: decide (what to kill), kill (the signal
// ladder), limits (how often), store (the audit record).
package remediate

import (
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/proc"
	"github.com/gpu-orphan/gpu-orphan/internal/snapshot"
	"github.com/gpu-orphan/gpu-orphan/internal/termsafe"
)

// State is where an action stands, as GET /api/v1/actions reports it.
type State string

// Action states. These names are a contract with outside tooling.
const (
	StateQueued      State = "queued"
	StateRunning     State = "running"
	StateDryRun      State = "dry_run"
	StateSucceeded   State = "succeeded"
	StateFailed      State = "failed"
	StateSkipped     State = "skipped"
	StateInterrupted State = "interrupted"
)

// Policy says which holders a cleanup may target.
type Policy string

// Policies, as --remediate.policy names them.
const (
	PolicyDeadOwner  Policy = "dead-owner"
	PolicyOrphaned   Policy = "orphaned"
	PolicyAllHolders Policy = "all-holders"
)

// Policies lists every policy, the default first.
var Policies = []Policy{PolicyDeadOwner, PolicyOrphaned, PolicyAllHolders}

// Action is one remediation of one GPU, from the alert that triggered it to
// the verification of its result. It is what the store keeps and what
// GET /api/v1/actions returns.
type Action struct {
	ID       string `json:"id"`
	Node     string `json:"node"`
	GPUUUID  string `json:"gpu_uuid"`
	GPUIndex int    `json:"gpu_index"`
	Policy   Policy `json:"policy"`
	State    State  `json:"state"`
	// Reason says why an action was skipped or failed.
	Reason string `json:"reason,omitempty"`
	// DryRun is true when the remediator ran without --act.
	DryRun bool `json:"dry_run"`

	AlertFingerprint string    `json:"alert_fingerprint,omitempty"`
	AlertStartsAt    time.Time `json:"alert_starts_at,omitempty"`
	// Source is what started the action: SourceWebhook, SourceCLI,
	// SourceProlog, SourceEpilog or SourceDispatch.
	Source string `json:"source"`
	// Job is set on a prolog's or an epilog's action (and its failure
	// record): the Slurm job the hook ran for. For the epilog it is the job
	// whose processes were signalled; for the prolog, the job about to
	// start, not the one that left the memory (DeadOwners name that one).
	Job *JobRef `json:"job,omitempty"`

	FreedBytes uint64     `json:"freed_bytes"`
	StartedAt  time.Time  `json:"started_at"`
	FinishedAt *time.Time `json:"finished_at,omitempty"`
	// VerifySeconds is how long the memory took to come back after the
	// first signal.
	VerifySeconds float64 `json:"verify_seconds,omitempty"`

	Before *MemoryEvidence `json:"before,omitempty"`
	After  *MemoryEvidence `json:"after,omitempty"`

	Targets  []Target    `json:"targets"`
	Excluded []Exclusion `json:"excluded,omitempty"`
	// Leftover, on failure, names what still holds the memory, and NextStep
	// what a human should do.
	Leftover []Leftover `json:"leftover,omitempty"`
	NextStep string     `json:"next_step,omitempty"`

	// DeadOwners are the PIDs that NVML listed on the GPU, dead, when the
	// plan was made: whose memory the action is about, and who they were.
	DeadOwners []DeadOwner `json:"dead_owners,omitempty"`
	// Agent is set on a dispatcher's action: the node agent's action that
	// the alert was forwarded to, and its outcome once the agent finished
	// it. The evidence, targets, freed bytes and dead owners above are then
	// the agent's, copied from its record.
	Agent *AgentResult `json:"agent,omitempty"`

	// Attempt numbers the actions of one alert (fingerprint, startsAt),
	// from 1. A later attempt is made when the one before it ended with the
	// memory still held (MemoryHeld): taken up at start-up when a restart
	// interrupted it, or on Alertmanager's next notification of the alert
	// once the cooldown has passed; never more than the store's
	// MaxAttempts. Each attempt plans from a fresh snapshot.
	Attempt int `json:"attempt"`
	// FirstActionID is the alert's first action, and RetryOf the attempt
	// this one follows; both empty on a first attempt.
	FirstActionID string `json:"first_action_id,omitempty"`
	RetryOf       string `json:"retry_of,omitempty"`
	// Escalation is set on a failed action whose targets are all gone while
	// the memory stays held by something the plan could not prove or could
	// not see (EscalationHiddenHolder, EscalationUnprovenHolder), or whose
	// surviving targets are all held at their exit by a tracer that is not a
	// target (EscalationTracedHolder): a case for a human, which the circuit
	// breaker does not count, since the remediator's own signals did all
	// they could.
	Escalation string `json:"escalation,omitempty"`
}

// Sources (Action.Source). These names are a contract with outside
// tooling, and the source label of
// gpu_orphan_remediator_recorded_actions_total.
const (
	// SourceWebhook: an alert delivered by Alertmanager to a node agent.
	SourceWebhook = "webhook"
	// SourceCLI: `gpu-orphan clean --store.path`.
	SourceCLI = "cli"
	// SourceProlog and SourceEpilog: `gpu-orphan prolog` and
	// `gpu-orphan epilog`, run by slurmd at a job's start and end.
	SourceProlog = "prolog"
	SourceEpilog = "epilog"
	// SourceDispatch: a dispatcher's forwarding of an alert to its node's
	// agent.
	SourceDispatch = "dispatch"
)

// Sources lists every source.
var Sources = []string{SourceWebhook, SourceCLI, SourceProlog, SourceEpilog, SourceDispatch}

// JobRef is the Slurm job that a prolog or an epilog ran for, as slurmd
// named it in the hook's environment (SLURM_JOB_ID, SLURM_JOB_UID).
type JobRef struct {
	SlurmJob string `json:"slurm_job"`
	// UID is the job's user; nil when slurmd did not say.
	UID *int `json:"uid,omitempty"`
	// User is the UID's name on the node, or the UID as a number when the
	// node cannot name it.
	User string `json:"user,omitempty"`
}

// UserLabel is the job's user as a report key or a metric label: its
// name, else its UID, else UnknownUser.
func (j JobRef) UserLabel() string {
	switch {
	case j.User != "":
		return j.User
	case j.UID != nil:
		return strconv.Itoa(*j.UID)
	}
	return UnknownUser
}

// Escalations (Action.Escalation).
const (
	// EscalationHiddenHolder: no process visible in /proc holds the GPU,
	// yet its memory stays: a descriptor in flight in a UNIX socket
	// message that nobody receives, a process in another PID namespace, or
	// the driver.
	EscalationHiddenHolder = "hidden_holder"
	// EscalationUnprovenHolder: processes that the plan did not target
	// still hold the GPU, and nothing proves that they inherited a dead
	// owner's context.
	EscalationUnprovenHolder = "unproven_holder"
	// EscalationTracedHolder: every target that outlived its signals is
	// held in a tracing stop by its tracer (ptrace(2), for instance
	// PTRACE_O_TRACEEXIT, which stops a dying process at its exit with its
	// descriptors still open), and the tracer is not one of the action's
	// targets: the hold is the tracer's user's (Target.Tracer names it).
	EscalationTracedHolder = "traced_holder"
)

// EscalationUsers are the users an escalated action is counted for, as
// metric labels, sorted: for traced_holder the users of the tracers that
// hold its surviving targets, else those of its dead owners; UnknownUser
// when there are none.
func (a Action) EscalationUsers() []string {
	var users []string
	if a.Escalation == EscalationTracedHolder {
		for _, t := range a.Targets {
			switch {
			case t.Tracer == nil || t.Outcome != "still_alive":
			case t.Tracer.User != "":
				users = append(users, t.Tracer.User)
			default:
				users = append(users, strconv.Itoa(t.Tracer.UID))
			}
		}
	} else {
		for _, o := range a.DeadOwners {
			users = append(users, o.UserLabel())
		}
	}
	if len(users) == 0 {
		return []string{UnknownUser}
	}
	slices.Sort(users)
	return slices.Compact(users)
}

// MemoryHeld reports whether a finished action ended with the memory it
// was about still held: it failed, a restart interrupted it, or it
// succeeded with other holders remaining. A dispatcher's forwarded action
// is judged by its agent's outcome. Such an action's alert gets a new
// attempt; one that brought the memory back, a dry run or a skipped plan
// does not.
func (a Action) MemoryHeld() bool {
	state, leftovers := a.State, len(a.Leftover) > 0
	if a.Agent != nil && a.State == StateSucceeded {
		state = a.Agent.State
	}
	switch state {
	case StateFailed, StateInterrupted:
		return true
	case StateSucceeded:
		return leftovers
	}
	return false
}

// DeadOwner is a dead PID that NVML still charged memory to when an action
// planned, with its identity as the remediator's snapshot loop saw the
// process alive. Known is false when no snapshot saw it alive (the
// remediator started after it died, or `gpu-orphan clean`, which keeps no
// history): the identity fields are then empty, never a guess.
type DeadOwner struct {
	PID       uint32 `json:"pid"`
	UsedBytes uint64 `json:"used_bytes"`
	Known     bool   `json:"known"`
	StartTime uint64 `json:"start_time,omitempty"`
	Comm      string `json:"comm,omitempty"`
	Cmdline   string `json:"cmdline,omitempty"`
	User      string `json:"user,omitempty"`
	// UID is set when Known (0 is root).
	UID         *int      `json:"uid,omitempty"`
	SlurmJob    string    `json:"slurm_job,omitempty"`
	SlurmStep   string    `json:"slurm_step,omitempty"`
	PodUID      string    `json:"pod_uid,omitempty"`
	ContainerID string    `json:"container_id,omitempty"`
	Cgroup      string    `json:"cgroup,omitempty"`
	LastSeen    time.Time `json:"last_seen,omitzero"`
}

// Who says in one line who the dead owner was, for people: "PID 463:
// python3, user alice, Slurm job 81234".
func (o DeadOwner) Who() string {
	if !o.Known {
		return fmt.Sprintf("PID %d: unknown", o.PID)
	}
	s := fmt.Sprintf("PID %d: %s, user %s", o.PID, o.Comm, o.User)
	if o.SlurmJob != "" {
		s += ", Slurm job " + o.SlurmJob
	}
	if o.PodUID != "" {
		s += ", pod " + o.PodUID
	}
	if o.ContainerID != "" {
		s += ", container " + o.ContainerID[:min(12, len(o.ContainerID))]
	}
	return s
}

// NewDeadOwners are the dead owners that NVML lists on a GPU, named as the
// snapshot's Identity remembers them.
func NewDeadOwners(g snapshot.GPU) []DeadOwner {
	var out []DeadOwner
	for _, o := range g.Owners {
		if o.Alive {
			continue
		}
		d := DeadOwner{PID: o.PID, UsedBytes: o.UsedBytes}
		if id := o.Identity; id != nil {
			uid := id.UID
			d.Known, d.StartTime, d.Comm, d.Cmdline, d.User, d.UID = true, id.StartTime, id.Comm, id.Cmdline, id.User, &uid
			d.SlurmJob, d.SlurmStep, d.PodUID, d.ContainerID, d.Cgroup = id.SlurmJob, id.SlurmStep, id.PodUID, id.ContainerID, id.Cgroup
			d.LastSeen = id.LastSeen.UTC()
		}
		out = append(out, d)
	}
	return out
}

// AgentResult is, on a dispatcher's action, the node agent's action for the
// same alert.
type AgentResult struct {
	// URL is the agent's base URL.
	URL string `json:"url"`
	// ActionID is the agent's action; empty when the agent made none (it
	// ignored the alert: Reason says why).
	ActionID string `json:"action_id,omitempty"`
	// State is the agent's action's state as the dispatcher last saw it:
	// queued or running until the agent finishes it.
	State      State      `json:"state"`
	Reason     string     `json:"reason,omitempty"`
	FinishedAt *time.Time `json:"finished_at,omitempty"`
	// Error is why the dispatcher could not read the agent's result the
	// last time it asked; it keeps asking.
	Error string `json:"error,omitempty"`
}

// Final reports whether an action in state s is finished: nothing more
// will happen to it.
func (s State) Final() bool {
	switch s {
	case StateDryRun, StateSucceeded, StateFailed, StateSkipped, StateInterrupted:
		return true
	}
	return false
}

// MemoryEvidence is the GPU's memory at one moment of an action.
type MemoryEvidence struct {
	At                time.Time `json:"at"`
	UsedBytes         uint64    `json:"used_bytes"`
	OwnedLiveBytes    uint64    `json:"owned_live_bytes"`
	OwnedDeadBytes    uint64    `json:"owned_dead_bytes"`
	UnownedBytes      uint64    `json:"unowned_bytes"`
	UnownedAgeSeconds float64   `json:"unowned_age_seconds"`
	DeadOwnerPIDs     []uint32  `json:"dead_owner_pids,omitempty"`
	HolderPIDs        []int     `json:"holder_pids,omitempty"`
}

// NewMemoryEvidence records a GPU's memory as the snapshot taken at `at`
// saw it; now dates the age of its memory with no live owner.
func NewMemoryEvidence(g snapshot.GPU, at, now time.Time) MemoryEvidence {
	e := MemoryEvidence{
		At: at, UsedBytes: g.Memory.Used, OwnedLiveBytes: g.OwnedLiveBytes, OwnedDeadBytes: g.OwnedDeadBytes,
		UnownedBytes: g.UnownedBytes, HolderPIDs: slices.Clone(g.HolderPIDs),
	}
	if !g.UnownedSince.IsZero() {
		e.UnownedAgeSeconds = now.Sub(g.UnownedSince).Seconds()
	}
	for _, o := range g.Owners {
		if !o.Alive {
			e.DeadOwnerPIDs = append(e.DeadOwnerPIDs, o.PID)
		}
	}
	return e
}

// ProcessInfo is the identity of a process, as recorded for evidence.
type ProcessInfo struct {
	PID       int    `json:"pid"`
	PPID      int    `json:"ppid"`
	PGID      int    `json:"pgid"`
	SID       int    `json:"sid"`
	StartTime uint64 `json:"start_time"`
	State     string `json:"state,omitempty"`
	User      string `json:"user"`
	Comm      string `json:"comm"`
	Command   string `json:"command"`
	Cgroup    string `json:"cgroup,omitempty"`
	Container string `json:"container,omitempty"`
	Pod       string `json:"pod,omitempty"`
}

// NewProcessInfo is a process's identity as the audit record keeps it.
func NewProcessInfo(p proc.Process) ProcessInfo {
	return ProcessInfo{
		PID: p.PID, PPID: p.PPID, PGID: p.PGID, SID: p.SID,
		StartTime: p.StartTime, State: p.State, User: p.User,
		Comm: p.Comm, Command: p.Cmdline, Cgroup: p.Cgroup,
		Container: p.Container, Pod: p.Pod,
	}
}

// TargetReason says why a process is a target. The snapshot's suspect
// reasons are target reasons too.
type TargetReason string

// Target reasons that come from the snapshot's suspects.
const (
	ReasonInheritedFromDeadOwner TargetReason = snapshot.ReasonInheritedFromDeadOwner
	ReasonOrphaned               TargetReason = snapshot.ReasonOrphaned
)

// Target is one process the plan signals, with why, and what happened.
type Target struct {
	ProcessInfo
	Reason TargetReason `json:"reason"`
	// WholeGroup is true when the target's whole process group is killed
	// (every member is a suspect or holds no GPU).
	WholeGroup bool `json:"whole_group"`
	// Outcome is filled in after the kill ladder: exited_after_sigterm,
	// exited_after_sigkill, gone_before_signal, identity_changed,
	// still_alive, or error.
	Outcome string   `json:"outcome,omitempty"`
	Signals []string `json:"signals,omitempty"`
	Error   string   `json:"error,omitempty"`
	// Tracer is the process that traced the target with ptrace(2) when the
	// plan was made or when it outlived its signals (/proc/PID/status
	// TracerPid); nil when none did.
	Tracer *Tracer `json:"tracer,omitempty"`
}

// Tracer is the process that traces a target (ptrace(2)): a tracee that
// dies stops at its exit (PTRACE_O_TRACEEXIT) or at the signal
// (signal-delivery-stop), its descriptors and so the GPU context still
// open, until the tracer lets it go or ends.
type Tracer struct {
	// PID is the tracer's process (its thread group: /proc/PID/status
	// TracerPid names the tracing thread).
	PID       int    `json:"pid"`
	StartTime uint64 `json:"start_time"`
	UID       int    `json:"uid"`
	// User and Comm are escaped (termsafe.Escape): the tracer's user
	// chose its comm.
	User string `json:"user,omitempty"`
	Comm string `json:"comm"`
	// Target is true when the tracer is itself a target of the action (a
	// proven target, or for the epilog a process of the ended job), so that
	// its signals end the hold.
	Target bool `json:"target,omitempty"`
}

// NewTracer names p as a tracer.
func NewTracer(p proc.Process) *Tracer {
	return &Tracer{PID: p.PID, StartTime: p.StartTime, UID: p.UID, User: termsafe.Escape(p.User), Comm: termsafe.Escape(p.Comm)}
}

// Who says who the tracer is, for people: "PID 4242 (strace), user
// alice (UID 1001)".
func (t Tracer) Who() string {
	user := t.User
	if user == "" {
		user = strconv.Itoa(t.UID)
	}
	return fmt.Sprintf("PID %d (%s), user %s (UID %d)", t.PID, t.Comm, user, t.UID)
}

// ExclusionReason says why a process is left alone.
type ExclusionReason string

// Exclusion is a holder the plan deliberately leaves alone, and why.
type Exclusion struct {
	ProcessInfo
	Why ExclusionReason `json:"why"`
}

// Leftover is what still holds the memory after a failed cleanup.
type Leftover struct {
	PID int `json:"pid,omitempty"`
	// Kind is alive, d_state, traced, zombie, other_pid_namespace,
	// protected, or driver.
	Kind   string `json:"kind"`
	Detail string `json:"detail"`
}
