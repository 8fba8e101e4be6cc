package snapshot

import (
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/proc"
)

// Identity is who an owner was, remembered while it lived: by the time NVML
// lists its PID as dead, /proc no longer knows it.
type Identity struct {
	PID       int
	StartTime uint64
	// PGID and SID are its process group and session when last seen.
	PGID, SID int
	Comm      string
	// Cmdline is cut to maxIdentityCmdline bytes: enough to recognise a job.
	Cmdline     string
	UID         int
	User        string
	Cgroup      string
	ContainerID string
	PodUID      string
	SlurmJob    string
	SlurmStep   string
	// FirstSeen and LastSeen are when snapshots saw it alive, owning memory.
	FirstSeen time.Time
	LastSeen  time.Time
}

const maxIdentityCmdline = 128

// UnknownIdentity is what to say of a dead owner that no snapshot of this
// process saw alive: never a guess.
const UnknownIdentity = "unknown (exporter started after the owner died)"

func identityOf(p proc.Process, at time.Time) Identity {
	cmd := p.Cmdline
	if len(cmd) > maxIdentityCmdline {
		cmd = cmd[:maxIdentityCmdline]
	}
	return Identity{
		PID: p.PID, StartTime: p.StartTime, PGID: p.PGID, SID: p.SID, Comm: p.Comm, Cmdline: cmd, UID: p.UID, User: p.User,
		Cgroup: p.Cgroup, ContainerID: p.Container, PodUID: p.Pod, SlurmJob: p.SlurmJob, SlurmStep: p.SlurmStep,
		FirstSeen: at, LastSeen: at,
	}
}

// Defaults of ownerBook's bounds.
const (
	// DefaultOwnerRetention is how long an owner is remembered after NVML
	// last listed it on a GPU (its memory is back by then).
	DefaultOwnerRetention = 10 * time.Minute
	// DefaultMaxOwners caps the book: about 1 KiB an entry.
	DefaultMaxOwners = 4096
)

// ownerBook remembers the identity of every live owner of each GPU, keyed
// by GPU, PID and start time, so that a reused PID is never confused with
// the owner it replaced.
type ownerBook struct {
	retention time.Duration
	max       int
	entries   map[ownerKey]*ownerEntry
}

type ownerKey struct {
	uuid      string
	pid       int
	startTime uint64
}

type ownerEntry struct {
	id Identity
	// listed is when NVML last listed the PID on the GPU, alive or dead.
	listed time.Time
}

func newOwnerBook(retention time.Duration, max int) *ownerBook {
	if retention <= 0 {
		retention = DefaultOwnerRetention
	}
	if max <= 0 {
		max = DefaultMaxOwners
	}
	return &ownerBook{retention: retention, max: max, entries: map[ownerKey]*ownerEntry{}}
}

// update records the live owners of s and names its dead ones, then drops
// what the bounds say to drop.
func (b *ownerBook) update(s *Snapshot) {
	now := s.Taken
	for i := range s.GPUs {
		g := &s.GPUs[i]
		if !g.Accountable() {
			continue
		}
		uuid := g.Device.UUID
		for j := range g.Owners {
			o := &g.Owners[j]
			pid := int(o.PID)
			if o.Alive && o.Process != nil {
				k := ownerKey{uuid, pid, o.Process.StartTime}
				e, ok := b.entries[k]
				if !ok {
					e = &ownerEntry{id: identityOf(*o.Process, now)}
					b.entries[k] = e
				}
				// The latest look wins: a job may be moved into its
				// cgroup, or change its name, after it first owns memory.
				first := e.id.FirstSeen
				e.id = identityOf(*o.Process, now)
				e.id.FirstSeen, e.listed = first, now
				continue
			}
			if o.Alive {
				continue
			}
			// Dead: the latest owner of this GPU that had the PID.
			if best := b.latest(uuid, pid); best != nil {
				best.listed = now
				id := best.id
				o.Identity = &id
			}
		}
	}
	b.prune(now)
}

// latest returns the owner of the GPU with pid that was seen alive last.
func (b *ownerBook) latest(uuid string, pid int) *ownerEntry {
	var best *ownerEntry
	for k, e := range b.entries {
		if k.uuid == uuid && k.pid == pid && (best == nil || e.id.LastSeen.After(best.id.LastSeen)) {
			best = e
		}
	}
	return best
}

// prune drops owners not listed for the retention, then, over the cap,
// those listed longest ago: an owner NVML still lists goes last.
func (b *ownerBook) prune(now time.Time) {
	for k, e := range b.entries {
		if now.Sub(e.listed) > b.retention {
			delete(b.entries, k)
		}
	}
	for len(b.entries) > b.max {
		var oldest ownerKey
		var at time.Time
		first := true
		for k, e := range b.entries {
			if first || e.listed.Before(at) {
				oldest, at, first = k, e.listed, false
			}
		}
		delete(b.entries, oldest)
	}
}

func (b *ownerBook) len() int { return len(b.entries) }
