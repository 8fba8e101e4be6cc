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
		s.GPUs = append(s.GPUs, t.account(r, s.HostPIDsVisible))
	}
	s.Sources = append(s.Sources, Source{Name: SourceProc, Err: err, Duration: time.Since(start)})

	start = time.Now()
	scanned, err := t.scanHolders(s, forceScan)
	if scanned {
		s.Sources = append(s.Sources, Source{Name: SourceFDScan, Err: err, Duration: time.Since(start)})
	}
	return s
}

// read calls the driver under a deadline. The cgo call cannot be
// interrupted, so a hung call is abandoned, and while it stays hung later
// reads fail fast instead of piling up goroutines behind it.
func (t *Taker) read(ctx context.Context) ([]gpu.Reading, error) {
	ctx, cancel := context.WithTimeout(ctx, t.cfg.DriverTimeout)
	defer cancel()
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
			readCtx, cancel := context.WithTimeout(context.Background(), t.cfg.DriverTimeout)
			defer cancel()
			c.readings, c.err = t.cfg.Driver.Read(readCtx)
			t.mu.Lock()
			t.inflight = nil
			t.mu.Unlock()
			close(c.done)
		}()
	}
	t.mu.Unlock()
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

// account splits one GPU's used memory by the liveness of its owners.
func (t *Taker) account(r gpu.Reading, pidsVisible bool) GPU {
	g := GPU{Device: r.Device, Memory: r.Memory, Unsupported: r.Unsupported, Err: r.Err}
	if !g.Accountable() {
		return g
	}
	if !pidsVisible {
		g.Unsupported = UnsupportedForeignPIDNamespace
		return g
	}
	var listed uint64
	for _, p := range r.Processes {
		o := Owner{PID: p.PID, UsedBytes: p.UsedBytes}
		if pr, ok := t.cfg.Proc.Alive(int(p.PID)); ok {
			o.Alive, o.Process = true, &pr
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
	return g
}

// scanHolders finds the suspect holders of every GPU that needs it, in one
// pass over /proc/*/fd. It reports whether a scan ran.
func (t *Taker) scanHolders(s *Snapshot, force bool) (bool, error) {
	want := map[string][]int{} // device path -> indexes into s.GPUs
	for i, g := range s.GPUs {
		if !g.Accountable() {
			continue
		}
		if force || g.DeadOwnerListed() || g.UnownedBytes > t.cfg.ScanUnownedBytes || t.orphanedOwner(g) {
			p := t.cfg.Driver.DevicePath(g.Device.Minor)
			want[p] = append(want[p], i)
		}
	}
	if len(want) == 0 {
		return false, nil
	}
	paths := make([]string, 0, len(want))
	for p := range want {
		paths = append(paths, p)
	}
	holders, err := t.cfg.Proc.Holders(paths)
	if err != nil {
		return true, fmt.Errorf("scanning /proc for holders of %v: %w", paths, err)
	}
	for path, idxs := range want {
		pids := slices.DeleteFunc(slices.Clone(holders[path]), func(pid int) bool {
			return slices.Contains(t.cfg.ExcludePIDs, pid)
		})
		for _, i := range idxs {
			g := &s.GPUs[i]
			g.Scanned = true
			g.HolderPIDs = pids
			g.Suspects = t.suspects(*g, pids, path)
		}
	}
	return true, nil
}

// suspects applies the two rules of a suspect holder.
//
// An unlisted holder must also have the device node mapped into its memory:
// a CUDA context maps it, and forked children inherit the mapping, whereas
// NVML-only tools (nvidia-smi, DCGM, monitoring agents, this exporter) only
// keep the descriptor open (measured on the H200: fuser shows F...m for the
// children, F.... for the exporter; all hold /dev/nvidia-uvm too).
func (t *Taker) suspects(g GPU, holderPIDs []int, devicePath string) []Holder {
	var out []Holder
	listed := map[int]Owner{}
	for _, o := range g.Owners {
		listed[int(o.PID)] = o
	}
	deadListed := g.DeadOwnerListed()
	for _, pid := range holderPIDs {
		if o, ok := listed[pid]; ok {
			if o.Alive && t.orphaned(*o.Process) {
				out = append(out, Holder{Process: *o.Process, Reason: ReasonOrphaned, Listed: true})
			}
			continue
		}
		if !deadListed {
			continue
		}
		if mapped, err := t.cfg.Proc.Maps(pid, devicePath); err != nil || !mapped {
			continue
		}
		if p, ok := t.cfg.Proc.Alive(pid); ok && !t.belongsToLiveOwner(p, g) {
			out = append(out, Holder{Process: p, Reason: ReasonInheritedFromDeadOwner})
		}
	}
	// A listed owner that is orphaned counts even if the scan missed it
	// (it may hold the node through a path we do not resolve).
	for _, o := range g.Owners {
		if o.Alive && !slices.Contains(holderPIDs, int(o.PID)) && t.orphaned(*o.Process) {
			out = append(out, Holder{Process: *o.Process, Reason: ReasonOrphaned, Listed: true})
		}
	}
	slices.SortFunc(out, func(a, b Holder) int { return a.PID - b.PID })
	return out
}

// belongsToLiveOwner reports whether an unlisted holder is a worker of a
// live job on the GPU: a live listed owner is its ancestor or shares its
// process group. Such a worker holds that owner's context, not the dead
// one's, and must never be called a suspect.
func (t *Taker) belongsToLiveOwner(p proc.Process, g GPU) bool {
	live := map[int]bool{}
	for _, o := range g.Owners {
		if o.Alive {
			live[int(o.PID)] = true
			if o.Process.PGID == p.PGID {
				return true
			}
		}
	}
	if len(live) == 0 {
		return false
	}
	ppid := p.PPID
	for range 64 { // a bounded walk up the process tree
		if ppid <= 1 {
			return false
		}
		if live[ppid] {
			return true
		}
		parent, ok := t.cfg.Proc.Alive(ppid)
		if !ok {
			return false
		}
		ppid = parent.PPID
	}
	return false
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
