// Package forks keeps the record of descent that the kernel's process
// events (internal/procevents) give as they happen: for each live process,
// which process forked it, and whether it has run exec since. It is the
// collector's proof that a holder of a dead owner's GPU inherited the
// owner's own open files, rather than opening the device itself: a fork
// copies the parent's descriptors; an exec or a later open replaces them.
//
// The record costs little under a fork storm. Events arrive in the order
// they happened, so between its fork event and its exit event a PID names
// one process: a process is recorded at its fork by PID alone, linked to
// the record's process that forked it, and its start time (its identity
// with the PID, which a snapshot compares) is read from /proc only when
// it is needed: when it forks its first child, when a snapshot watches or
// asks about it. A read is checked against the fork event's time, so
// that a process that took the PID after the recorded one died is never
// taken for it. Threads are counted from the events, so that the exit of
// a process seen from its fork costs no read either; what was found in
// /proc instead (at start-up, after lost events) is checked in /proc when
// it exits, as is a process whose exit matters (it leaves children, or a
// snapshot watches it).
package forks

import (
	"errors"
	"fmt"
	"sync"
	"time"

	"golang.org/x/sys/unix"

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

// node is what the record knows of one process.
type node struct {
	pid int
	// start is its start time, when known: read from /proc, checked to be
	// this process's.
	start uint64
	// forkTS is when its fork event was sent (CLOCK_MONOTONIC ns); 0 for a
	// process found in /proc.
	forkTS uint64
	// parent is the process that forked it, as the events named it; nil
	// when not known.
	parent *node
	// gen tells a node apart from its reuse for another process, across
	// an unlock.
	gen uint64
	// kids counts the nodes whose parent this is.
	kids int
	// threads counts its live threads, from the events, while counted.
	threads int
	// quietUntil: seen holding no GPU device, its children's execs are
	// not checked until then (UnixNano); quietFor is the next such spell.
	quietUntil int64
	quietFor   time.Duration
	known      bool
	// unresolvable: its start time could not be read while it lived (it
	// was gone, or the PID was another process's).
	unresolvable bool
	// atFork: the fork event said who the parent is, as it happened. A
	// process found in /proc (at start-up, after lost events) has only
	// its present parent, which is not evidence of descent (a reparented
	// child names init or a subreaper).
	atFork bool
	// counted: every thread of it was seen created, so that threads says
	// when it died. A process found in /proc is not, nor is one whose
	// PID was live in the record at its fork (another's exit event may
	// still come with that PID).
	counted bool
	// execed: it ran exec after the fork.
	execed bool
	// keptFiles: when it ran exec, it still shared an open file of a GPU
	// device with its parent (kcmp): the exec kept the inherited files.
	keptFiles bool
	// forkerUnsure: its files may not be its parent's. A fork event
	// names the child's real parent, not the caller of clone: a child of
	// that parent that clones with CLONE_PARENT gives the new process its
	// own files (forkerChecked). And a parent that held no GPU device
	// when it forked gave none.
	forkerUnsure bool
	// foreignKids counts its live children that may hold files that are
	// not its own (foreign), and any of which could clone a process with
	// CLONE_PARENT; countedForeign: n is counted in its parent's.
	foreignKids    int
	countedForeign bool
	// adopts: a process on its line died leaving children, which the
	// kernel may have given to it (a subreaper, a namespace's init).
	adopts bool
	// dead: it exited; kept while a recorded process descends from it.
	dead bool
	// leaderGone: its main thread exited while others may run on.
	leaderGone bool
}

func (n *node) key() Key { return Key{n.pid, n.start} }

// foreign reports whether n may hold files that are not its parent's: it
// was found in /proc, ran exec without keeping them, or was perhaps
// cloned by another child of its parent. Such a child could give its
// own files to a process whose fork event names the parent.
func (n *node) foreign() bool {
	return !n.atFork || (n.execed && !n.keptFiles) || n.forkerUnsure
}

// recount keeps n's parent's foreignKids right after n changed: a live
// child is counted while foreign. Called with the lock held.
func (r *Record) recount(n *node) {
	want := n.parent != nil && !n.dead && n.foreign()
	if want == n.countedForeign {
		return
	}
	if want {
		n.parent.foreignKids++
	} else {
		n.parent.foreignKids--
	}
	n.countedForeign = want
}

// adoptedAbove marks every process on n's line as perhaps given n's
// children: the kernel hands the children of a dying process to the
// nearest subreaper among its ancestors, or to the namespace's init.
// Called with the lock held.
func (r *Record) adoptedAbove(n *node) {
	p := n.parent
	for range maxDepth {
		if p == nil {
			return
		}
		p.adopts = true
		p = p.parent
	}
}

// Record is the fork record. It is safe for concurrent use; ApplyBatch is
// called by one goroutine at a time (Follow's).
type Record struct {
	fs proc.FS

	mu sync.Mutex
	// live maps each live PID to its process.
	live map[int]*node
	// dead are the dead processes that a recorded process descends from;
	// deadByKey indexes those whose start time is known, deadByPID counts
	// them all per PID.
	dead      map[*node]struct{}
	deadByKey map[Key]*node
	deadByPID map[int]int
	// exiting are PIDs whose exit events arrived, checked in /proc once
	// they had time to finish exiting (FlushExits).
	exiting map[int]time.Time
	// devices are the GPUs' device nodes, for the exec check.
	devices []proc.Device
	// watched are processes whose exit is worth a snapshot now: PID to
	// start time.
	watched map[int]uint64
	onExit  func(Key)
	// free holds released nodes for reuse; nodes counts allocations, for
	// gen.
	free  []*node
	nodes uint64
	// bootOffset is CLOCK_BOOTTIME less CLOCK_MONOTONIC (ns), read at
	// offsetAt: start times count from boot, event times do not count
	// suspended time.
	bootOffset int64
	offsetAt   time.Time
	// resyncs counts the resyncs after lost events; events the events
	// applied.
	resyncs uint64
	events  uint64
}

// quietFirst is how long a parent seen holding no GPU device is not read
// again when its children exec, doubled each time it is seen so up to
// quietMax: a shell's fork-and-exec storm costs a read of the shell's
// descriptors every few seconds. A parent that runs exec itself, or that a
// snapshot found holding a GPU, is read at its children's next exec.
const (
	quietFirst = 250 * time.Millisecond
	quietMax   = 4 * time.Second
)

// exitSettle is how long after an exit event a process is checked: the
// event is sent while the task is still exiting.
const exitSettle = 20 * time.Millisecond

// maxDepth bounds a walk up the record.
const maxDepth = 256

// maxFree bounds the released nodes kept for reuse.
const maxFree = 1024

// ticksPerSecond is USER_HZ, the unit of /proc/PID/stat's start time: 100
// on every Linux architecture.
const ticksPerSecond = 100

// New returns an empty record reading /proc through fs.
func New(fs proc.FS) *Record {
	return &Record{
		fs:        fs,
		live:      map[int]*node{},
		dead:      map[*node]struct{}{},
		deadByKey: map[Key]*node{},
		deadByPID: map[int]int{},
		exiting:   map[int]time.Time{},
		watched:   map[int]uint64{},
	}
}

// SetDevices sets the GPUs' device nodes that an exec is checked against.
func (r *Record) SetDevices(devs []proc.Device) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.devices = devs
}

// Watch sets the processes whose exit calls onExit (the owners and holders
// of the latest snapshot). Their start times are read now when the record
// does not know them yet, while they live: a watched owner that dies is
// then named exactly.
func (r *Record) Watch(keys []Key, onExit func(Key)) {
	w := make(map[int]uint64, len(keys))
	for _, k := range keys {
		w[k.PID] = k.Start
	}
	r.mu.Lock()
	r.watched, r.onExit = w, onExit
	r.mu.Unlock()
	for _, k := range keys {
		r.lookup(k)
		r.mu.Unlock()
	}
}

// alloc returns a zeroed node with a new gen. Called with the lock held.
func (r *Record) alloc() *node {
	var n *node
	if k := len(r.free); k > 0 {
		n, r.free = r.free[k-1], r.free[:k-1]
	} else {
		n = &node{}
	}
	r.nodes++
	n.gen = r.nodes
	return n
}

// release forgets n, which no node names as its parent any more.
func (r *Record) release(n *node) {
	*n = node{}
	if len(r.free) < maxFree {
		r.free = append(r.free, n)
	}
}

// Seed adds every process alive now with its present parent, as not seen
// at fork (a present parent is no evidence of descent: it may have
// adopted it), so that a parent that dies leaving them is seen doing so.
// Call it after subscribing, so that nothing forked meanwhile is missed.
func (r *Record) Seed() error {
	stats, err := r.readStats()
	if err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.seed(stats)
	return nil
}

// readStats reads the stat of every process alive now.
func (r *Record) readStats() (map[int]proc.Stat, error) {
	pids, err := r.fs.PIDs()
	if err != nil {
		return nil, fmt.Errorf("listing processes: %w", err)
	}
	stats := make(map[int]proc.Stat, len(pids))
	for _, pid := range pids {
		if st, err := r.fs.ReadStat(pid); err == nil {
			stats[pid] = st
		}
	}
	return stats, nil
}

// seed records the processes of stats (Seed): an entry whose PID another
// process holds now is dead. Called with the lock held.
func (r *Record) seed(stats map[int]proc.Stat) {
	r.readBootOffset(time.Now())
	var seeded []*node
	for pid, st := range stats {
		if n := r.live[pid]; n != nil {
			if n.known && n.start == st.StartTime {
				continue // an event already recorded it
			}
			if !n.known && r.startedBy(st.StartTime, n.forkTS) {
				n.start, n.known = st.StartTime, true
				continue
			}
			r.die(n)
		}
		n := r.alloc()
		n.pid, n.start, n.known = pid, st.StartTime, true
		r.live[pid] = n
		seeded = append(seeded, n)
	}
	for _, n := range seeded {
		st := stats[n.pid]
		pst, ok := stats[st.PPID]
		if p := r.live[st.PPID]; ok && p != nil && p.known && p.start == pst.StartTime && p != n {
			n.parent = p
			p.kids++
			r.recount(n)
		}
	}
}

// Resync follows lost events: what was missed is unknown (an exec, a
// fork, a thread), so every entry loses its proof of descent and its
// thread count, the dead are found and pruned, and the living are seeded
// anew, from one read of each process.
func (r *Record) Resync() error {
	stats, err := r.readStats()
	r.mu.Lock()
	defer r.mu.Unlock()
	r.resyncs++
	for _, n := range r.live {
		n.atFork, n.counted = false, false
		r.recount(n)
	}
	for n := range r.dead {
		n.atFork = false
	}
	if err != nil {
		return err
	}
	for pid, n := range r.live {
		if _, ok := stats[pid]; !ok {
			r.die(n)
		}
	}
	r.seed(stats)
	return nil
}

// link names n's parent: the live process with PID parent, unless it
// started after n's fork event (ts). Its start time is read now if not
// known, while it lives (or waits to be reaped): once per parent.
func (r *Record) link(n *node, parent int, ts uint64) {
	p := r.live[parent]
	if p == nil {
		return // a parent never seen names nobody for certain
	}
	switch {
	case p.known:
		if !r.startedBy(p.start, ts) {
			// Found in /proc after the real parent died and its PID
			// was reused: not the parent.
			return
		}
	case !p.unresolvable:
		// Seen at its own fork: by the order of the events it is n's
		// parent, whether or not it can still be read.
		if start, ok := r.readStart(p.pid, p.forkTS); ok {
			p.start, p.known = start, true
		} else {
			p.unresolvable = true
		}
	}
	n.parent, n.atFork = p, true
	p.kids++
	// The fork event names p whoever called clone: another child of p
	// may have, with CLONE_PARENT (forkerChecked settles it).
	n.forkerUnsure = p.foreignKids > 0 || p.adopts
	r.recount(n)
}

// unlink forgets n's parent, and prunes it if that was all it was kept
// for.
func (r *Record) unlink(n *node) {
	p := n.parent
	if p == nil {
		return
	}
	if n.countedForeign {
		p.foreignKids--
		n.countedForeign = false
	}
	n.parent, n.atFork = nil, false
	p.kids--
	r.prune(p)
}

// die marks n dead, forgets its PID as live, and prunes what no live
// process needs.
func (r *Record) die(n *node) {
	if r.live[n.pid] == n {
		delete(r.live, n.pid)
	}
	if n.dead {
		return
	}
	n.dead = true
	r.recount(n)
	if n.kids > 0 {
		r.adoptedAbove(n)
		r.dead[n] = struct{}{}
		r.deadByPID[n.pid]++
		if n.known {
			r.deadByKey[n.key()] = n
		}
		return
	}
	r.unlink(n)
	r.release(n)
}

// prune drops dead nodes that nothing recorded descends from, up the
// line.
func (r *Record) prune(n *node) {
	for range maxDepth {
		if n == nil || !n.dead || n.kids > 0 {
			return
		}
		// Kept when it died (die), since it had children then.
		delete(r.dead, n)
		if r.deadByKey[n.key()] == n {
			delete(r.deadByKey, n.key())
		}
		if r.deadByPID[n.pid]--; r.deadByPID[n.pid] <= 0 {
			delete(r.deadByPID, n.pid)
		}
		p := n.parent
		r.release(n)
		if p == nil {
			return
		}
		p.kids--
		n = p
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
	return Counts{Live: len(r.live), Entries: len(r.live) + len(r.dead), Events: r.events, Resyncs: r.resyncs}
}

// Why a holder's descent proves nothing (Inherits).
var (
	ErrNotRecorded  = errors.New("its fork was not recorded")
	ErrNotAtFork    = errors.New("a process on its line was found in /proc rather than seen forking (present before the daemon started, or after lost events)")
	ErrExeced       = errors.New("it or a process on its line ran exec since the fork, dropping the inherited files")
	ErrNotFromThe   = errors.New("it does not descend from the dead owner")
	ErrAmbiguous    = errors.New("more than one dead process had the owner's PID, and which one NVML lists is not known")
	ErrForkerUnsure = errors.New("it, or a process on its line, may hold files that are not its parent's: its parent held no GPU device when it forked, or another child of the parent may have cloned it (CLONE_PARENT)")
	ErrOwnerNotRead = errors.New("the process with the owner's PID on its line died before its start time was read: whether it is the owner a snapshot saw is not known")
)

// Inherits reports whether h descends, fork by fork as the kernel reported
// them, from the dead owner with PID owner, with no exec on the way that
// did not keep the inherited files. ownerStart is the owner's start time
// when a snapshot saw it alive, 0 when not: the owner is then the one dead
// process with that PID on h's line, and refused when the record keeps
// another dead process with that PID (its PID was reused). It returns the
// owner as found.
func (r *Record) Inherits(h Key, owner int, ownerStart uint64) (Key, error) {
	p, err := r.lineTo(h, owner, ownerStart)
	if err != nil {
		return Key{}, err
	}
	// Its exit may still wait for FlushExits: /proc says, read outside
	// the lock that the events' goroutine takes.
	if !p.dead {
		if alive, _, _ := r.aliveNode(p.pid, p.known, p.start, p.forkTS); alive {
			return Key{}, ErrNotFromThe
		}
	}
	if ownerStart != 0 {
		return p.key(), nil
	}
	r.mu.Lock()
	others := r.deadByPID[owner]
	r.mu.Unlock()
	if p.dead {
		others--
	}
	if others > 0 {
		return Key{}, ErrAmbiguous
	}
	return p.key(), nil
}

// lookup returns h's node, nil when the record has none, and leaves the
// lock held. A live process whose start time is not known yet is read
// (outside the lock) to tell whether it is h.
func (r *Record) lookup(h Key) *node {
	r.mu.Lock()
	n := r.live[h.PID]
	if n != nil && !n.known && !n.unresolvable {
		gen, forkTS := n.gen, n.forkTS
		r.mu.Unlock()
		start, ok := r.readStart(h.PID, forkTS)
		r.mu.Lock()
		if n.gen != gen {
			n = r.live[h.PID]
		} else if !n.known {
			if ok {
				n.start, n.known = start, true
			} else {
				n.unresolvable = true
			}
		}
	}
	if n != nil && n.known && n.start == h.Start {
		return n
	}
	return r.deadByKey[h]
}

// lineTo walks up from h, fork by fork, to the first process with PID
// owner (and start time ownerStart when known), and returns a copy of it.
func (r *Record) lineTo(h Key, owner int, ownerStart uint64) (node, error) {
	n := r.lookup(h)
	defer r.mu.Unlock()
	for range maxDepth {
		switch {
		case n == nil:
			return node{}, ErrNotRecorded
		case !n.atFork:
			return node{}, ErrNotAtFork
		case n.execed && !n.keptFiles:
			return node{}, ErrExeced
		case n.forkerUnsure:
			return node{}, ErrForkerUnsure
		}
		p := n.parent
		if p.pid == owner {
			switch {
			case ownerStart == 0 || (p.known && p.start == ownerStart):
				return *p, nil
			case !p.known:
				return node{}, ErrOwnerNotRead
			}
		}
		n = p
	}
	return node{}, ErrNotFromThe
}

// ForkedFrom reports whether h was seen forked, fork by fork, from one of
// ancestors (each by PID and start time): a process that a target forked
// is the target's, whatever it ran since. A line read from /proc (not seen
// at fork) proves nothing.
func (r *Record) ForkedFrom(h Key, ancestors []Key) bool {
	n := r.lookup(h)
	defer r.mu.Unlock()
	for range maxDepth {
		if n == nil || !n.atFork || n.parent == nil {
			return false
		}
		p := n.parent
		if p.known {
			for _, a := range ancestors {
				if p.key() == a {
					return true
				}
			}
		}
		n = p
	}
	return false
}

// ExecedChild returns the parent of h when h was seen forking from it and
// then ran exec that could not be checked to keep the parent's files (the
// parent was gone, or held none of the GPUs then).
func (r *Record) ExecedChild(h Key) (Key, bool) {
	n := r.lookup(h)
	defer r.mu.Unlock()
	if n == nil || !n.atFork || !n.execed || n.keptFiles || n.forkerUnsure {
		return Key{}, false
	}
	return n.parent.key(), true
}

// ApplyBatch records events received at now, in their order, and reports
// whether exits wait for FlushExits. Reading /proc for them happens here,
// and only where needed: a parent's start time at its first child's fork,
// a child's when its PID was live in the record at its fork, its files and
// its parent's at its exec when the parent may hold a GPU device.
func (r *Record) ApplyBatch(evs []procevents.Event, now time.Time) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if now.Sub(r.offsetAt) > 10*time.Second {
		r.readBootOffset(now)
	}
	for _, ev := range evs {
		r.events++
		switch ev.Kind {
		case procevents.Fork:
			r.fork(ev, now)
		case procevents.Exec:
			r.exec(ev.PID, now)
		case procevents.Exit:
			r.exit(ev, now)
		}
	}
	return len(r.exiting) > 0
}

// fork records a new process or thread. Called with the lock held, which
// it may release while reading (forkerChecked).
func (r *Record) fork(ev procevents.Event, now time.Time) {
	if ev.Thread() {
		if n := r.live[ev.PID]; n != nil {
			n.threads++
		}
		return
	}
	if old := r.live[ev.PID]; old != nil {
		r.forkOverLive(old, ev, now)
		return
	}
	n := r.alloc()
	n.pid, n.forkTS, n.counted, n.threads = ev.PID, ev.Timestamp, true, 1
	r.live[ev.PID] = n
	r.link(n, ev.ParentPID, ev.Timestamp)
	r.forkerChecked(n, now)
}

// forkOverLive handles a fork of a PID that the record holds as live: the
// previous process's exit event is still on its way (its parent reaped it
// before the kernel sent it), or was lost; or the child was found in
// /proc before its fork event was applied. Reading the child tells.
func (r *Record) forkOverLive(old *node, ev procevents.Event, now time.Time) {
	start, ok := r.readStart(ev.PID, ev.Timestamp)
	if !ok {
		r.die(old) // gone already: nothing to record
		return
	}
	if old.known && old.start == start {
		// Found in /proc, now seen forking: the same process.
		r.unlink(old)
		old.counted = false
		r.link(old, ev.ParentPID, ev.Timestamp)
		r.forkerChecked(old, now)
		return
	}
	r.die(old)
	// The old process's exit event may still come, with this PID: this
	// one's exit is checked in /proc.
	n := r.alloc()
	n.pid, n.start, n.known, n.forkTS = ev.PID, start, true, ev.Timestamp
	r.live[ev.PID] = n
	r.link(n, ev.ParentPID, ev.Timestamp)
	r.forkerChecked(n, now)
}

// forkerChecked settles whether a new child holds its parent's files: it
// shares an open file of a GPU device with the parent (kcmp), or it holds
// none of the parent's GPU files, whoever called clone (the parent held
// none, or another child of it cloned this one with CLONE_PARENT). Where
// nothing can be read (no GPU known yet, the parent gone), and where the
// parent was seen lately holding no GPU device (quiet) and link's rule
// finds it sure, the rule stands. Called with the lock held, which it
// releases while reading.
func (r *Record) forkerChecked(n *node, now time.Time) {
	if n.parent == nil || !n.atFork {
		return
	}
	shares, read := r.sharesParentFiles(n, now, n.forkerUnsure)
	if !read || r.live[n.pid] != n {
		return
	}
	n.forkerUnsure = !shares
	r.recount(n)
}

// exec marks the process as having run exec, and whether it kept an open
// file of a GPU device that its parent holds (sharesParentFiles). Called
// with the lock held, which it releases while reading.
func (r *Record) exec(pid int, now time.Time) {
	n := r.live[pid]
	if n == nil {
		return
	}
	n.execed, n.keptFiles = true, false
	// A new program: what it holds is read afresh at its children's exec.
	n.quietUntil, n.quietFor = 0, 0
	r.recount(n)
	// Only a child seen forking can be proven to hold its parent's files.
	if !n.atFork {
		return
	}
	if kept, read := r.sharesParentFiles(n, now, false); read && kept && r.live[pid] == n {
		n.keptFiles = true
		r.recount(n)
	}
}

// sharesParentFiles reads whether n shares an open file of a GPU device
// with its parent, unless the parent was seen lately holding none (quiet)
// and the read is not forced: a shell's fork-and-exec storm costs a read
// of the shell's descriptors every quietMax at most. read is false when
// nothing was read, or n was released meanwhile. Called with the lock
// held, which it releases while reading.
func (r *Record) sharesParentFiles(n *node, now time.Time, force bool) (shares, read bool) {
	p, devs := n.parent, r.devices
	if p == nil || p.dead || len(devs) == 0 || (!force && now.UnixNano() < p.quietUntil && !r.isWatched(p)) {
		return false, false
	}
	ngen, pgen, pid, ppid := n.gen, p.gen, n.pid, p.pid
	r.mu.Unlock()
	kept, parentHolds := r.keptFiles(pid, ppid, devs)
	r.mu.Lock()
	if p.gen == pgen {
		if parentHolds {
			p.quietUntil, p.quietFor = 0, 0
		} else {
			p.quietFor = min(max(2*p.quietFor, quietFirst), quietMax)
			p.quietUntil = now.Add(p.quietFor).UnixNano()
		}
	}
	return kept, n.gen == ngen
}

// exit counts a thread's exit. A process seen from its fork is dead with
// its last thread: at once when nothing depends on its death; checked in
// /proc once settled when it leaves children or is watched, and always
// when it was found in /proc. Called with the lock held.
func (r *Record) exit(ev procevents.Event, now time.Time) {
	n := r.live[ev.PID]
	if n == nil {
		return
	}
	if !ev.Thread() {
		n.leaderGone = true
	}
	if n.kids > 0 && (n.counted && n.threads == 1 || !n.counted && n.leaderGone) {
		// Its children go to a subreaper above it now, before its
		// death is confirmed: mark the line before their next fork.
		r.adoptedAbove(n)
	}
	if n.counted {
		if n.threads--; n.threads > 0 {
			return
		}
		if n.kids == 0 && !r.isWatched(n) {
			r.die(n)
			return
		}
		r.exiting[ev.PID] = now
		return
	}
	if n.leaderGone {
		r.exiting[ev.PID] = now
	}
}

// isWatched reports whether n's exit is worth a snapshot now; a process
// whose start time is not known is when its PID is watched. Called with
// the lock held.
func (r *Record) isWatched(n *node) bool {
	start, ok := r.watched[n.pid]
	return ok && (!n.known || start == n.start)
}

// keptFiles reports whether child shares an open file of one of devs with
// parent, and whether parent holds any of them. Each fd table is read
// once.
func (r *Record) keptFiles(child, parent int, devs []proc.Device) (kept, parentHolds bool) {
	hp, err := r.fs.HoldingsOf(parent, devs)
	if err != nil {
		return false, false
	}
	var held []proc.Device
	for i, h := range hp {
		if len(h.FDs) > 0 {
			held = append(held, devs[i])
		}
	}
	if len(held) == 0 {
		return false, false
	}
	hc, err := r.fs.HoldingsOf(child, held)
	if err != nil {
		return false, true
	}
	j := 0
	for _, h := range hp {
		if len(h.FDs) == 0 {
			continue
		}
		if c := hc[j]; len(c.FDs) > 0 {
			if same, err := r.fs.SharesFile(c, h); err == nil && same {
				return true, true
			}
		}
		j++
	}
	return false, true
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
		n := r.live[pid]
		if n == nil {
			r.mu.Unlock()
			continue
		}
		gen, start, known, forkTS := n.gen, n.start, n.known, n.forkTS
		r.mu.Unlock()
		alive, read, ok := r.aliveNode(pid, known, start, forkTS)
		if alive {
			r.mu.Lock()
			if n.gen == gen {
				// An exit event of an earlier process with this PID
				// was counted against it: count no more.
				n.counted = false
				if !n.known && ok {
					n.start, n.known = read, true
				}
			}
			r.mu.Unlock()
			continue
		}
		r.mu.Lock()
		if n.gen == gen && r.live[pid] == n {
			// A process that leaves live children behind may have left
			// them its GPU context, even if no snapshot saw it yet.
			orphaning := n.kids > 0
			watched := r.isWatched(n)
			k := n.key()
			r.die(n)
			if watched || orphaning {
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

// aliveNode reports whether a recorded process has a live thread, and its
// start time as read: that of a process with its PID that started by its
// fork event when the record did not know it (ok false when none). Its
// stat is read once.
func (r *Record) aliveNode(pid int, known bool, start, forkTS uint64) (alive bool, read uint64, ok bool) {
	st, err := r.fs.ReadStat(pid)
	if !known {
		if err != nil || !r.startedBy(st.StartTime, forkTS) {
			return false, 0, false
		}
		start = st.StartTime
	}
	return err == nil && r.liveThread(pid, st, start), start, true
}

// liveThread reports whether the process (pid, start), whose stat is st,
// has a live thread.
func (r *Record) liveThread(pid int, st proc.Stat, start uint64) bool {
	if st.StartTime != start {
		return false
	}
	if st.State != 'Z' && st.State != 'X' {
		return true
	}
	p, ok := r.fs.Alive(pid)
	return ok && p.StartTime == start
}

// readStart reads the start time of the process with PID pid whose fork
// event was sent at forkTS: false when no process has that PID, or the one
// that has it started after forkTS (the PID was given to another process
// after the recorded one died).
func (r *Record) readStart(pid int, forkTS uint64) (uint64, bool) {
	st, err := r.fs.ReadStat(pid)
	if err != nil {
		return 0, false
	}
	if !r.startedBy(st.StartTime, forkTS) {
		return 0, false
	}
	return st.StartTime, true
}

// startedBy reports whether a process with start time start (clock ticks
// since boot) started no later than the event sent at ts (CLOCK_MONOTONIC
// ns). The kernel sets a child's start time before it sends the fork
// event. Two processes that started in the same tick have the same key,
// and are not told apart here either. An event without a time (ts 0)
// proves nothing.
func (r *Record) startedBy(start, ts uint64) bool {
	if ts == 0 {
		return false
	}
	return int64(start)*(1e9/ticksPerSecond) <= int64(ts)+r.bootOffset
}

// readBootOffset reads CLOCK_BOOTTIME less CLOCK_MONOTONIC: the time the
// machine spent suspended. It only grows, so that an older reading only
// makes startedBy stricter. Called with the lock held.
func (r *Record) readBootOffset(now time.Time) {
	var boot, mono unix.Timespec
	if unix.ClockGettime(unix.CLOCK_BOOTTIME, &boot) != nil || unix.ClockGettime(unix.CLOCK_MONOTONIC, &mono) != nil {
		return
	}
	// Read in that order, the offset is never larger than the truth.
	r.bootOffset, r.offsetAt = max(r.bootOffset, boot.Nano()-mono.Nano()), now
}

// Pending reports whether exit events wait for FlushExits.
func (r *Record) Pending() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.exiting) > 0
}
