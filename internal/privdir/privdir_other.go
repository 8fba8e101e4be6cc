//go:build !unix

package privdir

import (
	"fmt"
	"os"
	"path/filepath"
)

// Dir is a checked directory. Where files have no owner and no
// O_NOFOLLOW, it is its path, and links are refused by Lstat.
type Dir struct {
	path string
	n    Names
}

func openNoFollow(abs string, n Names) (*Dir, error) {
	fi, err := os.Lstat(abs)
	if err != nil {
		return nil, err
	}
	if !fi.IsDir() {
		return nil, fmt.Errorf("%s is not a directory", abs)
	}
	return &Dir{path: abs, n: n}, nil
}

func (d *Dir) stat() (os.FileInfo, error) { return os.Lstat(d.path) }

// Close does nothing here.
func (d *Dir) Close() error { return nil }

// OpenFile opens name, a file of the directory; a symbolic link there is
// refused.
func (d *Dir) OpenFile(name string, flag int, perm os.FileMode) (*os.File, error) {
	path := filepath.Join(d.path, name)
	if fi, err := os.Lstat(path); err == nil && fi.Mode()&os.ModeSymlink != 0 {
		return nil, LinkError(path, d.n)
	}
	f, err := os.OpenFile(path, flag, perm)
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w", d.n.File, path, err)
	}
	return f, nil
}

// Remove removes name from the directory.
func (d *Dir) Remove(name string) error { return os.Remove(filepath.Join(d.path, name)) }

// Rename renames from to to, both in the directory.
func (d *Dir) Rename(from, to string) error {
	return os.Rename(filepath.Join(d.path, from), filepath.Join(d.path, to))
}

// fileOwner is the UID that owns fi: none where files have no UID.
func fileOwner(os.FileInfo) (int, bool) { return os.Geteuid(), true }
