package snapshot

import (
	"context"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

// BenchmarkHealthySnapshot is what the proof rules cost a healthy node: a
// live trainer with 8 forked workers holding GPU 0, nothing orphaned, so
// that no snapshot scans /proc/*/fd. "alone" is a snapshot as before the
// rules (Taker.Take); "lineage" is the Loop's, which also records the
// trainer's descendants (the children of its threads, each new one's
// descriptors once). The difference is the rules' cost per snapshot, paid
// once per --collector.interval.
func BenchmarkHealthySnapshot(b *testing.B) {
	var g gpu0 // GPU 0 is idle until the trainer runs
	d := newDriverFunc(b, func() gpu0 { return g })
	dev := d.DevicePath(0)
	trainer := exec.Command("sh", "-c", `exec 3<"$1"; for i in 1 2 3 4 5 6 7 8; do "$0" & done; wait`, os.Args[0], dev)
	trainer.Env = testenv.MapperEnviron()
	trainer.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := trainer.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { syscall.Kill(-trainer.Process.Pid, syscall.SIGKILL); trainer.Wait() })
	fs := procFS(b)
	testenv.Eventually(b, 10*time.Second, "the trainer's 8 workers", func() bool {
		kids, _ := fs.Children(trainer.Process.Pid)
		return len(kids) == 8
	})
	g = gpu0{usedMiB: 4714, procs: []nvml.ProcessInfo{listed(trainer.Process.Pid, 4706)}}
	taker := NewTaker(Config{Driver: d, Proc: fs, ScanUnownedBytes: 256 * mib, ExcludePIDs: []int{os.Getpid()}})

	b.Run("alone", func(b *testing.B) {
		for b.Loop() {
			if s := taker.Take(context.Background(), false); !s.GPUs[0].Owners[0].Alive || s.GPUs[0].Scanned {
				b.Fatalf("not a healthy snapshot: %+v", s.GPUs[0])
			}
		}
		b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N), "us/snapshot")
	})
	b.Run("lineage", func(b *testing.B) {
		loop := NewLoop(taker, time.Hour, 256*mib)
		loop.Refresh(context.Background(), false)
		if n := loop.Lineage().RecordedDescendants(); n != 8 {
			b.Fatalf("recorded %d descendants, want the 8 workers", n)
		}
		for b.Loop() {
			loop.Refresh(context.Background(), false)
		}
		b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N), "us/snapshot")
	})
}
