package stack

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Workload is a `gpu-orphan-sim run` on the simulated node: a job that
// creates a CUDA context and forks children that inherit it, as a training
// job forks DataLoader workers.
type Workload struct {
	GPU, MiB int
	// PID is the parent, the context's creator; Children hold its
	// descriptors.
	PID      int
	Children []int

	cmd  *exec.Cmd
	done chan struct{}
}

// StartWorkload starts a workload of mib MiB on GPU gpu with children
// forked children, in a session of its own as a scheduler starts a job,
// and returns once it is ready. Its output goes to logs/workload.out and
// logs/workload.log. Stop kills it if it still runs.
func (s *Stack) StartWorkload(ctx context.Context, gpu, mib, children int) (*Workload, error) {
	if s.SimRoot == "" {
		return nil, errors.New("a workload needs the simulated node (backend sim)")
	}
	outPath := filepath.Join(s.Logs, "workload.out")
	out, err := os.Create(outPath)
	if err != nil {
		return nil, err
	}
	defer out.Close()
	errf, err := os.Create(filepath.Join(s.Logs, "workload.log"))
	if err != nil {
		return nil, err
	}
	defer errf.Close()
	cmd := exec.Command(s.bin("gpu-orphan-sim"), "run", "--root", s.SimRoot, "--gpu", strconv.Itoa(gpu),
		"--mib", strconv.Itoa(mib), "--children", strconv.Itoa(children))
	cmd.Stdout, cmd.Stderr = out, errf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting the workload: %w", err)
	}
	w := &Workload{GPU: gpu, MiB: mib, PID: cmd.Process.Pid, cmd: cmd, done: make(chan struct{})}
	// The workload is killed, so Wait's error says only that: done is what
	// matters.
	go func() { _ = cmd.Wait(); close(w.done) }()
	s.mu.Lock()
	s.workloads = append(s.workloads, w)
	s.sessions = append(s.sessions, w.PID)
	s.mu.Unlock()

	err = s.poll(ctx, 10*time.Second, "the workload to be ready", func() (bool, string) {
		select {
		case <-w.done:
			return false, "exited: " + tail(errf.Name(), 5)
		default:
		}
		b, _ := os.ReadFile(outPath)
		line, _, complete := strings.Cut(string(b), "\n")
		return complete && strings.HasPrefix(line, "ready "), line
	})
	if err != nil {
		return nil, err
	}
	b, _ := os.ReadFile(outPath)
	line, _, _ := strings.Cut(string(b), "\n")
	for i, f := range strings.Fields(line)[1:] {
		pid, err := strconv.Atoi(f)
		if err != nil {
			return nil, fmt.Errorf("workload: bad pid in %q", line)
		}
		if i == 0 && pid != w.PID {
			return nil, fmt.Errorf("workload: ready line %q names pid %d, started %d", line, pid, w.PID)
		}
		if i > 0 {
			w.Children = append(w.Children, pid)
		}
	}
	return w, nil
}

// KillParent kills the parent with SIGKILL and reaps it: its children keep
// holding its context, and its GPU memory.
func (w *Workload) KillParent() error {
	if err := w.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		return err
	}
	<-w.done
	return nil
}

// kill kills the workload's whole session: the parent and the children it
// forked (which never leave it). Children are not killed by PID: the
// remediator may have killed them, and their PIDs may name other processes
// by now.
func (w *Workload) kill() {
	_ = syscall.Kill(-w.PID, syscall.SIGKILL) // killSession gets what is left
	killSession(w.PID)
	<-w.done
}
