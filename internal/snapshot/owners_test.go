package snapshot

import (
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/gpu"
	"github.com/gpu-orphan/gpu-orphan/internal/proc"
)

func ownerSnap(at time.Time, owners ...Owner) *Snapshot {
	return &Snapshot{Taken: at, GPUs: []GPU{{Device: gpu.Device{UUID: "GPU-a"}, Owners: owners}}}
}

func liveOwner(p proc.Process) Owner {
	return Owner{PID: uint32(p.PID), Alive: true, Process: &p}
}

func TestOwnerBook(t *testing.T) {
	t0 := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	trainer := proc.Process{PID: 4242, StartTime: 1000, Comm: "python3", Cmdline: "python3 train.py", User: "alice",
		Cgroup: "/system.slice/slurmstepd.scope/job_81234/step_0/user/task_0", SlurmJob: "81234", SlurmStep: "0"}
	b := newOwnerBook(time.Minute, 3)

	// First seen before slurmd moved it into its step's cgroup: the latest
	// look is what is remembered.
	early := trainer
	early.Cgroup, early.SlurmJob, early.SlurmStep = "/user.slice", "", ""
	b.update(ownerSnap(t0.Add(-time.Second), liveOwner(early)))
	b.update(ownerSnap(t0, liveOwner(trainer)))
	// It dies; NVML lists its PID, and the PID is someone else's now
	// (no live owner: ReusedBy is set and Alive is false).
	newcomer := proc.Process{PID: 4242, StartTime: 2000, Comm: "sleep"}
	s := ownerSnap(t0.Add(10*time.Second), Owner{PID: 4242, ReusedBy: &newcomer})
	b.update(s)
	id := s.GPUs[0].Owners[0].Identity
	if id == nil || id.StartTime != 1000 || id.User != "alice" || id.SlurmJob != "81234" || id.Cmdline != "python3 train.py" {
		t.Fatalf("dead owner identity %+v, want the trainer's", id)
	}
	if !id.LastSeen.Equal(t0) || !id.FirstSeen.Equal(t0.Add(-time.Second)) {
		t.Errorf("seen %v to %v, want %v to %v", id.FirstSeen, id.LastSeen, t0.Add(-time.Second), t0)
	}

	// Another GPU's owner with the same PID is not this one.
	s = &Snapshot{Taken: t0.Add(20 * time.Second), GPUs: []GPU{{Device: gpu.Device{UUID: "GPU-b"}, Owners: []Owner{{PID: 4242}}}}}
	b.update(s)
	if s.GPUs[0].Owners[0].Identity != nil {
		t.Errorf("GPU-b's dead owner got GPU-a's identity")
	}

	// A book that never saw the owner alive (an exporter started after
	// it died) knows nothing: never a guess.
	fresh := newOwnerBook(time.Minute, 3)
	s = ownerSnap(t0, Owner{PID: 4242})
	fresh.update(s)
	if s.GPUs[0].Owners[0].Identity != nil {
		t.Errorf("a fresh book named a dead owner it never saw: %+v", s.GPUs[0].Owners[0].Identity)
	}

	// While NVML lists the dead PID the entry stays; once the memory is
	// back (not listed), it goes after the retention.
	b.update(ownerSnap(t0.Add(5*time.Minute), Owner{PID: 4242}))
	if b.len() != 1 {
		t.Fatalf("book has %d entries while the dead owner is listed, want 1", b.len())
	}
	b.update(ownerSnap(t0.Add(5*time.Minute + 30*time.Second)))
	if b.len() != 1 {
		t.Errorf("dropped before the retention")
	}
	b.update(ownerSnap(t0.Add(7 * time.Minute)))
	if b.len() != 0 {
		t.Errorf("book has %d entries after the retention, want 0", b.len())
	}
}

// TestOwnerBookCap: over the cap, owners listed longest ago go first; one
// that NVML still lists stays.
func TestOwnerBookCap(t *testing.T) {
	t0 := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	b := newOwnerBook(time.Hour, 2)
	p := func(pid int) proc.Process { return proc.Process{PID: pid, StartTime: uint64(pid), Comm: "c"} }
	b.update(ownerSnap(t0, liveOwner(p(1))))
	b.update(ownerSnap(t0.Add(time.Second), liveOwner(p(2))))
	b.update(ownerSnap(t0.Add(2*time.Second), Owner{PID: 1}, liveOwner(p(3)))) // 1 dead, still listed
	if b.len() != 2 {
		t.Fatalf("book has %d entries, want the cap 2", b.len())
	}
	s := ownerSnap(t0.Add(3*time.Second), Owner{PID: 1})
	b.update(s)
	if s.GPUs[0].Owners[0].Identity == nil {
		t.Error("the still-listed dead owner was evicted before older entries")
	}
}
