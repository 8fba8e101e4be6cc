package decide

import (
	"errors"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/gpu"
	"github.com/gpu-orphan/gpu-orphan/internal/proc"
	"github.com/gpu-orphan/gpu-orphan/internal/snapshot"
	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/exclude"
)

const mib = gpu.MiB

var now = time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)

// self is the remediator in every case: PID 9000, its own group, in the
// session of a shell (8999).
var self = exclude.Self{PID: 9000, PGID: 9000, SID: 8999}

func baseConfig(policy remediate.Policy) Config {
	return Config{Policy: policy, MinAge: time.Minute, MinBytes: 256 * mib, Self: self}
}

// pr builds a live process of a job started from session 50.
func pr(pid, ppid, pgid int, comm string) proc.Process {
	return proc.Process{
		PID: pid, PPID: ppid, PGID: pgid, SID: 50, State: "S",
		StartTime: uint64(100000 + pid), UID: 1000, User: "alice",
		Comm: comm, Cmdline: comm + " --job", Cgroup: "/user.slice",
	}
}

func ptr(p proc.Process) *proc.Process { return &p }

// inherited is a proven inheritor of dead owner 100's context.
func inherited(p proc.Process) snapshot.Holder {
	return inheritedFrom(100, p)
}

func inheritedFrom(owner int, p proc.Process) snapshot.Holder {
	return snapshot.Holder{Process: p, Reason: snapshot.ReasonInheritedFromDeadOwner, DeadOwner: owner, Proof: snapshot.ProofDescentAtFork}
}

// unexplained maps the GPU without proof of inheritance.
func unexplained(p proc.Process) snapshot.Holder {
	return snapshot.Holder{Process: p, Reason: snapshot.ReasonUnexplained, Proof: snapshot.NoProof}
}

// orphaned is an orphaned owner of 2658 MiB, seen orphaned for ten minutes.
func orphaned(p proc.Process) snapshot.Holder {
	return snapshot.Holder{Process: p, Reason: snapshot.ReasonOrphaned, Listed: true, UsedBytes: 2658 * mib, Since: now.Add(-10 * time.Minute)}
}

// dead is a dead owner, dead for ten minutes.
func dead(pid uint32, bytes uint64) snapshot.Owner {
	return snapshot.Owner{PID: pid, UsedBytes: bytes, DeadSince: now.Add(-10 * time.Minute)}
}

func live(p proc.Process, bytes uint64) snapshot.Owner {
	return snapshot.Owner{PID: uint32(p.PID), UsedBytes: bytes, Alive: true, Process: ptr(p)}
}

// gpuAcct builds one scanned GPU and fills in the totals from its owners,
// as snapshot.Taker does. Unowned memory has been there for ten minutes.
func gpuAcct(index int, owners []snapshot.Owner, holders []int, suspects ...snapshot.Holder) snapshot.GPU {
	g := snapshot.GPU{
		Device:       gpu.Device{Index: index, UUID: "GPU-" + string(rune('a'+index)), Name: "NVIDIA H200", Minor: index},
		Owners:       owners,
		Scanned:      true,
		HolderPIDs:   holders,
		Suspects:     suspects,
		UnownedSince: now.Add(-10 * time.Minute),
	}
	for _, o := range owners {
		if o.Alive {
			g.OwnedLiveBytes += o.UsedBytes
		} else {
			g.OwnedDeadBytes += o.UsedBytes
		}
		g.Memory.Used += o.UsedBytes + 8*mib
	}
	g.UnownedBytes = g.Memory.Used - g.OwnedLiveBytes
	// Each context's 8 MiB is unattributed; the live ones explain theirs.
	g.UnexplainedBytes = g.OwnedDeadBytes
	for _, o := range owners {
		if !o.Alive {
			g.UnexplainedBytes += 8 * mib
		}
	}
	if g.UnownedBytes <= 256*mib {
		g.UnownedSince = time.Time{}
	}
	// Every holder of the cast maps the device but the NVML-only readers;
	// live owners (on this GPU) are live jobs.
	for _, pid := range holders {
		h := snapshot.Holding{Process: cast[pid], Mapped: true}
		if h.PID == 0 {
			h.Process = pr(pid, 1, pid, "cuda_app")
		}
		switch h.Comm {
		case "nvidia-smi", "dcgm-exporter", "nvidia-persiste":
			h.Mapped = false
		}
		for _, o := range owners {
			if o.Alive && int(o.PID) == pid {
				h.LiveJobGPUs = []string{g.Device.UUID}
			}
		}
		g.Holders = append(g.Holders, h)
	}
	return g
}

func snap(gpus ...snapshot.GPU) *snapshot.Snapshot {
	return &snapshot.Snapshot{
		Taken: now, Driver: "sim", GPUs: gpus, HostPIDsVisible: true,
		Sources: []snapshot.Source{{Name: "sim"}, {Name: snapshot.SourceProc}, {Name: snapshot.SourceFDScan}},
	}
}

// listed is what a caller found of process groups: their members.
func listed(groups map[int][]proc.Process) map[int]Group {
	out := map[int]Group{}
	for pgid, members := range groups {
		out[pgid] = Group{Members: members}
	}
	return out
}

// The cast of the fork-orphan case (docs/facts.md): trainer 100 forked workers
// 201 and 202 after CUDA init and was SIGKILLed; the workers, reparented to
// init, keep its context. 203 is a non-GPU helper of the same job. 300 is
// another user's healthy job.
var (
	worker1   = pr(201, 1, 100, "pt_data_worker")
	worker2   = pr(202, 1, 100, "pt_data_worker")
	helper    = pr(203, 1, 100, "tensorboard")
	stranger  = pr(204, 1, 100, "python3")
	other     = pr(300, 299, 300, "python3")
	smi       = pr(301, 1, 301, "nvidia-smi")
	persisted = pr(302, 1, 302, "nvidia-persiste") // nvidia-persistenced, truncated by the kernel
	exporter  = pr(303, 1, 303, "dcgm-exporter")
	// An orphaned owner: its own context outlived its killed parent; its
	// session leader (390) is dead.
	spawned  = proc.Process{PID: 400, PPID: 1, PGID: 390, SID: 390, State: "S", StartTime: 100400, User: "bob", Comm: "python3", Cmdline: "python3 spawn.py"}
	spawnAux = proc.Process{PID: 401, PPID: 400, PGID: 390, SID: 390, State: "S", StartTime: 100401, User: "bob", Comm: "sleep", Cmdline: "sleep 1000"}
)

// cast indexes the processes above by PID.
var cast = func() map[int]proc.Process {
	m := map[int]proc.Process{}
	for _, p := range []proc.Process{worker1, worker2, helper, stranger, other, smi, persisted, exporter, spawned, spawnAux} {
		m[p.PID] = p
	}
	return m
}()

func forkOrphan() snapshot.GPU {
	return gpuAcct(0, []snapshot.Owner{dead(100, 6754*mib)}, []int{201, 202}, inherited(worker1), inherited(worker2))
}

func forkOrphanGroups(members ...proc.Process) map[int]Group {
	return listed(map[int][]proc.Process{100: members})
}

func TestDecide(t *testing.T) {
	for _, tc := range []struct {
		name string
		snap *snapshot.Snapshot
		gpu  string
		cfg  Config
		// groups are the listed process groups; nil means none were
		// listed, and only suspects are targeted.
		groups map[int]Group

		wantSkip       SkipReason // "" means Act
		wantSkipDetail string     // a part of SkipDetail
		wantTargets    map[int]remediate.TargetReason
		wantWhole      []int
		wantGroups     []int
		wantExcluded   map[int]remediate.ExclusionReason
		wantNote       string
	}{
		{
			name:        "fork orphan: both children targeted, whole group",
			snap:        snap(forkOrphan()),
			gpu:         "0",
			cfg:         baseConfig(remediate.PolicyDeadOwner),
			groups:      forkOrphanGroups(worker1, worker2),
			wantTargets: map[int]remediate.TargetReason{201: remediate.ReasonInheritedFromDeadOwner, 202: remediate.ReasonInheritedFromDeadOwner},
			wantWhole:   []int{201, 202},
			wantGroups:  []int{100},
		},
		{
			// Finding 3 of issue 22: an idle member (a helper, another
			// user's process) is never signalled for being in the group.
			name:   "fork orphan by UUID, default policy: an idle member keeps the group from being killed whole",
			snap:   snap(forkOrphan()),
			gpu:    "GPU-a",
			cfg:    Config{MinAge: time.Minute, MinBytes: 256 * mib, Self: self},
			groups: forkOrphanGroups(worker1, worker2, helper),
			wantTargets: map[int]remediate.TargetReason{
				201: remediate.ReasonInheritedFromDeadOwner,
				202: remediate.ReasonInheritedFromDeadOwner,
			},
			wantNote: "member 203",
		},
		{
			name: "live owner on the same GPU is never targeted",
			snap: snap(gpuAcct(0, []snapshot.Owner{dead(100, 6754*mib), live(other, 4096*mib)}, []int{201, 300},
				inherited(worker1))),
			gpu:          "0",
			cfg:          baseConfig(remediate.PolicyDeadOwner),
			groups:       forkOrphanGroups(worker1),
			wantTargets:  map[int]remediate.TargetReason{201: remediate.ReasonInheritedFromDeadOwner},
			wantWhole:    []int{201},
			wantGroups:   []int{100},
			wantExcluded: map[int]remediate.ExclusionReason{300: WhyOwnsLiveMemory},
		},
		{
			name: "a suspect that owns live memory on another GPU is left alone",
			snap: snap(
				forkOrphan(),
				gpuAcct(1, []snapshot.Owner{live(worker2, 2048*mib)}, []int{202}),
			),
			gpu:          "0",
			cfg:          baseConfig(remediate.PolicyDeadOwner),
			groups:       forkOrphanGroups(worker1, worker2),
			wantTargets:  map[int]remediate.TargetReason{201: remediate.ReasonInheritedFromDeadOwner},
			wantExcluded: map[int]remediate.ExclusionReason{202: WhyOwnsLiveMemory},
			wantNote:     "member 202",
		},
		{
			name: "protected holders are excluded, truncated comm included",
			snap: snap(gpuAcct(0, []snapshot.Owner{dead(100, 6754*mib)}, []int{201, 301, 302, 303},
				inherited(worker1), inherited(smi), inherited(persisted), inherited(exporter))),
			gpu:          "0",
			cfg:          baseConfig(remediate.PolicyDeadOwner),
			groups:       forkOrphanGroups(worker1),
			wantTargets:  map[int]remediate.TargetReason{201: remediate.ReasonInheritedFromDeadOwner},
			wantWhole:    []int{201},
			wantGroups:   []int{100},
			wantExcluded: map[int]remediate.ExclusionReason{301: exclude.WhyProtected, 302: exclude.WhyProtected, 303: exclude.WhyProtected},
		},
		{
			name: "an innocent member holding another GPU keeps its group: suspects only",
			snap: snap(
				forkOrphan(),
				gpuAcct(1, []snapshot.Owner{dead(150, 1024*mib)}, []int{204}),
			),
			gpu:         "0",
			cfg:         baseConfig(remediate.PolicyDeadOwner),
			groups:      forkOrphanGroups(worker1, worker2, stranger),
			wantTargets: map[int]remediate.TargetReason{201: remediate.ReasonInheritedFromDeadOwner, 202: remediate.ReasonInheritedFromDeadOwner},
			wantNote:    "member 204 (python3) is not a proven target",
		},
		{
			name: "an idle member is not added while another GPU was not scanned",
			snap: func() *snapshot.Snapshot {
				g1 := gpuAcct(1, nil, nil)
				g1.Scanned = false
				return snap(forkOrphan(), g1)
			}(),
			gpu:         "0",
			cfg:         baseConfig(remediate.PolicyDeadOwner),
			groups:      forkOrphanGroups(worker1, worker2, helper),
			wantTargets: map[int]remediate.TargetReason{201: remediate.ReasonInheritedFromDeadOwner, 202: remediate.ReasonInheritedFromDeadOwner},
			wantNote:    "member 203 (tensorboard) is not a proven target",
		},
		{
			name: "a protected member keeps its group",
			snap: snap(forkOrphan()),
			gpu:  "0",
			cfg:  baseConfig(remediate.PolicyDeadOwner),
			groups: forkOrphanGroups(worker1, worker2,
				proc.Process{PID: 205, PPID: 1, PGID: 100, SID: 50, StartTime: 1, Comm: "sshd", Cmdline: "sshd: alice"}),
			wantTargets: map[int]remediate.TargetReason{201: remediate.ReasonInheritedFromDeadOwner, 202: remediate.ReasonInheritedFromDeadOwner},
			wantNote:    "member 205 (sshd) is not a proven target",
		},
		{
			name:        "a group that cannot be listed is not killed whole",
			snap:        snap(forkOrphan()),
			gpu:         "0",
			cfg:         baseConfig(remediate.PolicyDeadOwner),
			groups:      map[int]Group{100: {Err: errors.New("permission denied")}},
			wantTargets: map[int]remediate.TargetReason{201: remediate.ReasonInheritedFromDeadOwner, 202: remediate.ReasonInheritedFromDeadOwner},
			wantNote:    "permission denied",
		},
		{
			name:        "a group the caller did not list is not killed whole",
			snap:        snap(forkOrphan()),
			gpu:         "0",
			cfg:         baseConfig(remediate.PolicyDeadOwner),
			groups:      map[int]Group{},
			wantTargets: map[int]remediate.TargetReason{201: remediate.ReasonInheritedFromDeadOwner, 202: remediate.ReasonInheritedFromDeadOwner},
			wantNote:    "its members were not listed",
		},
		{
			name:        "without listed groups only suspects are targeted",
			snap:        snap(forkOrphan()),
			gpu:         "0",
			cfg:         baseConfig(remediate.PolicyDeadOwner),
			wantTargets: map[int]remediate.TargetReason{201: remediate.ReasonInheritedFromDeadOwner, 202: remediate.ReasonInheritedFromDeadOwner},
		},
		{
			name: "self, own group and own session are excluded",
			snap: snap(gpuAcct(0, []snapshot.Owner{dead(100, 6754*mib)}, []int{201, 9000, 9001, 9002},
				inherited(worker1),
				inherited(proc.Process{PID: 9000, PPID: 8999, PGID: 9000, SID: 8999, StartTime: 9, Comm: "gpu-orphan-rem", Cmdline: "x"}),
				inherited(proc.Process{PID: 9001, PPID: 9000, PGID: 9000, SID: 8999, StartTime: 9, Comm: "python3", Cmdline: "x"}),
				inherited(proc.Process{PID: 9002, PPID: 8999, PGID: 9002, SID: 8999, StartTime: 9, Comm: "python3", Cmdline: "x"}),
			)),
			gpu: "0",
			cfg: baseConfig(remediate.PolicyDeadOwner),
			// 201's group holds a process of our session: never killed whole.
			groups: forkOrphanGroups(worker1,
				proc.Process{PID: 210, PPID: 1, PGID: 100, SID: 8999, StartTime: 9, Comm: "bash", Cmdline: "bash"}),
			wantTargets:  map[int]remediate.TargetReason{201: remediate.ReasonInheritedFromDeadOwner},
			wantExcluded: map[int]remediate.ExclusionReason{9000: exclude.WhySelf, 9001: exclude.WhyOwnGroup, 9002: exclude.WhyOwnSession},
			wantNote:     "member 210 (bash) is not a proven target",
		},
		{
			name: "PID 1 and kernel threads are excluded",
			snap: snap(gpuAcct(0, []snapshot.Owner{dead(100, 6754*mib)}, []int{1, 2, 33, 34},
				inherited(proc.Process{PID: 1, SID: 1, PGID: 1, StartTime: 1, Comm: "bash", Cmdline: "/bin/bash"}),
				inherited(proc.Process{PID: 2, StartTime: 1, Comm: "kthreadd"}),
				inherited(proc.Process{PID: 33, PPID: 2, StartTime: 2, Comm: "nv_queue"}),
				inherited(proc.Process{PID: 34, StartTime: 2, Comm: "weird"}),
			)),
			gpu:          "0",
			cfg:          baseConfig(remediate.PolicyDeadOwner),
			wantSkip:     SkipNoTargets,
			wantExcluded: map[int]remediate.ExclusionReason{1: exclude.WhyPID1, 2: exclude.WhyKernelThread, 33: exclude.WhyKernelThread, 34: exclude.WhyKernelThread},
		},
		{
			name: "a holder whose identity /proc could not tell is excluded",
			snap: snap(gpuAcct(0, []snapshot.Owner{dead(100, 6754*mib)}, []int{201, 222},
				inherited(worker1), inherited(proc.Process{PID: 222}))),
			gpu:          "0",
			cfg:          baseConfig(remediate.PolicyDeadOwner),
			wantTargets:  map[int]remediate.TargetReason{201: remediate.ReasonInheritedFromDeadOwner},
			wantExcluded: map[int]remediate.ExclusionReason{222: exclude.WhyIdentityUnknown},
		},
		{
			name: "too young",
			snap: func() *snapshot.Snapshot {
				g := forkOrphan()
				g.Owners[0].DeadSince = now.Add(-10 * time.Second)
				return snap(g)
			}(),
			gpu:      "0",
			cfg:      baseConfig(remediate.PolicyDeadOwner),
			wantSkip: SkipTooYoung,
		},
		{
			name: "a dead owner never dated is too young for any min-age",
			snap: func() *snapshot.Snapshot {
				g := forkOrphan()
				g.Owners[0].DeadSince = time.Time{}
				return snap(g)
			}(),
			gpu:      "0",
			cfg:      baseConfig(remediate.PolicyDeadOwner),
			wantSkip: SkipTooYoung,
		},
		{
			// Finding 7 of issue 15: an old orphan that a protected process
			// holds does not make a new one old.
			name: "each dead owner has its own clock",
			snap: func() *snapshot.Snapshot {
				young := dead(150, 4096*mib)
				young.DeadSince = now.Add(-300 * time.Millisecond)
				return snap(gpuAcct(0, []snapshot.Owner{dead(100, 6754*mib), young}, []int{201, 205},
					inherited(worker1), inheritedFrom(150, pr(205, 1, 150, "pt_data_worker"))))
			}(),
			gpu:          "0",
			cfg:          baseConfig(remediate.PolicyDeadOwner),
			wantTargets:  map[int]remediate.TargetReason{201: remediate.ReasonInheritedFromDeadOwner},
			wantExcluded: map[int]remediate.ExclusionReason{205: WhyDeadOwnerTooYoung},
		},
		{
			// Findings 1, 2 and 5 of issue 15: mapping the GPU is no proof.
			name: "an unexplained holder is shown, never signalled",
			snap: snap(gpuAcct(0, []snapshot.Owner{dead(100, 6754*mib)}, []int{201, 204},
				inherited(worker1), unexplained(stranger))),
			gpu:          "0",
			cfg:          baseConfig(remediate.PolicyDeadOwner),
			wantTargets:  map[int]remediate.TargetReason{201: remediate.ReasonInheritedFromDeadOwner},
			wantExcluded: map[int]remediate.ExclusionReason{204: WhyUnexplained},
		},
		{
			name:           "only unexplained holders: no targets, and the plan says whom to look at",
			snap:           snap(gpuAcct(0, []snapshot.Owner{dead(100, 6754*mib)}, []int{204}, unexplained(stranger))),
			gpu:            "0",
			cfg:            baseConfig(remediate.PolicyDeadOwner),
			wantSkip:       SkipNoTargets,
			wantSkipDetail: "nothing proves that 204 (python3) inherited",
			wantExcluded:   map[int]remediate.ExclusionReason{204: WhyUnexplained},
		},
		{
			// Finding 4 of issue 15: 40 healthy contexts leave 320 MiB
			// charged to no process; that is no orphan.
			name: "all-holders: no dead owner, unattributed memory that live contexts explain",
			snap: func() *snapshot.Snapshot {
				var owners []snapshot.Owner
				var holders []int
				for i := range 40 {
					p := pr(500+i, 1, 500+i, "python3")
					cast[p.PID] = p
					owners = append(owners, live(p, 1024*mib))
					holders = append(holders, p.PID)
				}
				return snap(gpuAcct(0, owners, holders))
			}(),
			gpu:            "0",
			cfg:            baseConfig(remediate.PolicyAllHolders),
			wantSkip:       SkipBelowThreshold,
			wantSkipDetail: "what 40 live contexts explain",
		},
		{
			name: "below threshold: only the per-context slack is unowned",
			snap: snap(gpuAcct(0, []snapshot.Owner{live(other, 4096*mib)}, []int{300})),
			gpu:  "0",
			cfg:  baseConfig(remediate.PolicyDeadOwner),
			// 8 MiB per live context are charged to no process.
			wantSkip: SkipBelowThreshold,
		},
		{
			name: "unhealthy snapshot",
			snap: func() *snapshot.Snapshot {
				s := snap(forkOrphan())
				s.Sources[2].Err = errors.New("scan failed")
				return s
			}(),
			gpu:      "0",
			cfg:      baseConfig(remediate.PolicyDeadOwner),
			groups:   forkOrphanGroups(worker1, worker2),
			wantSkip: SkipSnapshotUnhealthy,
		},
		{
			name: "driver failed: no GPUs, unhealthy rather than not found",
			snap: &snapshot.Snapshot{Taken: now, Sources: []snapshot.Source{{Name: "nvml", Err: errors.New("hung")}}},
			gpu:  "0", cfg: baseConfig(remediate.PolicyDeadOwner),
			wantSkip: SkipSnapshotUnhealthy,
		},
		{
			name:     "nil snapshot",
			gpu:      "0",
			cfg:      baseConfig(remediate.PolicyDeadOwner),
			wantSkip: SkipSnapshotUnhealthy,
		},
		{
			name: "accounting unsupported",
			snap: func() *snapshot.Snapshot {
				g := forkOrphan()
				g.Unsupported = snapshot.UnsupportedForeignPIDNamespace
				return snap(g)
			}(),
			gpu:            "0",
			cfg:            baseConfig(remediate.PolicyDeadOwner),
			wantSkip:       SkipAccountingUnsupported,
			wantSkipDetail: snapshot.UnsupportedForeignPIDNamespace,
		},
		{
			name: "GPU read failed",
			snap: func() *snapshot.Snapshot {
				g := forkOrphan()
				g.Err = errors.New("GPU is lost")
				return snap(g)
			}(),
			gpu:            "0",
			cfg:            baseConfig(remediate.PolicyDeadOwner),
			wantSkip:       SkipGPUReadFailed,
			wantSkipDetail: "GPU is lost",
		},
		{
			name:     "GPU not found",
			snap:     snap(forkOrphan()),
			gpu:      "7",
			cfg:      baseConfig(remediate.PolicyDeadOwner),
			wantSkip: SkipGPUNotFound,
		},
		{
			name:           "unknown policy",
			snap:           snap(forkOrphan()),
			gpu:            "0",
			cfg:            baseConfig("everything"),
			wantSkip:       SkipUnknownPolicy,
			wantSkipDetail: "everything",
		},
		{
			name: "holders not scanned",
			snap: func() *snapshot.Snapshot {
				g := forkOrphan()
				g.Scanned, g.HolderPIDs, g.Suspects = false, nil, nil
				return snap(g)
			}(),
			gpu:      "0",
			cfg:      baseConfig(remediate.PolicyDeadOwner),
			wantSkip: SkipNotScanned,
		},
		{
			name: "unowned memory but no dead owner listed: nothing for dead-owner",
			snap: func() *snapshot.Snapshot {
				g := gpuAcct(0, nil, []int{204}, unexplained(stranger))
				g.Memory.Used, g.UnownedBytes, g.UnownedSince = 4096*mib, 4096*mib, now.Add(-time.Hour)
				g.UnexplainedBytes = 4096 * mib
				return snap(g)
			}(),
			gpu:          "0",
			cfg:          baseConfig(remediate.PolicyDeadOwner),
			wantSkip:     SkipNoTargets,
			wantExcluded: map[int]remediate.ExclusionReason{204: WhyUnexplained},
		},
		{
			name: "dead-owner leaves an orphaned owner alone",
			snap: snap(gpuAcct(0, []snapshot.Owner{live(spawned, 2658*mib)}, []int{400}, orphaned(spawned))),
			gpu:  "0",
			cfg:  baseConfig(remediate.PolicyDeadOwner),
			// Its memory has a live owner: nothing is unowned.
			wantSkip: SkipBelowThreshold,
		},
		{
			// Finding 6 of issue 15.
			name:     "orphaned policy: an orphaned owner on a GPU with no orphan is left alone",
			snap:     snap(gpuAcct(0, []snapshot.Owner{live(spawned, 2658*mib)}, []int{400}, orphaned(spawned))),
			gpu:      "0",
			cfg:      baseConfig(remediate.PolicyOrphaned),
			groups:   listed(map[int][]proc.Process{390: {spawned, spawnAux}}),
			wantSkip: SkipBelowThreshold,
		},
		{
			name:   "orphaned policy picks the orphaned owner and its group",
			snap:   snap(gpuAcct(0, []snapshot.Owner{dead(150, 1024*mib), live(spawned, 2658*mib)}, []int{400}, orphaned(spawned))),
			gpu:    "0",
			cfg:    baseConfig(remediate.PolicyOrphaned),
			groups: listed(map[int][]proc.Process{390: {spawned, spawnAux}}),
			wantTargets: map[int]remediate.TargetReason{
				400: remediate.ReasonOrphaned,
			},
			wantNote: "member 401",
		},
		{
			name: "orphaned policy takes inherited suspects too when the problem holds",
			snap: snap(
				gpuAcct(0, []snapshot.Owner{dead(100, 6754*mib), live(spawned, 2658*mib)}, []int{201, 202, 400},
					inherited(worker1), inherited(worker2), orphaned(spawned)),
			),
			gpu: "0",
			cfg: baseConfig(remediate.PolicyOrphaned),
			wantTargets: map[int]remediate.TargetReason{
				201: remediate.ReasonInheritedFromDeadOwner,
				202: remediate.ReasonInheritedFromDeadOwner,
				400: remediate.ReasonOrphaned,
			},
		},
		{
			name: "orphaned policy: a protected orphan is still excluded",
			snap: func() *snapshot.Snapshot {
				p := spawned
				p.Comm = "Xorg"
				return snap(gpuAcct(0, []snapshot.Owner{dead(150, 1024*mib), live(p, 2658*mib)}, []int{400}, orphaned(p)))
			}(),
			gpu:          "0",
			cfg:          baseConfig(remediate.PolicyOrphaned),
			wantSkip:     SkipNoTargets,
			wantExcluded: map[int]remediate.ExclusionReason{400: exclude.WhyProtected},
		},
		{
			name: "all-holders picks live owners but not protected ones",
			snap: snap(gpuAcct(0,
				[]snapshot.Owner{dead(100, 6754*mib), live(other, 4096*mib), live(smi, 2*mib)},
				[]int{201, 300, 301, 310},
				inherited(worker1))),
			gpu:    "0",
			cfg:    baseConfig(remediate.PolicyAllHolders),
			groups: listed(map[int][]proc.Process{100: {worker1}, 300: {other}, 310: {pr(310, 1, 310, "cuda_app")}}),
			wantTargets: map[int]remediate.TargetReason{
				201: remediate.ReasonInheritedFromDeadOwner,
				300: ReasonDeviceHolder,
				310: ReasonDeviceHolder,
			},
			wantWhole:  []int{201, 300, 310},
			wantGroups: []int{100, 300, 310},
			// nvidia-smi holds the node without mapping it: an NVML reader.
			wantExcluded: map[int]remediate.ExclusionReason{301: WhyNotMapped},
		},
		{
			name: "all-holders spares a live job on another GPU, and an NVML-only reader",
			snap: func() *snapshot.Snapshot {
				g0 := gpuAcct(0, []snapshot.Owner{dead(100, 6754*mib)}, []int{201, 300, 310, 320}, inherited(worker1))
				for i := range g0.Holders {
					switch g0.Holders[i].PID {
					case 300: // a job on GPU 1 that maps every GPU's node, as multi-GPU CUDA does
						g0.Holders[i].LiveJobGPUs = []string{"GPU-b"}
					case 310: // its forked worker: an ancestor owns GPU 1
						g0.Holders[i].LiveJobGPUs = []string{"GPU-b"}
					case 320: // a monitor that opened the node through NVML
						g0.Holders[i].Mapped = false
					}
				}
				g1 := gpuAcct(1, []snapshot.Owner{live(other, 4096*mib)}, []int{300, 310})
				return snap(g0, g1)
			}(),
			gpu:    "0",
			cfg:    baseConfig(remediate.PolicyAllHolders),
			groups: listed(map[int][]proc.Process{100: {worker1}}),
			wantTargets: map[int]remediate.TargetReason{
				201: remediate.ReasonInheritedFromDeadOwner,
			},
			wantWhole:    []int{201},
			wantGroups:   []int{100},
			wantExcluded: map[int]remediate.ExclusionReason{300: WhyLiveJobElsewhere, 310: WhyLiveJobElsewhere, 320: WhyNotMapped},
		},
		{
			name: "orphaned policy: an orphan seen for less than min-age is too young",
			snap: func() *snapshot.Snapshot {
				h := orphaned(spawned)
				h.Since = now.Add(-2 * time.Second) // a nohup job two seconds old
				young := dead(150, 1024*mib)
				young.DeadSince = now.Add(-2 * time.Second)
				return snap(gpuAcct(0, []snapshot.Owner{young, live(spawned, 2658*mib)}, []int{400}, h))
			}(),
			gpu:      "0",
			cfg:      baseConfig(remediate.PolicyOrphaned),
			groups:   listed(map[int][]proc.Process{390: {spawned, spawnAux}}),
			wantSkip: SkipTooYoung,
		},
		{
			// Finding 9 of issue 15: killing an orphaned owner alone leaves
			// its forked workers holding its context.
			name: "orphaned policy: the orphaned owner's workers go with it",
			snap: func() *snapshot.Snapshot {
				g := gpuAcct(0, []snapshot.Owner{dead(150, 1024*mib), live(spawned, 2658*mib)}, []int{400, 402, 300}, orphaned(spawned))
				for i := range g.Holders {
					switch g.Holders[i].PID {
					case 402: // forked by the orphaned owner after CUDA init
						g.Holders[i].LiveJobGPUs = []string{"GPU-a"}
						g.Holders[i].LiveJobs = []snapshot.JobLink{{OwnerPID: 400, GPU: "GPU-a", How: snapshot.JobDescendant}}
					case 300: // a launcher of the orphaned owner is not its inheritor
						g.Holders[i].LiveJobGPUs = []string{"GPU-a"}
						g.Holders[i].LiveJobs = []snapshot.JobLink{{OwnerPID: 400, GPU: "GPU-a", How: snapshot.JobAncestor}}
					}
				}
				return snap(g)
			}(),
			gpu: "0",
			cfg: baseConfig(remediate.PolicyOrphaned),
			wantTargets: map[int]remediate.TargetReason{
				400: remediate.ReasonOrphaned,
				402: ReasonInheritorOfTarget,
			},
		},
		{
			name: "orphaned policy: an orphan charged no more than min-bytes is below threshold",
			snap: func() *snapshot.Snapshot {
				h := orphaned(spawned)
				h.UsedBytes = 100 * mib
				return snap(gpuAcct(0, []snapshot.Owner{dead(150, 1024*mib), live(spawned, 100*mib)}, []int{400}, h))
			}(),
			gpu:          "0",
			cfg:          baseConfig(remediate.PolicyOrphaned),
			wantSkip:     SkipNoTargets,
			wantExcluded: map[int]remediate.ExclusionReason{400: WhyOwnsLiveMemory},
		},
		{
			name: "a group whose leader is alive and not a target is not killed whole",
			snap: snap(forkOrphan()),
			gpu:  "0",
			cfg:  baseConfig(remediate.PolicyDeadOwner),
			// A job script (setsid) leads group 100: it ran the trainer
			// and a tensorboard, and waits.
			groups: forkOrphanGroups(pr(100, 1, 100, "bash"), worker1, worker2, helper),
			wantTargets: map[int]remediate.TargetReason{
				201: remediate.ReasonInheritedFromDeadOwner,
				202: remediate.ReasonInheritedFromDeadOwner,
			},
			wantNote: "member 100 (bash) is not a proven target",
		},
		{
			name: "an incomplete scan is never acted on",
			snap: func() *snapshot.Snapshot {
				s := snap(forkOrphan())
				s.FDScanDenied = 3
				return s
			}(),
			gpu:            "0",
			cfg:            baseConfig(remediate.PolicyDeadOwner),
			groups:         forkOrphanGroups(worker1, worker2),
			wantSkip:       SkipScanIncomplete,
			wantSkipDetail: "the descriptors of 3 processes could not be read",
		},
		{
			name: "all-holders still needs the problem",
			snap: snap(gpuAcct(0, []snapshot.Owner{live(other, 4096*mib)}, []int{300})),
			gpu:  "0", cfg: baseConfig(remediate.PolicyAllHolders),
			wantSkip: SkipBelowThreshold,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := Decide(tc.snap, tc.gpu, tc.cfg, now)
			if tc.groups != nil {
				if want := slices.Sorted(maps.Keys(tc.groups)); p.Act && len(want) > 0 && !slices.Equal(p.GroupsToList(), want) {
					t.Errorf("GroupsToList = %v, want the groups the case lists, %v", p.GroupsToList(), want)
				}
				p = p.WithGroups(tc.snap, tc.cfg, tc.groups)
			}
			if tc.wantSkip != "" {
				if p.Act || p.SkipReason != tc.wantSkip || !strings.Contains(p.SkipDetail, tc.wantSkipDetail) {
					t.Fatalf("Act=%v SkipReason=%q SkipDetail=%q, want skip %q %q", p.Act, p.SkipReason, p.SkipDetail, tc.wantSkip, tc.wantSkipDetail)
				}
				if len(p.Targets) != 0 && tc.wantSkip != SkipNoTargets {
					t.Errorf("skipped plan has targets %v", p.Targets)
				}
			} else if !p.Act || p.SkipReason != "" {
				t.Fatalf("Act=%v SkipReason=%q, want act", p.Act, p.SkipReason)
			}
			if got := targetReasons(p); !maps.Equal(got, nonNil(tc.wantTargets)) {
				t.Errorf("targets = %v, want %v", got, tc.wantTargets)
			}
			var whole []int
			for _, tg := range p.Targets {
				if tg.WholeGroup {
					whole = append(whole, tg.PID)
				}
			}
			if !slices.Equal(whole, tc.wantWhole) {
				t.Errorf("whole-group targets = %v, want %v", whole, tc.wantWhole)
			}
			if !slices.Equal(p.Groups, tc.wantGroups) {
				t.Errorf("Groups = %v, want %v", p.Groups, tc.wantGroups)
			}
			excl := map[int]remediate.ExclusionReason{}
			for _, e := range p.Excluded {
				excl[e.PID] = e.Why
			}
			if !maps.Equal(excl, nonNil(tc.wantExcluded)) {
				t.Errorf("excluded = %v, want %v", excl, tc.wantExcluded)
			}
			if tc.wantNote != "" && !slices.ContainsFunc(p.Notes, func(n string) bool { return strings.Contains(n, tc.wantNote) }) {
				t.Errorf("notes = %q, want one containing %q", p.Notes, tc.wantNote)
			}
			if tc.wantNote == "" && len(p.Notes) > 0 {
				t.Errorf("unexpected notes %q", p.Notes)
			}
			for _, tg := range p.Targets {
				if tg.StartTime == 0 {
					t.Errorf("target %d has no start time: the ladder could not check its identity", tg.PID)
				}
			}
		})
	}
}

func targetReasons(p Plan) map[int]remediate.TargetReason {
	m := map[int]remediate.TargetReason{}
	for _, t := range p.Targets {
		m[t.PID] = t.Reason
	}
	return m
}

func nonNil[V any](m map[int]V) map[int]V {
	if m == nil {
		return map[int]V{}
	}
	return m
}

func TestDecideEvidence(t *testing.T) {
	s := snap(forkOrphan())
	p := Decide(s, "0", baseConfig(""), now).WithGroups(s, baseConfig(""), forkOrphanGroups(worker1, worker2))
	if p.Policy != remediate.PolicyDeadOwner || p.GPUUUID != "GPU-a" || p.GPUIndex != 0 {
		t.Errorf("plan names policy %q GPU %q/%d", p.Policy, p.GPUUUID, p.GPUIndex)
	}
	b := p.Before
	if b.At != now || b.UsedBytes != 6762*mib || b.OwnedDeadBytes != 6754*mib || b.UnownedBytes != 6762*mib {
		t.Errorf("evidence numbers: %+v", b)
	}
	if b.UnownedAgeSeconds != 600 {
		t.Errorf("UnownedAgeSeconds = %v, want 600", b.UnownedAgeSeconds)
	}
	if !slices.Equal(b.DeadOwnerPIDs, []uint32{100}) || !slices.Equal(b.HolderPIDs, []int{201, 202}) {
		t.Errorf("evidence PIDs: dead %v holders %v", b.DeadOwnerPIDs, b.HolderPIDs)
	}
	tg := p.Targets[0]
	if tg.PID != 201 || tg.StartTime != 100201 || tg.PGID != 100 || tg.Command != "pt_data_worker --job" || tg.User != "alice" {
		t.Errorf("target identity: %+v", tg.ProcessInfo)
	}
}

func TestSkipText(t *testing.T) {
	for _, tc := range []struct {
		p    Plan
		want string
	}{
		{Plan{SkipReason: SkipTooYoung}, "too_young"},
		{Plan{SkipReason: SkipGPUReadFailed, SkipDetail: "GPU is lost"}, "gpu_read_failed: GPU is lost"},
		{Plan{Act: true}, ""},
	} {
		if got := tc.p.SkipText(); got != tc.want {
			t.Errorf("SkipText of %q/%q = %q, want %q", tc.p.SkipReason, tc.p.SkipDetail, got, tc.want)
		}
	}
}

// TestWithGroupsLeavesThePlanAlone: WithGroups returns a new plan; the one
// it was given, and its targets, stay as they were.
func TestWithGroupsLeavesThePlanAlone(t *testing.T) {
	s := snap(forkOrphan())
	cfg := baseConfig(remediate.PolicyDeadOwner)
	p := Decide(s, "0", cfg, now)
	whole := p.WithGroups(s, cfg, forkOrphanGroups(worker1, worker2))
	if len(whole.Targets) != 2 || !slices.Equal(whole.Groups, []int{100}) || !whole.Targets[0].WholeGroup {
		t.Fatalf("with groups: targets %v, groups %v; want 201 and 202, group 100 whole", whole.Targets, whole.Groups)
	}
	if len(p.Targets) != 2 || p.Targets[0].WholeGroup || len(p.Groups) != 0 {
		t.Errorf("the plan WithGroups was given changed: %+v", p)
	}
}
