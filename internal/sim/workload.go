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
	// ChildComm, when set, is the name each child gives itself with
	// prctl(PR_SET_NAME) before it reports ready, as workers that name
	// themselves do: /proc/PID/comm shows it, /proc/PID/exe still names
	// this binary. At most MaxCommLen bytes.
	ChildComm string
	// ClosingChildren is how many of the children (the first ones) close
	// every inherited descriptor once they have mapped the device node, and
	// keep the mapping: they hold no context (docs/facts.md).
	ClosingChildren int
	// Helper starts one more process the way a double fork does: a child
	// starts a grandchild with the inherited descriptors and exits, so the
	// grandchild (Workload.Helper) is reparented to the nearest subreaper or
	// PID 1, stays in this process group and session, and shares this
	// process's open file descriptions.
	Helper bool
	// RespawnOnSIGTERM makes each child, told to stop with SIGTERM, start a
	// replacement with its descriptors and exit, as a self-healing worker
	// pool does: the replacement holds the context on. It respawns once.
	RespawnOnSIGTERM bool
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

// CommFlag is the child subcommand's flag for ChildConfig.Comm.
const CommFlag = "--comm"

// CloseDescriptorsFlag is the child subcommand's flag for
// ChildConfig.CloseDescriptors.
const CloseDescriptorsFlag = "--close-descriptors"

// ForkHelperFlag is the child subcommand's flag for ChildConfig.ForkHelper.
const ForkHelperFlag = "--fork-helper"

// ChildConfig is what a child learns from its command line.
type ChildConfig struct {
	IgnoreSIGTERM bool
	// OtherDevices is how many device nodes of other GPUs the child
	// inherited, from descriptor childOtherFD on (WorkloadConfig.AllVisible).
	OtherDevices int
	// Comm renames the child (WorkloadConfig.ChildComm); RunChild must then
	// run on the main thread.
	Comm string
	// CloseDescriptors closes every inherited descriptor after mapping the
	// device nodes (WorkloadConfig.ClosingChildren).
	CloseDescriptors bool
	// ForkHelper makes this child the middle of a double fork: it starts
	// a plain child with its descriptors, reports that child's PID, and
	// exits (WorkloadConfig.Helper).
	ForkHelper bool
	// RespawnOnSIGTERM: on SIGTERM, start a plain child with the inherited
	// descriptors and exit (WorkloadConfig.RespawnOnSIGTERM).
	RespawnOnSIGTERM bool
}

// RespawnFlag is the child subcommand's flag for ChildConfig.RespawnOnSIGTERM.
const RespawnFlag = "--respawn-on-sigterm"

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
	// Helper is the double-forked helper's PID, 0 without one.
	Helper  int
	Context Context

	*devices
	ctx *os.File
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
	if cfg.ClosingChildren < 0 || cfg.ClosingChildren > cfg.Children {
		return nil, fmt.Errorf("sim: %d closing children out of range 0..%d (the children)", cfg.ClosingChildren, cfg.Children)
	}
	if cfg.ChildComm != "" {
		if err := checkComm(cfg.ChildComm); err != nil {
			return nil, err
		}
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
	w.devices, err = openDevices(n, g, true, cfg.AllVisible)
	if err != nil {
		return nil, err
	}
	w.Context = Context{GPU: g.Index, PID: w.PID, StartTime: st.StartTime, UsedBytes: cfg.MiB * gpu.MiB}
	w.ctx, err = allocate(n, g, cfg.MiB, &w.Context)
	if err != nil {
		w.Close()
		return nil, err
	}
	for i := range cfg.Children {
		cmd, _, err := startChild(w, w.childArgs(cfg, i < cfg.ClosingChildren))
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
	if cfg.Helper {
		if err := w.startHelper(); err != nil {
			w.kill()
			return nil, err
		}
	}
	return w, nil
}

// childArgs is the command line of a child.
func (w *Workload) childArgs(cfg WorkloadConfig, closing bool) []string {
	var args []string
	if cfg.IgnoreSIGTERM {
		args = append(args, IgnoreSIGTERMFlag)
	}
	if len(w.others) > 0 {
		args = append(args, OtherDevicesFlag+"="+strconv.Itoa(len(w.others)))
	}
	if cfg.ChildComm != "" {
		args = append(args, CommFlag+"="+cfg.ChildComm)
	}
	if closing {
		args = append(args, CloseDescriptorsFlag)
	}
	if cfg.RespawnOnSIGTERM {
		args = append(args, RespawnFlag)
	}
	return args
}

// startHelper double-forks: the middle child starts the helper and exits.
// Waiting for it here means the helper is reparented before its PID is
// known to anyone.
func (w *Workload) startHelper() error {
	args := []string{ForkHelperFlag}
	if len(w.others) > 0 {
		args = append(args, OtherDevicesFlag+"="+strconv.Itoa(len(w.others)))
	}
	cmd, msg, err := startChild(w, args)
	if err != nil {
		return err
	}
	if err := cmd.Wait(); err != nil {
		return fmt.Errorf("sim: the helper's parent %d: %w", cmd.Process.Pid, err)
	}
	pid, err := strconv.Atoi(msg)
	if err != nil || pid <= 0 {
		return fmt.Errorf("sim: the helper's parent said %q, want its PID", msg)
	}
	w.Helper = pid
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
	f, err := readFaults(n.Root)
	if err != nil {
		return nil, err
	}
	// Leaked memory is used memory: it takes room from new contexts.
	m := reading(g, ctxs, f.leaked(g.Index)).Memory
	if mib > g.TotalBytes/gpu.MiB || m.Free < mib*gpu.MiB+ContextOverheadBytes {
		return nil, fmt.Errorf("sim: %w: tried to allocate %d MiB on GPU %d (%d MiB total, %d MiB reserved, %d MiB in use, %d MiB free)",
			ErrOutOfMemory, mib, g.Index, m.Total/gpu.MiB, m.Reserved/gpu.MiB, m.Used/gpu.MiB, m.Free/gpu.MiB)
	}
	return createContext(n, c)
}

// startChild starts one child with the child subcommand's flags args and
// waits until it has set up its signals, so that a SIGTERM sent right after
// StartWorkload returns finds them set. It returns what the child said
// after "ok".
func startChild(w *Workload, args []string) (*exec.Cmd, string, error) {
	r, wr, err := os.Pipe()
	if err != nil {
		return nil, "", fmt.Errorf("sim: %w", err)
	}
	defer r.Close()
	// childDevFD, childContextFD, childReadyFD, childUVMFD, then
	// childOtherFD on.
	files := append([]*os.File{w.dev, w.ctx, wr, w.uvm}, w.others...)
	cmd, err := execSelf(append([]string{ChildCommand}, args...), files)
	wr.Close()
	if err != nil {
		return nil, "", fmt.Errorf("sim: starting child: %w", err)
	}
	msg, err := readReady(r)
	if err != nil {
		// The child may have exited already; either way it is reaped, and
		// err says why it did not start.
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		return nil, "", fmt.Errorf("sim: child %d did not start: %w", cmd.Process.Pid, err)
	}
	return cmd, msg, nil
}

// selfCommand is this binary with args and files as its descriptors 3 on.
// The binary's own path gives the child its name (comm), as forked workers
// keep their parent's; /proc/self/exe is the fallback when the binary was
// replaced on disk. Stdio goes to /dev/null: a child holding its parent's
// output pipes would keep whoever reads them waiting long after the parent
// died.
func selfCommand(args []string, files []*os.File) *exec.Cmd {
	self, err := os.Executable()
	if err != nil {
		self = "/proc/self/exe"
	}
	return &exec.Cmd{
		Path:       self,
		Args:       append([]string{os.Args[0]}, args...),
		ExtraFiles: files,
	}
}

// execSelf starts selfCommand(args, files).
func execSelf(args []string, files []*os.File) (*exec.Cmd, error) {
	cmd := selfCommand(args, files)
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	return cmd, nil
}

// readReady reads a child's readiness message, "ok" and maybe more words,
// until the child closes its end, and returns what follows "ok".
func readReady(r *os.File) (string, error) {
	var msg []byte
	err := r.SetReadDeadline(time.Now().Add(childReadyTimeout))
	if err == nil {
		msg, err = io.ReadAll(r)
	}
	if err != nil {
		return "", err
	}
	rest, ok := strings.CutPrefix(strings.TrimSpace(string(msg)), "ok")
	if !ok || (rest != "" && rest[0] != ' ') {
		return "", fmt.Errorf("child said %q", msg)
	}
	return strings.TrimSpace(rest), nil
}

// kill undoes a half-started workload.
func (w *Workload) kill() {
	for _, pid := range w.ChildPIDs {
		_ = unix.Kill(pid, unix.SIGKILL) // best effort: it may be gone already
	}
	if w.Helper > 0 {
		_ = unix.Kill(w.Helper, unix.SIGKILL)
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

// HelperLine is the line `gpu-orphan-sim run --helper` prints after the
// ready line: "helper PID".
func (w *Workload) HelperLine() string { return "helper " + strconv.Itoa(w.Helper) }

// Hold keeps the workload's descriptors open until ctx ends, then closes
// them. With context.Background it holds until the process is killed.
func (w *Workload) Hold(ctx context.Context) error {
	hold(ctx)
	return w.Close()
}

// hold returns when ctx ends.
func hold(ctx context.Context) {
	// A pending timer keeps the runtime from calling it a deadlock once
	// every child has been reaped.
	t := time.NewTicker(time.Hour)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// Close closes this process's descriptors. The context lives on while the
// children hold theirs.
func (w *Workload) Close() error {
	var errs []error
	if w.ctx != nil {
		errs = append(errs, w.ctx.Close())
	}
	if w.devices != nil {
		errs = append(errs, w.close())
	}
	return errors.Join(errs...)
}

// RunChild is the body of a child: it checks the inherited descriptors,
// maps the device nodes, tells the parent it is ready, and sleeps holding
// them until killed.
func RunChild(cfg ChildConfig) error {
	if cfg.IgnoreSIGTERM {
		signal.Ignore(syscall.SIGTERM)
	}
	if cfg.OtherDevices < 0 || cfg.OtherDevices >= MaxGPUs {
		return fmt.Errorf("sim: child: %d other devices out of range 0..%d", cfg.OtherDevices, MaxGPUs-1)
	}
	if cfg.Comm != "" {
		if err := checkComm(cfg.Comm); err != nil {
			return err
		}
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
	if cfg.ForkHelper {
		return forkHelper(cfg)
	}
	var term chan os.Signal
	if cfg.RespawnOnSIGTERM {
		term = make(chan os.Signal, 1)
		signal.Notify(term, syscall.SIGTERM)
	}
	// An exec'd child does not inherit its parent's mappings as a forked
	// one does, so it maps the device nodes itself.
	for _, fd := range devs {
		if err := mapDevice(fd); err != nil {
			return err
		}
	}
	if cfg.CloseDescriptors {
		// As closerange(3, ...) after fork: every inherited descriptor but
		// the one that reports readiness, closed below. The runtime's own
		// descriptors, opened after these, stay.
		for _, fd := range fds {
			if fd != childReadyFD {
				if err := unix.Close(fd); err != nil {
					return fmt.Errorf("sim: child: closing descriptor %d: %w", fd, err)
				}
			}
		}
	}
	if cfg.Comm != "" {
		if err := setComm(cfg.Comm); err != nil {
			return err
		}
	}
	// Raw descriptors, never wrapped in *os.File, whose finalizer would
	// close them when garbage collected.
	if _, err := unix.Write(childReadyFD, []byte("ok\n")); err != nil {
		return fmt.Errorf("sim: child: %w", err)
	}
	unix.Close(childReadyFD)
	if term != nil {
		<-term
		return respawn(cfg)
	}
	for {
		time.Sleep(time.Hour)
	}
}

// respawn starts a plain child with this child's descriptors (the same
// open files), waits until it is ready, drains, and returns so that this
// process exits.
func respawn(cfg ChildConfig) error {
	if _, err := startInheritor(cfg, "replacement"); err != nil {
		return err
	}
	// A worker that hands over drains its work before it exits.
	time.Sleep(respawnDrain)
	return nil
}

// respawnDrain is how long a respawning worker lives on beside its
// replacement.
const respawnDrain = 500 * time.Millisecond

// forkHelper is the middle of a double fork: it starts a plain child with
// the descriptors it inherited, the same open file descriptions as the
// workload's, reports that child's PID once it is ready, and returns so
// that this process exits and the child is reparented.
func forkHelper(cfg ChildConfig) error {
	cmd, err := startInheritor(cfg, "helper")
	if err != nil {
		return err
	}
	if _, err := unix.Write(childReadyFD, []byte("ok "+strconv.Itoa(cmd.Process.Pid)+"\n")); err != nil {
		_ = cmd.Process.Kill()
		return fmt.Errorf("sim: helper: %w", err)
	}
	return nil
}

// startInheritor starts a plain child (what) with the descriptors this
// child inherited, and waits until it says it is ready.
func startInheritor(cfg ChildConfig, what string) (*exec.Cmd, error) {
	r, wr, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("sim: %s: %w", what, err)
	}
	defer r.Close()
	files := []*os.File{os.NewFile(childDevFD, "dev"), os.NewFile(childContextFD, "context"), wr, os.NewFile(childUVMFD, "uvm")}
	for i := range cfg.OtherDevices {
		files = append(files, os.NewFile(uintptr(childOtherFD+i), "other"))
	}
	var args []string
	if cfg.OtherDevices > 0 {
		args = append(args, OtherDevicesFlag+"="+strconv.Itoa(cfg.OtherDevices))
	}
	cmd, err := execSelf(append([]string{ChildCommand}, args...), files)
	wr.Close()
	if err != nil {
		return nil, fmt.Errorf("sim: starting the %s: %w", what, err)
	}
	if _, err := readReady(r); err != nil {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		return nil, fmt.Errorf("sim: %s %d did not start: %w", what, cmd.Process.Pid, err)
	}
	return cmd, nil
}
