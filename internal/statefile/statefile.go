// Package statefile keeps a daemon's small state in one file across
// restarts: written whole and renamed into place, so a crash leaves the old
// state or the new one, never half of one; readable by its owner only.
//
// The file's directory must be the daemon's user's and writable by no one
// else (internal/privdir), and the file is never followed if it is a
// symbolic link: a daemon that runs as root would otherwise read, or
// replace, whatever file a user's link names.
package statefile

import (
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"

	"github.com/gpu-orphan/gpu-orphan/internal/privdir"
)

// MaxBytes bounds a state file.
const MaxBytes = 8 << 20

// names are the words of the errors.
var names = privdir.Names{Dir: "the state file's directory", File: "the state file", Writer: "the state file", Flag: "--state.path"}

// Check makes the directory of the state at path (0700 when missing) and
// checks it, and the file if there is one, as Load and Save will: for a
// daemon to refuse to start, in one line, rather than fail at each save.
func Check(path string) error {
	d, base, err := openDir(path, privdir.Make)
	if err != nil {
		return err
	}
	defer d.Close()
	f, err := d.OpenFile(base, os.O_RDONLY, 0)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	return f.Close()
}

// Load reads the state at path. ok is false when there is none yet.
func Load(path string) (data []byte, ok bool, err error) {
	d, base, err := openDir(path, privdir.Open)
	if errors.Is(err, os.ErrNotExist) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, err
	}
	defer d.Close()
	f, err := d.OpenFile(base, os.O_RDONLY, 0)
	if errors.Is(err, os.ErrNotExist) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, err
	}
	defer f.Close()
	data, err = io.ReadAll(io.LimitReader(f, MaxBytes+1))
	if err != nil {
		return nil, false, fmt.Errorf("reading the state file %s: %w", path, err)
	}
	if len(data) > MaxBytes {
		return nil, false, fmt.Errorf("the state file %s is larger than %d bytes", path, MaxBytes)
	}
	return data, true, nil
}

// Save replaces the state at path with data. The directory is created
// 0700 when missing; the file is 0600 whatever the umask. A link at path
// is replaced, not followed.
func Save(path string, data []byte) error {
	d, base, err := openDir(path, privdir.Make)
	if err != nil {
		return err
	}
	defer d.Close()
	tmpName := fmt.Sprintf(".%s.%016x", base, rand.Uint64())
	tmp, err := d.OpenFile(tmpName, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("writing the state file: %w", err)
	}
	defer func() { _ = d.Remove(tmpName) }() // after the rename, a no-op (ENOENT)
	if err := tmp.Chmod(0o600); err != nil {
		tmp.Close()
		return fmt.Errorf("writing the state file: %w", err)
	}
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return fmt.Errorf("writing the state file: %w", err)
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return fmt.Errorf("writing the state file: %w", err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("writing the state file: %w", err)
	}
	if err := d.Rename(tmpName, base); err != nil {
		return fmt.Errorf("writing the state file: %w", err)
	}
	return nil
}

// openDir opens path's directory with open (privdir.Make or
// privdir.Open), and says path's name in it.
func openDir(path string, open func(string, privdir.Names) (*privdir.Dir, error)) (d *privdir.Dir, base string, err error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, "", fmt.Errorf("the state file %q: %w", path, err)
	}
	d, err = open(filepath.Dir(abs), names)
	return d, filepath.Base(abs), err
}
