package proc

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Exe is the identity of a process's executable: the file the kernel
// mapped at its last execve, read through /proc/PID/exe. Unlike comm
// (prctl PR_SET_NAME, a write to /proc/PID/comm) or argv, a process cannot
// change it without exec'ing another file. The zero Exe is unknown.
type Exe struct {
	// Path is where the kernel says the file is, for display (readlink
	// /proc/PID/exe): the path the process exec'd, symlinks resolved. A
	// file removed or replaced since (a package upgrade) ends in
	// " (deleted)"; see Name. A path says nothing the file's owner did not
	// allow: trust it only together with UID and Mode.
	Path string
	// File is the file itself (st_dev, st_ino): hard links and symlinks
	// to it, and bind mounts of it, are the same file.
	File FileID
	// UID owns the file; Mode is its st_mode, type and permission bits.
	UID  int
	Mode uint32
}

// deletedSuffix is what the kernel appends to the path of a file that is
// no longer linked where it was (d_path).
const deletedSuffix = " (deleted)"

// Known reports whether the executable could be read: false for kernel
// threads, which have none, for a process that exited or exec'd while it
// was read, and where /proc denies it (another user's process, without
// CAP_SYS_PTRACE).
func (e Exe) Known() bool { return e.File.Ino != 0 }

// ExecPath is Path without a trailing " (deleted)": where the file was
// when the process exec'd it, symlinks resolved. "" when unknown.
func (e Exe) ExecPath() string {
	p := strings.TrimSuffix(e.Path, deletedSuffix)
	if !strings.HasPrefix(p, "/") {
		return ""
	}
	return p
}

// Name is the base name of ExecPath, or "".
func (e Exe) Name() string {
	if p := e.ExecPath(); p != "" {
		return filepath.Base(p)
	}
	return ""
}

// Deleted reports whether the file was removed or replaced after the
// process exec'd it: it runs a binary that is no longer at Path.
func (e Exe) Deleted() bool { return strings.HasSuffix(e.Path, deletedSuffix) }

// exe reads the executable of process pid. A process whose main thread has
// exited (leaderExited) has no mm left on that thread, so /proc/PID/exe is
// empty: its live threads still run the same file, and one of them is
// read instead. Any failure leaves the Exe unknown.
func (fs FS) exe(pid int, leaderExited bool) Exe {
	dir := filepath.Join(fs.root, strconv.Itoa(pid))
	if e, ok := readExe(filepath.Join(dir, "exe")); ok || !leaderExited {
		return e
	}
	tasks, err := os.ReadDir(filepath.Join(dir, "task"))
	if err != nil {
		return Exe{}
	}
	for _, t := range tasks {
		if t.Name() == strconv.Itoa(pid) {
			continue
		}
		if e, ok := readExe(filepath.Join(dir, "task", t.Name(), "exe")); ok {
			return e
		}
	}
	return Exe{}
}

// readExe opens the file that link (a /proc/PID/exe) points to, without
// opening it for reading (O_PATH), and takes its identity and its path
// from that one descriptor: they name the same file even when the process
// exec's another meanwhile, which a stat and a readlink of the link each
// by itself would not promise.
func readExe(link string) (Exe, bool) {
	fd, err := unix.Open(link, unix.O_PATH|unix.O_CLOEXEC, 0)
	if err != nil {
		return Exe{}, false
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Ino == 0 {
		return Exe{}, false
	}
	path, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(fd))
	if err != nil {
		// No /proc of our own (a procfs mounted elsewhere only): the
		// link itself, read a moment later.
		if path, err = os.Readlink(link); err != nil {
			return Exe{}, false
		}
	}
	return Exe{
		Path: strings.ToValidUTF8(path, "\uFFFD"),
		File: FileID{Dev: st.Dev, Ino: st.Ino},
		UID:  int(st.Uid),
		Mode: st.Mode,
	}, true
}
