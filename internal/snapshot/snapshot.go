// Package snapshot joins what NVML reports with what /proc shows into one
// account per GPU: who owns its memory, who is dead, and who holds it.
package snapshot

import (
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/gpu"
	"github.com/gpu-orphan/gpu-orphan/internal/proc"
)

// Reasons a live process is a suspect holder of a GPU.
const (
	// ReasonInheritedFromDeadOwner: the process holds the GPU's device node,
	// NVML does not list it, and NVML lists a dead PID on that GPU. This is
	// a forked child keeping a dead creator's context alive (docs/facts.md).
	ReasonInheritedFromDeadOwner = "inherited_from_dead_owner"
	// ReasonOrphaned: NVML lists the process and it is alive, but its session
	// leader died and it was reparented to init or a subreaper.
	ReasonOrphaned = "orphaned"
)

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
}

// Holding is a live process that holds a GPU's device node open.
type Holding struct {
	proc.Process
	// Mapped is true when it maps the device node, as a CUDA context's
	// holders do. NVML-only readers (nvidia-smi, DCGM, exporters) keep
	// the node open without mapping it.
	Mapped bool
	// LiveJobGPUs are the UUIDs of the GPUs where the process itself or
	// one of its ancestors owns live memory: it is part of a live job
	// there, whatever else it holds.
	LiveJobGPUs []string
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
