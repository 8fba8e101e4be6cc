package sim

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/gpu-orphan/gpu-orphan/internal/gpu"
)

// MPS as measured on an H200 (docs/facts.md): the control daemon
// (nvidia-cuda-mps-control -d) holds and maps the device but has no context,
// and NVML does not list it; the server it starts (nvidia-cuda-mps-server)
// is an NVML owner of 66 MiB. Clients are ordinary CUDA processes as far as
// NVML's accounting goes: each is listed with its own memory, and a killed
// client stays listed while its forked workers hold its context.

// MPSServerCommand is the hidden subcommand of gpu-orphan-sim that runs
// RunMPSServer. StartMPS re-executes its own binary with it.
const MPSServerCommand = "mps-server"

// DefaultMPSServerMiB is what the measured server held.
const DefaultMPSServerMiB = 66

// mpsServerReadyFD is where the server reports "ok", or why it failed.
const mpsServerReadyFD = 3

// MPSConfig describes an MPS control daemon and its server.
type MPSConfig struct {
	Root string
	GPU  int
	// ServerMiB is the server's context.
	ServerMiB uint64
	// ControlComm is the control daemon's name; empty means MPSComm. On the
	// H200 the daemon was also run as a copy named gpu-watchd, a name on no
	// protected list.
	ControlComm string
	// Logger receives the server's exit; nil discards it.
	Logger *slog.Logger
}

// MPS is a running control daemon (this process) and its server.
type MPS struct {
	ControlPID int
	ServerPID  int
	*devices
}

// StartMPS makes this process the control daemon: it renames itself as the
// real one shows in /proc (MPSComm), opens and maps the device node without
// a context, and starts the server, which dies with it (PR_SET_PDEATHSIG).
// It must run on the main thread, and the calling goroutine must stay
// locked to it: the kernel sends the parent-death signal when the thread
// that started the server exits, not the process.
func StartMPS(cfg MPSConfig) (*MPS, error) {
	logger := cfg.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
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
	comm := cfg.ControlComm
	if comm == "" {
		comm = MPSComm
	}
	if err := checkComm(comm); err != nil {
		return nil, err
	}
	if err := setComm(comm); err != nil {
		return nil, err
	}
	m := &MPS{ControlPID: os.Getpid()}
	m.devices, err = openDevices(n, g, false, false)
	if err != nil {
		return nil, err
	}
	r, wr, err := os.Pipe()
	if err != nil {
		m.close()
		return nil, fmt.Errorf("sim: %w", err)
	}
	defer r.Close()
	cmd := selfCommand([]string{MPSServerCommand, "--root", n.Root, "--gpu", strconv.Itoa(g.Index),
		"--mib", strconv.FormatUint(cfg.ServerMiB, 10)}, []*os.File{wr})
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	err = cmd.Start()
	wr.Close()
	if err != nil {
		m.close()
		return nil, fmt.Errorf("sim: starting the MPS server: %w", err)
	}
	if _, err := readReady(r); err != nil {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		m.close()
		return nil, fmt.Errorf("sim: the MPS server %d did not start: %w", cmd.Process.Pid, err)
	}
	m.ServerPID = cmd.Process.Pid
	go func() {
		err := cmd.Wait()
		logger.Info("MPS server exited", "pid", m.ServerPID, "err", err)
	}()
	return m, nil
}

// ReadyLine is what `gpu-orphan-sim mps` prints once the server is up:
// "ready CONTROL_PID SERVER_PID".
func (m *MPS) ReadyLine() string {
	return "ready " + strconv.Itoa(m.ControlPID) + " " + strconv.Itoa(m.ServerPID)
}

// Hold keeps the control daemon's descriptors open until ctx ends, then
// closes them.
func (m *MPS) Hold(ctx context.Context) error {
	hold(ctx)
	return m.close()
}

// MPSServerConfig is what the server learns from its command line.
type MPSServerConfig struct {
	Root string
	GPU  int
	MiB  uint64
}

// RunMPSServer is the body of the server: it renames itself (MPSComm),
// opens and maps the device node and the uvm node, makes its context, says
// "ok" to the control daemon (or why it failed), and holds until killed. It
// must run on the main thread.
func RunMPSServer(cfg MPSServerConfig) error {
	var st unix.Stat_t
	if err := unix.Fstat(mpsServerReadyFD, &st); err != nil {
		return fmt.Errorf("sim: MPS server: inherited descriptor %d: %w (run only by gpu-orphan-sim mps)", mpsServerReadyFD, err)
	}
	err := runMPSServer(cfg)
	// Raw descriptor writes: the control daemon reads until it is closed.
	if err != nil {
		_, _ = unix.Write(mpsServerReadyFD, []byte(err.Error()+"\n"))
		return err
	}
	return nil
}

func runMPSServer(cfg MPSServerConfig) error {
	if err := setComm(MPSComm); err != nil {
		return err
	}
	n, err := Load(cfg.Root)
	if err != nil {
		return err
	}
	g, err := n.GPU(cfg.GPU)
	if err != nil {
		return err
	}
	self, err := readProcStat(os.Getpid())
	if err != nil {
		return fmt.Errorf("sim: reading own start time: %w", err)
	}
	d, err := openDevices(n, g, true, false)
	if err != nil {
		return err
	}
	c := Context{GPU: g.Index, PID: os.Getpid(), StartTime: self.StartTime, UsedBytes: cfg.MiB * gpu.MiB}
	ctx, err := allocate(n, g, cfg.MiB, &c)
	if err != nil {
		d.close()
		return err
	}
	if _, err := unix.Write(mpsServerReadyFD, []byte("ok\n")); err != nil {
		ctx.Close()
		d.close()
		return fmt.Errorf("sim: MPS server: %w", err)
	}
	unix.Close(mpsServerReadyFD)
	hold(context.Background())
	// Never reached; keeps the files, whose finalizers would close them.
	ctx.Close()
	return d.close()
}
