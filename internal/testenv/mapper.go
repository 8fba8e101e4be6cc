package testenv

import (
	"os"
	"syscall"
	"time"
)

// MapperEnv, set to "1" in a test binary's environment, makes it a
// CUDA-like holder (see RunMapperIfAsked).
const MapperEnv = "GPU_ORPHAN_TEST_MAPPER"

// RunMapperIfAsked turns the test binary into a stand-in for a process with
// a CUDA context when MapperEnv is set: it maps the device node it got as
// fd 3, as a context maps its GPU's, and sleeps. Call it first in TestMain.
func RunMapperIfAsked() {
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
