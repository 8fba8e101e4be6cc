package proc

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// BootID is the kernel's random ID of this boot
// (/proc/sys/kernel/random/boot_id): PIDs and start times name the same
// processes only within one boot.
func (fs FS) BootID() (string, error) {
	b, err := os.ReadFile(filepath.Join(fs.root, "sys", "kernel", "random", "boot_id"))
	if err != nil {
		return "", fmt.Errorf("reading the boot ID: %w", err)
	}
	id := strings.TrimSpace(string(b))
	if id == "" {
		return "", fmt.Errorf("reading the boot ID: %s is empty", filepath.Join(fs.root, "sys", "kernel", "random", "boot_id"))
	}
	return id, nil
}
