package proc

import (
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// MaxScanWorkers is the most goroutines one holder scan runs, however many
// CPUs there are.
const MaxScanWorkers = 8

// ErrDenied is returned when a process's descriptors may not be read (not
// root, no CAP_SYS_PTRACE): what it holds is unknown, not nothing.
var ErrDenied = errors.New("permission denied reading the process's descriptors")

// ErrShielded is returned when a process's descriptors may not be read
// even with CAP_SYS_PTRACE: a security policy shields it.
var ErrShielded = errors.New("a security policy shields the process's descriptors")

// Holding is one process's hold on a device.
type Holding struct {
	PID int
	// Via is the task whose fd table was read, and whose maps tell whether
	// the device is mapped: PID itself, or another live thread when the
	// main thread has exited (a zombie leader's own fd and maps are empty).
	Via int
	// Files are the files through which its descriptors hold the device.
	// A mapping of the device names one of them in /proc/PID/maps.
	Files []FileID
	// FDs are the descriptors (in Via's table) that hold the device, for
	// kcmp: two processes share an open file only through descriptors.
	FDs []int
}

// HolderScan is what one pass over /proc/*/fd found.
type HolderScan struct {
	// Holders maps each device that some process holds open to its
	// holders, sorted by PID. Devices nobody holds are absent.
	Holders map[Device][]Holding
	// Scanned counts the processes whose fd table was read.
	Scanned int
	// Denied counts the processes whose fd table could not be read for
	// lack of privilege (not root, no CAP_SYS_PTRACE): their holds are
	// missing from Holders, so "no holder" is not proven when Denied > 0.
	Denied int
	// Shielded lists the processes whose fd table could not be read
	// although we have CAP_SYS_PTRACE: a security policy shields them
	// (seen here: a sandbox's PID 1). No privilege would show more.
	Shielded []int
}

// ScanHolders finds, in one pass over /proc/*/fd, the processes that hold
// each of devs open. A descriptor holds a device when statx of its target
// says so (the device number of a character device, the identity of a
// regular file): the name it was opened by does not count. Processes that
// exit during the scan are skipped, and those that deny access are
// counted: a scan never fails for them.
func (fs FS) ScanHolders(devs []Device) (HolderScan, error) {
	scan := HolderScan{Holders: make(map[Device][]Holding)}
	if len(devs) == 0 {
		return scan, nil
	}
	rootfd, err := unix.Open(fs.root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return scan, fmt.Errorf("open %s: %w", fs.root, err)
	}
	defer unix.Close(rootfd)
	pids, err := readPIDs(rootfd, make([]int, 0, 1024))
	if err != nil {
		return scan, fmt.Errorf("read %s: %w", fs.root, err)
	}

	// The scan is one statx per descriptor; spread the syscalls over the
	// CPUs. Each worker takes the next PID, so a process with a huge fd
	// table does not hold up the others.
	workers := min(runtime.GOMAXPROCS(0), MaxScanWorkers, len(pids)/256+1)
	results := make([]scanner, workers)
	var next atomic.Int64
	var wg sync.WaitGroup
	for w := range results {
		s := &results[w]
		s.init(rootfd, devs)
		wg.Go(func() {
			for {
				i := int(next.Add(1)) - 1
				if i >= len(pids) {
					return
				}
				switch s.scanPID(pids[i]) {
				case tableRead:
					s.scanned++
				case tableDenied:
					if fs.mayPtrace {
						s.shielded = append(s.shielded, pids[i])
					} else {
						s.denied++
					}
				}
			}
		})
	}
	wg.Wait()

	for _, s := range results {
		scan.Scanned += s.scanned
		scan.Denied += s.denied
		scan.Shielded = append(scan.Shielded, s.shielded...)
		for i, h := range s.hits {
			if len(h) > 0 {
				scan.Holders[devs[i]] = append(scan.Holders[devs[i]], h...)
			}
		}
	}
	slices.Sort(scan.Shielded)
	for d, hs := range scan.Holders {
		slices.SortFunc(hs, func(a, b Holding) int { return a.PID - b.PID })
		scan.Holders[d] = hs
	}
	return scan, nil
}

// HoldingOf reads the fd table of one process and returns its hold on dev;
// ok is false when it holds no descriptor of dev. The error wraps
// ErrNotExist when the process is gone, and ErrDenied when its table may
// not be read for lack of privilege, ErrShielded when a security policy
// shields it.
func (fs FS) HoldingOf(pid int, dev Device) (h Holding, ok bool, err error) {
	hs, err := fs.HoldingsOf(pid, []Device{dev})
	if err != nil || len(hs[0].FDs) == 0 {
		return Holding{}, false, err
	}
	return hs[0], true, nil
}

// HoldingsOf is HoldingOf for several devices, from one read of the fd
// table: its holds indexed like devs, with no FDs where it holds none.
func (fs FS) HoldingsOf(pid int, devs []Device) ([]Holding, error) {
	rootfd, err := unix.Open(fs.root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", fs.root, err)
	}
	defer unix.Close(rootfd)
	var s scanner
	s.init(rootfd, devs)
	switch s.scanPID(pid) {
	case tableGone:
		return nil, fmt.Errorf("%s/%d/fd: %w", fs.root, pid, ErrNotExist)
	case tableDenied:
		if fs.mayPtrace {
			return nil, fmt.Errorf("%s/%d/fd: %w", fs.root, pid, ErrShielded)
		}
		return nil, fmt.Errorf("%s/%d/fd: %w", fs.root, pid, ErrDenied)
	}
	out := make([]Holding, len(devs))
	for i, hits := range s.hits {
		if len(hits) > 0 {
			out[i] = hits[0]
		}
	}
	return out, nil
}

// scanner is one worker's state: buffers reused across PIDs, and hits
// indexed like the devices asked for.
type scanner struct {
	rootfd   int
	devs     []Device
	dirbuf   []byte
	hits     [][]Holding
	files    [][]FileID // this process's files per device, while it is read
	fds      [][]int    // and its descriptors of each device
	scanned  int
	denied   int
	shielded []int
}

func (s *scanner) init(rootfd int, devs []Device) {
	s.rootfd = rootfd
	s.devs = devs
	s.dirbuf = make([]byte, direntBufSize)
	s.hits = make([][]Holding, len(devs))
	s.files = make([][]FileID, len(devs))
	s.fds = make([][]int, len(devs))
}

// What reading one fd table gave.
type tableResult int

const (
	tableRead   tableResult = iota
	tableEmpty              // read, and it lists no descriptor
	tableDenied             // EACCES or EPERM
	tableGone               // exited, or no such process
)

// scanPID reads the fd table of pid. A process whose main thread has
// exited shows an empty table under its PID; its other threads share the
// real one, so it is read through one of them.
func (s *scanner) scanPID(pid int) tableResult {
	for i := range s.files {
		s.files[i] = s.files[i][:0]
		s.fds[i] = s.fds[i][:0]
	}
	dir := strconv.Itoa(pid)
	via := pid
	res := s.scanTable(dir + "/fd")
	if res == tableEmpty {
		if tid := s.otherThread(pid); tid > 0 {
			via = tid
			res = s.scanTable(dir + "/task/" + strconv.Itoa(tid) + "/fd")
		}
	}
	if res == tableEmpty {
		res = tableRead
	}
	if res != tableRead {
		return res
	}
	for i, files := range s.files {
		if len(files) > 0 {
			s.hits[i] = append(s.hits[i], Holding{PID: pid, Via: via, Files: slices.Clone(files), FDs: slices.Clone(s.fds[i])})
		}
	}
	return tableRead
}

// scanTable statx'es every descriptor of the fd directory dir (relative to
// the procfs root) and records those that are one of the devices.
func (s *scanner) scanTable(dir string) tableResult {
	// Opening the fd directory once and reading each link relative to it
	// spares the kernel a walk of /proc/PID/fd/N per descriptor.
	dirfd, err := unix.Openat(s.rootfd, dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	switch {
	case err == unix.EACCES || err == unix.EPERM:
		return tableDenied
	case err != nil:
		return tableGone
	}
	defer unix.Close(dirfd)
	res := tableEmpty
	var st unix.Statx_t
	for res != tableDenied {
		n, err := unix.Getdents(dirfd, s.dirbuf)
		if err == unix.EINTR {
			continue
		}
		if err != nil || n <= 0 {
			break
		}
		eachDirent(s.dirbuf[:n], func(name []byte) {
			if res == tableDenied {
				return
			}
			fd, ok := atoi(name)
			if !ok {
				return
			}
			res = tableRead
			errno := statxAt(dirfd, name, &st)
			if errno == unix.EACCES || errno == unix.EPERM {
				// Listing the table is allowed, following a link needs
				// ptrace access: all links of this process will fail.
				res = tableDenied
				return
			}
			if errno != 0 {
				return // closed meanwhile
			}
			for i, d := range s.devs {
				if d.matches(&st) {
					s.fds[i] = append(s.fds[i], fd)
					id := FileID{Dev: unix.Mkdev(st.Dev_major, st.Dev_minor), Ino: st.Ino}
					if !slices.Contains(s.files[i], id) {
						s.files[i] = append(s.files[i], id)
					}
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
	return res
}

// otherThread returns a thread of pid other than its main thread, or 0.
// Kernel threads and single-threaded processes have none.
func (s *scanner) otherThread(pid int) int {
	dirfd, err := unix.Openat(s.rootfd, strconv.Itoa(pid)+"/task", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0
	}
	defer unix.Close(dirfd)
	n, err := unix.Getdents(dirfd, s.dirbuf)
	if err != nil || n <= 0 {
		return 0
	}
	tid := 0
	eachDirent(s.dirbuf[:n], func(name []byte) {
		if t, ok := atoi(name); ok && t != pid && tid == 0 {
			tid = t
		}
	})
	return tid
}

// maxFdDirent bounds a linux_dirent64 record naming a descriptor: 19 bytes
// of header, up to 10 digits and a NUL, padded to 8 bytes.
const maxFdDirent = 32

// statxAt is statx(dirfd, name) following the link, without unix.Statx's
// two allocations per call (string(name), then a NUL-terminated copy):
// name is a dirent name, which the kernel NUL-terminates in the buffer, so
// it is passed in place. That spares ~100,000 allocations per scan of
// ~50,000 descriptors. AT_STATX_DONT_SYNC takes what the kernel has
// cached, so a descriptor on a hung network file system cannot stall the
// scan; device numbers and inode numbers never need a round trip.
func statxAt(dirfd int, name []byte, st *unix.Statx_t) unix.Errno {
	// eachDirent cut name before its NUL; check that it is still there.
	if len(name) == 0 || len(name) >= cap(name) || name[:len(name)+1][len(name)] != 0 {
		return unix.EINVAL
	}
	p := unsafe.Pointer(unsafe.SliceData(name))
	_, _, errno := unix.Syscall6(unix.SYS_STATX, uintptr(dirfd), uintptr(p),
		uintptr(unix.AT_STATX_DONT_SYNC), uintptr(unix.STATX_TYPE|unix.STATX_INO), uintptr(unsafe.Pointer(st)), 0)
	return errno
}
