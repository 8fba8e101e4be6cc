package store

import (
	"bytes"
	"fmt"
	"os"
	"syscall"
)

// ext2, ext3 and ext4 share this magic number. They are the file systems
// that keep blocks in reserve for root (5% by default, mke2fs -m): a user
// who fills the disk leaves those, and root may still write into them.
const extSuperMagic = 0xEF53

// freeBytes is the space this process may still use on dir's file system:
// on ext2/3/4, the free blocks including root's reserve when we are root
// (the reserve belongs to resuid, 0 unless tune2fs changed it); elsewhere,
// or when we are not root, the blocks an unprivileged writer may use.
func freeBytes(dir string) (uint64, error) {
	var st syscall.Statfs_t
	if err := syscall.Statfs(dir, &st); err != nil {
		return 0, fmt.Errorf("statfs %s: %w", dir, err)
	}
	return usableBytes(st, hostRoot()), nil
}

// usableBytes is the space that statfs reports usable: Bfree when root
// may write into an ext file system's reserve, Bavail otherwise.
func usableBytes(st syscall.Statfs_t, root bool) uint64 {
	if root && st.Type == extSuperMagic {
		return st.Bfree * uint64(st.Bsize)
	}
	return st.Bavail * uint64(st.Bsize)
}

// hostRoot reports whether this process is root as file systems see it:
// effective UID 0 in a user namespace that maps UID 0 to the host's UID 0.
// A rootless container's root is a user like any other to ext4's reserve.
func hostRoot() bool {
	if os.Geteuid() != 0 {
		return false
	}
	b, err := os.ReadFile("/proc/self/uid_map")
	if err != nil {
		return false
	}
	for line := range bytes.Lines(b) {
		f := bytes.Fields(line)
		if len(f) == 3 && string(f[0]) == "0" && string(f[1]) == "0" {
			return true
		}
	}
	return false
}
