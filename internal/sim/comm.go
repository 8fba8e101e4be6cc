package sim

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
)

// MaxCommLen is the most bytes of a process name that the kernel keeps
// (TASK_COMM_LEN 16, less the NUL).
const MaxCommLen = 15

// MPSComm is what /proc/PID/comm shows for both nvidia-cuda-mps-control and
// nvidia-cuda-mps-server: their names cut to MaxCommLen bytes.
const MPSComm = "nvidia-cuda-mps"

// checkComm rejects a name the kernel would change: cut, or ended at a NUL.
func checkComm(name string) error {
	switch {
	case name == "":
		return errors.New("sim: empty process name")
	case len(name) > MaxCommLen:
		return fmt.Errorf("sim: process name %q is %d bytes; the kernel keeps %d", name, len(name), MaxCommLen)
	case strings.IndexByte(name, 0) >= 0:
		return fmt.Errorf("sim: process name %q holds a NUL", name)
	}
	return nil
}

// setComm renames this process as prctl(PR_SET_NAME) does in a worker that
// names itself: /proc/PID/comm changes, /proc/PID/exe does not.
// PR_SET_NAME names the calling thread only, and /proc/PID/comm is the main
// thread's, so it must be called on the main thread (gpu-orphan-sim keeps
// its main goroutine there for the commands that rename themselves).
func setComm(name string) error {
	if err := checkComm(name); err != nil {
		return err
	}
	if tid, pid := unix.Gettid(), os.Getpid(); tid != pid {
		return fmt.Errorf("sim: renaming the process from thread %d, not its main thread %d", tid, pid)
	}
	b := append([]byte(name), 0)
	if err := unix.Prctl(unix.PR_SET_NAME, uintptr(unsafe.Pointer(&b[0])), 0, 0, 0); err != nil {
		return fmt.Errorf("sim: prctl(PR_SET_NAME): %w", err)
	}
	return nil
}
