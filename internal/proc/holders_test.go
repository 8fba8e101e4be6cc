package proc

import (
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestHoldersFixture(t *testing.T) {
	fs := newFixture(t)
	// The fixture's descriptors are symlinks; those that name /dev/null
	// lead to the real character device 1:3.
	null := CharDevice(1, 3)
	scan, err := fs.ScanHolders([]Device{null, CharDevice(NVIDIAMajor, 0)})
	if err != nil {
		t.Fatal(err)
	}
	if got := holdingPIDs(scan.Holders[null]); !reflect.DeepEqual(got, []int{1, 100, 200, 500}) {
		t.Errorf("holders of /dev/null = %v, want 1 100 200 500", got)
	}
	if len(scan.Holders) != 1 {
		t.Errorf("holders of devices nobody holds: %v", scan.Holders)
	}
	// 1, 100, 200, 300, 400, 500, 600; 700 has no fd directory.
	if scan.Scanned != 7 || scan.Denied != 0 {
		t.Errorf("Scanned %d, Denied %d; want 7, 0", scan.Scanned, scan.Denied)
	}
	got, err := fs.ScanHolders(nil)
	if err != nil || len(got.Holders) != 0 {
		t.Errorf("ScanHolders(nil) = %v, %v", got, err)
	}
}

func holdingPIDs(hs []Holding) []int {
	var pids []int
	for _, h := range hs {
		pids = append(pids, h.PID)
	}
	return pids
}

func TestHoldersMissingRoot(t *testing.T) {
	fs := newFixture(t)
	fs.root = filepath.Join(t.TempDir(), "nothing")
	if _, err := fs.ScanHolders([]Device{CharDevice(NVIDIAMajor, 0)}); err == nil {
		t.Error("ScanHolders on a missing procfs: no error")
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
	heldDev, twiceDev, freeDev := statDevice(t, held.Name()), statDevice(t, twice.Name()), statDevice(t, free.Name())
	free.Close()
	twice2, err := os.Open(twice.Name())
	if err != nil {
		t.Fatal(err)
	}
	cmd := startHolder(t, held, twice, twice2)
	pid := cmd.Process.Pid

	scan, err := fs.ScanHolders([]Device{heldDev, twiceDev, freeDev})
	if err != nil {
		t.Fatal(err)
	}
	if got := holdingPIDs(scan.Holders[heldDev]); !reflect.DeepEqual(got, []int{pid}) {
		t.Errorf("holders of held = %v, want %d", got, pid)
	}
	if hs := scan.Holders[twiceDev]; len(hs) != 1 || hs[0].PID != pid || len(hs[0].Files) != 1 || hs[0].Via != pid {
		t.Errorf("holders of twice = %+v, want %d once, through one file", hs, pid)
	}
	if len(scan.Holders[freeDev]) != 0 {
		t.Errorf("holders of a closed file: %v", scan.Holders[freeDev])
	}

	// Once it has exited (and been reaped), it holds nothing.
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	scan, err = fs.ScanHolders([]Device{heldDev})
	if err != nil {
		t.Fatal(err)
	}
	if len(scan.Holders) != 0 {
		t.Errorf("Holders after exit = %v, want none", scan.Holders)
	}
}

func statDevice(t *testing.T, path string) Device {
	t.Helper()
	d, err := StatDevice(path)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// TestHoldersByDeviceNotPath: a device is its device number, a file its
// identity, whatever name shows them. A character device made under
// another name (as a container's /dev is) is the same device; a regular
// file named like the device is not; a hard link is the same file.
func TestHoldersByDeviceNotPath(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("mknod needs root")
	}
	fs, err := NewFS("/proc")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	alias := filepath.Join(dir, "nvidia0") // char 1:7, /dev/full under another name
	if err := unix.Mknod(alias, unix.S_IFCHR|0o666, int(unix.Mkdev(1, 7))); err != nil {
		t.Skipf("mknod: %v", err)
	}
	decoy := filepath.Join(dir, "full") // a regular file named like the device
	if err := os.WriteFile(decoy, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	node := tempFile(t, "node") // a simulated node, and a hard link to it
	link := filepath.Join(dir, "nvidia1")
	if err := os.Link(node.Name(), link); err != nil {
		t.Fatal(err)
	}
	nodeDev := statDevice(t, node.Name())
	node.Close()

	open := func(path string) *os.File {
		f, err := os.Open(path)
		if err != nil {
			t.Fatal(err)
		}
		return f
	}
	viaAlias := startHolder(t, open(alias)).Process.Pid
	viaDecoy := startHolder(t, open(decoy)).Process.Pid
	viaLink := startHolder(t, open(link)).Process.Pid

	full := CharDevice(1, 7)
	scan, err := fs.ScanHolders([]Device{full, nodeDev})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(holdingPIDs(scan.Holders[full]), viaAlias) {
		t.Errorf("the holder of char 1:7 under the name %s is missing: %v", alias, holdingPIDs(scan.Holders[full]))
	}
	for _, dev := range []Device{full, nodeDev} {
		if slices.Contains(holdingPIDs(scan.Holders[dev]), viaDecoy) {
			t.Errorf("the holder of a regular file named %s counts as a holder of %s", decoy, dev)
		}
	}
	if got := holdingPIDs(scan.Holders[nodeDev]); !reflect.DeepEqual(got, []int{viaLink}) {
		t.Errorf("holders of the node file = %v, want %d through its hard link", got, viaLink)
	}
	if _, ok, err := fs.HoldingOf(viaLink, nodeDev); !ok || err != nil {
		t.Errorf("HoldingOf(%d) = %v, %v; want it held", viaLink, ok, err)
	}
	if _, ok, err := fs.HoldingOf(viaDecoy, nodeDev); ok || err != nil {
		t.Errorf("HoldingOf(%d) = %v, %v; want not held", viaDecoy, ok, err)
	}
}

// Processes come and go during a scan; none of them may fail it.
func TestHoldersChurn(t *testing.T) {
	fs, err := NewFS("/proc")
	if err != nil {
		t.Fatal(err)
	}
	held := tempFile(t, "held")
	heldDev := statDevice(t, held.Name())
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
		scan, err := fs.ScanHolders([]Device{heldDev})
		if err != nil {
			t.Fatal(err)
		}
		if got, want := holdingPIDs(scan.Holders[heldDev]), []int{steady.Process.Pid}; !reflect.DeepEqual(got, want) {
			t.Fatalf("Holders = %v, want %v", got, want)
		}
	}
}
