package proc

import (
	"os"
	"path/filepath"
	"reflect"
	"testing"
)

func TestNamespaceFixture(t *testing.T) {
	fs := newFixture(t)
	ns, err := fs.PIDNamespace()
	if err != nil || ns != fixPIDNS {
		t.Errorf("PIDNamespace = %q, %v; want %q", ns, err, fixPIDNS)
	}
	// self -> 100, a container's process seen from the host.
	nspid, err := fs.SelfNSpid()
	if err != nil || !reflect.DeepEqual(nspid, []int{100, 1}) {
		t.Errorf("SelfNSpid = %v, %v; want [100 1]", nspid, err)
	}
}

func TestNamespaceReal(t *testing.T) {
	fs, err := NewFS("/proc")
	if err != nil {
		t.Fatal(err)
	}
	ns, err := fs.PIDNamespace()
	if err != nil {
		t.Skipf("PIDNamespace: %v (PID 1 not readable here)", err)
	}
	// /proc is mounted for our own namespace, so PID 1 shares it.
	if self, _ := os.Readlink("/proc/self/ns/pid"); ns != self {
		t.Errorf("PIDNamespace = %q, want ours, %q", ns, self)
	}
	nspid, err := fs.SelfNSpid()
	if err != nil || len(nspid) == 0 || nspid[0] != os.Getpid() {
		t.Errorf("SelfNSpid = %v, %v; want it to start with %d", nspid, err, os.Getpid())
	}
}

// TestNamespaceFallbacks: where PID 1's ns link cannot be read (ptrace
// rights), kernel threads or the reader's own NSpid still tell.
func TestNamespaceFallbacks(t *testing.T) {
	write := func(t *testing.T, root, name, data string) {
		t.Helper()
		p := filepath.Join(root, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	t.Run("kthreadd shows the initial namespace", func(t *testing.T) {
		root := t.TempDir()
		write(t, root, "2/stat", "2 (kthreadd) S 0 0 0 0 -1 2129984 0 0 0 0 0 0 0 0 20 0 1 0 1 0 0\n")
		fs, err := NewFS(root)
		if err != nil {
			t.Fatal(err)
		}
		if ns, err := fs.PIDNamespace(); err != nil || ns != "pid:[4026531836]" {
			t.Errorf("PIDNamespace = %q, %v", ns, err)
		}
	})
	t.Run("a container's own procfs", func(t *testing.T) {
		root := t.TempDir()
		write(t, root, "7/status", "Name:\tx\nNSpid:\t7\n")
		write(t, root, "2/stat", "2 (bash) S 1 2 2 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 1 0 0\n")
		if err := os.MkdirAll(filepath.Join(root, "7", "ns"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink("pid:[4026532999]", filepath.Join(root, "7", "ns", "pid")); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink("7", filepath.Join(root, "self")); err != nil {
			t.Fatal(err)
		}
		fs, err := NewFS(root)
		if err != nil {
			t.Fatal(err)
		}
		if ns, err := fs.PIDNamespace(); err != nil || ns != "pid:[4026532999]" {
			t.Errorf("PIDNamespace = %q, %v", ns, err)
		}
	})
	t.Run("nothing to tell by", func(t *testing.T) {
		fs, err := NewFS(t.TempDir())
		if err != nil {
			t.Fatal(err)
		}
		if ns, err := fs.PIDNamespace(); err == nil {
			t.Errorf("PIDNamespace = %q with nothing to read", ns)
		}
	})
}
