package main

import (
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/proc"
	"github.com/gpu-orphan/gpu-orphan/internal/snapshot"
	"github.com/gpu-orphan/gpu-orphan/remediate"
)

// Report is the JSON view of a snapshot that `gpu-orphan ps -o json`
// prints; its field names are for scripts, so keep them stable.
type Report struct {
	Taken           time.Time      `json:"taken"`
	Driver          string         `json:"driver"`
	HostPIDsVisible bool           `json:"host_pids_visible"`
	Sources         []ReportSource `json:"sources"`
	// FDScanUnreadableProcesses counts the processes whose descriptors
	// could not be read (not root, no CAP_SYS_PTRACE). When it is not 0,
	// holders may be missing: "no suspect holders" is not proven.
	FDScanUnreadableProcesses int `json:"fdscan_unreadable_processes"`
	// FDScanShieldedPIDs are the processes whose descriptors a security
	// policy hides even from CAP_SYS_PTRACE; they do not fail the scan.
	FDScanShieldedPIDs []int       `json:"fdscan_shielded_pids,omitempty"`
	GPUs               []ReportGPU `json:"gpus"`
	// ProofSource says whose record of descent proved the inheritors: the
	// node agent's store, or none (then no holder is proven one).
	ProofSource string `json:"proof_source,omitempty"`
}

// ReportSource is one input's health.
type ReportSource struct {
	Name            string  `json:"name"`
	DurationSeconds float64 `json:"duration_seconds"`
	Error           string  `json:"error,omitempty"`
}

// ReportGPU is one GPU's account.
type ReportGPU struct {
	Index             int            `json:"index"`
	UUID              string         `json:"uuid"`
	Name              string         `json:"name"`
	MIGInstance       string         `json:"mig_instance,omitempty"`
	DevicePath        string         `json:"device_path"`
	Error             string         `json:"error,omitempty"`
	Unsupported       string         `json:"unsupported,omitempty"`
	TotalBytes        uint64         `json:"total_bytes"`
	ReservedBytes     uint64         `json:"reserved_bytes"`
	UsedBytes         uint64         `json:"used_bytes"`
	FreeBytes         uint64         `json:"free_bytes"`
	OwnedLiveBytes    uint64         `json:"owned_live_bytes"`
	OwnedDeadBytes    uint64         `json:"owned_dead_bytes"`
	UnattributedBytes uint64         `json:"unattributed_bytes"`
	UnownedBytes      uint64         `json:"unowned_bytes"`
	Owners            []ReportOwner  `json:"owners"`
	HolderPIDs        []int          `json:"holder_pids"`
	Suspects          []ReportHolder `json:"suspects"`
}

// ReportOwner is one PID that NVML lists.
type ReportOwner struct {
	PID       uint32 `json:"pid"`
	UsedBytes uint64 `json:"used_bytes"`
	Alive     bool   `json:"alive"`
	// LeaderExited: alive, but its main thread has exited while other
	// threads run on (/proc shows it as Z).
	LeaderExited bool `json:"leader_exited,omitempty"`
	// Unverified: alive, but its descriptors could not be read, so that
	// it still holds the GPU is assumed, not proven.
	Unverified bool `json:"unverified,omitempty"`
	// ReusedBy is the unrelated live process that now has the PID of
	// this dead owner; it holds no descriptor of the GPU.
	ReusedBy *ReportProcessRef `json:"reused_by,omitempty"`
	// DeadOwner, for a dead owner, is who it was (from the node's exporter).
	DeadOwner *ReportDeadOwner `json:"dead_owner,omitempty"`
}

// ReportProcessRef names a process: (pid, start_time) is its identity even
// when the PID is reused.
type ReportProcessRef struct {
	PID       int    `json:"pid"`
	Comm      string `json:"comm"`
	StartTime uint64 `json:"start_time"`
}

// ReportHolder is one suspect holder: its identity, as the remediator's
// audit record keeps it, and why it is a suspect.
type ReportHolder struct {
	remediate.ProcessInfo
	Reason string `json:"reason"`
	Listed bool   `json:"listed_by_nvml"`
	// Proof is what proves an inheritor (or, for unexplained_holder, why
	// nothing does); DeadOwner is the dead PID whose context it holds.
	Proof     string `json:"proof,omitempty"`
	DeadOwner int    `json:"dead_owner_pid,omitempty"`
}

// NewReport builds the JSON view of s.
func NewReport(s *snapshot.Snapshot, devicePath func(minor int) string) Report {
	r := Report{Taken: s.Taken, Driver: s.Driver, HostPIDsVisible: s.HostPIDsVisible, Sources: []ReportSource{}, GPUs: []ReportGPU{},
		FDScanUnreadableProcesses: s.FDScanDenied, FDScanShieldedPIDs: s.FDScanShielded}
	for _, src := range s.Sources {
		rs := ReportSource{Name: src.Name, DurationSeconds: src.Duration.Seconds()}
		if src.Err != nil {
			rs.Error = src.Err.Error()
		}
		r.Sources = append(r.Sources, rs)
	}
	for _, g := range s.GPUs {
		rg := ReportGPU{
			Index: g.Device.Index, UUID: g.Device.UUID, Name: g.Device.Name, MIGInstance: g.Device.MIGInstance,
			DevicePath: devicePath(g.Device.Minor), Unsupported: g.Unsupported,
			TotalBytes: g.Memory.Total, ReservedBytes: g.Memory.Reserved, UsedBytes: g.Memory.Used, FreeBytes: g.Memory.Free,
			OwnedLiveBytes: g.OwnedLiveBytes, OwnedDeadBytes: g.OwnedDeadBytes, UnattributedBytes: g.UnattributedBytes, UnownedBytes: g.UnownedBytes,
			Owners: []ReportOwner{}, HolderPIDs: g.HolderPIDs, Suspects: []ReportHolder{},
		}
		if g.Err != nil {
			rg.Error = g.Err.Error()
		}
		if rg.HolderPIDs == nil {
			rg.HolderPIDs = []int{}
		}
		for _, o := range g.Owners {
			ro := ReportOwner{PID: o.PID, UsedBytes: o.UsedBytes, Alive: o.Alive, Unverified: o.Alive && o.Unverified}
			if o.Alive && o.Process != nil {
				ro.LeaderExited = o.Process.LeaderExited
			}
			if !o.Alive && o.ReusedBy != nil {
				ro.ReusedBy = &ReportProcessRef{PID: o.ReusedBy.PID, Comm: o.ReusedBy.Comm, StartTime: o.ReusedBy.StartTime}
			}
			rg.Owners = append(rg.Owners, ro)
		}
		for _, h := range g.Suspects {
			rh := NewReportHolder(h.Process, h.Reason, h.Listed)
			rh.Proof, rh.DeadOwner = h.Proof, h.DeadOwner
			rg.Suspects = append(rg.Suspects, rh)
		}
		r.GPUs = append(r.GPUs, rg)
	}
	return r
}

// NewReportHolder is the JSON view of one process.
func NewReportHolder(p proc.Process, reason string, listed bool) ReportHolder {
	return ReportHolder{ProcessInfo: remediate.NewProcessInfo(p), Reason: reason, Listed: listed}
}
