package kill

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"github.com/gpu-orphan/gpu-orphan/internal/proc"
	"github.com/gpu-orphan/gpu-orphan/remediate"
)

// Tracing is what /proc/PID/status says of a process and ptrace(2).
//
// A tracer that set PTRACE_O_TRACEEXIT holds a dying tracee at its exit
// (PTRACE_EVENT_EXIT), before its descriptors are closed: neither SIGTERM
// nor SIGKILL ends it, and its pidfd does not become readable, until the
// tracer lets it go or ends (the kernel then detaches its tracees). A
// tracee sent SIGTERM stops at the signal (signal-delivery-stop) until the
// tracer delivers it. Either stop shows as state t (tracing stop).
type Tracing struct {
	// TracerPID is the thread group of the tracer (status's TracerPid names
	// the tracing thread, which may be any thread of it); 0 when the
	// process is not traced.
	TracerPID int
	// Stopped is true in a tracing stop (state t).
	Stopped bool
}

// ErrIdentityChanged says that a PID no longer names the process that a
// start time identifies.
var ErrIdentityChanged = errors.New("the PID names another process now")

// ReadTracing reads how pid, the process that started at startTime, is
// traced.
func ReadTracing(fs proc.FS, pid int, startTime uint64) (Tracing, error) {
	root := fs.Root()
	b, err := os.ReadFile(filepath.Join(root, strconv.Itoa(pid), "status"))
	if err != nil {
		return Tracing{}, err
	}
	state, tracer, _, err := parseStatus(b)
	if err != nil {
		return Tracing{}, fmt.Errorf("/proc/%d/status: %w", pid, err)
	}
	// Read after the status: when the start time still matches, the
	// status was this process's.
	st, err := fs.ReadStat(pid)
	if err != nil {
		return Tracing{}, err
	}
	if st.StartTime != startTime {
		return Tracing{}, ErrIdentityChanged
	}
	tr := Tracing{Stopped: state == "t"}
	if tracer == 0 {
		return tr, nil
	}
	// The tracing thread's thread group is the tracer.
	tb, err := os.ReadFile(filepath.Join(root, strconv.Itoa(tracer), "status"))
	if err != nil {
		return Tracing{}, fmt.Errorf("reading tracer %d of %d: %w", tracer, pid, err)
	}
	_, _, tgid, err := parseStatus(tb)
	if err != nil {
		return Tracing{}, fmt.Errorf("/proc/%d/status: %w", tracer, err)
	}
	tr.TracerPID = tgid
	return tr, nil
}

// parseStatus reads the state letter, TracerPid and Tgid of a
// /proc/PID/status.
func parseStatus(b []byte) (state string, tracer, tgid int, err error) {
	var haveTracer, haveTgid bool
	for line := range bytes.Lines(b) {
		key, val, ok := bytes.Cut(line, []byte(":"))
		if !ok {
			continue
		}
		val = bytes.TrimSpace(val)
		switch string(key) {
		case "State":
			if len(val) > 0 {
				state = string(val[:1])
			}
		case "TracerPid":
			if tracer, err = strconv.Atoi(string(val)); err != nil {
				return "", 0, 0, fmt.Errorf("TracerPid %q: %w", val, err)
			}
			haveTracer = true
		case "Tgid":
			if tgid, err = strconv.Atoi(string(val)); err != nil {
				return "", 0, 0, fmt.Errorf("field Tgid %q: %w", val, err)
			}
			haveTgid = true
		}
	}
	if state == "" || !haveTracer || !haveTgid {
		return "", 0, 0, errors.New("no State, TracerPid or Tgid line")
	}
	return state, tracer, tgid, nil
}

// TracerOf names the tracer of pid (started at startTime), and reads it,
// or returns nil when pid is not traced or either cannot be read.
func TracerOf(fs proc.FS, pid int, startTime uint64) (*remediate.Tracer, proc.Process) {
	tr, err := ReadTracing(fs, pid, startTime)
	if err != nil || tr.TracerPID == 0 {
		return nil, proc.Process{}
	}
	p, err := fs.Process(tr.TracerPID)
	if err != nil {
		return nil, proc.Process{}
	}
	return remediate.NewTracer(p), p
}
