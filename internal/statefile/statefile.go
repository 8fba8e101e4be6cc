// Package statefile keeps a daemon's small state in one file across
// restarts: written whole and renamed into place, so a crash leaves the old
// state or the new one, never half of one; readable by its owner only.
package statefile

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
)

// MaxBytes bounds a state file.
const MaxBytes = 8 << 20

// Load reads the state at path. ok is false when there is none yet.
func Load(path string) (data []byte, ok bool, err error) {
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, fmt.Errorf("reading the state file: %w", err)
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
// 0700 when missing; the file is 0600 whatever the umask.
func Save(path string, data []byte) error {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("the state file's directory: %w", err)
	}
	tmp, err := os.CreateTemp(dir, "."+filepath.Base(path)+".*")
	if err != nil {
		return fmt.Errorf("writing the state file: %w", err)
	}
	defer os.Remove(tmp.Name()) // after the rename, a no-op
	if err := tmp.Chmod(0o600); err != nil {
		tmp.Close()
		return fmt.Errorf("writing the state file: %w", err)
	}
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return fmt.Errorf("writing the state file: %w", err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("writing the state file: %w", err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("writing the state file: %w", err)
	}
	return nil
}
