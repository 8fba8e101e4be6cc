package stack

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/proc"
)

// stopTimeout is how long a daemon has between SIGTERM and SIGKILL.
var stopTimeout = 10 * time.Second

// killWait is how long Stop waits, on an idle machine, for what it killed
// to be gone.
const killWait = 5 * time.Second

// daemon is a long-running process of the stack, in a session of its own,
// logging to a file.
//
// Its own session keeps the terminal's Ctrl+C away from it (the launcher
// stops the daemons in order), lets Stop find whatever it started (every
// process it forks stays in its session unless it calls setsid), and keeps
// the remediator from sharing a session with anything it might act on.
// Pdeathsig kills it if the launcher dies without stopping it.
type daemon struct {
	name string
	cmd  *exec.Cmd
	log  string
	done chan struct{} // closed when it has exited
	err  error         // its exit status, once done is closed
}

func startDaemon(name, log string, cmd *exec.Cmd) (*daemon, error) {
	logf, err := os.Create(log)
	if err != nil {
		return nil, err
	}
	d := &daemon{name: name, log: log, done: make(chan struct{}), cmd: cmd}
	d.cmd.Stdout, d.cmd.Stderr = logf, logf
	d.cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Pdeathsig: syscall.SIGKILL}
	if err := d.cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("starting %s: %w", name, err)
	}
	go func() {
		d.err = d.cmd.Wait()
		logf.Close()
		close(d.done)
	}()
	return d, nil
}

func (d *daemon) pid() int { return d.cmd.Process.Pid }

// exited returns an error, with the end of its log, once the daemon has
// exited.
func (d *daemon) exited() error {
	select {
	case <-d.done:
		return fmt.Errorf("%s (pid %d) exited: %v; the end of %s:\n%s", d.name, d.pid(), d.err, d.log, tail(d.log, 20))
	default:
		return nil
	}
}

// terminate sends SIGTERM to the daemon's process group.
// The group may be gone already; wait finds out either way.
func (d *daemon) terminate() { _ = syscall.Kill(-d.pid(), syscall.SIGTERM) }

// wait waits up to stopTimeout for the daemon to exit after terminate,
// then kills it, and anything left in its session. It reports whether the
// daemon needed SIGKILL.
func (d *daemon) wait() (killed bool) {
	select {
	case <-d.done:
	case <-time.After(stopTimeout):
		killed = true
		_ = syscall.Kill(-d.pid(), syscall.SIGKILL) // <-d.done says when it is gone
		<-d.done
	}
	killSession(d.pid())
	return killed
}

// sessionMembers lists the processes whose session is one of sids.
func sessionMembers(sids ...int) ([]int, error) {
	fs, err := proc.NewFS("")
	if err != nil {
		return nil, err
	}
	pids, err := fs.PIDs()
	if err != nil {
		return nil, err
	}
	var in []int
	for _, pid := range pids {
		p, err := fs.Process(pid)
		if err != nil {
			continue // gone while we looked, or unreadable: not ours
		}
		for _, sid := range sids {
			if p.SID == sid && !p.Zombie() {
				in = append(in, pid)
			}
		}
	}
	return in, nil
}

// killSession sends SIGKILL to every process of session sid.
func killSession(sid int) {
	pids, _ := sessionMembers(sid)
	for _, pid := range pids {
		_ = syscall.Kill(pid, syscall.SIGKILL) // best effort: it may have exited since
	}
}

// alive reports whether pid exists and is not a zombie.
func alive(pid int) bool {
	fs, err := proc.NewFS("")
	if err != nil {
		return syscall.Kill(pid, 0) == nil
	}
	_, ok := fs.Alive(pid)
	return ok
}

// tail returns the last n lines of a file.
func tail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	lines := bytes.Split(bytes.TrimRight(b, "\n"), []byte("\n"))
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return string(bytes.Join(lines, []byte("\n")))
}

// lockDir takes an exclusive lock on dir/run.pid, which names the process
// that holds it. The lock goes with the process, however it ends.
func lockDir(path string) (*os.File, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		b, _ := os.ReadFile(path)
		f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, fmt.Errorf("another run (pid %s) uses %s", strings.TrimSpace(string(b)), path)
		}
		return nil, fmt.Errorf("locking %s: %w", path, err)
	}
	if err := f.Truncate(0); err == nil {
		fmt.Fprintf(f, "%d\n", os.Getpid())
	}
	return f, nil
}
