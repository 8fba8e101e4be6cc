//go:build unix

package privdir

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"

	"golang.org/x/sys/unix"
)

// Dir is a directory opened without following a link and checked: the
// files opened through it are in the directory that was checked, whatever
// happens to the path since.
type Dir struct {
	f    *os.File
	path string
	n    Names
}

func openNoFollow(abs string, n Names) (*Dir, error) {
	fd, err := unix.Open(abs, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: abs, Err: err}
	}
	return &Dir{f: os.NewFile(uintptr(fd), abs), path: abs, n: n}, nil
}

func (d *Dir) stat() (os.FileInfo, error) { return d.f.Stat() }

// Close closes the directory.
func (d *Dir) Close() error { return d.f.Close() }

// OpenFile opens name, a file of the directory, with O_NOFOLLOW: a
// symbolic link there is refused (LinkError), never followed; so is
// anything but a regular file. Its errors name the file (Names.File and
// its path); os.ErrNotExist when there is none.
func (d *Dir) OpenFile(name string, flag int, perm os.FileMode) (*os.File, error) {
	path := filepath.Join(d.path, name)
	fd, err := unix.Openat(int(d.f.Fd()), name, flag|unix.O_NOFOLLOW|unix.O_CLOEXEC|unix.O_NONBLOCK, uint32(perm.Perm()))
	if err != nil {
		if errors.Is(err, unix.ELOOP) || errors.Is(err, unix.EEXIST) && d.isLink(name) {
			return nil, d.linkError(name)
		}
		return nil, fmt.Errorf("%s %s: %w", d.n.File, path, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("%s %s: %w", d.n.File, path, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		unix.Close(fd)
		return nil, fmt.Errorf("%s %s is not a file: move it away, or give %s elsewhere", d.n.File, path, d.n.Flag)
	}
	// O_NONBLOCK kept a FIFO from blocking the open; a file needs none.
	if err := clearNonblock(fd); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("%s %s: %w", d.n.File, path, err)
	}
	return os.NewFile(uintptr(fd), path), nil
}

func clearNonblock(fd int) error {
	fl, err := unix.FcntlInt(uintptr(fd), unix.F_GETFL, 0)
	if err != nil {
		return err
	}
	_, err = unix.FcntlInt(uintptr(fd), unix.F_SETFL, fl&^unix.O_NONBLOCK)
	return err
}

// lstat is the mode of name, a link not followed.
func (d *Dir) lstat(name string) (os.FileMode, error) {
	var st unix.Stat_t
	if err := unix.Fstatat(int(d.f.Fd()), name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return 0, &os.PathError{Op: "lstat", Path: filepath.Join(d.path, name), Err: err}
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFLNK:
		return os.ModeSymlink, nil
	case unix.S_IFREG:
		return os.FileMode(st.Mode & 0o777), nil
	case unix.S_IFDIR:
		return os.ModeDir | os.FileMode(st.Mode&0o777), nil
	}
	return os.ModeIrregular, nil
}

func (d *Dir) isLink(name string) bool {
	m, err := d.lstat(name)
	return err == nil && m&os.ModeSymlink != 0
}

func (d *Dir) linkError(name string) error {
	return LinkError(filepath.Join(d.path, name), d.n)
}

// Remove removes name from the directory (not a directory).
func (d *Dir) Remove(name string) error {
	if err := unix.Unlinkat(int(d.f.Fd()), name, 0); err != nil {
		return &os.PathError{Op: "remove", Path: filepath.Join(d.path, name), Err: err}
	}
	return nil
}

// Rename renames from to to, both in the directory.
func (d *Dir) Rename(from, to string) error {
	fd := int(d.f.Fd())
	if err := unix.Renameat(fd, from, fd, to); err != nil {
		return &os.LinkError{Op: "rename", Old: filepath.Join(d.path, from), New: filepath.Join(d.path, to), Err: err}
	}
	return nil
}

// fileOwner is the UID that owns fi.
func fileOwner(fi os.FileInfo) (int, bool) {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return 0, false
	}
	return int(st.Uid), true
}
