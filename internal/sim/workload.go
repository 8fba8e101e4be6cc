package sim

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpu-orphan/gpu-orphan/internal/gpu"
)

// WorkloadConfig describes a simulated CUDA process.
type WorkloadConfig struct {
	Root string
	GPU  int
	// MiB is what the workload allocates on the GPU.
	MiB uint64
	// Children is how many forked workers (like PyTorch DataLoader workers)
	// inherit the device and context descriptors.
	Children int
	// IgnoreSIGTERM makes the children ignore SIGTERM, as workers that
	// block it do; only SIGKILL ends them then.
	IgnoreSIGTERM bool
	// AllVisible makes the workload, and each child, also open and map the
	// device node of every other GPU of the node, as a multi-GPU CUDA
	// process does for every visible device. The context is still made on
	// GPU alone, the only GPU where NVML lists the process.
	AllVisible bool
	// Logger receives the children's exits; nil discards them.
	Logger *slog.Logger
}

// MaxChildren bounds WorkloadConfig.Children.
const MaxChildren = 64

// ChildCommand is the hidden subcommand of gpu-orphan-sim that runs
// RunChild. StartWorkload re-executes its own binary with it, so only a
// binary that dispatches it to RunChild can call StartWorkload.
const ChildCommand = "child"

// IgnoreSIGTERMFlag is the child subcommand's flag for IgnoreSIGTERM.
const IgnoreSIGTERMFlag = "--ignore-sigterm"

// OtherDevicesFlag is the child subcommand's flag for ChildConfig.OtherDevices.
const OtherDevicesFlag = "--other-devices"

// ChildConfig is what a child learns from its command line.
type ChildConfig struct {
	IgnoreSIGTERM bool
	// OtherDevices is how many device nodes of other GPUs the child
	// inherited, from descriptor childOtherFD on (WorkloadConfig.AllVisible).
	OtherDevices int
}

// The descriptors a child inherits, after stdin, stdout and stderr.
const (
	childDevFD = 3 + iota
	childContextFD
	childReadyFD
	childUVMFD
	// childOtherFD is the first of ChildConfig.OtherDevices descriptors.
	childOtherFD
)

// childReadyTimeout bounds how long StartWorkload waits for a child to say
// it has set up its signals.
const childReadyTimeout = 10 * time.Second

// ErrOutOfMemory is returned when the GPU cannot fit the allocation.
var ErrOutOfMemory = errors.New("CUDA out of memory")

// Workload is a running simulated CUDA process: this process, holding the
// device node and a context, and its children, which inherited both.
type Workload struct {
	PID       int
	ChildPIDs []int
	Context   Context

	dev, ctx, uvm *os.File
	// others are the device nodes of the other GPUs (AllVisible).
	others []*os.File
}

// StartWorkload creates a context of cfg.MiB on cfg.GPU in this process and
// starts cfg.Children children that inherit its descriptors. Go cannot
// fork, so the children are this binary re-executed with ChildCommand; they
// stay in this process group and session, as forked workers do.
func StartWorkload(cfg WorkloadConfig) (*Workload, error) {
	logger := cfg.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Children < 0 || cfg.Children > MaxChildren {
		return nil, fmt.Errorf("sim: %d children out of range 0..%d", cfg.Children, MaxChildren)
	}
	n, err := Load(cfg.Root)
	if err != nil {
		return nil, err
	}
	g, err := n.GPU(cfg.GPU)
	if err != nil {
		return nil, err
	}
	if g.MIG {
		return nil, fmt.Errorf("sim: GPU %d is in MIG mode, which the simulator does not model", g.Index)
	}
	st, err := readProcStat(os.Getpid())
	if err != nil {
		return nil, fmt.Errorf("sim: reading own start time: %w", err)
	}
	w := &Workload{PID: os.Getpid()}
	w.dev, err = os.OpenFile(n.DevicePath(g.Minor), os.O_RDWR, 0)
	if err != nil {
		return nil, fmt.Errorf("sim: opening device node: %w", err)
	}
	if err := mapDevice(int(w.dev.Fd())); err != nil {
		w.dev.Close()
		return nil, err
	}
	w.uvm, err = os.OpenFile(n.UVMPath(), os.O_RDWR, 0)
	if err != nil {
		w.Close()
		return nil, fmt.Errorf("sim: opening %s (a node made by an older gpu-orphan-sim? init --force): %w", n.UVMPath(), err)
	}
	if cfg.AllVisible {
		if err := w.openOthers(n, g.Index); err != nil {
			w.Close()
			return nil, err
		}
	}
	w.Context = Context{GPU: g.Index, PID: w.PID, StartTime: st.StartTime, UsedBytes: cfg.MiB * gpu.MiB}
	w.ctx, err = allocate(n, g, cfg.MiB, &w.Context)
	if err != nil {
		w.Close()
		return nil, err
	}
	for range cfg.Children {
		cmd, err := startChild(w, cfg.IgnoreSIGTERM)
		if err != nil {
			w.kill()
			return nil, err
		}
		pid := cmd.Process.Pid
		w.ChildPIDs = append(w.ChildPIDs, pid)
		// Reap children while we live; once we die, they are orphans.
		go func() {
			err := cmd.Wait()
			logger.Info("child exited", "pid", pid, "err", err)
		}()
	}
	return w, nil
}

// openOthers opens and maps the device node of every GPU but own.
func (w *Workload) openOthers(n *Node, own int) error {
	for _, o := range n.GPUs {
		if o.Index == own {
			continue
		}
		f, err := os.OpenFile(n.DevicePath(o.Minor), os.O_RDWR, 0)
		if err != nil {
			return fmt.Errorf("sim: opening device node of GPU %d: %w", o.Index, err)
		}
		w.others = append(w.others, f)
		if err := mapDevice(int(f.Fd())); err != nil {
			return err
		}
	}
	return nil
}

// allocate checks the GPU's free memory and creates the context under the
// node's allocation lock, so that two workloads cannot both take the last
// free bytes.
func allocate(n *Node, g GPU, mib uint64, c *Context) (*os.File, error) {
	lock, err := os.OpenFile(filepath.Join(n.Root, contextsDir, "."+allocLock), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, fmt.Errorf("sim: %w", err)
	}
	defer lock.Close() // releases the lock
	if err := flock(lock, unix.LOCK_EX); err != nil {
		return nil, fmt.Errorf("sim: taking the allocation lock: %w", err)
	}
	ctxs, err := listContexts(n)
	if err != nil {
		return nil, err
	}
	m := reading(g, ctxs).Memory
	if mib > g.TotalBytes/gpu.MiB || m.Free < mib*gpu.MiB+ContextOverheadBytes {
		return nil, fmt.Errorf("sim: %w: tried to allocate %d MiB on GPU %d (%d MiB total, %d MiB reserved, %d MiB in use, %d MiB free)",
			ErrOutOfMemory, mib, g.Index, m.Total/gpu.MiB, m.Reserved/gpu.MiB, m.Used/gpu.MiB, m.Free/gpu.MiB)
	}
	return createContext(n, c)
}

// startChild starts one child and waits until it has set up its signals,
// so that a SIGTERM sent right after StartWorkload returns finds them set.
func startChild(w *Workload, ignoreSIGTERM bool) (*exec.Cmd, error) {
	r, wr, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("sim: %w", err)
	}
	defer r.Close()
	args := []string{os.Args[0], ChildCommand}
	if ignoreSIGTERM {
		args = append(args, IgnoreSIGTERMFlag)
	}
	if len(w.others) > 0 {
		args = append(args, OtherDevicesFlag+"="+strconv.Itoa(len(w.others)))
	}
	// The binary's own path gives the children its name (comm), as forked
	// workers keep their parent's; /proc/self/exe is the fallback when the
	// binary was replaced on disk. Stdio goes to /dev/null: a child holding
	// its parent's output pipes would keep whoever reads them waiting long
	// after the parent died.
	self, err := os.Executable()
	if err != nil {
		self = "/proc/self/exe"
	}
	cmd := &exec.Cmd{
		Path: self,
		Args: args,
		// childDevFD, childContextFD, childReadyFD, childUVMFD, then
		// childOtherFD on.
		ExtraFiles: append([]*os.File{w.dev, w.ctx, wr, w.uvm}, w.others...),
	}
	err = cmd.Start()
	wr.Close()
	if err != nil {
		return nil, fmt.Errorf("sim: starting child: %w", err)
	}
	var msg []byte
	if err = r.SetReadDeadline(time.Now().Add(childReadyTimeout)); err == nil {
		msg, err = io.ReadAll(r)
	}
	if err == nil && strings.TrimSpace(string(msg)) != "ok" {
		err = fmt.Errorf("child said %q", msg)
	}
	if err != nil {
		// The child may have exited already; either way it is reaped, and
		// err says why it did not start.
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		return nil, fmt.Errorf("sim: child %d did not start: %w", cmd.Process.Pid, err)
	}
	return cmd, nil
}

// kill undoes a half-started workload.
func (w *Workload) kill() {
	for _, pid := range w.ChildPIDs {
		_ = unix.Kill(pid, unix.SIGKILL) // best effort: it may be gone already
	}
	w.Close()
}

// ReadyLine is what `gpu-orphan-sim run` prints once the workload is up:
// "ready PID CHILD1 CHILD2 ...".
func (w *Workload) ReadyLine() string {
	var b strings.Builder
	b.WriteString("ready ")
	b.WriteString(strconv.Itoa(w.PID))
	for _, pid := range w.ChildPIDs {
		b.WriteByte(' ')
		b.WriteString(strconv.Itoa(pid))
	}
	return b.String()
}

// Hold keeps the workload's descriptors open until ctx ends, then closes
// them. With context.Background it holds until the process is killed.
func (w *Workload) Hold(ctx context.Context) error {
	// A pending timer keeps the runtime from calling it a deadlock once
	// every child has been reaped.
	t := time.NewTicker(time.Hour)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return w.Close()
		case <-t.C:
		}
	}
}

// Close closes this process's descriptors. The context lives on while the
// children hold theirs.
func (w *Workload) Close() error {
	var errs []error
	for _, f := range append([]*os.File{w.ctx, w.dev, w.uvm}, w.others...) {
		if f != nil {
			errs = append(errs, f.Close())
		}
	}
	return errors.Join(errs...)
}

// RunChild is the body of a child: it checks the inherited descriptors,
// tells the parent it is ready, and sleeps holding them until killed.
func RunChild(cfg ChildConfig) error {
	if cfg.IgnoreSIGTERM {
		signal.Ignore(syscall.SIGTERM)
	}
	if cfg.OtherDevices < 0 || cfg.OtherDevices >= MaxGPUs {
		return fmt.Errorf("sim: child: %d other devices out of range 0..%d", cfg.OtherDevices, MaxGPUs-1)
	}
	fds := []int{childDevFD, childContextFD, childReadyFD, childUVMFD}
	devs := []int{childDevFD}
	for i := range cfg.OtherDevices {
		fds = append(fds, childOtherFD+i)
		devs = append(devs, childOtherFD+i)
	}
	var st unix.Stat_t
	for _, fd := range fds {
		if err := unix.Fstat(fd, &st); err != nil {
			return fmt.Errorf("sim: child: inherited descriptor %d: %w (run only by gpu-orphan-sim run)", fd, err)
		}
	}
	// An exec'd child does not inherit its parent's mappings as a forked
	// one does, so it maps the device nodes itself.
	for _, fd := range devs {
		if err := mapDevice(fd); err != nil {
			return err
		}
	}
	// Raw descriptors, never wrapped in *os.File, whose finalizer would
	// close them when garbage collected.
	if _, err := unix.Write(childReadyFD, []byte("ok\n")); err != nil {
		return fmt.Errorf("sim: child: %w", err)
	}
	unix.Close(childReadyFD)
	for {
		time.Sleep(time.Hour)
	}
}

// DeviceMapBytes is the size of a simulated device node, and of the
// mapping a workload keeps of it.
const DeviceMapBytes = 4096

// mapDevice maps the device node as a CUDA context maps the real one: the
// mapping (not just the descriptor) is what tells a context's holders from
// tools that only query NVML. It is never unmapped: it lives as long as the
// process.
func mapDevice(fd int) error {
	if _, err := unix.Mmap(fd, 0, DeviceMapBytes, unix.PROT_READ, unix.MAP_SHARED); err != nil {
		return fmt.Errorf("sim: mapping the device node: %w", err)
	}
	return nil
}
