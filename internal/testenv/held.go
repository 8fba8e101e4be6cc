package testenv

import (
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"
)

// Held is a process the test saw alive, held by a pidfd opened then: a
// signal through it reaches that process or none, never one that took its
// PID later. The tests' cleanups kill through it, not by PID: PIDs wrap
// quickly where pid_max is 32768 and the tests start thousands of
// processes, and a PID noted at the start of a test may be another
// process's (another test's, or a person's shell) by its end.
type Held struct {
	pid int
	fd  int
}

// Hold takes pid, nil when it is already gone.
func Hold(pid int) *Held {
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return nil
	}
	return &Held{pid: pid, fd: fd}
}

// Alive reports whether the held process has not been reaped yet (a zombie
// counts): while it has not, its PID is its own.
func (h *Held) Alive() bool {
	return h != nil && unix.PidfdSendSignal(h.fd, 0, nil, 0) == nil
}

// Kill sends SIGKILL to the held process, if it is still there.
func (h *Held) Kill() {
	if h != nil {
		_ = unix.PidfdSendSignal(h.fd, unix.SIGKILL, nil, 0)
	}
}

// Release closes the pidfd.
func (h *Held) Release() {
	if h != nil {
		unix.Close(h.fd)
	}
}

// KillGroup kills process group pgid only while one of members, not reaped,
// is still in it: a group's ID is not given to another process while the
// group has a member. A group whose every known member is gone is left
// alone, since its ID may be another's by now.
func KillGroup(pgid int, members ...*Held) bool {
	for _, m := range members {
		if m.Alive() && groupOf(m.pid) == pgid {
			_ = syscall.Kill(-pgid, syscall.SIGKILL)
			return true
		}
	}
	return false
}

// groupOf is field 5 of /proc/PID/stat, 0 when it cannot be read.
func groupOf(pid int) int {
	f := statFields(pid)
	if len(f) < 3 {
		return 0
	}
	g, _ := strconv.Atoi(f[2])
	return g
}
