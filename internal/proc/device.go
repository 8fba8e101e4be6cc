package proc

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// NVIDIAMajor is the character major of /dev/nvidia<minor> (and of
// /dev/nvidiactl, minor 255).
const NVIDIAMajor = 195

// Device is how the kernel names a GPU's device node: a character device
// number, or for a simulated node (a regular file) the file's identity.
// Paths are never compared: a container's /dev or a bind mount can show
// any file under any name.
type Device struct {
	char bool
	rdev uint64
	file FileID
}

// FileID names one file: the st_dev and st_ino that stat gives for it, and
// that /proc/PID/maps prints as "dev inode" for a mapping of it.
type FileID struct{ Dev, Ino uint64 }

// CharDevice is the character device major:minor, for example
// CharDevice(NVIDIAMajor, 0) for /dev/nvidia0.
func CharDevice(major, minor uint32) Device {
	return Device{char: true, rdev: unix.Mkdev(major, minor)}
}

// FileDevice names a regular file that stands in for a device node.
func FileDevice(id FileID) Device { return Device{file: id} }

// StatDevice is the Device of the file at path: its device number when it
// is a character device, else its file identity.
func StatDevice(path string) (Device, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return Device{}, fmt.Errorf("stat %s: %w", path, err)
	}
	if st.Mode&unix.S_IFMT == unix.S_IFCHR {
		return Device{char: true, rdev: st.Rdev}, nil
	}
	return FileDevice(FileID{Dev: st.Dev, Ino: st.Ino}), nil
}

func (d Device) String() string {
	if d.char {
		return fmt.Sprintf("char %d:%d", unix.Major(d.rdev), unix.Minor(d.rdev))
	}
	return fmt.Sprintf("file %d:%d inode %d", unix.Major(d.file.Dev), unix.Minor(d.file.Dev), d.file.Ino)
}

// matches reports whether a descriptor's target, as statx gave it, is d.
func (d Device) matches(st *unix.Statx_t) bool {
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFCHR:
		return d.char && unix.Mkdev(st.Rdev_major, st.Rdev_minor) == d.rdev
	case unix.S_IFREG:
		return !d.char && st.Ino == d.file.Ino && unix.Mkdev(st.Dev_major, st.Dev_minor) == d.file.Dev
	}
	return false
}
