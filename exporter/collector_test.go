package exporter

import (
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/prometheus/common/expfmt"

	"github.com/gpu-orphan/gpu-orphan/internal/gpu"
	"github.com/gpu-orphan/gpu-orphan/internal/proc"
	"github.com/gpu-orphan/gpu-orphan/internal/snapshot"
)

type staticSource struct{ s *snapshot.Snapshot }

func (s staticSource) Latest() *snapshot.Snapshot { return s.s }
func (s staticSource) OrphanBytes() uint64        { return 256 * gpu.MiB }

var taken = time.Unix(1_800_000_000, 0)

// forkOrphan is docs/facts.md's fork case after SIGKILL of the creator on GPU 0,
// a MIG GPU 1 and an unreadable GPU 2.
func forkOrphan() *snapshot.Snapshot {
	child := proc.Process{PID: 5001, PPID: 1, PGID: 5000, SID: 4000, State: "S", User: "alice", Comm: "python3",
		Container: "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef", Pod: "6b1f2c1e-9d2a-4c4e-9e36-0a7e4c1b2f3d"}
	return &snapshot.Snapshot{
		Taken: taken, Driver: "sim", HostPIDsVisible: true,
		Sources: []snapshot.Source{{Name: "sim", Duration: 2 * time.Millisecond}, {Name: "proc", Duration: time.Millisecond},
			{Name: "fdscan", Err: errors.New("boom"), Duration: 3 * time.Millisecond}},
		GPUs: []snapshot.GPU{
			{
				Device: gpu.Device{Index: 0, UUID: "GPU-0", Name: "NVIDIA H200", Minor: 0},
				Memory: gpu.Memory{Total: 143771 * gpu.MiB, Reserved: 615 * gpu.MiB, Used: 6762 * gpu.MiB, Free: (143771 - 615 - 6762) * gpu.MiB},
				Owners: []snapshot.Owner{{PID: 5000, UsedBytes: 6754 * gpu.MiB, Identity: &snapshot.Identity{
					PID: 5000, StartTime: 77, Comm: "python3", Cmdline: "python3 train.py", User: "alice", SlurmJob: "81234", SlurmStep: "0",
					ContainerID: child.Container, PodUID: child.Pod,
				}}},
				OwnedDeadBytes: 6754 * gpu.MiB, UnattributedBytes: 8 * gpu.MiB, UnownedBytes: 6762 * gpu.MiB,
				Scanned: true, HolderPIDs: []int{5001},
				Suspects:     []snapshot.Holder{{Process: child, Reason: snapshot.ReasonInheritedFromDeadOwner, Proof: snapshot.ProofDescentAtFork, DeadOwner: 5000}},
				UnownedSince: taken.Add(-90 * time.Second),
			},
			{Device: gpu.Device{Index: 1, UUID: "GPU-1", Name: "NVIDIA H200", Minor: 1}, Unsupported: "mig"},
			{Device: gpu.Device{Index: 2, UUID: "GPU-2", Name: "NVIDIA H200", Minor: 2}, Err: errors.New("GPU is lost")},
		},
	}
}

func TestCollectorGolden(t *testing.T) {
	c := NewCollector(staticSource{forkOrphan()}, nil)
	c.now = func() time.Time { return taken.Add(2 * time.Second) }
	golden, err := os.Open("testdata/fork_orphan.prom")
	if err != nil {
		t.Fatal(err)
	}
	defer golden.Close()
	if err := testutil.CollectAndCompare(c, golden); err != nil {
		t.Fatal(err)
	}
	problems, err := testutil.CollectAndLint(c)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("lint: %s: %s", p.Metric, p.Text)
	}
}

func TestCollectorForeignNamespace(t *testing.T) {
	s := forkOrphan()
	s.HostPIDsVisible = false
	s.GPUs[0].Unsupported = snapshot.UnsupportedForeignPIDNamespace
	c := NewCollector(staticSource{s}, nil)
	out := gather(t, c)
	if strings.Contains(out, "gpu_orphan_unowned_memory_bytes{") {
		t.Errorf("memory must not be called orphaned in a foreign PID namespace:\n%s", out)
	}
	for _, want := range []string{"gpu_orphan_host_pids_visible 0", `gpu_orphan_memory_used_bytes{gpu="0",uuid="GPU-0"}`,
		`gpu_orphan_gpu_accounting_supported{gpu="0",reason="foreign_pid_namespace",uuid="GPU-0"} 0`} {
		if !strings.Contains(out, want) {
			t.Errorf("missing %q in:\n%s", want, out)
		}
	}
}

func TestCollectorBeforeFirstSnapshot(t *testing.T) {
	if n := testutil.CollectAndCount(NewCollector(staticSource{nil}, nil)); n != 0 {
		t.Fatalf("got %d metrics before any snapshot", n)
	}
}

func gather(t *testing.T, c *Collector) string {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(c)
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	enc := expfmt.NewEncoder(&b, expfmt.NewFormat(expfmt.TypeTextPlain))
	for _, mf := range mfs {
		if err := enc.Encode(mf); err != nil {
			t.Fatal(err)
		}
	}
	return b.String()
}
