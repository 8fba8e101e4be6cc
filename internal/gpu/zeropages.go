package gpu

import (
	"bytes"
	"debug/elf"
	"fmt"
	"os"
	"strings"

	"github.com/prometheus/procfs"
	"golang.org/x/sys/unix"
)

// libnvidia-ml's zero-initialised data (its BSS) is 13.2 MiB, and nvmlInit
// writes all of it: every page resident, while 99.8% of them still hold
// zeros, and NVML's reads never touch them again (measured on the H200,
// driver 580: 28 KiB resident after 200 reads; docs/benchmarks.md). A page
// of zeros handed back with MADV_DONTNEED reads as zeros again, so NVML
// sees the same memory; the process holds 13 MiB less.
//
// The one hazard is a write between reading a page and handing it back.
// No goroutine calls NVML yet (OpenNVML has not returned the library), but
// nvmlInit starts a thread of libcuda's own. So the BSS is read-only while
// its pages are checked and handed back: a write then faults and the
// process dies at start-up, loudly, instead of losing what was written.

// ZeroPages says what ReleaseZeroPages found and gave back.
type ZeroPages struct {
	Library    string // the library's path
	Bytes      uint64 // its BSS as mapped
	Released   uint64 // the pages that held zeros, handed back
	Unreleased uint64 // pages that held data
}

// ReleaseZeroPages hands back the pages of zeros in the BSS of the loaded
// library whose file name starts with prefix.
func ReleaseZeroPages(prefix string) (ZeroPages, error) {
	self, err := procfs.Self()
	if err != nil {
		return ZeroPages{}, err
	}
	maps, err := self.ProcMaps()
	if err != nil {
		return ZeroPages{}, err
	}
	bss, err := findBSS(maps, prefix)
	if err != nil {
		return ZeroPages{}, err
	}
	return releaseZeroPages(bss)
}

// bssRange is a library's BSS beyond its last file-backed page: the
// anonymous mapping that the dynamic loader made for it.
type bssRange struct {
	library    string
	start, end uintptr
}

// findBSS locates the BSS of the library whose file name starts with
// prefix from its ELF program headers and the process's mappings. It
// refuses anything but a private, read-write, anonymous mapping that holds
// the whole range.
func findBSS(maps []*procfs.ProcMap, prefix string) (bssRange, error) {
	var first *procfs.ProcMap
	for _, m := range maps {
		name := m.Pathname[strings.LastIndexByte(m.Pathname, '/')+1:]
		if strings.HasPrefix(name, prefix) && m.Offset == 0 && (first == nil || m.StartAddr < first.StartAddr) {
			first = m
		}
	}
	if first == nil {
		return bssRange{}, fmt.Errorf("%s is not loaded", prefix)
	}
	f, err := elf.Open(first.Pathname)
	if err != nil {
		return bssRange{}, err
	}
	defer f.Close()
	var loads []*elf.Prog
	for _, p := range f.Progs {
		if p.Type == elf.PT_LOAD {
			loads = append(loads, p)
		}
	}
	if len(loads) == 0 {
		return bssRange{}, fmt.Errorf("%s has no LOAD segment", first.Pathname)
	}
	page := uint64(os.Getpagesize())
	down := func(x uint64) uint64 { return x &^ (page - 1) }
	up := func(x uint64) uint64 { return down(x + page - 1) }
	// The loader maps the first LOAD segment's page at the library's
	// lowest address.
	bias := uint64(first.StartAddr) - down(loads[0].Vaddr)
	var r bssRange
	for _, p := range loads {
		if p.Flags&elf.PF_W != 0 && p.Memsz > p.Filesz {
			r = bssRange{library: first.Pathname,
				start: uintptr(up(bias + p.Vaddr + p.Filesz)), end: uintptr(up(bias + p.Vaddr + p.Memsz))}
		}
	}
	if r.end <= r.start {
		return bssRange{}, fmt.Errorf("%s has no BSS beyond its file's pages", first.Pathname)
	}
	for _, m := range maps {
		if m.StartAddr <= r.start && r.end <= m.EndAddr {
			if m.Pathname != "" || m.Perms == nil || !m.Perms.Read || !m.Perms.Write || m.Perms.Execute || !m.Perms.Private {
				return bssRange{}, fmt.Errorf("%s's BSS %#x-%#x lies in a mapping %q %+v, not private anonymous read-write memory",
					first.Pathname, r.start, r.end, m.Pathname, m.Perms)
			}
			return r, nil
		}
	}
	return bssRange{}, fmt.Errorf("%s's BSS %#x-%#x is not one mapping", first.Pathname, r.start, r.end)
}

// releaseZeroPages makes r read-only, hands back each page that holds only
// zeros, and makes r read-write again.
func releaseZeroPages(r bssRange) (z ZeroPages, err error) {
	z = ZeroPages{Library: r.library, Bytes: uint64(r.end - r.start)}
	if err := mprotect(r.start, r.end-r.start, unix.PROT_READ); err != nil {
		return z, fmt.Errorf("mprotect read-only: %w", err)
	}
	defer func() {
		if perr := mprotect(r.start, r.end-r.start, unix.PROT_READ|unix.PROT_WRITE); perr != nil {
			// Left read-only, the library's next write would kill the
			// process somewhere less clear than here.
			panic(fmt.Sprintf("cannot make %s's BSS writable again: %v", r.library, perr))
		}
	}()
	mem, err := os.Open("/proc/self/mem")
	if err != nil {
		return z, err
	}
	defer mem.Close()
	page := uintptr(os.Getpagesize())
	buf, zero := make([]byte, 64*page), make([]byte, page)
	for at := r.start; at < r.end; {
		n := min(uintptr(len(buf)), r.end-at)
		if _, err := mem.ReadAt(buf[:n], int64(at)); err != nil {
			return z, fmt.Errorf("reading %#x: %w", at, err)
		}
		for off := uintptr(0); off < n; off += page {
			if !bytes.Equal(buf[off:off+page], zero) {
				z.Unreleased += uint64(page)
				continue
			}
			if testHookBeforeRelease != nil {
				testHookBeforeRelease(at + off)
			}
			if err := madviseDontNeed(at+off, page); err != nil {
				return z, fmt.Errorf("madvise %#x: %w", at+off, err)
			}
			z.Released += uint64(page)
		}
		at += n
	}
	return z, nil
}

// testHookBeforeRelease, when set, runs between finding a page of zeros
// and handing it back.
var testHookBeforeRelease func(addr uintptr)

// mprotect and madviseDontNeed take addresses that Go did not allocate,
// hence the raw system calls rather than x/sys/unix's []byte forms.
func mprotect(addr, length uintptr, prot int) error {
	if _, _, errno := unix.Syscall(unix.SYS_MPROTECT, addr, length, uintptr(prot)); errno != 0 {
		return errno
	}
	return nil
}

func madviseDontNeed(addr, length uintptr) error {
	if _, _, errno := unix.Syscall(unix.SYS_MADVISE, addr, length, unix.MADV_DONTNEED); errno != 0 {
		return errno
	}
	return nil
}
