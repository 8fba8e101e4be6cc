package proc

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"
)

// GroupMembers returns the live processes whose process group is pgid: a
// zombie leader whose other threads run is one of them. It reads only
// /proc/PID/stat of every process (about 2,000 on a busy node, inside the
// kill ladder's grace period), and the full identity of the members. A member that cannot be read fails the whole listing: a
// group is killed whole only when every member is known.
func (fs FS) GroupMembers(pgid int) ([]Process, error) {
	if pgid <= 0 {
		return nil, fmt.Errorf("listing process group %d: not a process group", pgid)
	}
	pids, err := fs.PIDs()
	if err != nil {
		return nil, fmt.Errorf("listing process group %d: %w", pgid, err)
	}
	root, err := unix.Open(fs.root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("listing process group %d: open %s: %w", pgid, fs.root, err)
	}
	defer unix.Close(root)
	buf := make([]byte, 1024)
	var members []Process
	for _, pid := range pids {
		_, pgrp, err := readStat(root, pid, buf)
		if gone(err) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("listing process group %d: %w", pgid, err)
		}
		if pgrp != pgid {
			continue
		}
		p, err := fs.Process(pid)
		if errors.Is(err, ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("listing process group %d: %w", pgid, err)
		}
		// It may have exited or moved between the two reads.
		if p.Zombie() || p.PGID != pgid {
			continue
		}
		members = append(members, p)
	}
	return members, nil
}

// readStat reads the state and process group of pid from its stat file,
// relative to the procfs's directory: one open and one read, where
// procfs's general parser costs some 70 µs a process.
func readStat(root, pid int, buf []byte) (state byte, pgrp int, err error) {
	name := strconv.Itoa(pid) + "/stat"
	fd, err := unix.Openat(root, name, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, 0, fmt.Errorf("open %s: %w", name, err)
	}
	defer unix.Close(fd)
	n, err := readFull(fd, buf)
	if err != nil {
		return 0, 0, fmt.Errorf("read %s: %w", name, err)
	}
	state, pgrp, ok := parseStat(buf[:n])
	if !ok {
		return 0, 0, fmt.Errorf("parse %s: %q", name, buf[:n])
	}
	return state, pgrp, nil
}

func readFull(fd int, buf []byte) (int, error) {
	n := 0
	for n < len(buf) {
		m, err := unix.Read(fd, buf[n:])
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return n, err
		}
		if m == 0 {
			break
		}
		n += m
	}
	return n, nil
}

// Stat is what ancestry and group listings need of /proc/PID/stat.
type Stat struct {
	State byte
	PPID  int
	PGRP  int
	// StartTime is field 22: with the PID, the process's identity.
	StartTime uint64
}

// parseStat reads fields 3 (state) and 5 (pgrp) of /proc/PID/stat.
func parseStat(b []byte) (state byte, pgrp int, ok bool) {
	st, ok := parseStatFields(b)
	return st.State, st.PGRP, ok
}

// parseStatFields reads fields 3 (state), 4 (ppid), 5 (pgrp) and, when the
// line has it, 22 (starttime) of /proc/PID/stat. comm, field 2, may hold
// spaces and parentheses, so fields are counted from the last ')'.
func parseStatFields(b []byte) (Stat, bool) {
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return Stat{}, false
	}
	f := bytes.Fields(b[i+1:]) // f[0] is field 3
	if len(f) < 4 || len(f[0]) != 1 {
		return Stat{}, false
	}
	ppid, err1 := strconv.Atoi(string(f[1]))
	pgrp, err2 := strconv.Atoi(string(f[2]))
	if err1 != nil || err2 != nil {
		return Stat{}, false
	}
	st := Stat{State: f[0][0], PPID: ppid, PGRP: pgrp}
	if len(f) > 19 {
		st.StartTime, _ = strconv.ParseUint(string(f[19]), 10, 64)
	}
	return st, true
}

// ReadStat reads the state, parent, group and start time of pid: one small
// file, where Process reads four and looks up the user.
func (fs FS) ReadStat(pid int) (Stat, error) {
	b, err := os.ReadFile(filepath.Join(fs.root, strconv.Itoa(pid), "stat"))
	if err != nil {
		return Stat{}, fs.wrap(pid, "stat", err)
	}
	st, ok := parseStatFields(b)
	if !ok {
		return Stat{}, fmt.Errorf("%s/%d/stat: cannot parse %q", fs.root, pid, b)
	}
	return st, nil
}
