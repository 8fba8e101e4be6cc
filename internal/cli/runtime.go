package cli

import (
	"errors"
	"runtime"
	"strconv"

	"github.com/gpu-orphan/gpu-orphan/internal/proc"
)

// DefaultMaxProcs bounds a daemon's GOMAXPROCS unless told otherwise. Each
// of Go's Ps keeps its own cache of heap spans, so an idle daemon's memory
// grows with the CPUs it may use: on the simulated node the node agent
// holds about 10 MiB more with 224 Ps (a dual-socket GPU server's hardware
// threads) than with 2 (docs/benchmarks.md). The /proc scan, the one
// parallel part, uses at most proc.MaxScanWorkers workers, so more Ps buy
// nothing.
const DefaultMaxProcs = proc.MaxScanWorkers

// Runtime holds the --runtime.gomaxprocs flag.
type Runtime struct {
	// MaxProcs is the most Ps; 0 keeps Go's choice.
	MaxProcs int
}

// AddRuntimeFlags registers --runtime.gomaxprocs (named as node_exporter
// names it, and read from GOMAXPROCS when that is set).
func AddRuntimeFlags(a flagger) *Runtime {
	r := &Runtime{}
	f := a.Flag("runtime.gomaxprocs", "The most CPUs that run this daemon's Go code at once (GOMAXPROCS), never more than Go's own choice (the CPUs the process may use, from its affinity and cgroup quota); 0 for Go's choice. Each costs memory while idle; the /proc scan uses at most "+strconv.Itoa(proc.MaxScanWorkers)+" workers.").
		Envar("GOMAXPROCS").Default(strconv.Itoa(DefaultMaxProcs))
	setValue(f, &r.MaxProcs, func(s string) (int, error) {
		n, err := strconv.Atoi(s)
		if err != nil || n < 0 {
			return 0, errors.New("want a whole number, 0 or more")
		}
		return n, nil
	}, strconv.Itoa)
	return r
}

// Apply sets GOMAXPROCS and returns it. It leaves Go's choice alone when
// the flag does not lower it, so that Go keeps following a changed cgroup
// quota.
func (r *Runtime) Apply() int {
	goChoice := runtime.GOMAXPROCS(0)
	n := maxProcs(r.MaxProcs, goChoice)
	if n != goChoice {
		runtime.GOMAXPROCS(n)
	}
	return n
}

// maxProcs is the flag's value, bounded by Go's choice; 0 is Go's choice.
func maxProcs(flag, goChoice int) int {
	if flag <= 0 || flag >= goChoice {
		return goChoice
	}
	return flag
}
