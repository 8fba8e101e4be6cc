package testenv

import (
	"os"
	"os/exec"
	"slices"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// MapperEnv, set to "1" in a test binary's environment, makes it a
// CUDA-like holder (see RunMapperIfAsked).
const MapperEnv = "GPU_ORPHAN_TEST_MAPPER"

// RunMapperIfAsked turns the test binary into a stand-in for a process with
// a CUDA context when MapperEnv is set: it maps the device node it got as
// fd 3, as a context maps its GPU's, and sleeps. Call it first in TestMain.
func RunMapperIfAsked() {
	runSubreaperIfAsked()
	runCloneParentIfAsked()
	runPreforkIfAsked()
	if os.Getenv(MapperEnv) != "1" {
		return
	}
	if _, err := syscall.Mmap(3, 0, 4096, syscall.PROT_READ, syscall.MAP_SHARED); err != nil {
		os.Exit(3)
	}
	time.Sleep(300 * time.Second)
	os.Exit(0)
}

// MapperEnviron is the environment of a child that RunMapperIfAsked turns
// into a mapper.
func MapperEnviron() []string { return append(os.Environ(), MapperEnv+"=1") }

// SubreaperEnv, set to a bash script in a test binary's environment, makes
// it a subreaper (PR_SET_CHILD_SUBREAPER, as tini, systemd --user or a
// container's init are) that runs the script with bash: the attribute
// stays across exec, so orphans of the script's jobs are reparented to it.
const SubreaperEnv = "GPU_ORPHAN_TEST_SUBREAPER"

func runSubreaperIfAsked() {
	script := os.Getenv(SubreaperEnv)
	if script == "" {
		return
	}
	if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
		os.Exit(4)
	}
	bash, err := exec.LookPath("bash")
	if err != nil {
		os.Exit(5)
	}
	env := slices.DeleteFunc(os.Environ(), func(e string) bool { return strings.HasPrefix(e, SubreaperEnv+"=") })
	_ = syscall.Exec(bash, []string{"bash", "-c", script}, env)
	os.Exit(6)
}
