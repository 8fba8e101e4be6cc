package proc

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"

	"golang.org/x/sys/unix"
)

// Children returns the PIDs of pid's children, from
// /proc/PID/task/TID/children of each of its threads: a child belongs to
// the thread that forked it. The list is what the kernel knows now; a
// child that exits meanwhile may still be in it.
func (fs FS) Children(pid int) ([]int, error) {
	taskDir := filepath.Join(fs.root, strconv.Itoa(pid), "task")
	tasks, err := os.ReadDir(taskDir)
	if err != nil {
		return nil, fs.wrap(pid, "task", err)
	}
	var out []int
	for _, t := range tasks {
		b, err := os.ReadFile(filepath.Join(taskDir, t.Name(), "children"))
		if err != nil {
			if gone(err) {
				continue // the thread exited
			}
			return nil, fs.wrap(pid, "task/"+t.Name()+"/children", err)
		}
		for _, f := range splitFields(b) {
			if c, ok := atoi(f); ok && !slices.Contains(out, c) {
				out = append(out, c)
			}
		}
	}
	slices.Sort(out)
	return out, nil
}

// ThreadChildren returns the PIDs of the children that thread tid of pid
// forked (/proc/PID/task/TID/children): one read, where Children reads
// every thread's.
func (fs FS) ThreadChildren(pid, tid int) ([]int, error) {
	b, err := os.ReadFile(filepath.Join(fs.root, strconv.Itoa(pid), "task", strconv.Itoa(tid), "children"))
	if err != nil {
		return nil, fs.wrap(pid, "task/"+strconv.Itoa(tid)+"/children", err)
	}
	var out []int
	for _, f := range splitFields(b) {
		if c, ok := atoi(f); ok {
			out = append(out, c)
		}
	}
	return out, nil
}

func splitFields(b []byte) [][]byte {
	var out [][]byte
	start := -1
	for i, c := range b {
		if c == ' ' || c == '\n' {
			if start >= 0 {
				out = append(out, b[start:i])
				start = -1
			}
			continue
		}
		if start < 0 {
			start = i
		}
	}
	if start >= 0 {
		out = append(out, b[start:])
	}
	return out
}

// ErrKcmpUnavailable is returned when the kernel cannot compare open files
// (no kcmp: CONFIG_KCMP off, or a seccomp policy): sharing is then unknown.
var ErrKcmpUnavailable = errors.New("kcmp(2) is not available: open files cannot be compared")

// SharesFile reports whether two holdings share an open file description
// of the device: one descriptor of a and one of b are the same open file,
// as kcmp(KCMP_FILE) tells. Forked children and processes that received a
// descriptor (SCM_RIGHTS, pidfd_getfd) share them; two processes that each
// opened the device do not. PIDs are those of the caller's PID namespace,
// which must be the procfs's (SelfNamespace).
func (fs FS) SharesFile(a, b Holding) (bool, error) {
	pa, pb := a.Via, b.Via
	if pa == 0 {
		pa = a.PID
	}
	if pb == 0 {
		pb = b.PID
	}
	for _, fa := range a.FDs {
		for _, fb := range b.FDs {
			same, err := kcmpFile(pa, pb, fa, fb)
			switch {
			case err == nil && same:
				return true, nil
			case err == nil, errors.Is(err, unix.EBADF):
				// Different files, or a descriptor closed since the scan.
			case errors.Is(err, unix.ESRCH):
				return false, fmt.Errorf("comparing open files of %d and %d: %w", a.PID, b.PID, ErrNotExist)
			case errors.Is(err, unix.ENOSYS), errors.Is(err, unix.EPERM), errors.Is(err, unix.EACCES):
				return false, fmt.Errorf("comparing open files of %d and %d: %w: %w", a.PID, b.PID, ErrKcmpUnavailable, err)
			default:
				return false, fmt.Errorf("comparing open files of %d and %d: %w", a.PID, b.PID, err)
			}
		}
	}
	return false, nil
}

// kcmpFile is kcmp(pid1, pid2, KCMP_FILE, fd1, fd2): 0 means the same open
// file; 1 and 2 order different ones.
func kcmpFile(pid1, pid2, fd1, fd2 int) (bool, error) {
	for {
		r, _, errno := unix.Syscall6(unix.SYS_KCMP, uintptr(pid1), uintptr(pid2), uintptr(kcmpFileType), uintptr(fd1), uintptr(fd2), 0)
		switch errno {
		case 0:
			return r == 0, nil
		case unix.EINTR:
			continue
		}
		return false, errno
	}
}

// kcmpFileType is KCMP_FILE of <linux/kcmp.h>.
const kcmpFileType = 0
