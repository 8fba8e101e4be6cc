package snapshot

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/forks"
	"github.com/gpu-orphan/gpu-orphan/internal/gpu"
	"github.com/gpu-orphan/gpu-orphan/internal/proc"
)

// Source names, as they appear in metrics and logs.
const (
	SourceProc   = "proc"
	SourceFDScan = "fdscan"
)

// Config says how to take snapshots.
type Config struct {
	Driver gpu.Driver
	Proc   proc.FS
	// DriverTimeout bounds one driver Read; a hung NVML call fails the
	// snapshot's driver source instead of hanging the caller.
	DriverTimeout time.Duration
	// ScanUnownedBytes: scan /proc/*/fd for a GPU's holders when its memory
	// with no live owner exceeds this, even if NVML lists no dead PID.
	ScanUnownedBytes uint64
	// ExcludePIDs are never reported as holders (this process: NVML itself
	// keeps the device nodes open).
	ExcludePIDs []int
	Logger      *slog.Logger
}

// Taker takes snapshots. It is safe for concurrent use.
type Taker struct {
	cfg Config

	// One driver read at a time: concurrent Takes (the background loop, a
	// decision, a verification) share the read in flight rather than
	// queue behind it, and a read stuck past the deadline is abandoned.
	mu       sync.Mutex
	inflight *driverCall
	// shielded is the latest scan's shielded PIDs, to log them once.
	shielded []int
	// kcmpWarned: that kcmp is unavailable was logged.
	kcmpWarned bool
}

// driverCall is one driver Read, shared by every Take that arrives while
// it runs.
type driverCall struct {
	started  time.Time
	done     chan struct{}
	readings []gpu.Reading
	err      error
}

// NewTaker returns a Taker for cfg.
func NewTaker(cfg Config) *Taker {
	if cfg.DriverTimeout <= 0 {
		cfg.DriverTimeout = 5 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	return &Taker{cfg: cfg}
}

// ErrDriverHung is returned while an earlier driver call has not returned.
var ErrDriverHung = errors.New("an earlier GPU driver call is still hung")

// Take reads the driver and /proc once. forceScan scans holders of every
// GPU, as `gpu-orphan ps` does; otherwise only GPUs that show memory with
// no live owner are scanned, so a healthy node costs almost nothing. A
// snapshot taken alone has no lineage: only what the kernel shows now
// proves who inherited a dead owner's context.
func (t *Taker) Take(ctx context.Context, forceScan bool) *Snapshot {
	return t.TakeWith(ctx, forceScan, nil)
}

// TakeWith is Take with what a Loop remembers: the owners it saw alive
// and their recorded descendants, which it also records into.
func (t *Taker) TakeWith(ctx context.Context, forceScan bool, mem *Lineage) *Snapshot {
	s := &Snapshot{Taken: time.Now(), Driver: t.cfg.Driver.Name()}

	start := time.Now()
	readings, err := t.read(ctx)
	s.Sources = append(s.Sources, Source{Name: t.cfg.Driver.Name(), Err: err, Duration: time.Since(start)})
	if err != nil {
		return s
	}

	start = time.Now()
	s.HostPIDsVisible, err = t.pidsVisible()
	s.GPUs = make([]GPU, 0, len(readings))
	for _, r := range readings {
		g, denied := t.account(r, s.HostPIDsVisible, mem)
		s.GPUs = append(s.GPUs, g)
		s.FDScanDenied += denied
	}
	t.recordOwnersDescent(s, mem)
	s.Sources = append(s.Sources, Source{Name: SourceProc, Err: err, Duration: time.Since(start)})

	start = time.Now()
	scanned, err := t.scanHolders(s, forceScan, mem)
	if !scanned && s.FDScanDenied > 0 {
		scanned, err = true, fmt.Errorf("%w: %d listed owners", ErrScanIncomplete, s.FDScanDenied)
	}
	if scanned {
		s.Sources = append(s.Sources, Source{Name: SourceFDScan, Err: err, Duration: time.Since(start)})
	}
	return s
}

// read calls the driver under a deadline. The cgo call cannot be
// interrupted, so a hung call is abandoned, and while it stays hung later
// reads fail fast instead of piling up goroutines behind it.
//
// Every deadline runs from the call's start, the clock by which a later
// caller judges it hung: a caller's deadline started before the call did
// (before the lock) could expire while the call still looked young to the
// next caller, which then joined it and timed out instead of failing fast.
func (t *Taker) read(ctx context.Context) ([]gpu.Reading, error) {
	t.mu.Lock()
	c := t.inflight
	if c != nil && time.Since(c.started) >= t.cfg.DriverTimeout {
		t.mu.Unlock()
		return nil, ErrDriverHung
	}
	if c == nil {
		c = &driverCall{started: time.Now(), done: make(chan struct{})}
		t.inflight = c
		go func() {
			// The driver gets its own deadline: a caller that gives up
			// must not cut short the read that others share.
			readCtx, cancel := context.WithDeadline(context.Background(), c.started.Add(t.cfg.DriverTimeout))
			defer cancel()
			c.readings, c.err = t.cfg.Driver.Read(readCtx)
			t.mu.Lock()
			t.inflight = nil
			t.mu.Unlock()
			close(c.done)
		}()
	}
	t.mu.Unlock()
	// Wait no longer than the call may run: by the time this deadline
	// expires (c.started keeps its monotonic reading), the call counts as
	// hung for every later caller.
	ctx, cancel := context.WithDeadline(ctx, c.started.Add(t.cfg.DriverTimeout))
	defer cancel()
	select {
	case <-c.done:
		if c.err != nil {
			return nil, fmt.Errorf("reading GPUs through %s: %w", t.cfg.Driver.Name(), c.err)
		}
		return c.readings, nil
	case <-ctx.Done():
		return nil, fmt.Errorf("reading GPUs through %s: %w", t.cfg.Driver.Name(), ctx.Err())
	}
}

// pidsVisible compares the driver's PID namespace with our /proc's.
func (t *Taker) pidsVisible() (bool, error) {
	ns, err := t.cfg.Proc.PIDNamespace()
	if err != nil {
		return false, fmt.Errorf("finding the PID namespace of /proc: %w", err)
	}
	return ns == t.cfg.Driver.PIDNamespace(), nil
}

// account splits one GPU's used memory by the liveness of its owners. A
// listed PID is a live owner only when a live process has it and holds the
// GPU's device node: after a dead owner's PID is reused, the newcomer does
// not (docs/facts.md, measured on the H200).
func (t *Taker) account(r gpu.Reading, pidsVisible bool, mem *Lineage) (GPU, int) {
	g := GPU{Device: r.Device, Memory: r.Memory, Unsupported: r.Unsupported, Err: r.Err}
	if !g.Accountable() {
		return g, 0
	}
	if !pidsVisible {
		g.Unsupported = UnsupportedForeignPIDNamespace
		return g, 0
	}
	dev, err := t.cfg.Driver.DeviceNode(g.Device.Minor)
	if err != nil {
		g.Err = fmt.Errorf("identifying the device node of GPU %d: %w", g.Device.Index, err)
		return g, 0
	}
	denied := 0
	var listed uint64
	for _, p := range r.Processes {
		o := Owner{PID: p.PID, UsedBytes: p.UsedBytes}
		if pr, ok := t.cfg.Proc.Alive(int(p.PID)); ok {
			_, holds, err := t.cfg.Proc.HoldingOf(int(p.PID), dev)
			switch {
			case errors.Is(err, proc.ErrNotExist):
				// Exited since: dead.
			case err != nil:
				// Unreadable is not proof of reuse: count it as the owner.
				denied += boolInt(errors.Is(err, proc.ErrDenied))
				o.Alive, o.Process, o.Unverified = true, &pr, true
			case holds && t.reused(g.Device.UUID, pr, dev, mem):
				o.ReusedBy = &pr
			case holds:
				o.Alive, o.Process = true, &pr
			default:
				o.ReusedBy = &pr
			}
		}
		if !o.Alive {
			mem.identify(g.Device.UUID, &o)
		}
		if o.Alive {
			g.OwnedLiveBytes += p.UsedBytes
		} else {
			g.OwnedDeadBytes += p.UsedBytes
		}
		listed += p.UsedBytes
		g.Owners = append(g.Owners, o)
	}
	used := g.Memory.Used
	g.UnattributedBytes = used - min(listed, used)
	g.UnownedBytes = used - min(g.OwnedLiveBytes, used)
	live := uint64(0)
	for _, o := range g.Owners {
		if o.Alive {
			live++
		}
	}
	explained := live * ContextOverheadBytes
	g.UnexplainedBytes = min(g.OwnedDeadBytes+g.UnattributedBytes-min(explained, g.UnattributedBytes), g.UnownedBytes)
	return g, denied
}

// reused reports whether the live process pr, which has a listed PID and
// holds the GPU, is a newcomer given a dead owner's PID rather than the
// owner: the Loop remembers another process (another start time) as the
// owner with that PID, NVML listed the PID in the latest snapshot without
// a break, and a recorded descendant of that owner still holds the GPU, so
// its context was never freed for the newcomer to make its own (a CUDA
// process given a held context's PID fails to initialise: FACTS.md).
func (t *Taker) reused(uuid string, pr proc.Process, dev proc.Device, mem *Lineage) bool {
	id, listedLast, ok := mem.remembered(uuid, pr.PID)
	if !ok || !listedLast || id.StartTime == pr.StartTime {
		return false
	}
	for _, d := range mem.descendants(uuid, procKey{id.PID, id.StartTime}) {
		st, err := t.cfg.Proc.ReadStat(d.pid)
		if err != nil || st.StartTime != d.start {
			continue
		}
		if _, holds, err := t.cfg.Proc.HoldingOf(d.pid, dev); err == nil && holds {
			return true
		}
	}
	return false
}

// recordOwnersDescent records, for each live owner, its descendants that
// hold the owner's GPU, by PID and start time: once the owner dies, they
// are its proven inheritors. It reads the children of the owners' threads,
// and the descriptors of descendants not seen before; a descendant that
// does not hold the GPU is not read again, nor are its children (they
// cannot have inherited the device through it).
func (t *Taker) recordOwnersDescent(s *Snapshot, mem *Lineage) {
	if mem == nil {
		return
	}
	for _, g := range s.GPUs {
		if !g.Accountable() {
			continue
		}
		var dev proc.Device
		devKnown := false
		for _, o := range g.Owners {
			if !o.Alive || o.Process == nil || o.Unverified {
				continue
			}
			if !devKnown {
				d, err := t.cfg.Driver.DeviceNode(g.Device.Minor)
				if err != nil {
					break
				}
				dev, devKnown = d, true
			}
			owner := procKey{int(o.PID), o.Process.StartTime}
			t.recordDescent(g.Device.UUID, owner, dev, mem)
		}
	}
}

// maxDescentWalk bounds one walk of a process tree.
const maxDescentWalk = 4096

// recordDescent walks the descendants of the live owner and records those
// that hold dev as descending from owner; those that share an open file of
// dev with the owner (kcmp) hold the owner's own files, and are recorded as
// its inheritors (ProofSharedOwnerFile). The owner's descriptors are read
// only when a descendant not proven yet holds dev: a healthy node's
// snapshot reads no more than the children files it read before. Every
// thread of the owner may have forked; below it, only what main threads
// forked is read (one file per process, every interval): a worker's own
// workers come from its main thread.
func (t *Taker) recordDescent(uuid string, owner procKey, dev proc.Device, mem *Lineage) {
	root := owner.pid
	var own proc.Holding
	ownRead, ownHolds := false, false
	sharesOwnerFile := func(h proc.Holding) bool {
		if !ownRead {
			ownRead = true
			var err error
			own, ownHolds, err = t.cfg.Proc.HoldingOf(root, dev)
			ownHolds = ownHolds && err == nil
		}
		return ownHolds && t.sharesFile(h, own)
	}
	queue := []int{root}
	for n := 0; len(queue) > 0 && n < maxDescentWalk; n++ {
		pid := queue[0]
		queue = queue[1:]
		var kids []int
		var err error
		if pid == root {
			kids, err = t.cfg.Proc.Children(pid)
		} else {
			kids, err = t.cfg.Proc.ThreadChildren(pid, pid)
		}
		if err != nil {
			continue
		}
		for _, kid := range kids {
			st, err := t.cfg.Proc.ReadStat(kid)
			if err != nil {
				continue
			}
			k := procKey{kid, st.StartTime}
			switch {
			case mem.wasInherited(uuid, owner, k):
			case mem.wasChecked(uuid, k):
				continue
			default:
				h, holds, err := t.cfg.Proc.HoldingOf(kid, dev)
				if err != nil {
					continue // gone, or unreadable: nothing proven
				}
				if holds && sharesOwnerFile(h) {
					mem.recordInherited(uuid, owner, k, ProofSharedOwnerFile)
				}
				mem.recordDescent(uuid, owner, k, holds)
				if !holds {
					continue
				}
			}
			queue = append(queue, kid)
		}
	}
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

// ErrScanIncomplete fails the fdscan source when some processes'
// descriptors could not be read.
var ErrScanIncomplete = errors.New("the descriptors of some processes could not be read (run as root, or with CAP_SYS_PTRACE)")

// scanHolders finds the holders of every GPU that needs it, in one pass
// over /proc/*/fd, and judges them. It reports whether a scan ran.
func (t *Taker) scanHolders(s *Snapshot, force bool, mem *Lineage) (bool, error) {
	want := map[proc.Device][]int{} // device -> indexes into s.GPUs
	for i, g := range s.GPUs {
		if !g.Accountable() {
			continue
		}
		if force || g.DeadOwnerListed() || g.UnownedBytes > t.cfg.ScanUnownedBytes || t.orphanedOwner(g) {
			dev, err := t.cfg.Driver.DeviceNode(g.Device.Minor)
			if err != nil {
				return true, fmt.Errorf("identifying the device node of GPU %d: %w", g.Device.Index, err)
			}
			want[dev] = append(want[dev], i)
		}
	}
	if len(want) == 0 {
		return false, nil
	}
	devs := make([]proc.Device, 0, len(want))
	for d := range want {
		devs = append(devs, d)
	}
	scan, err := t.cfg.Proc.ScanHolders(devs)
	if err != nil {
		return true, fmt.Errorf("scanning /proc for holders of %v: %w", devs, err)
	}
	s.FDScanDenied += scan.Denied
	s.FDScanShielded = scan.Shielded
	t.mu.Lock()
	changed := !slices.Equal(t.shielded, scan.Shielded)
	t.shielded = scan.Shielded
	t.mu.Unlock()
	if changed && len(scan.Shielded) > 0 {
		t.cfg.Logger.Info("Descriptors shielded by a security policy even from CAP_SYS_PTRACE: these processes are not scanned", "pids", scan.Shielded)
	}
	jobs := t.liveJobs(s)
	parents := map[int]proc.Stat{}
	ancestors := t.liveAncestors(jobs, parents)
	for dev, idxs := range want {
		holdings := slices.DeleteFunc(slices.Clone(scan.Holders[dev]), func(h proc.Holding) bool {
			return slices.Contains(t.cfg.ExcludePIDs, h.PID)
		})
		pids := make([]int, 0, len(holdings))
		raw := map[int]proc.Holding{}
		var holders []Holding
		for _, h := range holdings {
			pids = append(pids, h.PID)
			if hd, ok := t.holding(h, jobs, ancestors, parents); ok {
				holders = append(holders, hd)
				raw[h.PID] = h
			}
		}
		t.linkSharedFiles(holders, raw, jobs)
		for _, i := range idxs {
			g := &s.GPUs[i]
			g.Scanned = true
			g.HolderPIDs = pids
			g.Holders = holders
			g.Suspects = t.suspects(*g, holders, raw, mem)
			t.recordInheritorsDescent(*g, mem)
		}
	}
	if s.FDScanDenied > 0 {
		return true, fmt.Errorf("%w: %d processes", ErrScanIncomplete, s.FDScanDenied)
	}
	return true, nil
}

// procKey names a process as the kernel does: its PID and start time.
type procKey struct {
	pid   int
	start uint64
}

// liveJobs maps each live owner to the GPUs where it owns memory.
func (t *Taker) liveJobs(s *Snapshot) map[procKey][]string {
	jobs := map[procKey][]string{}
	for _, g := range s.GPUs {
		for _, o := range g.Owners {
			if !o.Alive || o.Process == nil {
				continue
			}
			k := procKey{int(o.PID), o.Process.StartTime}
			if !slices.Contains(jobs[k], g.Device.UUID) {
				jobs[k] = append(jobs[k], g.Device.UUID)
			}
		}
	}
	return jobs
}

// jobOf is a live owner and one GPU where it owns memory.
type jobOf struct {
	owner int
	gpu   string
}

// maxAncestry bounds a walk up the process tree.
const maxAncestry = 64

// parentOf reads the stat line of pid through the scan's cache.
func (t *Taker) parentOf(pid int, parents map[int]proc.Stat) (proc.Stat, bool) {
	if st, ok := parents[pid]; ok {
		return st, true
	}
	st, err := t.cfg.Proc.ReadStat(pid)
	if err != nil {
		return proc.Stat{}, false
	}
	parents[pid] = st
	return st, true
}

// liveAncestors maps every ancestor of a live owner (a launcher, a job
// script, MPS control) to the owners' jobs it is part of.
func (t *Taker) liveAncestors(jobs map[procKey][]string, parents map[int]proc.Stat) map[procKey][]jobOf {
	out := map[procKey][]jobOf{}
	for owner, gpus := range jobs {
		st, ok := t.parentOf(owner.pid, parents)
		if !ok {
			continue
		}
		ppid := st.PPID
		for range maxAncestry {
			if ppid <= 1 {
				break
			}
			pst, ok := t.parentOf(ppid, parents)
			if !ok {
				break
			}
			k := procKey{ppid, pst.StartTime}
			for _, uuid := range gpus {
				out[k] = append(out[k], jobOf{owner.pid, uuid})
			}
			ppid = pst.PPID
		}
	}
	return out
}

// holding reads who a holder is, whether it maps the device, and which live
// jobs it belongs to through the process tree. ok is false when it is not
// alive. parents caches the stat lines over one scan: holders share their
// ancestors.
func (t *Taker) holding(h proc.Holding, jobs map[procKey][]string, ancestors map[procKey][]jobOf, parents map[int]proc.Stat) (Holding, bool) {
	p, ok := t.cfg.Proc.Alive(h.PID)
	if !ok {
		return Holding{}, false
	}
	mapped, err := t.cfg.Proc.Maps(h)
	hd := Holding{Process: p, Mapped: err == nil && mapped}
	self := procKey{h.PID, p.StartTime}
	// A launcher that started a live owner is part of its job.
	for _, j := range ancestors[self] {
		hd.link(j.owner, j.gpu, JobAncestor)
	}
	// A worker belongs to a live job through its ancestry, on any GPU: the
	// process itself, its parent, and so on up to init; each one by PID
	// and start time, so that a reused PID is nobody's ancestor.
	k, ppid := self, p.PPID
	for range maxAncestry {
		how := JobDescendant
		if k == self {
			how = JobSelf
		}
		for _, uuid := range jobs[k] {
			hd.link(k.pid, uuid, how)
		}
		if ppid <= 1 {
			break
		}
		st, ok := t.parentOf(ppid, parents)
		if !ok {
			break
		}
		k, ppid = procKey{ppid, st.StartTime}, st.PPID
	}
	return hd, true
}

// linkSharedFiles ties to a live job each mapping holder that shares an
// open file of the device with a live owner (kcmp): it holds that owner's
// own context, as a double-forked helper reparented to init does.
func (t *Taker) linkSharedFiles(holders []Holding, raw map[int]proc.Holding, jobs map[procKey][]string) {
	var owners []Holding
	for _, h := range holders {
		if len(jobs[procKey{h.PID, h.StartTime}]) > 0 {
			owners = append(owners, h)
		}
	}
	for i := range holders {
		h := &holders[i]
		if !h.Mapped || len(h.LiveJobGPUs) > 0 {
			continue
		}
		for _, o := range owners {
			if !t.sharesFile(raw[h.PID], raw[o.PID]) {
				continue
			}
			for _, uuid := range jobs[procKey{o.PID, o.StartTime}] {
				h.link(o.PID, uuid, JobSharesFile)
			}
		}
	}
}

// sharesFile is proc.FS.SharesFile; when the kernel cannot compare open
// files it says so once and reports no sharing: the rules that need no
// kcmp still hold, and a holder not proven an inheritor is not signalled.
func (t *Taker) sharesFile(a, b proc.Holding) bool {
	same, err := t.cfg.Proc.SharesFile(a, b)
	if errors.Is(err, proc.ErrKcmpUnavailable) {
		t.mu.Lock()
		first := !t.kcmpWarned
		t.kcmpWarned = true
		t.mu.Unlock()
		if first {
			t.cfg.Logger.Warn("Cannot compare open files: a helper sharing a live owner's context, or a dead owner's inheritor's, is not recognised by it", "err", err)
		}
	}
	return err == nil && same
}

// suspects judges the holders of one GPU.
//
//   - inherited_from_dead_owner: a holder that NVML does not list, maps the
//     device node (a CUDA context does; NVML-only readers only keep it
//     open), belongs to no live job on any GPU, and is proven to have
//     inherited a dead listed owner's context (prove).
//   - unexplained_holder: such a holder without proof, on a GPU that has
//     a dead owner or memory that the live contexts do not explain.
//   - orphaned: a live listed owner whose session leader died.
func (t *Taker) suspects(g GPU, holders []Holding, raw map[int]proc.Holding, mem *Lineage) []Holder {
	var dead []Owner
	live := map[int]bool{}
	for _, o := range g.Owners {
		if o.Alive {
			live[int(o.PID)] = true
		} else {
			dead = append(dead, o)
		}
	}
	problem := len(dead) > 0 || g.UnexplainedBytes > t.cfg.ScanUnownedBytes
	var proven, unproven []Holder
	for _, h := range holders {
		if live[h.PID] || !h.Mapped || len(h.LiveJobGPUs) > 0 {
			continue
		}
		hd := t.prove(g.Device.UUID, h, dead, mem)
		if hd.Reason == ReasonInheritedFromDeadOwner {
			proven = append(proven, hd)
		} else {
			unproven = append(unproven, hd)
		}
	}
	proven, unproven = t.proveExecedSiblings(g, proven, unproven, raw, mem)
	// A holder that shares an open file of the device with a proven
	// inheritor holds the same dead context (passed on by fork or
	// SCM_RIGHTS after the walks that recorded descent).
	for grew := true; grew; {
		grew = false
		for i := 0; i < len(unproven); i++ {
			u := unproven[i]
			for _, p := range proven {
				o, _ := g.Owner(p.DeadOwner)
				if o.Identity != nil && u.StartTime < o.Identity.StartTime {
					continue
				}
				if t.sharesFile(raw[u.PID], raw[p.PID]) {
					u.Reason, u.DeadOwner, u.Proof = ReasonInheritedFromDeadOwner, p.DeadOwner, ProofSharesFile
					proven = append(proven, u)
					unproven = slices.Delete(unproven, i, i+1)
					i--
					grew = true
					break
				}
			}
		}
	}
	out := proven
	if problem {
		out = append(out, unproven...)
	}
	// A listed owner that is orphaned counts even if the scan missed it.
	for _, o := range g.Owners {
		if o.Alive && t.orphaned(*o.Process) {
			out = append(out, Holder{Process: *o.Process, Reason: ReasonOrphaned, Listed: true, UsedBytes: o.UsedBytes})
		}
	}
	slices.SortFunc(out, func(a, b Holder) int { return a.PID - b.PID })
	return out
}

// prove looks for what the kernel recorded that shows h holds one dead
// owner's own open files of the device: the fork record (descent at fork,
// no exec since that dropped them), or the same proof recorded earlier (by
// this daemon before a restart, or by the node agent whose state a command
// reads). Group, session and descent seen by polling only rank a suspect:
// they never make one a target.
func (t *Taker) prove(uuid string, h Holding, dead []Owner, mem *Lineage) Holder {
	hd := Holder{Process: h.Process, Reason: ReasonUnexplained, Proof: NoProof}
	self := procKey{h.PID, h.StartTime}
	rec := mem.forkRecord()
	before := 0
	why := ""
	for _, o := range dead {
		pid, id := int(o.PID), o.Identity
		if id != nil && h.StartTime < id.StartTime {
			before++
			continue
		}
		if proof := mem.inheritedBy(uuid, deadOwnerKey(o), self); proof != "" {
			hd.Reason, hd.DeadOwner, hd.Proof = ReasonInheritedFromDeadOwner, pid, proof
			return hd
		}
		if rec != nil {
			var ownerStart uint64
			if id != nil {
				ownerStart = id.StartTime
			}
			_, err := rec.Inherits(forks.Key{PID: h.PID, Start: h.StartTime}, pid, ownerStart)
			if err == nil {
				mem.recordInherited(uuid, deadOwnerKey(o), self, ProofDescentAtFork)
				hd.Reason, hd.DeadOwner, hd.Proof = ReasonInheritedFromDeadOwner, pid, ProofDescentAtFork
				return hd
			}
			if w := noProofFor(err); w != "" && why == "" {
				why = w
			}
		}
		if why == "" && (mem.descends(uuid, deadOwnerKey(o), self) ||
			(o.ReusedBy == nil && (h.PGID == pid || h.SID == pid))) {
			why = NoProofMembershipOnly
		}
	}
	switch {
	case len(dead) > 0 && before == len(dead):
		hd.Proof = NoProofStartedBefore
	case why != "":
		hd.Proof = why
	case rec == nil && len(dead) > 0:
		hd.Proof = NoProofEventsUnavailable
	}
	return hd
}

// noProofFor names why the fork record proves nothing; "" when the holder
// is simply not on the owner's line.
func noProofFor(err error) string {
	switch {
	case errors.Is(err, forks.ErrNotAtFork):
		return NoProofNotAtFork
	case errors.Is(err, forks.ErrExeced):
		return NoProofExeced
	case errors.Is(err, forks.ErrForkerUnsure):
		return NoProofForkerUnsure
	case errors.Is(err, forks.ErrOwnerNotRead):
		return NoProofOwnerNotRead
	case errors.Is(err, forks.ErrAmbiguous):
		return NoProofOwnerPIDReused
	}
	return ""
}

// proveExecedSiblings proves the children of one dead owner that ran exec
// when two of them share an open file of the device (kcmp): processes
// forked from the owner share a file only if it was in the owner's table
// when they forked (or was passed between them). It covers workers whose
// exec could not be checked against the owner's files because the owner
// died first (gpu-orphan-sim's workers run exec; PyTorch's do not). One
// such child alone stays unproven.
func (t *Taker) proveExecedSiblings(g GPU, proven, unproven []Holder, raw map[int]proc.Holding, mem *Lineage) ([]Holder, []Holder) {
	rec := mem.forkRecord()
	if rec == nil {
		return proven, unproven
	}
	byOwner := map[forks.Key][]int{} // dead owner -> indexes into unproven
	for i, u := range unproven {
		if u.Proof != NoProofExeced {
			continue
		}
		parent, ok := rec.ExecedChild(forks.Key{PID: u.PID, Start: u.StartTime})
		if !ok {
			continue
		}
		o, dead := g.Owner(parent.PID)
		if !dead || o.Alive || (o.Identity != nil && o.Identity.StartTime != parent.Start) {
			continue
		}
		byOwner[parent] = append(byOwner[parent], i)
	}
	sibling := map[int]int{} // index into unproven -> dead owner PID
	for owner, idxs := range byOwner {
		for a := 0; a < len(idxs); a++ {
			for b := a + 1; b < len(idxs); b++ {
				if t.sharesFile(raw[unproven[idxs[a]].PID], raw[unproven[idxs[b]].PID]) {
					sibling[idxs[a]], sibling[idxs[b]] = owner.PID, owner.PID
				}
			}
		}
	}
	if len(sibling) == 0 {
		return proven, unproven
	}
	var rest []Holder
	for i, u := range unproven {
		if owner, ok := sibling[i]; ok {
			u.Reason, u.DeadOwner, u.Proof = ReasonInheritedFromDeadOwner, owner, ProofExecedSiblingsShare
			proven = append(proven, u)
			continue
		}
		rest = append(rest, u)
	}
	return proven, rest
}

// deadOwnerKey names a dead owner for its descent records: by PID and start
// time when a Loop saw it alive, by PID alone (start 0) when not, for
// inheritors recorded after its death.
func deadOwnerKey(o Owner) procKey {
	if o.Identity != nil {
		return procKey{int(o.PID), o.Identity.StartTime}
	}
	return procKey{int(o.PID), 0}
}

// recordInheritorsDescent keeps the proven inheritors (by fork, or by an
// open file shared with one) as proven, so that the proof outlives the
// fork record's pruning, a restart, and is there for the commands that read
// the agent's state.
func (t *Taker) recordInheritorsDescent(g GPU, mem *Lineage) {
	if mem == nil {
		return
	}
	for _, h := range g.Suspects {
		if h.Reason != ReasonInheritedFromDeadOwner {
			continue
		}
		if o, ok := g.Owner(h.DeadOwner); ok {
			mem.recordInherited(g.Device.UUID, deadOwnerKey(o), procKey{h.PID, h.StartTime}, h.Proof)
		}
	}
}

// orphanedOwner reports whether any live listed owner is orphaned; that
// alone is worth a scan.
func (t *Taker) orphanedOwner(g GPU) bool {
	for _, o := range g.Owners {
		if o.Alive && t.orphaned(*o.Process) {
			return true
		}
	}
	return false
}

// orphaned: the session leader is gone and the process was reparented out
// of its session (to init or a subreaper).
func (t *Taker) orphaned(p proc.Process) bool {
	if p.SID == p.PID || p.SID == 0 {
		return false
	}
	if _, ok := t.cfg.Proc.Alive(p.SID); ok {
		return false
	}
	if p.PPID == 1 {
		return true
	}
	parent, ok := t.cfg.Proc.Alive(p.PPID)
	return ok && parent.SID != p.SID
}

func itoa(i int) string { return strconv.Itoa(i) }
