package store

import (
	"fmt"
	"syscall"
)

// freeBytes is the space an unprivileged writer may still use on dir's
// file system (root may use the reserved blocks too, so this errs early).
func freeBytes(dir string) (uint64, error) {
	var st syscall.Statfs_t
	if err := syscall.Statfs(dir, &st); err != nil {
		return 0, fmt.Errorf("statfs %s: %w", dir, err)
	}
	return st.Bavail * uint64(st.Bsize), nil
}
