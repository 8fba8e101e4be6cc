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
	// a forked child keeping a dead creator's context alive (FACTS.md).
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
	// Alive is false when the PID is gone or a zombie.
	Alive bool
	// Process is set when Alive.
	Process *proc.Process
}

// Holder is a live process that holds a GPU's device node open and is a
// suspect, with the reason why.
type Holder struct {
	proc.Process
	Reason string
	// Listed is true when NVML lists this PID as an owner on the GPU.
	Listed bool
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
	Suspects   []Holder

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
