package statefile

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

// TestSaveModes: whatever the umask, the state is its owner's alone.
func TestSaveModes(t *testing.T) {
	old := syscall.Umask(0)
	defer syscall.Umask(old)
	path := filepath.Join(t.TempDir(), "state", "exporter.json")
	if _, ok, err := Load(path); ok || err != nil {
		t.Fatalf("Load before any Save: %v %v", ok, err)
	}
	for _, v := range []string{"first", "second"} {
		if err := Save(path, []byte(v)); err != nil {
			t.Fatal(err)
		}
	}
	data, ok, err := Load(path)
	if err != nil || !ok || string(data) != "second" {
		t.Errorf("Load = %q %v %v", data, ok, err)
	}
	for p, want := range map[string]os.FileMode{path: 0o600, filepath.Dir(path): 0o700} {
		fi, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		if got := fi.Mode().Perm(); got != want {
			t.Errorf("%s: mode %o, want %o", p, got, want)
		}
	}
	entries, _ := os.ReadDir(filepath.Dir(path))
	if len(entries) != 1 {
		t.Errorf("the directory holds %d entries, want the state alone (no temporary file left)", len(entries))
	}
}

func TestLoadTooLarge(t *testing.T) {
	path := filepath.Join(t.TempDir(), "big")
	if err := os.WriteFile(path, make([]byte, MaxBytes+1), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, _, err := Load(path); err == nil {
		t.Error("an oversized state file was read")
	}
}
