// Package cli holds the flags and wiring that every gpu-orphan binary
// shares, so that --backend, --sim.root and --path.procfs mean the same
// thing everywhere.
package cli

import (
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/alecthomas/kingpin/v2"

	"github.com/gpu-orphan/gpu-orphan/internal/gpu"
	"github.com/gpu-orphan/gpu-orphan/internal/proc"
	"github.com/gpu-orphan/gpu-orphan/internal/sim"
	"github.com/gpu-orphan/gpu-orphan/internal/snapshot"
)

// flagger is what both *kingpin.Application and *kingpin.CmdClause offer.
type flagger interface {
	Flag(name, help string) *kingpin.FlagClause
}

// Backend says where GPU facts come from: the flags --backend, --sim.root
// and --path.procfs, and the snapshot's tuning.
type Backend struct {
	// Kind is "nvml" (the real driver) or "sim" (a simulated node).
	Kind string
	// SimRoot is the simulated node's directory, for Kind "sim".
	SimRoot string
	// ProcFS is the procfs mountpoint.
	ProcFS string
	// DriverTimeout is the deadline of one read of every GPU.
	DriverTimeout time.Duration
	// ScanBytes: scan /proc/*/fd when a GPU's memory with no live owner
	// exceeds it.
	ScanBytes uint64
	// ReleaseZeroPages: see gpu.NVMLOptions; only daemons set it
	// (AddDaemonFlags).
	ReleaseZeroPages bool
}

// AddBackendFlags registers --backend, --sim.root, --path.procfs and the
// snapshot tuning flags; the Backend holds their values after parsing.
func AddBackendFlags(a flagger) *Backend {
	b := &Backend{}
	EnumVar(a.Flag("backend", "Where GPU facts come from: nvml (the real driver) or sim (a simulated node, for machines without a GPU; see --sim.root).").
		Default("nvml"), &b.Kind, "nvml", "sim")
	a.Flag("sim.root", "Directory of the simulated node (made by `gpu-orphan-sim init`); used with --backend=sim.").
		Default("").StringVar(&b.SimRoot)
	a.Flag("path.procfs", "procfs mountpoint. It must show the host's PID namespace, where NVML's PIDs live.").
		Default("/proc").StringVar(&b.ProcFS)
	DurationVar(a.Flag("nvml.timeout", "Deadline for one read of every GPU through the driver; a hung call fails that read.").
		Default("5s"), &b.DriverTimeout)
	BytesVar(a.Flag("scan.unowned-bytes", "Scan /proc/*/fd for holders of a GPU when its memory with no live owner exceeds this many bytes (or a size with a unit: 256MiB, 1GiB), even if NVML lists no dead PID.").
		Default("256MiB"), &b.ScanBytes)
	return b
}

// AddDaemonFlags registers what only a long-running reader of NVML wants:
// --nvml.release-zero-pages, off unless asked for. A command that exits in
// a second gains nothing from it, and an epilog must not risk its fault.
func (b *Backend) AddDaemonFlags(a flagger) {
	a.Flag("nvml.release-zero-pages", releaseZeroPagesHelp).Default("false").BoolVar(&b.ReleaseZeroPages)
}

// releaseZeroPagesHelp is --nvml.release-zero-pages's help: what it saves,
// and why it is opt-in (issue 24, item 10).
const releaseZeroPagesHelp = "Off unless given. Saves about 13 MiB per daemon: after nvmlInit, hand back the pages of zeros that it wrote into libnvidia-ml's static memory (NVML reads them as zeros again). " +
	"It relies on undocumented driver internals, measured on one driver (580) on x86_64 only: a page there that the driver has pinned would be silently detached from the process; " +
	"the memory is read-only for about 10 ms meanwhile, so a write by a driver thread crashes the process at start-up, and a kernel write from another thread's system call gets EFAULT, so NVML fails quietly; " +
	"arm64 with 64 KiB pages (GH200) is untested. The failure is a crash at start-up: after a driver upgrade, on every node at once. Try it on one node per driver and architecture first."

// Node is an opened backend: the driver, /proc, and a Taker over both.
type Node struct {
	Driver gpu.Driver
	Proc   proc.FS
	Taker  *snapshot.Taker
}

// Open loads the driver and /proc. Close the Node's Driver when done.
func (b *Backend) Open(logger *slog.Logger) (*Node, error) {
	var driver gpu.Driver
	switch b.Kind {
	case "sim":
		if b.SimRoot == "" {
			return nil, fmt.Errorf("--backend=sim needs --sim.root=DIR (create one with `gpu-orphan-sim init --root DIR --gpus N`)")
		}
		d, err := sim.NewDriver(b.SimRoot)
		if err != nil {
			return nil, fmt.Errorf("opening the simulated node at %s: %w", b.SimRoot, err)
		}
		driver = d
	default:
		d, err := gpu.OpenNVML(logger, gpu.NVMLOptions{ReleaseZeroPages: b.ReleaseZeroPages})
		if err != nil {
			return nil, err
		}
		driver = d
	}
	fs, err := proc.NewFS(b.ProcFS)
	if err != nil {
		driver.Close()
		return nil, fmt.Errorf("opening procfs at %s: %w", b.ProcFS, err)
	}
	taker := snapshot.NewTaker(snapshot.Config{
		Driver:           driver,
		Proc:             fs,
		DriverTimeout:    b.DriverTimeout,
		ScanUnownedBytes: b.ScanBytes,
		ExcludePIDs:      []int{os.Getpid()},
		Logger:           logger,
	})
	return &Node{Driver: driver, Proc: fs, Taker: taker}, nil
}
