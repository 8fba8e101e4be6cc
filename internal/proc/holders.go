package proc

import (
	"bytes"
	"fmt"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// HolderScan is what one pass over /proc/*/fd found.
type HolderScan struct {
	// Holders maps each path that some process holds open to the sorted
	// PIDs holding it, each PID once. Paths nobody holds are absent.
	Holders map[string][]int
	// Scanned counts the processes whose fd table was read.
	Scanned int
	// Denied counts the processes whose fd table could not be read for
	// lack of permission (not root, no CAP_SYS_PTRACE): their holds are
	// missing from Holders, so "no holder" is not proven when Denied > 0.
	Denied int
}

// Holders returns, for each of paths, the sorted PIDs whose fd table holds
// it open, in one pass over /proc/*/fd. A descriptor holds a path when its
// link target, as readlink prints it, is the path made absolute and clean,
// or the path with its symlinks resolved; a " (deleted)" suffix is
// ignored. Paths nobody holds are absent from the map. Processes that exit
// or deny access during the scan are skipped (ScanHolders counts the
// latter): a scan never fails for them.
func (fs FS) Holders(paths []string) (map[string][]int, error) {
	s, err := fs.ScanHolders(paths)
	return s.Holders, err
}

// ScanHolders is Holders with counts of what the scan could and could not
// read.
func (fs FS) ScanHolders(paths []string) (HolderScan, error) {
	scan := HolderScan{Holders: make(map[string][]int)}
	if len(paths) == 0 {
		return scan, nil
	}
	want := wantedTargets(paths)

	rootfd, err := unix.Open(fs.root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return scan, fmt.Errorf("open %s: %w", fs.root, err)
	}
	defer unix.Close(rootfd)
	pids, err := readPIDs(rootfd, make([]int, 0, 1024))
	if err != nil {
		return scan, fmt.Errorf("read %s: %w", fs.root, err)
	}

	// The scan is one readlink per descriptor; spread the syscalls over the
	// CPUs. Each worker takes the next PID, so a process with a huge fd
	// table does not hold up the others.
	workers := min(runtime.GOMAXPROCS(0), 8, len(pids)/256+1)
	results := make([]scanner, workers)
	var next atomic.Int64
	var wg sync.WaitGroup
	for w := range results {
		s := &results[w]
		s.init(rootfd, want, len(paths))
		wg.Go(func() {
			for {
				i := int(next.Add(1)) - 1
				if i >= len(pids) {
					return
				}
				s.scanPID(pids[i])
			}
		})
	}
	wg.Wait()

	hits := make([][]int, len(paths))
	for _, s := range results {
		scan.Scanned += s.scanned
		scan.Denied += s.denied
		for i, h := range s.hits {
			hits[i] = append(hits[i], h...)
		}
	}
	for i, h := range hits {
		if len(h) == 0 {
			continue
		}
		slices.Sort(h)
		scan.Holders[paths[i]] = slices.Compact(h)
	}
	return scan, nil
}

// wantedTargets maps each link target that names one of paths, as
// readlink(/proc/PID/fd/N) prints it, to the indices of those paths.
func wantedTargets(paths []string) map[string][]int {
	want := make(map[string][]int, 2*len(paths))
	add := func(target string, i int) {
		if !slices.Contains(want[target], i) {
			want[target] = append(want[target], i)
		}
	}
	for i, p := range paths {
		if abs, err := filepath.Abs(p); err == nil {
			p = abs
		}
		add(filepath.Clean(p), i)
		// The kernel prints the file's own path, symlinks resolved.
		if real, err := filepath.EvalSymlinks(p); err == nil {
			add(real, i)
		}
	}
	return want
}

// scanner is one worker's state: buffers reused across PIDs, and hits
// indexed like the paths asked for.
type scanner struct {
	rootfd  int
	want    map[string][]int
	dirbuf  []byte
	linkbuf []byte
	hits    [][]int
	scanned int
	denied  int
}

func (s *scanner) init(rootfd int, want map[string][]int, npaths int) {
	s.rootfd = rootfd
	s.want = want
	s.dirbuf = make([]byte, direntBufSize)
	s.linkbuf = make([]byte, unix.PathMax)
	s.hits = make([][]int, npaths)
}

// scanPID reads the fd table of pid. Any error skips the process: it exited
// (ENOENT, ESRCH) or is not ours to read (EACCES, counted as denied).
func (s *scanner) scanPID(pid int) {
	// Opening the fd directory once and reading each link relative to it
	// spares the kernel a walk of /proc/PID/fd/N per descriptor.
	dirfd, err := unix.Openat(s.rootfd, strconv.Itoa(pid)+"/fd", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		if err == unix.EACCES || err == unix.EPERM {
			s.denied++
		}
		return
	}
	defer unix.Close(dirfd)
	denied := false
	for !denied {
		n, err := unix.Getdents(dirfd, s.dirbuf)
		if err == unix.EINTR {
			continue
		}
		if err != nil || n <= 0 {
			break
		}
		eachDirent(s.dirbuf[:n], func(name []byte) {
			if denied {
				return
			}
			if _, ok := atoi(name); !ok {
				return
			}
			m, errno := readlinkat(dirfd, name, s.linkbuf)
			if errno == unix.EACCES || errno == unix.EPERM {
				// Listing the table is allowed, reading a link needs
				// ptrace access: all links of this process will fail.
				denied = true
				return
			}
			if errno != 0 || m == 0 || s.linkbuf[0] != '/' {
				// Closed meanwhile, or a socket, pipe or anon inode.
				return
			}
			target := s.linkbuf[:m]
			// A device node unlinked since it was opened (a container's
			// /dev torn down) still names the device the fd holds.
			target = bytes.TrimSuffix(target, deleted)
			for _, i := range s.want[string(target)] {
				if h := s.hits[i]; len(h) == 0 || h[len(h)-1] != pid {
					s.hits[i] = append(h, pid)
				}
			}
		})
		// procfs lists a whole fd table in one call when it fits: a call
		// that left room for another entry was the last one, and the
		// getdents that would return 0 can be spared.
		if n < len(s.dirbuf)-maxFdDirent {
			break
		}
	}
	if denied {
		s.denied++
		return
	}
	s.scanned++
}

var deleted = []byte(" (deleted)")

// maxFdDirent bounds a linux_dirent64 record naming a descriptor: 19 bytes
// of header, up to 10 digits and a NUL, padded to 8 bytes.
const maxFdDirent = 32

// readlinkat is unix.Readlinkat without its two allocations per call
// (string(name), then a NUL-terminated copy): name is a dirent name, which
// the kernel NUL-terminates in the buffer, so it is passed in place. That
// spares ~100,000 allocations per scan of ~50,000 descriptors.
func readlinkat(dirfd int, name, buf []byte) (int, unix.Errno) {
	// eachDirent cut name before its NUL; check that it is still there.
	if len(name) == 0 || len(name) >= cap(name) || name[:len(name)+1][len(name)] != 0 {
		return 0, unix.EINVAL
	}
	p := unsafe.Pointer(unsafe.SliceData(name))
	n, _, errno := unix.Syscall6(unix.SYS_READLINKAT, uintptr(dirfd), uintptr(p),
		uintptr(unsafe.Pointer(unsafe.SliceData(buf))), uintptr(len(buf)), 0, 0)
	return int(n), errno
}
