package proc

import (
	"github.com/gpu-orphan/gpu-orphan/internal/testenv"

	"bytes"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"
)

// The benchmark load: like docs/facts.md's measurement machine, ~2,000 processes
// holding ~48,000 descriptors, a few of them holding the target.
const (
	benchProcs     = 2000
	benchExtraFDs  = 21 // + stdin, stdout, stderr = 24 per process
	benchHoldEvery = 100
)

var bench struct {
	once sync.Once
	err  error
	*testenv.Crowd
}

// TestMain kills the benchmark's processes, which outlive any one benchmark.
func TestMain(m *testing.M) {
	code := m.Run()
	if bench.Crowd != nil {
		bench.Stop()
	}
	os.Exit(code)
}

func setupBench(b *testing.B) {
	b.Helper()
	bench.once.Do(func() {
		bench.Crowd, bench.err = testenv.StartCrowd(benchProcs, benchExtraFDs+3, benchHoldEvery)
	})
	if bench.err != nil {
		b.Fatal(bench.err)
	}
}

func BenchmarkHolders(b *testing.B) {
	setupBench(b)
	fs, err := NewFS("/proc")
	if err != nil {
		b.Fatal(err)
	}
	// Closed after startBenchProcs: only the children hold target.
	want := slices.Sorted(slices.Values(bench.Holders))
	dev, err := StatDevice(bench.Target)
	if err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	cpu0 := cpuTime(syscall.RUSAGE_SELF)
	for b.Loop() {
		scan, err := fs.ScanHolders([]Device{dev})
		if err != nil {
			b.Fatal(err)
		}
		if got := holdingPIDs(scan.Holders[dev]); !slices.Equal(got, want) {
			b.Fatalf("holders = %v, want %v", got, want)
		}
	}
	reportCPU(b, cpuTime(syscall.RUSAGE_SELF)-cpu0)
}

// BenchmarkFuser is the baseline: psmisc's fuser, as runbooks use it.
func BenchmarkFuser(b *testing.B) {
	fuser, err := exec.LookPath("/usr/bin/fuser")
	if err != nil {
		b.Skip("fuser not installed")
	}
	setupBench(b)
	want := slices.Sorted(slices.Values(bench.Holders))
	b.ResetTimer()
	var cpu time.Duration
	for b.Loop() {
		cmd := exec.Command(fuser, bench.Target)
		out, err := cmd.Output()
		if err != nil {
			b.Fatalf("fuser: %v", err)
		}
		cpu += cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()
		var got []int
		for f := range bytes.FieldsSeq(out) {
			pid, err := strconv.Atoi(string(f))
			if err != nil {
				b.Fatalf("fuser output %q: %v", out, err)
			}
			got = append(got, pid)
		}
		slices.Sort(got)
		if !slices.Equal(got, want) {
			b.Fatalf("fuser = %v, want %v", got, want)
		}
	}
	reportCPU(b, cpu)
}

// reportCPU adds CPU time (user + system) per op: on a shared machine wall
// time measures the neighbours' load as much as the code.
func reportCPU(b *testing.B, cpu time.Duration) {
	b.ReportMetric(float64(cpu.Nanoseconds())/float64(b.N), "cpu-ns/op")
}

func cpuTime(who int) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(who, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func BenchmarkProcess(b *testing.B) {
	fs, err := NewFS("/proc")
	if err != nil {
		b.Fatal(err)
	}
	pid := os.Getpid()
	for b.Loop() {
		if _, err := fs.Process(pid); err != nil {
			b.Fatal(err)
		}
	}
}
