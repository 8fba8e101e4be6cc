package sim

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"syscall"
)

// LauncherConfig describes a process that initialised CUDA without making
// a context, as torchrun (or any tool that only calls cuInit) does.
type LauncherConfig struct {
	Root string
	GPU  int
	// AllVisible also opens and maps every other GPU's device node, as for
	// WorkloadConfig.AllVisible.
	AllVisible bool
}

// Launcher is a running cuInit-only process: it holds and maps the device
// nodes but has no context, so NVML does not list it and it holds no
// memory (docs/facts.md, "cuInit alone").
type Launcher struct {
	PID int
	*devices
}

// StartLauncher opens and maps the device node of cfg.GPU, and opens the
// uvm node, in this process. It creates no context.
func StartLauncher(cfg LauncherConfig) (*Launcher, error) {
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
	d, err := openDevices(n, g, true, cfg.AllVisible)
	if err != nil {
		return nil, err
	}
	return &Launcher{PID: os.Getpid(), devices: d}, nil
}

// Line is what `gpu-orphan-sim launch` prints once it holds the devices:
// "launcher PID".
func (l *Launcher) Line() string { return "launcher " + strconv.Itoa(l.PID) }

// StartRank starts argv as the launcher's child in a session (and process
// group) of its own, as torchrun starts a rank, writing to stdout and
// stderr. The launcher's descriptors are close-on-exec: the rank opens the
// devices and makes its context itself.
func (l *Launcher) StartRank(argv []string, stdout, stderr io.Writer) (*exec.Cmd, error) {
	if len(argv) == 0 {
		return nil, errors.New("sim: launcher: no command")
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdin = os.Stdin
	cmd.Stdout, cmd.Stderr = stdout, stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("sim: launcher: starting %s: %w", argv[0], err)
	}
	return cmd, nil
}

// Hold keeps the launcher's descriptors open until ctx ends, then closes
// them.
func (l *Launcher) Hold(ctx context.Context) error {
	hold(ctx)
	return l.Close()
}

// Close closes the launcher's descriptors.
func (l *Launcher) Close() error { return l.close() }
