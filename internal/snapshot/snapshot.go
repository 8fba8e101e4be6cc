// Package snapshot joins what NVML reports with what /proc shows into one
// account per GPU: who owns its memory, who is dead, and who holds it.
package snapshot

import (
	"slices"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/gpu"
	"github.com/gpu-orphan/gpu-orphan/internal/proc"
)

// Reasons a live process is a suspect holder of a GPU.
const (
	// ReasonInheritedFromDeadOwner: the process maps the GPU's device node,
	// NVML does not list it, and the kernel's records prove that it
	// inherited the context of a dead PID that NVML lists (Holder.Proof):
	// a forked child keeping a dead creator's context alive
	// (docs/facts.md).
	ReasonInheritedFromDeadOwner = "inherited_from_dead_owner"
	// ReasonUnexplained: the process maps the device of a GPU whose memory
	// has no live owner, belongs to no live job, and nothing proves that
	// it inherited a dead owner's context. It is shown, to be looked at,
	// and never signalled for a dead owner.
	ReasonUnexplained = "unexplained_holder"
	// ReasonOrphaned: NVML lists the process and it is alive, but its session
	// leader died and it was reparented to init or a subreaper.
	ReasonOrphaned = "orphaned"
)

// What proves that a holder inherited a dead owner's context (Holder.Proof):
// that it holds the owner's own open files of the device. Membership of the
// owner's process group or session, or descent alone, proves nothing: a
// pipeline partner, a process spawned into the session, or a child that ran
// exec and opened the device itself hold files of their own.
const (
	// ProofDescentAtFork: the kernel's fork events show it forked from the
	// owner (or from a process forked from it, and so on), each after its
	// parent, by PID and start time, and no process on that line ran exec
	// since, unless it still shared its parent's open file of the GPU when
	// it did: it holds the files the owner opened.
	ProofDescentAtFork = "descent_at_fork"
	// ProofSharedOwnerFile: while the owner lived, a snapshot saw it, a
	// descendant of the owner, share an open file of the device with the
	// owner (kcmp): it holds the owner's own files. This needs no process
	// events, only a snapshot between the fork and the owner's death.
	ProofSharedOwnerFile = "shared_owner_open_file"
	// ProofSharesFile: it shares an open file of the device (kcmp) with a
	// proven inheritor of the same dead owner.
	ProofSharesFile = "shares_open_file_with_inheritor"
	// ProofExecedSiblingsShare: it and another child of the dead owner,
	// both seen forking from it and both having run exec that could not be
	// checked, share an open file of the device (kcmp): a file that two of
	// its children share was the owner's.
	ProofExecedSiblingsShare = "siblings_share_owner_open_file"
)

// Why an unexplained holder is not proven (Holder.Proof). Each is a reason
// not to signal it.
const (
	// NoProofStartedBefore: it started before every dead owner of the GPU,
	// so it cannot have inherited from one.
	NoProofStartedBefore = "started_before_dead_owner"
	// NoProof: nothing recorded ties it to a dead owner.
	NoProof = "no_proof"
	// NoProofEventsUnavailable: the kernel's process events were not
	// available to record descent (not root or no CAP_NET_ADMIN, a network
	// namespace other than the host's, no CONFIG_PROC_EVENTS), and no
	// daemon that had them recorded this holder.
	NoProofEventsUnavailable = "process_events_unavailable"
	// NoProofNotAtFork: its descent was read from /proc (present before the
	// daemon started, or after lost events), not seen at fork.
	NoProofNotAtFork = "descent_not_seen_at_fork"
	// NoProofExeced: it, or a process between it and the owner, ran exec
	// since the fork and did not keep the inherited files.
	NoProofExeced = "exec_since_fork"
	// NoProofForkerUnsure: it, or a process between it and the owner, may
	// hold files that are not its parent's: the parent held no GPU device
	// when it forked, or another child of the parent may have cloned it
	// (CLONE_PARENT makes the fork event name the caller's parent).
	NoProofForkerUnsure = "parent_files_unproven_at_fork"
	// NoProofOwnerNotRead: the process with the owner's PID on its line
	// died before its start time was read, so whether it is the owner
	// that NVML lists is not known.
	NoProofOwnerNotRead = "dead_owner_not_identified"
	// NoProofOwnerPIDReused: more than one dead process had the owner's
	// PID, and which one NVML lists is not known.
	NoProofOwnerPIDReused = "dead_owner_pid_reused"
	// NoProofMembershipOnly: it is in the dead owner's process group or
	// session, or was seen descending from it, but nothing shows it holds
	// the owner's files. Shown to rank suspects; never signalled.
	NoProofMembershipOnly = "membership_only"
)

// How a holder belongs to a live job (JobLink.How).
const (
	JobSelf       = "self"
	JobDescendant = "descendant"
	JobAncestor   = "ancestor"
	// JobSharesFile: it shares an open file of the device with the owner,
	// so it holds the owner's own, live context.
	JobSharesFile = "shares_open_file"
)

// ContextOverheadBytes is what NVML charges to no process for each live
// context: about 8 MiB on the H200 (4714 - 4706 MiB for one context, 6354 -
// 6340 MiB for two). Memory with no owner that the live contexts explain
// is not an orphan.
const ContextOverheadBytes = 8 << 20

// Why a GPU's accounting is withheld rather than published wrong.
const (
	// UnsupportedForeignPIDNamespace: NVML's PIDs belong to a PID namespace
	// that our /proc cannot see, so every owner would look dead.
	UnsupportedForeignPIDNamespace = "foreign_pid_namespace"
)

// Snapshot is one consistent look at every GPU of the node.
type Snapshot struct {
	Taken time.Time
	// Driver is the backend that produced the readings: "nvml" or "sim".
	Driver string
	GPUs   []GPU
	// HostPIDsVisible is false when the driver's PIDs live in a PID
	// namespace this process's /proc does not show.
	HostPIDsVisible bool
	Sources         []Source
	// FDScanDenied counts the processes whose descriptors could not be
	// read (not root, no CAP_SYS_PTRACE). When it is not zero, "holds no
	// GPU" is unknown rather than proven, and the fdscan source fails.
	FDScanDenied int
	// FDScanShielded are the processes whose descriptors a security policy
	// hides even from CAP_SYS_PTRACE (a sandbox's PID 1): no privilege
	// would show more, so they are reported but do not fail the scan.
	FDScanShielded []int
}

// Source is the health of one input of a snapshot.
type Source struct {
	Name     string
	Err      error
	Duration time.Duration
}

// Owner is one process in NVML's process list for a GPU.
type Owner struct {
	PID       uint32
	UsedBytes uint64
	// Alive is true when a live process has the PID (any of its threads
	// lives) and holds this GPU's device node. A live process that does
	// not is someone else who was given a dead owner's PID.
	Alive bool
	// Process is set when Alive.
	Process *proc.Process
	// ReusedBy is the live process that now has the PID of this dead
	// owner: it holds no descriptor of the GPU, so it is not the owner.
	ReusedBy *proc.Process
	// Unverified is set when the owner is alive but its descriptors could
	// not be read: it is counted as the owner, unproven.
	Unverified bool
	// Identity, for a dead owner, is who it was, as a Loop saw it alive;
	// nil when no snapshot of this process saw it (UnknownIdentity).
	Identity *Identity
	// DeadSince, for a dead owner, is when a Loop first saw it dead, in an
	// unbroken run of snapshots: the age of its orphan.
	DeadSince time.Time
}

// Holder is a live process that holds a GPU's device node open and is a
// suspect, with the reason why.
type Holder struct {
	proc.Process
	Reason string
	// Listed is true when NVML lists this PID as an owner on the GPU.
	Listed bool
	// UsedBytes is what NVML charges to it, when Listed.
	UsedBytes uint64
	// Since is when this process was first seen a suspect for Reason, in
	// an unbroken run of snapshots (set by Loop).
	Since time.Time
	// DeadOwner is the dead listed PID whose context it holds, for
	// inherited_from_dead_owner.
	DeadOwner int
	// Proof is what proves it (Proof*) or, for unexplained_holder, why
	// nothing does (NoProof*).
	Proof string
}

// Holding is a live process that holds a GPU's device node open.
type Holding struct {
	proc.Process
	// Mapped is true when it maps the device node, as a CUDA context's
	// holders do. NVML-only readers (nvidia-smi, DCGM, exporters) keep
	// the node open without mapping it.
	Mapped bool
	// LiveJobGPUs are the UUIDs of the GPUs where the process is part of a
	// live job, whatever else it holds: it, one of its ancestors, or one of
	// its descendants (a launcher) owns live memory there, or it shares an
	// open file of the device with a live owner there (a helper holding
	// the owner's own context).
	LiveJobGPUs []string
	// LiveJobs say how it belongs to each live owner's job.
	LiveJobs []JobLink
}

// JobLink ties a holder to a live owner's job.
type JobLink struct {
	OwnerPID int
	GPU      string
	// How is one of the Job* constants.
	How string
}

func (h *Holding) link(owner int, gpu, how string) {
	if !slices.Contains(h.LiveJobGPUs, gpu) {
		h.LiveJobGPUs = append(h.LiveJobGPUs, gpu)
	}
	l := JobLink{OwnerPID: owner, GPU: gpu, How: how}
	if !slices.Contains(h.LiveJobs, l) {
		h.LiveJobs = append(h.LiveJobs, l)
	}
}

// GPU is the account of one GPU (or one MIG instance).
type GPU struct {
	Device gpu.Device
	Memory gpu.Memory
	// Unsupported, when set, says why the numbers below are not published.
	Unsupported string
	// Err is set when this GPU could not be read.
	Err error

	Owners []Owner

	OwnedLiveBytes    uint64
	OwnedDeadBytes    uint64
	UnattributedBytes uint64
	// UnownedBytes is Used minus OwnedLiveBytes: memory no live process owns.
	UnownedBytes uint64
	// UnexplainedBytes is the part of UnownedBytes that is an orphan: what
	// dead owners own, plus unattributed memory beyond what the live
	// contexts explain (ContextOverheadBytes each). No policy acts below it.
	UnexplainedBytes uint64

	// Scanned is true when /proc/*/fd was scanned for this GPU's holders.
	Scanned bool
	// HolderPIDs are every process holding the device node, when Scanned.
	HolderPIDs []int
	// Holders are the live ones among them, with what they are.
	Holders  []Holding
	Suspects []Holder

	// UnownedSince is when UnownedBytes first rose above the orphan
	// threshold in an unbroken run of snapshots; zero when it is below.
	UnownedSince time.Time
}

// Accountable reports whether the GPU's ownership numbers can be trusted.
func (g GPU) Accountable() bool { return g.Err == nil && g.Unsupported == "" }

// DeadOwnerListed reports whether NVML lists a PID that no longer lives.
func (g GPU) DeadOwnerListed() bool {
	for _, o := range g.Owners {
		if !o.Alive {
			return true
		}
	}
	return false
}

// Owner returns the listed owner with pid.
func (g GPU) Owner(pid int) (Owner, bool) {
	for _, o := range g.Owners {
		if int(o.PID) == pid {
			return o, true
		}
	}
	return Owner{}, false
}

// Healthy reports whether every source of the snapshot succeeded.
func (s *Snapshot) Healthy() bool {
	for _, src := range s.Sources {
		if src.Err != nil {
			return false
		}
	}
	return true
}

// GPUByID finds a GPU by its index ("0") or UUID.
func (s *Snapshot) GPUByID(id string) (GPU, bool) {
	for _, g := range s.GPUs {
		if g.Device.UUID == id || (g.Device.MIGInstance == "" && itoa(g.Device.Index) == id) {
			return g, true
		}
	}
	return GPU{}, false
}
