// Package slowness measures how many times slower than when idle this
// machine runs now, so that a wait for a process (a stage of the stack, a
// test's condition) stretches its timeout by it instead of hoping that the
// machine is idle: on 2 CPUs under a load of 7 (a `make test` beside
// another), a daemon takes 3 to 4 times as long to start and answer.
package slowness

import (
	"os"
	"runtime"
	"strconv"
	"strings"
	"time"
)

// Env sets the factor instead of the load: for a machine whose load
// average is someone else's (a container's host), or to try a slow one.
const Env = "GPU_ORPHAN_SLOWNESS"

// Max bounds the factor: a wait for what never comes must still end.
const Max = 10

// Factor is how many times slower than idle the machine runs now, from 1
// to Max: the runnable tasks per CPU, from the load average of the last
// minute (/proc/loadavg) and the CPUs this process may run on; Env sets
// it instead.
func Factor() float64 {
	if v, err := strconv.ParseFloat(os.Getenv(Env), 64); err == nil && v > 0 {
		return min(v, Max)
	}
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return 1
	}
	return fromLoad(string(b), runtime.NumCPU())
}

// fromLoad is Factor for the content of /proc/loadavg and cpus CPUs.
func fromLoad(loadavg string, cpus int) float64 {
	f := strings.Fields(loadavg)
	if len(f) == 0 || cpus < 1 {
		return 1
	}
	load, err := strconv.ParseFloat(f[0], 64)
	if err != nil {
		return 1
	}
	return min(max(load/float64(cpus), 1), Max)
}

// Scale is d stretched by factor.
func Scale(d time.Duration, factor float64) time.Duration {
	return time.Duration(float64(d) * factor)
}
