package proc

import (
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"testing"
	"time"
)

func TestHoldersFixture(t *testing.T) {
	fs := newFixture(t)
	paths := []string{
		"/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia1", "/dev/nvidia2",
		"/dev/../dev/nvidia1", "/var/log/vllm.log", "/dev/null",
	}
	scan, err := fs.ScanHolders(paths)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string][]int{
		// 100 holds nvidia0 twice; 300 holds one that was unlinked.
		"/dev/nvidia0":        {100, 300},
		"/dev/nvidiactl":      {100, 200, 300},
		"/dev/nvidia1":        {200},
		"/dev/../dev/nvidia1": {200},
		"/var/log/vllm.log":   {300},
		"/dev/null":           {1, 100, 200, 500},
	}
	if !reflect.DeepEqual(scan.Holders, want) {
		t.Errorf("Holders =\n%v\nwant\n%v", scan.Holders, want)
	}
	// 1, 100, 200, 300, 400, 500, 600; 700 has no fd directory.
	if scan.Scanned != 7 || scan.Denied != 0 {
		t.Errorf("Scanned %d, Denied %d; want 7, 0", scan.Scanned, scan.Denied)
	}

	got, err := fs.Holders(nil)
	if err != nil || len(got) != 0 {
		t.Errorf("Holders(nil) = %v, %v", got, err)
	}
}

func TestHoldersMissingRoot(t *testing.T) {
	fs := newFixture(t)
	fs.root = filepath.Join(t.TempDir(), "nothing")
	if _, err := fs.Holders([]string{"/dev/nvidia0"}); err == nil {
		t.Error("Holders on a missing procfs: no error")
	}
}

func TestPIDs(t *testing.T) {
	fs := newFixture(t)
	pids, err := fs.PIDs()
	if err != nil {
		t.Fatal(err)
	}
	if want := []int{1, 100, 200, 300, 400, 500, 600, 700}; !reflect.DeepEqual(pids, want) {
		t.Errorf("PIDs = %v, want %v", pids, want)
	}
}

// startHolder starts a sleep holding files open, and closes our copies so
// that the child alone holds them.
func startHolder(t *testing.T, files ...*os.File) *exec.Cmd {
	t.Helper()
	cmd := exec.Command("sleep", "60")
	cmd.ExtraFiles = files
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	for _, f := range files {
		f.Close()
	}
	return cmd
}

func tempFile(t *testing.T, name string) *os.File {
	t.Helper()
	f, err := os.Create(filepath.Join(t.TempDir(), name))
	if err != nil {
		t.Fatal(err)
	}
	return f
}

func TestHoldersRealProcess(t *testing.T) {
	fs, err := NewFS("/proc")
	if err != nil {
		t.Fatal(err)
	}
	held, twice, free := tempFile(t, "held"), tempFile(t, "twice"), tempFile(t, "free")
	heldPath, twicePath, freePath := held.Name(), twice.Name(), free.Name()
	free.Close()
	twice2, err := os.Open(twicePath)
	if err != nil {
		t.Fatal(err)
	}
	cmd := startHolder(t, held, twice, twice2)
	pid := cmd.Process.Pid

	got, err := fs.Holders([]string{heldPath, twicePath, freePath})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string][]int{heldPath: {pid}, twicePath: {pid}}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("Holders = %v, want %v", got, want)
	}

	// Once it has exited (and been reaped), it holds nothing.
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	got, err = fs.Holders([]string{heldPath})
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 0 {
		t.Errorf("Holders after exit = %v, want none", got)
	}
}

// Processes come and go during a scan; none of them may fail it.
func TestHoldersChurn(t *testing.T) {
	fs, err := NewFS("/proc")
	if err != nil {
		t.Fatal(err)
	}
	held := tempFile(t, "held")
	heldPath := held.Name()
	steady := startHolder(t, held)

	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
			}
			_ = exec.Command("true").Run()
		}
	}()
	defer func() { close(stop); <-done }()

	for deadline := time.Now().Add(500 * time.Millisecond); time.Now().Before(deadline); {
		got, err := fs.Holders([]string{heldPath})
		if err != nil {
			t.Fatal(err)
		}
		if want := []int{steady.Process.Pid}; !reflect.DeepEqual(got[heldPath], want) {
			t.Fatalf("Holders = %v, want %v", got[heldPath], want)
		}
	}
}
