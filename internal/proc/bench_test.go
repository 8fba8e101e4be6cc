package proc

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"
)

// The benchmark load: like FACTS.md's measurement machine, ~2,000 processes
// holding ~48,000 descriptors, a few of them holding the target.
const (
	benchProcs     = 2000
	benchExtraFDs  = 21 // + stdin, stdout, stderr = 24 per process
	benchHoldEvery = 100
)

var bench struct {
	once    sync.Once
	err     error
	dir     string
	target  string
	cmds    []*exec.Cmd
	holders []int // PIDs started holding target
}

// TestMain kills the benchmark's processes, which outlive any one benchmark.
func TestMain(m *testing.M) {
	code := m.Run()
	teardownBench()
	os.Exit(code)
}

func setupBench(b *testing.B) {
	b.Helper()
	bench.once.Do(func() { bench.err = startBenchProcs() })
	if bench.err != nil {
		b.Fatal(bench.err)
	}
}

func startBenchProcs() error {
	dir, err := os.MkdirTemp("", "proc-bench-")
	if err != nil {
		return err
	}
	bench.dir = dir
	bench.target = filepath.Join(dir, "target")
	target, err := os.Create(bench.target)
	if err != nil {
		return err
	}
	defer target.Close()

	// Our own descriptors are shared by all children (dup'd at fork), so
	// ~25 here make ~48,000 there. A pipe and a socket give the links that
	// are not paths.
	var extra []*os.File
	for i := range benchExtraFDs - 3 {
		f, err := os.Create(filepath.Join(dir, "file"+strconv.Itoa(i)))
		if err != nil {
			return err
		}
		defer f.Close()
		extra = append(extra, f)
	}
	pr, pw, err := os.Pipe()
	if err != nil {
		return err
	}
	defer pr.Close()
	defer pw.Close()
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	sock := os.NewFile(uintptr(fds[0]), "socket")
	defer sock.Close()
	syscall.Close(fds[1])
	extra = append(extra, pr, sock)

	for i := range benchProcs {
		files := append(slices.Clip(extra), extra[0])
		if i%benchHoldEvery == 0 {
			files[len(files)-1] = target
		}
		cmd := exec.Command("sleep", "3600")
		cmd.ExtraFiles = files
		// Die with the test binary, whatever kills it.
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		if err := cmd.Start(); err != nil {
			return fmt.Errorf("start sleep %d: %w", i, err)
		}
		bench.cmds = append(bench.cmds, cmd)
		if i%benchHoldEvery == 0 {
			bench.holders = append(bench.holders, cmd.Process.Pid)
		}
	}
	return nil
}

func teardownBench() {
	for _, c := range bench.cmds {
		_ = c.Process.Kill()
	}
	for _, c := range bench.cmds {
		_ = c.Wait()
	}
	if bench.dir != "" {
		_ = os.RemoveAll(bench.dir)
	}
}

func BenchmarkHolders(b *testing.B) {
	setupBench(b)
	fs, err := NewFS("/proc")
	if err != nil {
		b.Fatal(err)
	}
	// Closed after startBenchProcs: only the children hold target.
	want := slices.Sorted(slices.Values(bench.holders))
	b.ResetTimer()
	cpu0 := cpuTime(syscall.RUSAGE_SELF)
	for b.Loop() {
		got, err := fs.Holders([]string{bench.target})
		if err != nil {
			b.Fatal(err)
		}
		if !slices.Equal(got[bench.target], want) {
			b.Fatalf("holders = %v, want %v", got[bench.target], want)
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
	want := slices.Sorted(slices.Values(bench.holders))
	b.ResetTimer()
	var cpu time.Duration
	for b.Loop() {
		cmd := exec.Command(fuser, bench.target)
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
