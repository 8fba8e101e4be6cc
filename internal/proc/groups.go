package proc

import (
	"bytes"
	"errors"
	"fmt"
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

// parseStat reads fields 3 (state) and 5 (pgrp) of /proc/PID/stat. comm,
// field 2, may hold spaces and parentheses, so fields are counted from the
// last ')'.
func parseStat(b []byte) (state byte, pgrp int, ok bool) {
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, 0, false
	}
	var f [3][]byte // state, ppid, pgrp
	rest := b[i+1:]
	for k := range f {
		rest = bytes.TrimLeft(rest, " ")
		end := bytes.IndexByte(rest, ' ')
		if end < 0 {
			return 0, 0, false
		}
		f[k], rest = rest[:end], rest[end:]
	}
	if len(f[0]) != 1 {
		return 0, 0, false
	}
	pgrp, err := strconv.Atoi(string(f[2]))
	if err != nil {
		return 0, 0, false
	}
	return f[0][0], pgrp, true
}
