package proc

import (
	"errors"
	"fmt"
	iofs "io/fs"
	"slices"
	"syscall"

	"github.com/prometheus/procfs"
	"golang.org/x/sys/unix"
)

// ErrNotExist is returned for a process that does not exist, or that exited
// while it was being read. errors.Is(err, fs.ErrNotExist) holds as well.
var ErrNotExist error = notExist{}

type notExist struct{}

func (notExist) Error() string        { return "process does not exist" }
func (notExist) Is(target error) bool { return target == iofs.ErrNotExist }

// gone reports whether err means the process is not there any more: its
// directory is missing (ENOENT) or it exited after a file was opened (ESRCH).
func gone(err error) bool {
	return errors.Is(err, iofs.ErrNotExist) || errors.Is(err, syscall.ESRCH)
}

// FS reads processes from a procfs mount (the host's /proc, or a fixture).
type FS struct {
	root  string
	proc  procfs.FS
	users *userCache
	// mayPtrace is true when this process has CAP_SYS_PTRACE: a descriptor
	// table it may not read is then shielded by a security policy (an LSM,
	// a sandbox's init), not hidden for lack of privilege.
	mayPtrace bool
}

// NewFS returns an FS for the procfs mounted at root ("/proc" if empty).
func NewFS(root string) (FS, error) {
	if root == "" {
		root = procfs.DefaultMountPoint
	}
	p, err := procfs.NewFS(root)
	if err != nil {
		return FS{}, fmt.Errorf("procfs %s: %w", root, err)
	}
	return FS{root: root, proc: p, users: newUserCache(), mayPtrace: hasCapability(unix.CAP_SYS_PTRACE)}, nil
}

// hasCapability reports whether capability c is in our effective set.
func hasCapability(c int) bool {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return false
	}
	return data[c/32].Effective&(1<<(uint(c)%32)) != 0
}

// Root is the procfs mount point the FS reads.
func (fs FS) Root() string { return fs.root }

// PIDs lists the processes (thread group leaders) in the procfs, sorted.
func (fs FS) PIDs() ([]int, error) {
	dirfd, err := unix.Open(fs.root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", fs.root, err)
	}
	defer unix.Close(dirfd)
	pids, err := readPIDs(dirfd, nil)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", fs.root, err)
	}
	slices.Sort(pids)
	return pids, nil
}
