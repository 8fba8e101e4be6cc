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
	return FS{root: root, proc: p, users: newUserCache()}, nil
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
