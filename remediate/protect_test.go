package remediate_test

// Protection by what a process runs, not by what it calls itself (issue
// 15, finding 11): real processes through the real webhook with --act on a
// simulated node.

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/gpu-orphan/gpu-orphan/internal/proc"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/remediate"
)

// TestProtectRenamedWorkerIsCleaned: a fork orphan whose workers renamed
// themselves systemd-worker (prctl PR_SET_NAME) is cleaned. Protection by
// comm let them escape: systemd* is on the protected list.
func TestProtectRenamedWorkerIsCleaned(t *testing.T) {
	skipShort(t)
	t.Parallel()
	root := testenv.SimNode(t, 2)
	orphan := testenv.StartWorkload(t, root, 1, 4096, 2, "--child-comm", "systemd-worker")
	for _, pid := range orphan.Children {
		if p := readProcess(t, pid); p.Comm != "systemd-worker" || p.Exe.Name() != "gpu-orphan-sim" {
			t.Fatalf("worker %d: comm %q, exe %q; want systemd-worker running gpu-orphan-sim", pid, p.Comm, p.Exe.Path)
		}
	}

	a, _ := cleanGPUAfter(t, root, 1, func() { orphan.KillParent(t) }, "--act")
	if a.State != remediate.StateSucceeded {
		t.Fatalf("action %s: %s (excluded %+v)", a.State, a.Reason, a.Excluded)
	}
	wantTargets(t, a, orphan.Children...)
	wantDead(t, "a renamed worker", orphan.Children...)
	wantUsedMiB(t, root, 1, 0)
}

// TestProtectDaemonByExecutable: beside an ordinary fork orphan on GPU 1,
// fork orphans that stand in for daemons, each a copy of gpu-orphan-sim.
// Protected, and so left holding their memory:
//   - a root-owned copy named nv-fabricmanager (comm "nv-fabricmanage",
//     which the old list, by comm, did not name): by the executable's name;
//   - a root-owned copy named nv-hostengine, replaced on disk while it runs
//     (a package upgrade: /proc/PID/exe ends in " (deleted)"): by the name
//     it was exec'd as;
//   - a file given as --remediate.protect=PATH, run through a hard link
//     named worker-7 (nothing protects that name): by the file itself;
//   - a root-owned file at another --remediate.protect=PATH, replaced since
//     (the running file is no longer there): by its path.
//
// Not protected, and cleaned: a copy named nv-hostengine that a user owns
// (the old code protected it by comm).
func TestProtectDaemonByExecutable(t *testing.T) {
	skipShort(t)
	t.Parallel()
	if os.Geteuid() != 0 {
		t.Skip("needs root, for root-owned binaries and a user's")
	}
	root := testenv.SimNode(t, 2)
	dir := t.TempDir()
	mkdir := func(name string) string {
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(p, 0o755); err != nil {
			t.Fatal(err)
		}
		return p
	}
	fabric := installSim(t, filepath.Join(mkdir("usr"), "nv-fabricmanager"))
	hostengine := installSim(t, filepath.Join(dir, "usr", "nv-hostengine"))
	listed := installSim(t, filepath.Join(mkdir("site"), "server"))
	worker := filepath.Join(mkdir("run"), "worker-7")
	if err := os.Link(listed, worker); err != nil {
		t.Fatal(err)
	}
	agent := installSim(t, filepath.Join(mkdir("opt"), "agent"))
	usersCopy := installSim(t, filepath.Join(mkdir("home"), "nv-hostengine"))
	if err := os.Chown(usersCopy, 1000, 1000); err != nil {
		t.Fatal(err)
	}

	// Each job's owner is killed once the agent runs (killAll), as on a
	// node where it runs all along.
	var owners []*exec.Cmd
	orphan := func(bin string, mib int) *testenv.Workload {
		s := testenv.StartScript(t, fmt.Sprintf("exec %s run --root %s --gpu 1 --mib %d --children 1", bin, root, mib))
		w := s.Ready(t)
		owners = append(owners, s.Cmd)
		return w
	}
	pFabric := orphan(fabric, 1024)
	pHostengine := orphan(hostengine, 512)
	pListed := orphan(worker, 256)
	pAgent := orphan(agent, 128)
	pUsers := orphan(usersCopy, 2048)
	ordinary := testenv.StartWorkload(t, root, 1, 2048, 1)

	// The upgrades, after the daemons started.
	reinstallSim(t, hostengine)
	reinstallSim(t, agent)

	for _, c := range []struct {
		w          *testenv.Workload
		comm, path string
	}{
		{pFabric, "nv-fabricmanage", fabric},
		{pHostengine, "nv-hostengine", hostengine + " (deleted)"},
		{pListed, "worker-7", worker},
		{pAgent, "agent", agent + " (deleted)"},
		{pUsers, "nv-hostengine", usersCopy},
	} {
		if p := readProcess(t, c.w.Children[0]); p.Comm != c.comm || p.Exe.Path != c.path {
			t.Fatalf("holder %d: comm %q, exe %q; want %q running %q", p.PID, p.Comm, p.Exe.Path, c.comm, c.path)
		}
	}

	killAll := func() {
		// Every job's forks applied by the agent first; then every owner
		// is sent SIGKILL before any is reaped, so that they die together
		// and ripen together: a snapshot taken while they died one by one
		// (a reap each, on a loaded machine) saw some dead and some alive,
		// and those seen dead later were still too young when the first
		// ripened.
		testenv.WaitEventsApplied(t, ordinary.Ready)
		owners = append(owners, ordinary.Cmd)
		for _, c := range owners {
			if err := c.Process.Signal(syscall.SIGKILL); err != nil {
				t.Fatal(err)
			}
		}
		for _, c := range owners {
			c.Wait()
		}
	}
	a, _ := cleanGPUAfter(t, root, 1, killAll, "--act", "--remediate.protect="+listed, "--remediate.protect="+agent)
	if a.State != remediate.StateSucceeded || !strings.HasPrefix(a.Reason, "other holders remain") {
		t.Errorf("action %s (%s), want succeeded with other holders remaining", a.State, a.Reason)
	}
	wantTargets(t, a, pUsers.Children[0], ordinary.Children[0])
	wantDead(t, "the user's copy named nv-hostengine", pUsers.Children...)
	wantDead(t, "the ordinary orphan's holder", ordinary.Children...)
	for _, c := range []struct {
		what string
		w    *testenv.Workload
	}{
		{"nv-fabricmanager", pFabric},
		{"nv-hostengine, upgraded while it runs", pHostengine},
		{"the protected file, run by another name", pListed},
		{"the protected path's former file", pAgent},
	} {
		pid := c.w.Children[0]
		wantAlive(t, c.what, pid)
		if !slices.ContainsFunc(a.Excluded, func(e remediate.Exclusion) bool { return e.PID == pid && e.Why == "protected" }) {
			t.Errorf("%s (PID %d) is not recorded as protected: %+v", c.what, pid, a.Excluded)
		}
		if !slices.ContainsFunc(a.Leftover, func(l remediate.Leftover) bool { return l.PID == pid }) {
			t.Errorf("%s (PID %d) is not named among the leftovers: %+v", c.what, pid, a.Leftover)
		}
	}
	wantUsedMiB(t, root, 1, 1024+512+256+128+4*8)
}

// installSim copies gpu-orphan-sim to path as root installs a daemon:
// owned by root, 0755.
func installSim(t *testing.T, path string) string {
	t.Helper()
	testenv.CopyExecutable(t, simBin(t), path, 0o755)
	return path
}

// reinstallSim replaces the binary at path by a new file, as a package
// upgrade does: the processes running the old one keep it, deleted.
func reinstallSim(t *testing.T, path string) {
	t.Helper()
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	installSim(t, path)
}

func readProcess(t *testing.T, pid int) proc.Process {
	t.Helper()
	p, err := procFS(t).Process(pid)
	if err != nil {
		t.Fatal(err)
	}
	return p
}
