package proc

import (
	"os"
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
