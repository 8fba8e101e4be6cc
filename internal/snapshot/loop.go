package snapshot

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/forks"
	"github.com/gpu-orphan/gpu-orphan/internal/proc"
)

// Loop takes a snapshot on an interval in the background, so that readers
// (scrapes, decisions) get the latest one without waiting on NVML or /proc.
// It also keeps how long each GPU has had memory with no live owner.
type Loop struct {
	taker    *Taker
	interval time.Duration
	// orphanBytes is the threshold above which memory with no live owner
	// starts the age clock; it allows for the ~8 MiB per context that NVML
	// charges to no process.
	orphanBytes uint64

	mu     sync.RWMutex
	latest *Snapshot
	since  map[string]time.Time // GPU UUID -> start of the current run
	// suspectSince: when each suspect was first seen, per GPU, process
	// (PID and start time, so a reused PID starts afresh) and reason.
	suspectSince map[suspectKey]time.Time
	// lineage remembers who each owner was and who descended from it, to
	// name it and prove its inheritors once it is dead.
	lineage *Lineage
	ticked  chan struct{}
	// persist, when set, saves the lineage (Persist).
	persist *persister
	// forks, when set, is the fork record fed by the process events: the
	// exit of an owner or holder of the latest snapshot, or of a process
	// that leaves live children, takes the next snapshot now (kick) rather
	// than at the next tick.
	forks *forks.Record
	// events says how far the fork record has applied the kernel's events.
	events *forks.Status
	kick   chan struct{}
}

// catchUpLimit bounds how long a forced snapshot waits for the fork record
// to apply the events sent before it.
const catchUpLimit = 2 * time.Second

// kickGap bounds the snapshots that exits take: a few per second at most.
const kickGap = 200 * time.Millisecond

// NewLoop returns a Loop; call Run to start it.
func NewLoop(t *Taker, interval time.Duration, orphanBytes uint64) *Loop {
	return &Loop{taker: t, interval: interval, orphanBytes: orphanBytes, since: map[string]time.Time{}, suspectSince: map[suspectKey]time.Time{}, lineage: NewLineage(), ticked: make(chan struct{}), kick: make(chan struct{}, 1)}
}

// FollowForks makes the loop prove descent through rec, and take a
// snapshot as soon as an owner or holder of the latest one exits. Call it
// before Run.
func (l *Loop) FollowForks(rec *forks.Record, st *forks.Status) {
	l.forks = rec
	l.events = st
	l.lineage.UseForks(rec)
}

// Kick asks for a snapshot now; kicks that arrive while one is due merge.
func (l *Loop) Kick() {
	select {
	case l.kick <- struct{}{}:
	default:
	}
}

// Run takes snapshots until ctx ends.
func (l *Loop) Run(ctx context.Context) {
	tick := time.NewTicker(l.interval)
	defer tick.Stop()
	for {
		last := time.Now()
		l.Refresh(ctx, false)
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		case <-l.kick:
			if wait := kickGap - time.Since(last); wait > 0 {
				select {
				case <-ctx.Done():
					return
				case <-time.After(wait):
				}
			}
		}
	}
}

// Refresh takes one snapshot now, records it as the latest and returns it.
// A forced one (a decision's) first lets the fork record apply the events
// sent until then: a holder forked just before, on a busy node, is then
// proven rather than left unproven (a worker's replacement forked on
// SIGTERM, seen by a re-plan).
func (l *Loop) Refresh(ctx context.Context, forceScan bool) *Snapshot {
	if forceScan && l.events != nil && !l.events.CatchUp(ctx, catchUpLimit) && l.events.Up() && ctx.Err() == nil {
		l.taker.cfg.Logger.Warn("The fork record did not apply the kernel's process events in time: this decision may find recent holders unproven", "waited", catchUpLimit)
	}
	s := l.refresh(ctx, forceScan)
	l.watch(s)
	l.save()
	return s
}

// watch tells the fork record which exits are worth a snapshot now (the
// live owners and the holders of s) and which device nodes an exec is
// checked against.
func (l *Loop) watch(s *Snapshot) {
	if l.forks == nil || len(s.GPUs) == 0 {
		return
	}
	var keys []forks.Key
	var devs []proc.Device
	for _, g := range s.GPUs {
		if d, err := l.taker.cfg.Driver.DeviceNode(g.Device.Minor); err == nil && g.Err == nil {
			devs = append(devs, d)
		}
		for _, o := range g.Owners {
			if o.Alive && o.Process != nil {
				keys = append(keys, forks.Key{PID: int(o.PID), Start: o.Process.StartTime})
			}
		}
		for _, h := range g.Holders {
			keys = append(keys, forks.Key{PID: h.PID, Start: h.StartTime})
		}
	}
	if len(devs) > 0 {
		l.forks.SetDevices(devs)
	}
	l.forks.Watch(keys, func(forks.Key) { l.Kick() })
}

func (l *Loop) refresh(ctx context.Context, forceScan bool) *Snapshot {
	s := l.taker.TakeWith(ctx, forceScan, l.lineage)
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.latest != nil && s.Taken.Before(l.latest.Taken) {
		// A concurrent refresh that started later finished first: keep
		// the newer one, so time never runs backwards for readers. The
		// caller still gets its snapshot dated: undated, its orphan would
		// look as young as a new one (a plan made on it skips too_young).
		l.date(s)
		return s
	}
	l.age(s)
	l.latest = s
	close(l.ticked)
	l.ticked = make(chan struct{})
	return s
}

// age carries the start of each GPU's orphan run from one snapshot to the
// next. A GPU that cannot be accounted keeps its clock: a failed read is not
// evidence that the memory came back.
func (l *Loop) age(s *Snapshot) {
	if len(s.GPUs) == 0 {
		return
	}
	seen := map[string]bool{}
	for i := range s.GPUs {
		g := &s.GPUs[i]
		uuid := g.Device.UUID
		seen[uuid] = true
		if !g.Accountable() {
			continue
		}
		if g.UnownedBytes <= l.orphanBytes {
			delete(l.since, uuid)
			continue
		}
		if _, ok := l.since[uuid]; !ok {
			l.since[uuid] = s.Taken
		}
		g.UnownedSince = l.since[uuid]
	}
	for uuid := range l.since {
		if !seen[uuid] {
			delete(l.since, uuid)
		}
	}
	l.ageSuspects(s)
	l.lineage.update(s)
}

// date sets the clocks of s, a snapshot older than the latest, from the
// runs that the loop has dated already, without changing them: s is not
// evidence that a run began or ended. What no snapshot dated yet stays
// undated (zero), as young as it can be.
func (l *Loop) date(s *Snapshot) {
	for i := range s.GPUs {
		g := &s.GPUs[i]
		if g.Accountable() && g.UnownedBytes > l.orphanBytes {
			g.UnownedSince = l.since[g.Device.UUID]
		}
		for j := range g.Suspects {
			h := &g.Suspects[j]
			h.Since = l.suspectSince[suspectKey{g.Device.UUID, h.PID, h.StartTime, h.Reason}]
		}
	}
	l.lineage.date(s)
}

type suspectKey struct {
	uuid      string
	pid       int
	startTime uint64
	reason    string
}

// ageSuspects carries when each suspect was first seen. A GPU that was not
// scanned this time keeps its suspects' clocks: not looking is not seeing
// them gone.
func (l *Loop) ageSuspects(s *Snapshot) {
	current := map[suspectKey]bool{}
	for i := range s.GPUs {
		g := &s.GPUs[i]
		if !g.Scanned {
			for k := range l.suspectSince {
				if k.uuid == g.Device.UUID {
					current[k] = true
				}
			}
			continue
		}
		for j := range g.Suspects {
			h := &g.Suspects[j]
			k := suspectKey{g.Device.UUID, h.PID, h.StartTime, h.Reason}
			if _, ok := l.suspectSince[k]; !ok {
				l.suspectSince[k] = s.Taken
			}
			h.Since = l.suspectSince[k]
			current[k] = true
		}
	}
	for k := range l.suspectSince {
		if !current[k] {
			delete(l.suspectSince, k)
		}
	}
}

// Latest returns the most recent snapshot, or nil before the first.
func (l *Loop) Latest() *Snapshot {
	l.mu.RLock()
	defer l.mu.RUnlock()
	return l.latest
}

// Next returns a channel closed when the next snapshot is recorded.
func (l *Loop) Next() <-chan struct{} {
	l.mu.RLock()
	defer l.mu.RUnlock()
	return l.ticked
}

// Persist makes the loop save what it remembers (Lineage.MarshalState) with
// save after each snapshot that changed it, and at least every `every`
// while owners are seen; bootID names this boot. A failed save is logged
// once until one succeeds. Call it before Run.
func (l *Loop) Persist(bootID string, every time.Duration, save func([]byte) error, logger *slog.Logger) {
	l.persist = &persister{bootID: bootID, every: every, save: save, logger: logger}
}

// persister is how a Loop saves its lineage.
type persister struct {
	bootID string
	every  time.Duration
	save   func([]byte) error
	logger *slog.Logger

	mu     sync.Mutex
	gen    uint64
	saved  time.Time
	failed bool
}

// save writes the lineage when it changed, or is due; one save at a time,
// and a refresh never waits for another's.
func (l *Loop) save() {
	p := l.persist
	if p == nil || !p.mu.TryLock() {
		return
	}
	defer p.mu.Unlock()
	gen := l.lineage.Generation()
	if gen == p.gen && time.Since(p.saved) < p.every {
		return
	}
	data, err := l.lineage.MarshalState(p.bootID)
	if err == nil {
		err = p.save(data)
	}
	if err != nil {
		if !p.failed {
			p.logger.Warn("Cannot save what the collector remembers; a restart will forget it", "err", err)
		}
		p.failed = true
		return
	}
	if p.failed {
		p.logger.Info("Saving what the collector remembers again")
	}
	p.gen, p.saved, p.failed = gen, time.Now(), false
}

// Lineage is what the loop remembers across snapshots.
func (l *Loop) Lineage() *Lineage { return l.lineage }

// OrphanBytes is the threshold that starts a GPU's age clock.
func (l *Loop) OrphanBytes() uint64 { return l.orphanBytes }
