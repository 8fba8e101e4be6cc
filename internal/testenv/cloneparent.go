package testenv

import (
	"fmt"
	"os"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// CloneParentEnv, set to a device node's path in a test binary's
// environment, makes it a program with a context of its own that clones a
// helper with CLONE_PARENT (see runCloneParentIfAsked): the kernel's fork
// event then names the program's parent as the helper's, although the
// helper holds the program's files, not the parent's.
const CloneParentEnv = "GPU_ORPHAN_TEST_CLONE_PARENT"

// runCloneParentIfAsked opens and maps the device node itself, as a
// process creating its own context does, clones a child with CLONE_PARENT
// (which shares that file and mapping, and names this process's parent as
// its own), prints "clone PID CHILD" and sleeps.
func runCloneParentIfAsked() {
	path := os.Getenv(CloneParentEnv)
	if path == "" {
		return
	}
	fd, err := unix.Open(path, unix.O_RDONLY, 0)
	if err != nil {
		os.Exit(7)
	}
	if _, err := unix.Mmap(fd, 0, 4096, unix.PROT_READ, unix.MAP_SHARED); err != nil {
		os.Exit(8)
	}
	child, errno := cloneParentAndPause()
	if errno != 0 {
		os.Exit(9)
	}
	fmt.Printf("clone %d %d\n", os.Getpid(), child)
	time.Sleep(300 * time.Second)
	os.Exit(0)
}

// cloneParentAndPause clones this process with CLONE_PARENT. The child
// runs no Go code that could need the runtime (it has one thread and the
// runtime's state of many): it waits in ppoll until killed.
//
//go:nosplit
//go:norace
func cloneParentAndPause() (uintptr, syscall.Errno) {
	pid, _, errno := syscall.RawSyscall6(unix.SYS_CLONE, unix.CLONE_PARENT|uintptr(unix.SIGCHLD), 0, 0, 0, 0, 0)
	if errno != 0 || pid != 0 {
		return pid, errno
	}
	for {
		_, _, _ = syscall.RawSyscall6(unix.SYS_PPOLL, 0, 0, 0, 0, 0, 0)
	}
}

// PreforkEnv, set to a device node's path in a test binary's environment,
// makes it a trainer that forks a worker before it opens the GPU (see
// runPreforkIfAsked): the worker opens and maps the GPU itself and forks a
// child of its own, none of them running exec.
const PreforkEnv = "GPU_ORPHAN_TEST_PREFORK"

// runPreforkIfAsked forks the worker, which opens and maps the device node
// and forks its child (both then wait until killed); then it opens and
// maps the device itself, prints "prefork WORKER CHILD" and sleeps.
func runPreforkIfAsked() {
	path := os.Getenv(PreforkEnv)
	if path == "" {
		return
	}
	cpath, err := unix.BytePtrFromString(path)
	if err != nil {
		os.Exit(7)
	}
	var pipe [2]int
	if err := unix.Pipe2(pipe[:], unix.O_CLOEXEC); err != nil {
		os.Exit(8)
	}
	worker, errno := forkHolder(cpath, pipe[1])
	if errno != 0 {
		os.Exit(9)
	}
	var child [8]byte
	if n, err := unix.Read(pipe[0], child[:]); err != nil || n != len(child) {
		os.Exit(10)
	}
	fd, err := unix.Open(path, unix.O_RDONLY, 0)
	if err != nil {
		os.Exit(11)
	}
	if _, err := unix.Mmap(fd, 0, 4096, unix.PROT_READ, unix.MAP_SHARED); err != nil {
		os.Exit(12)
	}
	fmt.Printf("prefork %d %d\n", worker, *(*int64)(unsafe.Pointer(&child)))
	time.Sleep(300 * time.Second)
	os.Exit(0)
}

// forkHolder forks the worker of runPreforkIfAsked. The worker runs no Go
// code that could need the runtime, only system calls: it opens and maps
// path, forks its child, writes the child's PID to report and waits in
// ppoll, as its child does.
//
//go:nosplit
//go:norace
func forkHolder(path *byte, report int) (uintptr, syscall.Errno) {
	pid, _, errno := syscall.RawSyscall6(unix.SYS_CLONE, uintptr(unix.SIGCHLD), 0, 0, 0, 0, 0)
	if errno != 0 || pid != 0 {
		return pid, errno
	}
	atFDCWD := ^uintptr(99) // AT_FDCWD, -100
	fd, _, errno := syscall.RawSyscall6(unix.SYS_OPENAT, atFDCWD, uintptr(unsafe.Pointer(path)), unix.O_RDONLY, 0, 0, 0)
	if errno == 0 {
		_, _, _ = syscall.RawSyscall6(unix.SYS_MMAP, 0, 4096, unix.PROT_READ, unix.MAP_SHARED, fd, 0)
	}
	child, _, errno := syscall.RawSyscall6(unix.SYS_CLONE, uintptr(unix.SIGCHLD), 0, 0, 0, 0, 0)
	if errno == 0 && child != 0 {
		pid := int64(child)
		_, _, _ = syscall.RawSyscall6(unix.SYS_WRITE, uintptr(report), uintptr(unsafe.Pointer(&pid)), 8, 0, 0, 0)
	}
	for {
		_, _, _ = syscall.RawSyscall6(unix.SYS_PPOLL, 0, 0, 0, 0, 0, 0)
	}
}
