package testenv

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// Cgroup hierarchies of the test machines: cgroup v2 mounted at
// /sys/fs/cgroup/unified beside v1 controllers (a hybrid host).
const (
	CgroupV2 = "/sys/fs/cgroup/unified"
	CgroupV1 = "/sys/fs/cgroup/freezer"
)

// SlurmV2Step is the cgroup v2 path, under the hierarchy's root, that
// slurmstepd gives task 0 of a job's step 0.
func SlurmV2Step(job string) string {
	return "system.slice/slurmstepd.scope/job_" + job + "/step_0/user/task_0"
}

var jobSeq atomic.Int64

// SlurmJobID returns a job number that no other test, in this process or
// another package's running at the same time, uses.
func SlurmJobID() string {
	return strconv.FormatInt(int64(os.Getpid())*1000+jobSeq.Add(1), 10)
}

// IntoCgroup moves pid into the cgroup rel (created) of the hierarchy
// mounted at mount, as slurmd or the kubelet would place a job; it skips
// the test where cgroups cannot be made (not root, no such hierarchy). The
// cgroup, and its parents once empty, are removed at cleanup.
func IntoCgroup(t testing.TB, mount, rel string, pid int) {
	t.Helper()
	if os.Getuid() != 0 {
		t.Skip("making cgroups needs root")
	}
	if _, err := os.Stat(filepath.Join(mount, "cgroup.procs")); err != nil {
		t.Skipf("no cgroup hierarchy at %s", mount)
	}
	dir := filepath.Join(mount, rel)
	var err error
	// Another test may remove a shared parent between our mkdir calls.
	for range 5 {
		if err = os.MkdirAll(dir, 0o755); err == nil {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err != nil {
		t.Skipf("cannot make cgroup %s: %v", dir, err)
	}
	t.Cleanup(func() {
		// Move whatever is left back to the root, then remove leaf first.
		if b, err := os.ReadFile(filepath.Join(dir, "cgroup.procs")); err == nil {
			for _, p := range strings.Fields(string(b)) {
				_ = os.WriteFile(filepath.Join(mount, "cgroup.procs"), []byte(p), 0) // best effort: it may have exited
			}
		}
		for d := dir; d != mount && strings.HasPrefix(d, mount); d = filepath.Dir(d) {
			os.Remove(d)
		}
	})
	if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0); err != nil {
		t.Skipf("cannot move %d into %s: %v", pid, dir, err)
	}
	want := "/" + rel
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cgroup")
	if err != nil || !strings.Contains(string(b), want+"\n") {
		t.Fatalf("%d is not in %s after the move: %s (%v)", pid, want, b, err)
	}
}
