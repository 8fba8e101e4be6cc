package sim

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/gpu"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

// TestLeak: a leak is memory that stays used with no process holding it,
// whatever the processes do; it takes room from new contexts, and only
// clearing the fault (a GPU reset, on real hardware) gives it back.
func TestLeak(t *testing.T) {
	root := newNode(t, 2)
	d := newDriver(t, root)
	if err := WriteFaults(root, Faults{GPU: AllGPUs, Leaks: []Leak{{GPU: 1, Bytes: 4096 * gpu.MiB}}}); err != nil {
		t.Fatal(err)
	}
	if err := wantGPU(d, 1, 4096); err != nil {
		t.Fatalf("GPU 1 with a 4096 MiB leak: %v", err)
	}
	if err := wantGPU(d, 0, 0); err != nil {
		t.Fatalf("GPU 0, without a leak: %v", err)
	}
	if r := readGPU(t, d, 1); r.Memory.Free != TotalBytes-ReservedBytes-4096*gpu.MiB {
		t.Errorf("GPU 1 free %d MiB, want the leak taken from it", r.Memory.Free/gpu.MiB)
	}

	// A job on the leaking GPU: its memory is its own, and comes back when
	// its last holder dies; the leak stays.
	p := startRun(t, root, "--gpu", "1", "--mib", "100", "--children", "1")
	if err := wantGPU(d, 1, 4096+100+8, gpu.Process{PID: uint32(p.pid), UsedBytes: 100 * gpu.MiB}); err != nil {
		t.Fatalf("a job beside the leak: %v", err)
	}
	p.signal(t, syscall.SIGKILL)
	p.wait()
	for _, c := range p.children {
		syscall.Kill(c, syscall.SIGKILL)
		reap(c)
	}
	testenv.EventuallyNil(t, 5*time.Second, "the job's memory back, the leak left", func() error { return wantGPU(d, 1, 4096) })

	// Leaked memory is used: a context that needs it does not fit.
	if err := WriteFaults(root, Faults{GPU: AllGPUs, Leaks: []Leak{{GPU: 0, Bytes: MaxLeakBytes - 50*gpu.MiB}}}); err != nil {
		t.Fatal(err)
	}
	if _, err := tryRun(t, root, "--gpu", "0", "--mib", "100"); err == nil || !strings.Contains(err.Error(), "out of memory") {
		t.Errorf("100 MiB on a GPU whose leak leaves 50 MiB: %v, want out of memory", err)
	}
	if err := wantGPU(d, 1, 0); err != nil {
		t.Errorf("GPU 1 after its leak was replaced: %v", err)
	}

	var status bytes.Buffer
	if err := WriteStatus(&status, root); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(status.String(), "leaked (fault): 143106 MiB used with no process holding it") {
		t.Errorf("status does not show the leak:\n%s", status.String())
	}

	if err := ClearFaults(root); err != nil {
		t.Fatal(err)
	}
	if err := wantGPU(d, 0, 0); err != nil {
		t.Errorf("GPU 0 after the fault was cleared: %v", err)
	}
}

func TestLeakFile(t *testing.T) {
	root := newNode(t, 2)
	d := newDriver(t, root)
	path := filepath.Join(root, "faults.json")
	// Two leaks on one GPU add up; an error fault on another GPU stays.
	if err := os.WriteFile(path, []byte(`{"error": "Unknown Error", "gpu": 0, "leaks": [{"gpu": 1, "mib": 10}, {"gpu": 1, "mib": 30}]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	rs, err := d.Read(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if rs[0].Err == nil || rs[1].Err != nil || rs[1].Memory.Used != 40*gpu.MiB || len(rs[1].Processes) != 0 {
		t.Errorf("GPU 0 %v; GPU 1 used %d MiB, processes %v; want GPU 0 failing and 40 MiB leaked on GPU 1 with no process",
			rs[0].Err, rs[1].Memory.Used/gpu.MiB, rs[1].Processes)
	}
	for _, bad := range []string{
		`{"leaks": [{"mib": 10}]}`,
		`{"leaks": [{"gpu": 0}]}`,
		`{"leaks": [{"gpu": 0, "mib": 0}]}`,
		`{"leaks": [{"gpu": -1, "mib": 10}]}`,
		`{"leaks": [{"gpu": 0, "MiB": 10}]}`,
		`{"leaks": [{"gpu": 0, "mib": 10, "bytes": 1}]}`,
		`{"leaks": [{"gpu": 0, "mib": 18446744073709551615}]}`,
		`{"leaks": [{"gpu": 0, "mib": 143157}]}`,
		`{"leaks": {"gpu": 0, "mib": 10}}`,
	} {
		if err := os.WriteFile(path, []byte(bad), 0o644); err != nil {
			t.Fatal(err)
		}
		if _, err := d.Read(t.Context()); err == nil || !strings.Contains(err.Error(), "faults.json") {
			t.Errorf("faults.json %s: %v, want an error naming the file", bad, err)
		}
	}
	for _, l := range []Leak{{GPU: 0, Bytes: gpu.MiB + 1}, {GPU: 0}, {GPU: -1, Bytes: gpu.MiB}, {GPU: 0, Bytes: MaxLeakBytes + gpu.MiB}} {
		if err := WriteFaults(root, Faults{Leaks: []Leak{l}}); err == nil {
			t.Errorf("WriteFaults(%+v): no error", l)
		}
	}
	// A leak on a GPU the node does not have leaks nothing.
	if err := WriteFaults(root, Faults{GPU: AllGPUs, Leaks: []Leak{{GPU: 7, Bytes: gpu.MiB}}}); err != nil {
		t.Fatal(err)
	}
	if _, err := d.Read(t.Context()); err != nil {
		t.Errorf("a leak on GPU 7 of a 2-GPU node: %v", err)
	}
}
