package snapshot

import (
	"sync"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/forks"
)

// Lineage is what a Loop remembers across snapshots, the evidence that one
// snapshot cannot see: who each owner was while it lived, which processes
// descended from it holding its GPU, and since when each dead owner has
// been dead. It is safe for concurrent use: Takes read and record it while
// the Loop updates it.
type Lineage struct {
	mu     sync.Mutex
	owners *ownerBook
	// descent maps each owner, as it lived on one GPU, to the processes
	// seen descending from it while holding that GPU's device.
	descent map[ownerKey]map[procKey]bool
	// inherited maps each dead owner, on one GPU, to the holders proven
	// its inheritors at fork (ProofDescentAtFork): what the fork record
	// showed, kept after the record has pruned it and across restarts, and
	// what `gpu-orphan clean` and the Slurm hooks read from the agent's
	// store.
	inherited map[ownerKey]map[procKey]string
	// forks is the fork record fed by the kernel's process events; nil
	// where they are unavailable.
	forks *forks.Record
	// checked are descendants seen not holding a GPU's device: not read
	// again while they live.
	checked map[gpuProc]bool
	// deadSince is when each listed PID of a GPU was first seen dead.
	deadSince map[gpuPID]time.Time
	// lastUpdate is the time of the latest snapshot recorded.
	lastUpdate time.Time
	// gen counts the changes a saved state would miss (Generation).
	gen uint64
}

type gpuProc struct {
	uuid string
	proc procKey
}

type gpuPID struct {
	uuid string
	pid  int
}

// Bounds of the descent records.
const (
	// maxDescendants caps the descendants recorded per owner.
	maxDescendants = 1024
	// maxChecked caps the negative cache; it is cleared when full.
	maxChecked = 16384
)

// NewLineage returns an empty Lineage.
func NewLineage() *Lineage {
	return &Lineage{
		owners:    newOwnerBook(0, 0),
		descent:   map[ownerKey]map[procKey]bool{},
		inherited: map[ownerKey]map[procKey]string{},
		checked:   map[gpuProc]bool{},
		deadSince: map[gpuPID]time.Time{},
	}
}

// remembered returns the latest owner of the GPU known with pid, and
// whether it was listed by the latest snapshot recorded.
func (l *Lineage) remembered(uuid string, pid int) (Identity, bool, bool) {
	if l == nil {
		return Identity{}, false, false
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	e := l.owners.latest(uuid, pid)
	if e == nil {
		return Identity{}, false, false
	}
	return e.id, e.listed.Equal(l.lastUpdate), true
}

// descendants returns the recorded descendants of an owner on a GPU.
func (l *Lineage) descendants(uuid string, owner procKey) []procKey {
	if l == nil {
		return nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []procKey
	for k := range l.descent[ownerKey{uuid, owner.pid, owner.start}] {
		out = append(out, k)
	}
	return out
}

// descends reports whether p was recorded descending from owner on a GPU.
func (l *Lineage) descends(uuid string, owner, p procKey) bool {
	if l == nil {
		return false
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.descent[ownerKey{uuid, owner.pid, owner.start}][p]
}

// UseForks makes the lineage prove descent through rec, the fork record
// that the kernel's process events feed.
func (l *Lineage) UseForks(rec *forks.Record) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.forks = rec
}

// forkRecord returns the fork record, nil without one.
func (l *Lineage) forkRecord() *forks.Record {
	if l == nil {
		return nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.forks
}

// inheritedBy returns how p was proven an inheritor of owner on a GPU
// (ProofDescentAtFork, ProofSharedOwnerFile), by this process or by the
// daemon whose state was restored; "" when it was not.
func (l *Lineage) inheritedBy(uuid string, owner, p procKey) string {
	if l == nil {
		return ""
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.inherited[ownerKey{uuid, owner.pid, owner.start}][p]
}

// wasInherited reports whether p was proven an inheritor of owner.
func (l *Lineage) wasInherited(uuid string, owner, p procKey) bool {
	return l.inheritedBy(uuid, owner, p) != ""
}

// recordInherited records that p was proven to inherit owner's context on
// a GPU, and how; the first proof stays.
func (l *Lineage) recordInherited(uuid string, owner, p procKey, proof string) {
	if l == nil {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	k := ownerKey{uuid, owner.pid, owner.start}
	d := l.inherited[k]
	if d == nil {
		d = map[procKey]string{}
		l.inherited[k] = d
	}
	if d[p] == "" {
		d[p] = proof
		l.gen++
	}
}

// wasChecked reports whether p was seen not holding the GPU's device.
func (l *Lineage) wasChecked(uuid string, p procKey) bool {
	if l == nil {
		return false
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.checked[gpuProc{uuid, p}]
}

// recordDescent records that p descends from owner and holds the GPU's
// device (holds), or that it does not.
func (l *Lineage) recordDescent(uuid string, owner, p procKey, holds bool) {
	if l == nil {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if !holds {
		if len(l.checked) >= maxChecked {
			clear(l.checked)
		}
		l.checked[gpuProc{uuid, p}] = true
		return
	}
	k := ownerKey{uuid, owner.pid, owner.start}
	d := l.descent[k]
	if d == nil {
		d = map[procKey]bool{}
		l.descent[k] = d
	}
	if len(d) < maxDescendants && !d[p] {
		d[p] = true
		l.gen++
	}
}

// date sets the DeadSince of the dead owners of s from the clocks, without
// changing them (Loop.date).
func (l *Lineage) date(s *Snapshot) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for i := range s.GPUs {
		g := &s.GPUs[i]
		for j := range g.Owners {
			if o := &g.Owners[j]; !o.Alive {
				o.DeadSince = l.deadSince[gpuPID{g.Device.UUID, int(o.PID)}]
			}
		}
	}
}

// update records the live owners of s, names its dead ones and dates them,
// then drops what the bounds say to drop. A GPU that cannot be accounted
// keeps its dead owners' clocks: a failed read is not evidence that the
// memory came back.
func (l *Lineage) update(s *Snapshot) {
	l.mu.Lock()
	defer l.mu.Unlock()
	before := len(l.owners.entries)
	l.owners.update(s)
	if len(l.owners.entries) != before {
		l.gen++
	}
	l.lastUpdate = s.Taken
	current := map[gpuPID]bool{}
	for i := range s.GPUs {
		g := &s.GPUs[i]
		if !g.Accountable() {
			for k := range l.deadSince {
				if k.uuid == g.Device.UUID {
					current[k] = true
				}
			}
			continue
		}
		for j := range g.Owners {
			o := &g.Owners[j]
			if o.Alive {
				continue
			}
			k := gpuPID{g.Device.UUID, int(o.PID)}
			if _, ok := l.deadSince[k]; !ok {
				l.deadSince[k] = s.Taken
				l.gen++
			}
			o.DeadSince = l.deadSince[k]
			current[k] = true
		}
	}
	for k := range l.deadSince {
		if !current[k] {
			delete(l.deadSince, k)
		}
	}
	// Descent is kept while its owner is remembered or listed dead.
	kept := func(k ownerKey) bool {
		_, known := l.owners.entries[k]
		_, dead := l.deadSince[gpuPID{k.uuid, k.pid}]
		return known || dead
	}
	for k := range l.descent {
		if !kept(k) {
			delete(l.descent, k)
		}
	}
	for k := range l.inherited {
		if !kept(k) {
			delete(l.inherited, k)
		}
	}
}

// identify names a dead owner of the GPU from what was remembered.
func (l *Lineage) identify(uuid string, o *Owner) {
	if l == nil {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if e := l.owners.latest(uuid, int(o.PID)); e != nil {
		id := e.id
		o.Identity = &id
	}
}

func (l *Lineage) ownersLen() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.owners.len()
}

// RecordedDescendants counts the processes recorded descending from an
// owner while holding its GPU, for a metric.
func (l *Lineage) RecordedDescendants() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, d := range l.descent {
		n += len(d)
	}
	return n
}

// Owners counts the owners remembered.
func (l *Lineage) Owners() int { return l.ownersLen() }
