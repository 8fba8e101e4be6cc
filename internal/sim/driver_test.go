package sim

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpu-orphan/gpu-orphan/internal/gpu"
)

func TestDriverIdle(t *testing.T) {
	root := newNode(t, 2)
	d := newDriver(t, root)
	root, err := filepath.EvalSymlinks(root)
	if err != nil {
		t.Fatal(err)
	}
	if d.Name() != "sim" {
		t.Errorf("Name %q", d.Name())
	}
	ns, _ := os.Readlink("/proc/self/ns/pid")
	if d.PIDNamespace() != ns {
		t.Errorf("PIDNamespace %q, want %q", d.PIDNamespace(), ns)
	}
	if got, want := d.DevicePath(1), filepath.Join(root, "dev", "nvidia1"); got != want {
		t.Errorf("DevicePath(1) = %q, want %q", got, want)
	}
	rs, err := d.Read(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(rs) != 2 {
		t.Fatalf("%d readings, want 2", len(rs))
	}
	for i, r := range rs {
		want := gpu.Memory{Total: 143771 * gpu.MiB, Reserved: 615 * gpu.MiB, Used: 0, Free: (143771 - 615) * gpu.MiB}
		if r.Memory != want || len(r.Processes) != 0 || r.Err != nil || r.Unsupported != "" {
			t.Errorf("GPU %d: %+v", i, r)
		}
		if r.Device.Index != i || r.Device.Minor != i || !uuidRE.MatchString(r.Device.UUID) || r.Device.Name != GPUName {
			t.Errorf("GPU %d: device %+v", i, r.Device)
		}
	}
}

// TestContextLifetime drives the lock protocol in this process: a context
// lives exactly while a descriptor of it is open.
func TestContextLifetime(t *testing.T) {
	root := newNode(t, 2)
	n, err := Load(root)
	if err != nil {
		t.Fatal(err)
	}
	d := newDriver(t, root)
	c := Context{GPU: 1, PID: os.Getpid(), StartTime: 1, UsedBytes: 100 * gpu.MiB}
	f, err := createContext(n, &c)
	if err != nil {
		t.Fatal(err)
	}
	// A second context of the same process merges into one process entry.
	c2 := Context{GPU: 1, PID: os.Getpid(), StartTime: 1, UsedBytes: 50 * gpu.MiB}
	f2, err := createContext(n, &c2)
	if err != nil {
		t.Fatal(err)
	}
	// A context being written is invisible, and not collected.
	tmp := filepath.Join(root, "contexts", ".gpu1-pid1-1-0.json.tmp")
	if err := os.WriteFile(tmp, []byte("{"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := wantGPU(d, 1, 150+16, gpu.Process{PID: uint32(os.Getpid()), UsedBytes: 150 * gpu.MiB}); err != nil {
		t.Fatal(err)
	}
	if err := wantGPU(d, 0, 0); err != nil {
		t.Fatal(err)
	}

	// A reader collecting a dead context holds LOCK_EX; a concurrent
	// reader must count it as dead, not as held.
	f2.Close()
	collector, err := os.Open(c2.Path)
	if err != nil {
		t.Fatal(err)
	}
	if err := flock(collector, unix.LOCK_EX|unix.LOCK_NB); err != nil {
		t.Fatal(err)
	}
	if err := wantGPU(d, 1, 100+8, gpu.Process{PID: uint32(os.Getpid()), UsedBytes: 100 * gpu.MiB}); err != nil {
		t.Fatal(err)
	}
	collector.Close()

	f.Close()
	if err := wantGPU(d, 1, 0); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{c.Path, c2.Path} {
		if _, err := os.Stat(p); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("dead context %s not deleted: %v", p, err)
		}
	}
	if _, err := os.Stat(tmp); err != nil {
		t.Errorf("context being written was touched: %v", err)
	}
}

func TestFaults(t *testing.T) {
	root := newNode(t, 2)
	d := newDriver(t, root)

	if err := WriteFaults(root, Faults{Error: "GPU is lost", GPU: AllGPUs}); err != nil {
		t.Fatal(err)
	}
	if _, err := d.Read(context.Background()); err == nil || err.Error() != "GPU is lost" {
		t.Errorf("Read with a fault on all GPUs: %v", err)
	}

	if err := WriteFaults(root, Faults{Error: "Unknown Error", GPU: 1}); err != nil {
		t.Fatal(err)
	}
	rs, err := d.Read(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if rs[0].Err != nil || rs[1].Err == nil || rs[1].Err.Error() != "Unknown Error" || rs[1].Device.UUID == "" {
		t.Errorf("fault on GPU 1: %+v", rs)
	}

	// A hung driver: Read gives up when ctx does.
	if err := WriteFaults(root, Faults{Delay: 2 * time.Second}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	start := time.Now()
	if _, err := d.Read(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("hung Read: %v, want DeadlineExceeded", err)
	}
	if took := time.Since(start); took > time.Second {
		t.Errorf("hung Read returned after %v, want about 100ms", took)
	}
	if err := WriteFaults(root, Faults{Delay: 50 * time.Millisecond, GPU: AllGPUs}); err != nil {
		t.Fatal(err)
	}
	start = time.Now()
	if _, err := d.Read(context.Background()); err != nil {
		t.Errorf("slow Read: %v", err)
	}
	if took := time.Since(start); took < 50*time.Millisecond {
		t.Errorf("slow Read took %v, want at least 50ms", took)
	}

	// The file's own form: gpu left out means every GPU.
	path := filepath.Join(root, "faults.json")
	if err := os.WriteFile(path, []byte(`{"error": "boom", "delay": "1ms"}`), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := d.Read(context.Background()); err == nil || err.Error() != "boom" {
		t.Errorf("Read with gpu left out: %v", err)
	}
	for _, bad := range []string{`{"eror": "x"}`, `{"delay": "soon"}`, `{"gpu": -2}`, `{"delay": "-1s"}`, `{} {}`} {
		if err := os.WriteFile(path, []byte(bad), 0o644); err != nil {
			t.Fatal(err)
		}
		if _, err := d.Read(context.Background()); err == nil || !strings.Contains(err.Error(), "faults.json") {
			t.Errorf("faults.json %s: %v, want an error naming the file", bad, err)
		}
	}

	if err := ClearFaults(root); err != nil {
		t.Fatal(err)
	}
	if err := ClearFaults(root); err != nil {
		t.Errorf("clearing twice: %v", err)
	}
	if _, err := d.Read(context.Background()); err != nil {
		t.Errorf("Read after ClearFaults: %v", err)
	}

	ctx, cancel = context.WithCancel(context.Background())
	cancel()
	if _, err := d.Read(ctx); !errors.Is(err, context.Canceled) {
		t.Errorf("Read with a cancelled ctx: %v", err)
	}
}

func TestMIG(t *testing.T) {
	root := newNode(t, 2)
	n, err := Load(root)
	if err != nil {
		t.Fatal(err)
	}
	n.GPUs[1].MIG = true
	if err := n.Save(); err != nil {
		t.Fatal(err)
	}
	rs, err := newDriver(t, root).Read(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if rs[0].Unsupported != "" || rs[1].Unsupported != "mig" {
		t.Errorf("unsupported: %q %q, want \"\" \"mig\"", rs[0].Unsupported, rs[1].Unsupported)
	}
	if _, err := StartWorkload(WorkloadConfig{Root: root, GPU: 1, MiB: 1}); err == nil || !strings.Contains(err.Error(), "MIG") {
		t.Errorf("workload on a MIG GPU: %v", err)
	}
}

func TestParseProcStat(t *testing.T) {
	// The command name may hold spaces and parentheses.
	in := "42 (a) b (c) S 1 42 42 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10 18446744073709551615"
	st, err := parseProcStat([]byte(in))
	if err != nil {
		t.Fatal(err)
	}
	if st.State != "S" || st.StartTime != 987654 {
		t.Errorf("parsed %+v", st)
	}
	if _, err := parseProcStat([]byte("42 (a) S 1")); err == nil {
		t.Error("short stat parsed")
	}
	if _, err := readProcStat(os.Getpid()); err != nil {
		t.Error(err)
	}
}
