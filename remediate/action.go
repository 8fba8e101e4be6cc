// Package remediate turns Alertmanager's alerts into verified, rate-limited
// cleanup of the processes that hold orphaned GPU memory. The steps live in
// subpackages named after them: decide (what to kill), kill (the signal
// ladder), limits (how often), store (the audit record).
package remediate

import (
	"slices"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/proc"
	"github.com/gpu-orphan/gpu-orphan/internal/snapshot"
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
	// Source is "webhook" or "cli".
	Source string `json:"source"`

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
	// Kind is d_state, zombie, other_pid_namespace, protected, or driver.
	Kind   string `json:"kind"`
	Detail string `json:"detail"`
}
