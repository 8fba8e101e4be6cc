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
// no live owner are scanned, so a healthy node costs almost nothing.
func (t *Taker) Take(ctx context.Context, forceScan bool) *Snapshot {
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
		g, denied := t.account(r, s.HostPIDsVisible)
		s.GPUs = append(s.GPUs, g)
		s.FDScanDenied += denied
	}
	s.Sources = append(s.Sources, Source{Name: SourceProc, Err: err, Duration: time.Since(start)})

	start = time.Now()
	scanned, err := t.scanHolders(s, forceScan)
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
func (t *Taker) account(r gpu.Reading, pidsVisible bool) (GPU, int) {
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
			case holds:
				o.Alive, o.Process = true, &pr
			default:
				o.ReusedBy = &pr
			}
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
	return g, denied
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
// over /proc/*/fd. It reports whether a scan ran.
func (t *Taker) scanHolders(s *Snapshot, force bool) (bool, error) {
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
	for dev, idxs := range want {
		holdings := slices.DeleteFunc(slices.Clone(scan.Holders[dev]), func(h proc.Holding) bool {
			return slices.Contains(t.cfg.ExcludePIDs, h.PID)
		})
		pids := make([]int, 0, len(holdings))
		var holders []Holding
		for _, h := range holdings {
			pids = append(pids, h.PID)
			if hd, ok := t.holding(h, jobs, parents); ok {
				holders = append(holders, hd)
			}
		}
		for _, i := range idxs {
			g := &s.GPUs[i]
			g.Scanned = true
			g.HolderPIDs = pids
			g.Holders = holders
			g.Suspects = suspects(*g, holders, t.orphaned)
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

// holding reads who a holder is, whether it maps the device, and which live
// jobs it belongs to. ok is false when it is not alive. parents caches the
// ancestors' stat lines over one scan: holders share their ancestors.
func (t *Taker) holding(h proc.Holding, jobs map[procKey][]string, parents map[int]proc.Stat) (Holding, bool) {
	p, ok := t.cfg.Proc.Alive(h.PID)
	if !ok {
		return Holding{}, false
	}
	mapped, err := t.cfg.Proc.Maps(h)
	hd := Holding{Process: p, Mapped: err == nil && mapped}
	// A worker belongs to a live job through its ancestry, on any GPU: the
	// process itself, its parent, and so on up to init; each one by PID
	// and start time, so that a reused PID is nobody's ancestor.
	k, ppid := procKey{h.PID, p.StartTime}, p.PPID
	for range 64 { // a bounded walk up the process tree
		for _, uuid := range jobs[k] {
			if !slices.Contains(hd.LiveJobGPUs, uuid) {
				hd.LiveJobGPUs = append(hd.LiveJobGPUs, uuid)
			}
		}
		if ppid <= 1 {
			break
		}
		st, ok := parents[ppid]
		if !ok {
			if st, err = t.cfg.Proc.ReadStat(ppid); err != nil {
				break
			}
			parents[ppid] = st
		}
		k, ppid = procKey{ppid, st.StartTime}, st.PPID
	}
	return hd, true
}

// suspects applies the two rules of a suspect holder.
//
//   - inherited_from_dead_owner: NVML lists a dead PID on the GPU, and a live
//     holder that NVML does not list maps the device node and belongs to no
//     live job on any GPU. A CUDA context maps the node and forked children
//     inherit the mapping, whereas NVML-only tools (nvidia-smi, DCGM, this
//     exporter) only keep it open (measured on the H200: fuser shows F...m
//     for the children, F.... for the exporter).
//   - orphaned: a live listed owner whose session leader died.
func suspects(g GPU, holders []Holding, orphaned func(proc.Process) bool) []Holder {
	var out []Holder
	listed := map[int]Owner{}
	for _, o := range g.Owners {
		listed[int(o.PID)] = o
	}
	deadListed := g.DeadOwnerListed()
	for _, h := range holders {
		if o, ok := listed[h.PID]; ok && o.Alive {
			continue // listed owners are judged below
		}
		if deadListed && h.Mapped && len(h.LiveJobGPUs) == 0 {
			out = append(out, Holder{Process: h.Process, Reason: ReasonInheritedFromDeadOwner})
		}
	}
	// A listed owner that is orphaned counts even if the scan missed it.
	for _, o := range g.Owners {
		if o.Alive && orphaned(*o.Process) {
			out = append(out, Holder{Process: *o.Process, Reason: ReasonOrphaned, Listed: true, UsedBytes: o.UsedBytes})
		}
	}
	slices.SortFunc(out, func(a, b Holder) int { return a.PID - b.PID })
	return out
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
