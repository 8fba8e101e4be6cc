package main

// The audit store's directory on a node where no remediator made it yet
// (issue 23, "The Slurm hooks out of the box"): the prolog, the epilog and
// `gpu-orphan clean --act --store.path` make it as the remediator does
// (store.MakeDir), and refuse one they must not trust, saying what to run
// and that nothing was signalled.

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

// slurmdRun runs script as slurmd runs Epilog= and Prolog=: `env -i`
// with Slurm's variables only, no PATH. It returns the exit status and
// what the script wrote.
func slurmdRun(t *testing.T, script string, env ...string) (int, string) {
	t.Helper()
	envBin, err := exec.LookPath("env")
	if err != nil {
		t.Skip("no env(1)")
	}
	cmd := exec.Command(envBin, append(append([]string{"-i"}, env...), script)...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	return testenv.ExitCode(t, cmd.Run()), out.String()
}

// hookScript writes the script that docs/slurm.md installs as
// /etc/slurm/gpu-orphan-<hook> (`exec gpu-orphan <hook> --drain
// --store.path=...`), here with the simulated node and a test's scontrol.
func hookScript(t *testing.T, hook, root, db, scontrol string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "gpu-orphan-"+hook)
	testenv.WriteExecutable(t, path, []byte("#!/bin/sh\nexec "+testenv.Bin(t, "gpu-orphan")+" --backend=sim --sim.root="+root+" "+hook+
		" --drain --store.path="+db+" --slurm.scontrol="+scontrol+" --grace=1s --log.syslog-socket=\n"))
	return path
}

// checkStoreDir fails the test unless dir is a directory, 0700.
func checkStoreDir(t *testing.T, dir string) {
	t.Helper()
	fi, err := os.Lstat(dir)
	if err != nil || !fi.IsDir() || fi.Mode().Perm() != store.DirMode {
		t.Errorf("the store directory %s: %v, %v; want a directory, %#o", dir, fi, err, store.DirMode)
	}
}

// TestEpilogAsSlurmdMakesStoreDir: installed as docs/slurm.md says, on a
// node where /var/lib/gpu-orphan does not exist yet (no remediator ran
// there), the epilog that slurmd runs (as root, `env -i`, no PATH) makes
// the store's directory, 0700, cleans the job, records it and exits 0:
// the node is not drained. A clean job's epilog and the prolog make it as
// well, with nothing but their one line.
func TestEpilogAsSlurmdMakesStoreDir(t *testing.T) {
	t.Parallel()
	requireRoot(t)
	root := testenv.SimNode(t, 2)
	scontrol, drained := fakeScontrol(t)
	slurmEnv := func(job string) []string {
		return []string{"SLURM_JOB_ID=" + job, "SLURM_JOBID=" + job, "SLURM_JOB_UID=0", "SLURM_JOB_USER=root", "SLURM_JOB_GID=0",
			"SLURMD_NODENAME=node-a", "SLURM_SCRIPT_CONTEXT=epilog_slurmd", "SLURM_JOB_GPUS=0", "CUDA_VISIBLE_DEVICES=0", "GPU_DEVICE_ORDINAL=0"}
	}

	// A job that left a fork orphan in its cgroup.
	job := testenv.SlurmJobID()
	w := testenv.StartWorkload(t, root, 0, 512, 1)
	intoJob(t, job, w.Children...)
	w.KillParent(t)
	dir := filepath.Join(t.TempDir(), "var", "lib", "gpu-orphan")
	db := filepath.Join(dir, "remediator.db")
	code, out := slurmdRun(t, hookScript(t, "epilog", root, db, scontrol), slurmEnv(job)...)
	if code != 0 || !strings.HasPrefix(out, "gpu-orphan epilog: job "+job+": signalled 1 processes on GPU 0") || !strings.Contains(out, "GPU 0 clean") ||
		strings.Count(out, "\n") != 1 {
		t.Fatalf("the epilog as slurmd runs it, its store's directory missing: exit %d, want 0 and one line\n%s", code, out)
	}
	testenv.WaitGone(t, w.Children[0])
	checkStoreDir(t, dir)
	as, _ := actions(t, db)
	if len(as) != 1 || as[0].Source != "epilog" || as[0].State != remediate.StateSucceeded || as[0].Job == nil || as[0].Job.SlurmJob != job {
		t.Errorf("actions %+v, want the epilog's for job %s, succeeded", as, job)
	}
	if _, err := os.Stat(drained); err == nil {
		t.Errorf("the epilog ran scontrol (drained the node)")
	}

	// A job that left nothing: no warning that the store cannot be opened.
	dir = filepath.Join(t.TempDir(), "var", "lib", "gpu-orphan")
	code, out = slurmdRun(t, hookScript(t, "epilog", root, filepath.Join(dir, "remediator.db"), scontrol), slurmEnv(testenv.SlurmJobID())...)
	if code != 0 || !strings.Contains(out, "nothing of the job holds a GPU; GPU 0 clean") || strings.Count(out, "\n") != 1 {
		t.Errorf("the epilog of a clean job, its store's directory missing: exit %d, want 0 and one line\n%s", code, out)
	}
	checkStoreDir(t, dir)

	// The prolog, installed the same way.
	dir = filepath.Join(t.TempDir(), "var", "lib", "gpu-orphan")
	env := slurmEnv(testenv.SlurmJobID())
	env[6] = "SLURM_SCRIPT_CONTEXT=prolog_slurmd"
	code, out = slurmdRun(t, hookScript(t, "prolog", root, filepath.Join(dir, "remediator.db"), scontrol), env...)
	if code != 0 || !strings.Contains(out, "GPU 0 clean") || strings.Count(out, "\n") != 1 {
		t.Errorf("the prolog, its store's directory missing: exit %d, want 0 and one line\n%s", code, out)
	}
	checkStoreDir(t, dir)
}

// TestCleanActStoreCannotOpen: `clean --act` whose --store.path cannot be
// opened says that nothing was signalled, and why, instead of a plan that
// says "Will signal"; the workers live. With a store whose directory does
// not exist yet it makes it, 0700, as the remediator does, and records
// the cleanup there.
func TestCleanActStoreCannotOpen(t *testing.T) {
	t.Parallel()
	root := testenv.SimNode(t, 2)
	w := testenv.StartWorkload(t, root, 1, 1024, 2)
	w.KillParent(t)
	open := filepath.Join(t.TempDir(), "open")
	if err := os.Mkdir(open, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(open, 0o777); err != nil {
		t.Fatal(err)
	}
	code, stdout, stderr := runBin(t, "--backend=sim", "--sim.root="+root, "clean", "--gpu", "1", "--act", "--policy=all-holders", "--grace=1s",
		"--store.path="+filepath.Join(open, "audit.db"))
	want := "gpu-orphan: nothing was signalled: the audit store " + filepath.Join(open, "audit.db") + " cannot be opened: the store directory " + open +
		" has mode 0777, so users other than its owner could replace the audit database: run `chmod 0700 " + open + "`\n"
	if code != 1 || stderr != want || strings.Contains(stdout, "Will signal") {
		t.Errorf("clean --act with a store it cannot open: exit %d\nstdout:\n%s\nstderr: %q\nwant exit 1, no \"Will signal\", stderr %q", code, stdout, stderr, want)
	}
	for _, c := range w.Children {
		if !testenv.Alive(c) {
			t.Errorf("worker %d was signalled without a record", c)
		}
	}

	dir := filepath.Join(t.TempDir(), "var", "lib", "gpu-orphan")
	db := filepath.Join(dir, "audit.db")
	code, stdout, stderr = runBin(t, "--backend=sim", "--sim.root="+root, "clean", "--gpu", "1", "--act", "--policy=all-holders", "--grace=1s", "--store.path="+db)
	if code != 0 || !strings.Contains(stdout, "Will signal") || !strings.Contains(stdout, "Memory back: 1032 MiB freed") || !strings.Contains(stdout, "Recorded as action") {
		t.Errorf("clean --act, its store's directory missing: exit %d, want 0, the memory back and recorded\n%s%s", code, stdout, stderr)
	}
	checkStoreDir(t, dir)
	if as, _ := actions(t, db); len(as) != 1 || as[0].Source != "cli" || as[0].State != remediate.StateSucceeded {
		t.Errorf("actions %+v, want clean's, succeeded", as)
	}
}
