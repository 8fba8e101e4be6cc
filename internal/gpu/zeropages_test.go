package gpu

import (
	"os"
	"runtime/debug"
	"strings"
	"testing"
	"unsafe"

	"github.com/prometheus/procfs"
	"golang.org/x/sys/unix"
)

// anonPages maps n private anonymous read-write pages, all resident.
func anonPages(t *testing.T, n int) ([]byte, bssRange) {
	t.Helper()
	page := os.Getpagesize()
	b, err := unix.Mmap(-1, 0, n*page, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := unix.Munmap(b); err != nil {
			t.Error(err)
		}
	})
	for i := 0; i < len(b); i += page {
		b[i] = 1 // a write fault makes the page resident; then zeros again
		b[i] = 0
	}
	start := uintptr(unsafe.Pointer(&b[0]))
	return b, bssRange{library: "test", start: start, end: start + uintptr(len(b))}
}

func resident(t *testing.T, b []byte) int {
	t.Helper()
	vec := make([]byte, (len(b)+os.Getpagesize()-1)/os.Getpagesize())
	if _, _, errno := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)),
		uintptr(unsafe.Pointer(&vec[0]))); errno != 0 {
		t.Fatal(errno)
	}
	n := 0
	for _, v := range vec {
		n += int(v & 1)
	}
	return n
}

// TestReleaseZeroPages: the pages of zeros go, the pages with data stay
// with their data, and the memory is writable again.
func TestReleaseZeroPages(t *testing.T) {
	page := os.Getpagesize()
	b, r := anonPages(t, 64)
	data := map[int]byte{3: 0x11, 10: 0x22, 63: 0x33}
	for p, v := range data {
		b[p*page+page-1] = v // the last byte: a page is zeros only if all of it is
	}
	if got := resident(t, b); got != 64 {
		t.Fatalf("%d pages resident before, want 64", got)
	}
	z, err := releaseZeroPages(r)
	if err != nil {
		t.Fatal(err)
	}
	if z.Released != uint64(61*page) || z.Unreleased != uint64(3*page) || z.Bytes != uint64(64*page) {
		t.Errorf("released %d, kept %d of %d bytes; want 61, 3 and 64 pages", z.Released, z.Unreleased, z.Bytes)
	}
	if got := resident(t, b); got != 3 {
		t.Errorf("%d pages resident after, want the 3 with data", got)
	}
	for i, c := range b {
		if want := data[i/page]; i%page == page-1 && c != want || i%page != page-1 && c != 0 {
			t.Fatalf("byte %d = %#x after the release, want %#x", i, c, want)
		}
	}
	b[5*page] = 0x44 // writable again: a fault here fails the test
	if b[5*page] != 0x44 {
		t.Error("a released page lost a write")
	}
}

// TestReleaseZeroPagesReadOnlyMeanwhile: a write between finding a page of
// zeros and handing it back would be lost; the memory is read-only then,
// so the write faults (the process dies, in a daemon), and the memory is
// writable again afterwards.
func TestReleaseZeroPagesReadOnlyMeanwhile(t *testing.T) {
	page := os.Getpagesize()
	b, r := anonPages(t, 8)
	target := r.start + uintptr(5*page)
	testHookBeforeRelease = func(addr uintptr) {
		if addr == target {
			b[5*page] = 0x55 // the driver's thread, writing just then
		}
	}
	defer func() { testHookBeforeRelease = nil }()
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	faulted := func() (faulted bool) {
		defer func() { faulted = recover() != nil }()
		_, _ = releaseZeroPages(r)
		return false
	}()
	if !faulted {
		t.Fatalf("a write while pages are checked and handed back did not fault (the page reads %#x: the write is lost)", b[5*page])
	}
	b[5*page] = 0x66 // writable again after the fault
	if b[5*page] != 0x66 {
		t.Error("the memory lost a write after the release")
	}
}

// TestFindBSS locates libc's BSS (this test binary links libc, as every
// binary with go-nvml does) and refuses a range that is not anonymous.
func TestFindBSS(t *testing.T) {
	self, err := procfs.Self()
	if err != nil {
		t.Fatal(err)
	}
	maps, err := self.ProcMaps()
	if err != nil {
		t.Fatal(err)
	}
	r, err := findBSS(maps, "libc.so")
	if err != nil {
		t.Fatal(err)
	}
	page := uintptr(os.Getpagesize())
	if r.start%page != 0 || r.end%page != 0 || r.end <= r.start || !strings.Contains(r.library, "libc.so") {
		t.Fatalf("libc's BSS = %+v", r)
	}
	if _, err := findBSS(maps, "libnothing.so"); err == nil {
		t.Error("found the BSS of a library that is not loaded")
	}
	// The same library, its BSS inside a file's mapping: refused.
	var fake []*procfs.ProcMap
	for _, m := range maps {
		c := *m
		if c.StartAddr <= r.start && r.end <= c.EndAddr {
			c.Pathname = "/usr/lib/other.so"
		}
		fake = append(fake, &c)
	}
	if _, err := findBSS(fake, "libc.so"); err == nil || !strings.Contains(err.Error(), "not private anonymous") {
		t.Errorf("findBSS in a file's mapping: err = %v", err)
	}
}
