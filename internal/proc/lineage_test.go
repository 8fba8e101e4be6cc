package proc

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/stack/slowness"
)

// startSleeper starts `sleep 300` holding f as descriptor 3.
func startSleeper(t *testing.T, f *os.File) *exec.Cmd {
	t.Helper()
	cmd := exec.Command("sleep", "300")
	if f != nil {
		cmd.ExtraFiles = []*os.File{f}
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	return cmd
}

func TestChildren(t *testing.T) {
	fs, err := NewFS("")
	if err != nil {
		t.Fatal(err)
	}
	a, b := startSleeper(t, nil), startSleeper(t, nil)
	kids, err := fs.Children(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	// The Go runtime forks from whichever thread runs: every thread's
	// children file must be read.
	for _, c := range []*exec.Cmd{a, b} {
		if !slices.Contains(kids, c.Process.Pid) {
			t.Errorf("children %v miss %d", kids, c.Process.Pid)
		}
	}
	if kids, err := fs.Children(a.Process.Pid); err != nil || len(kids) != 0 {
		t.Errorf("children of sleep = %v, %v; want none", kids, err)
	}
	a.Process.Kill()
	a.Wait()
	if _, err := fs.Children(a.Process.Pid); !errors.Is(err, ErrNotExist) {
		t.Errorf("children of a reaped process: %v, want ErrNotExist", err)
	}
}

// TestSharesFile: a descriptor inherited from one open is the same open
// file in both processes; a second open of the same device is not.
func TestSharesFile(t *testing.T) {
	fs, err := NewFS("")
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "nvidia0")
	if err := os.WriteFile(path, make([]byte, 4096), 0o600); err != nil {
		t.Fatal(err)
	}
	dev, err := StatDevice(path)
	if err != nil {
		t.Fatal(err)
	}
	open := func() *os.File {
		f, err := os.Open(path)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		return f
	}
	shared := open()
	a, b, c := startSleeper(t, shared), startSleeper(t, shared), startSleeper(t, open())
	var holding map[int]Holding
	deadline := time.Now().Add(slowness.Scale(5*time.Second, slowness.Factor()))
	for {
		scan, err := fs.ScanHolders([]Device{dev})
		if err != nil {
			t.Fatal(err)
		}
		holding = map[int]Holding{}
		for _, h := range scan.Holders[dev] {
			holding[h.PID] = h
		}
		if len(holding) >= 4 || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	ha, hb, hc := holding[a.Process.Pid], holding[b.Process.Pid], holding[c.Process.Pid]
	if !slices.Equal(ha.FDs, []int{3}) || !slices.Equal(hc.FDs, []int{3}) {
		t.Fatalf("descriptors of the holders: %v and %v, want [3]", ha.FDs, hc.FDs)
	}
	for _, tc := range []struct {
		name string
		x, y Holding
		want bool
	}{
		{"inherited from one open", ha, hb, true},
		{"the opener and its child", holding[os.Getpid()], ha, true},
		{"opened separately", ha, hc, false},
	} {
		got, err := fs.SharesFile(tc.x, tc.y)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if got != tc.want {
			t.Errorf("%s: SharesFile = %v, want %v", tc.name, got, tc.want)
		}
	}
	c.Process.Kill()
	c.Wait()
	if _, err := fs.SharesFile(ha, hc); !errors.Is(err, ErrNotExist) {
		t.Errorf("SharesFile with a reaped process: %v, want ErrNotExist", err)
	}
}
