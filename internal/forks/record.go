// Package forks keeps the record of descent that the kernel's process
// events (internal/procevents) give as they happen: for each live process,
// which process forked it, and whether it has run exec since. It is the
// collector's proof that a holder of a dead owner's GPU inherited the
// owner's own open files, rather than opening the device itself: a fork
// copies the parent's descriptors; an exec or a later open replaces them.
package forks

import (
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/proc"
	"github.com/gpu-orphan/gpu-orphan/internal/procevents"
)

// Key names a process as the kernel does: its PID (thread-group ID) and its
// start time (field 22 of /proc/PID/stat), so that a reused PID is another
// key.
type Key struct {
	PID   int
	Start uint64
}

// entry is what the record knows of one process.
type entry struct {
	parent Key
	// atFork: the fork event said who the parent is, as it happened. A
	// process found in /proc (at start-up, after lost events) has only
	// its present parent, which is not evidence of descent (a reparented
	// child names init or a subreaper).
	atFork bool
	// execed: it ran exec after the fork.
	execed bool
	// keptFiles: when it ran exec, it still shared an open file of a GPU
	// device with its parent (kcmp): the exec kept the inherited files.
	keptFiles bool
	// dead: it exited; kept while a recorded process descends from it.
	dead bool
	// leaderGone: its main thread exited while others may run on.
	leaderGone bool
	kids       int
}

// Record is the fork record. It is safe for concurrent use.
type Record struct {
	fs proc.FS

	mu      sync.Mutex
	entries map[Key]*entry
	// live maps each live PID to its start time.
	live map[int]uint64
	// deadByPID counts, per PID, the dead processes kept in entries.
	deadByPID map[int]int
	// exiting are PIDs whose exit events arrived, checked once they had
	// time to finish exiting (flushExits).
	exiting map[int]time.Time
	// devices are the GPUs' device nodes, for the exec check.
	devices []proc.Device
	// quiet caches parents seen holding no GPU device, so that a fork
	// storm of a shell costs one read per parent per quietFor.
	quiet map[Key]time.Time
	// watched are processes whose exit is worth a snapshot now.
	watched map[Key]bool
	onExit  func(Key)
	// resyncs counts the resyncs after lost events; events the events
	// applied.
	resyncs uint64
	events  uint64
}

// quietFor is how long a parent seen holding no GPU device is not read
// again when its children exec: a shell's fork-and-exec storm costs a few
// reads a second, and a parent that opens the GPU is read again soon.
const quietFor = 250 * time.Millisecond

// exitSettle is how long after an exit event a process is checked: the
// event is sent while the task is still exiting.
const exitSettle = 20 * time.Millisecond

// maxDepth bounds a walk up the record.
const maxDepth = 256

// New returns an empty record reading /proc through fs.
func New(fs proc.FS) *Record {
	return &Record{
		fs:        fs,
		entries:   map[Key]*entry{},
		live:      map[int]uint64{},
		deadByPID: map[int]int{},
		exiting:   map[int]time.Time{},
		quiet:     map[Key]time.Time{},
		watched:   map[Key]bool{},
	}
}

// SetDevices sets the GPUs' device nodes that an exec is checked against.
func (r *Record) SetDevices(devs []proc.Device) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.devices = devs
}

// Watch sets the processes whose exit calls onExit (the owners and holders
// of the latest snapshot).
func (r *Record) Watch(keys []Key, onExit func(Key)) {
	w := make(map[Key]bool, len(keys))
	for _, k := range keys {
		w[k] = true
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.watched, r.onExit = w, onExit
}

// Seed adds every process alive now with its present parent, as not seen
// at fork. Call it after subscribing, so that nothing forked meanwhile is
// missed.
func (r *Record) Seed() error {
	pids, err := r.fs.PIDs()
	if err != nil {
		return fmt.Errorf("listing processes: %w", err)
	}
	stats := make(map[int]proc.Stat, len(pids))
	for _, pid := range pids {
		if st, err := r.fs.ReadStat(pid); err == nil {
			stats[pid] = st
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for pid, st := range stats {
		k := Key{pid, st.StartTime}
		if cur, ok := r.live[pid]; ok && cur == k.Start {
			continue // an event already recorded it
		}
		if cur, ok := r.live[pid]; ok {
			r.die(Key{pid, cur})
		}
		r.live[pid] = k.Start
		parent := Key{st.PPID, 0}
		if pst, ok := stats[st.PPID]; ok {
			parent.Start = pst.StartTime
		}
		r.add(k, &entry{parent: parent})
	}
	return nil
}

// Resync follows lost events: what was missed is unknown (an exec, a
// fork), so every entry loses its proof of descent, the dead are found
// and pruned, and the living are seeded anew.
func (r *Record) Resync() error {
	r.mu.Lock()
	r.resyncs++
	for _, e := range r.entries {
		e.atFork = false
	}
	live := make(map[int]uint64, len(r.live))
	for pid, start := range r.live {
		live[pid] = start
	}
	r.mu.Unlock()
	for pid, start := range live {
		st, err := r.fs.ReadStat(pid)
		if err == nil && st.StartTime == start {
			continue
		}
		r.mu.Lock()
		if r.live[pid] == start {
			r.die(Key{pid, start})
		}
		r.mu.Unlock()
	}
	return r.Seed()
}

// add records e for k and counts it as its parent's child. A process
// recorded again (seeded, then its fork event) keeps its children.
func (r *Record) add(k Key, e *entry) {
	if old, ok := r.entries[k]; ok {
		e.kids = old.kids
		if p := r.entries[old.parent]; p != nil {
			p.kids--
			defer r.prune(old.parent)
		}
	}
	r.entries[k] = e
	if p := r.entries[e.parent]; p != nil {
		p.kids++
	}
}

// die marks k dead, forgets its PID as live, and prunes what no live
// process needs.
func (r *Record) die(k Key) {
	if r.live[k.PID] == k.Start {
		delete(r.live, k.PID)
	}
	e := r.entries[k]
	if e == nil || e.dead {
		return
	}
	e.dead = true
	r.deadByPID[k.PID]++
	r.prune(k)
}

// prune drops dead entries that nothing recorded descends from, up the
// line.
func (r *Record) prune(k Key) {
	for range maxDepth {
		e := r.entries[k]
		if e == nil || !e.dead || e.kids > 0 {
			return
		}
		delete(r.entries, k)
		if r.deadByPID[k.PID]--; r.deadByPID[k.PID] <= 0 {
			delete(r.deadByPID, k.PID)
		}
		p := r.entries[e.parent]
		if p == nil {
			return
		}
		p.kids--
		k = e.parent
	}
}

// Counts of the record, for metrics.
type Counts struct {
	// Live processes and all entries (the live, and the dead that a live
	// process descends from).
	Live, Entries int
	// Events applied, and resyncs after lost events.
	Events, Resyncs uint64
}

// Counts returns the record's size and counters.
func (r *Record) Counts() Counts {
	r.mu.Lock()
	defer r.mu.Unlock()
	return Counts{Live: len(r.live), Entries: len(r.entries), Events: r.events, Resyncs: r.resyncs}
}

// Why a holder's descent proves nothing (Inherits).
var (
	ErrNotRecorded = errors.New("its fork was not recorded")
	ErrNotAtFork   = errors.New("a process on its line was found in /proc rather than seen forking (present before the daemon started, or after lost events)")
	ErrExeced      = errors.New("it or a process on its line ran exec since the fork, dropping the inherited files")
	ErrNotFromThe  = errors.New("it does not descend from the dead owner")
	ErrAmbiguous   = errors.New("more than one dead process had the owner's PID, and which one NVML lists is not known")
)

// Inherits reports whether h descends, fork by fork as the kernel reported
// them, from the dead owner with PID owner, with no exec on the way that
// did not keep the inherited files. ownerStart is the owner's start time
// when a snapshot saw it alive, 0 when not: the owner is then the one dead
// process with that PID on h's line, and refused when the record keeps
// another dead process with that PID (its PID was reused). It returns the
// owner as found.
func (r *Record) Inherits(h Key, owner int, ownerStart uint64) (Key, error) {
	p, marked, err := r.lineTo(h, owner, ownerStart)
	if err != nil {
		return Key{}, err
	}
	// Its exit may still wait for FlushExits: /proc says, read outside
	// the lock that the events' goroutine takes.
	if !marked && r.alive(p.PID, p.Start) {
		return Key{}, ErrNotFromThe
	}
	if ownerStart != 0 {
		return p, nil
	}
	r.mu.Lock()
	others := r.deadByPID[owner]
	r.mu.Unlock()
	if marked {
		others--
	}
	if others > 0 {
		return Key{}, ErrAmbiguous
	}
	return p, nil
}

// lineTo walks up from h, fork by fork, to the first process with PID
// owner (and start time ownerStart when known), and says whether the
// record has marked it dead.
func (r *Record) lineTo(h Key, owner int, ownerStart uint64) (Key, bool, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	k := h
	for range maxDepth {
		e := r.entries[k]
		switch {
		case e == nil:
			return Key{}, false, ErrNotRecorded
		case !e.atFork:
			return Key{}, false, ErrNotAtFork
		case e.execed && !e.keptFiles:
			return Key{}, false, ErrExeced
		}
		p := e.parent
		if p.PID == owner && (ownerStart == 0 || p.Start == ownerStart) {
			pe := r.entries[p]
			return p, pe != nil && pe.dead, nil
		}
		k = p
	}
	return Key{}, false, ErrNotFromThe
}

// ExecedChild returns the parent of h when h was seen forking from it and
// then ran exec that could not be checked to keep the parent's files (the
// parent was gone, or held none of the GPUs then).
func (r *Record) ExecedChild(h Key) (Key, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	e := r.entries[h]
	if e == nil || !e.atFork || !e.execed || e.keptFiles {
		return Key{}, false
	}
	return e.parent, true
}

// Apply records one event. Reading /proc for it happens here: a child's
// start time at its fork, its files and its parent's at its exec.
func (r *Record) Apply(ev procevents.Event) {
	switch ev.Kind {
	case procevents.Fork:
		if !ev.Thread() {
			r.fork(ev.PID, ev.ParentPID)
		}
	case procevents.Exec:
		r.exec(ev.PID)
	case procevents.Exit:
		r.mu.Lock()
		r.events++
		if start, ok := r.live[ev.PID]; ok {
			e := r.entries[Key{ev.PID, start}]
			if !ev.Thread() && e != nil {
				e.leaderGone = true
			}
			if !ev.Thread() || (e != nil && e.leaderGone) {
				r.exiting[ev.PID] = time.Now()
			}
		}
		r.mu.Unlock()
	}
}

func (r *Record) fork(child, parent int) {
	st, err := r.fs.ReadStat(child)
	if err != nil {
		r.count()
		return // gone already: nothing to record
	}
	k := Key{child, st.StartTime}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.events++
	if cur, ok := r.live[child]; ok && cur != k.Start {
		r.die(Key{child, cur}) // its exit event is still pending, or lost
	}
	ps, ok := r.live[parent]
	if !ok || ps > k.Start {
		// A parent never seen (it started while events were lost) names
		// nobody for certain.
		r.live[child] = k.Start
		r.add(k, &entry{parent: Key{parent, 0}})
		return
	}
	r.live[child] = k.Start
	r.add(k, &entry{parent: Key{parent, ps}, atFork: true})
}

func (r *Record) count() {
	r.mu.Lock()
	r.events++
	r.mu.Unlock()
}

// exec marks the process as having run exec, and whether it kept an open
// file of a GPU device that its parent holds: checked only when the parent
// holds one, so that a shell's fork-and-exec storm costs one read of the
// shell's descriptors per quietFor.
func (r *Record) exec(pid int) {
	r.mu.Lock()
	r.events++
	start, ok := r.live[pid]
	k := Key{pid, start}
	e := r.entries[k]
	if !ok || e == nil {
		r.mu.Unlock()
		return
	}
	e.execed, e.keptFiles = true, false
	parent, devs := e.parent, r.devices
	quietUntil, quiet := r.quiet[parent]
	parentLive := r.live[parent.PID] == parent.Start && parent.Start != 0
	r.mu.Unlock()
	if !parentLive || len(devs) == 0 || (quiet && time.Now().Before(quietUntil)) {
		return
	}
	kept, parentHolds := r.keptFiles(pid, parent.PID, devs)
	r.mu.Lock()
	defer r.mu.Unlock()
	if !parentHolds {
		if len(r.quiet) > 4096 {
			clear(r.quiet)
		}
		r.quiet[parent] = time.Now().Add(quietFor)
	}
	if e := r.entries[k]; e != nil && kept {
		e.keptFiles = true
	}
}

// keptFiles reports whether child shares an open file of one of devs with
// parent, and whether parent holds any of them.
func (r *Record) keptFiles(child, parent int, devs []proc.Device) (kept, parentHolds bool) {
	for _, dev := range devs {
		hp, ok, err := r.fs.HoldingOf(parent, dev)
		if err != nil || !ok {
			continue
		}
		parentHolds = true
		hc, ok, err := r.fs.HoldingOf(child, dev)
		if err != nil || !ok {
			continue
		}
		if same, err := r.fs.SharesFile(hc, hp); err == nil && same {
			return true, true
		}
	}
	return false, parentHolds
}

// FlushExits checks the processes whose exit events arrived at least
// exitSettle before now, marks those that are dead, and calls onExit for
// the watched ones and those that left live children. A process is alive
// while any of its threads is.
func (r *Record) FlushExits(now time.Time) {
	r.mu.Lock()
	var due []int
	for pid, at := range r.exiting {
		if now.Sub(at) >= exitSettle {
			due = append(due, pid)
			delete(r.exiting, pid)
		}
	}
	r.mu.Unlock()
	var died []Key
	for _, pid := range due {
		r.mu.Lock()
		start, ok := r.live[pid]
		r.mu.Unlock()
		if !ok {
			continue
		}
		if r.alive(pid, start) {
			continue
		}
		k := Key{pid, start}
		r.mu.Lock()
		if r.live[pid] == start {
			// A process that leaves live children behind may have left
			// them its GPU context, even if no snapshot saw it yet.
			e := r.entries[k]
			orphaning := e != nil && e.kids > 0
			r.die(k)
			if r.watched[k] || orphaning {
				died = append(died, k)
			}
		}
		onExit := r.onExit
		r.mu.Unlock()
		if onExit != nil {
			for _, d := range died {
				onExit(d)
			}
			died = died[:0]
		}
	}
}

// alive reports whether the process (pid, start) has a live thread.
func (r *Record) alive(pid int, start uint64) bool {
	st, err := r.fs.ReadStat(pid)
	if err != nil || st.StartTime != start {
		return false
	}
	if st.State != 'Z' && st.State != 'X' {
		return true
	}
	p, ok := r.fs.Alive(pid)
	return ok && p.StartTime == start
}

// Pending reports whether exit events wait for FlushExits.
func (r *Record) Pending() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.exiting) > 0
}
