package main

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/gpu-orphan/gpu-orphan/internal/gpu"
	"github.com/gpu-orphan/gpu-orphan/internal/snapshot"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/remediate/hooks"
)

func TestMain(m *testing.M) { os.Exit(testenv.Main(m)) }

// runBin runs the gpu-orphan binary and returns its exit code, stdout and
// stderr.
func runBin(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	cmd := exec.Command(testenv.Bin(t, "gpu-orphan"), args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	code := testenv.ExitCode(t, cmd.Run())
	return code, stdout.String(), stderr.String()
}

// TestCleanNoSuchGPU: `clean --gpu 7` on a 2-GPU node names the GPUs it
// has and exits 2, as for any other wrong argument, printing no plan.
func TestCleanNoSuchGPU(t *testing.T) {
	t.Parallel()
	root := testenv.SimNode(t, 2)
	for _, id := range []string{"7", "GPU-no-such-uuid"} {
		code, stdout, stderr := runBin(t, "--backend=sim", "--sim.root="+root, "clean", "--gpu", id)
		if want := "gpu-orphan: no GPU " + id + " on this node (it has GPUs 0-1)\n"; code != 2 || stderr != want || stdout != "" {
			t.Errorf("clean --gpu %s: exit %d, stderr %q, stdout %q; want exit 2, stderr %q and no plan", id, code, stderr, stdout, want)
		}
	}
}

// TestCleanDryRunLeavesNoStore: a plan that does not act opens no audit
// database, so --store.path is not created by a dry run.
func TestCleanDryRunLeavesNoStore(t *testing.T) {
	t.Parallel()
	root := testenv.SimNode(t, 2)
	storePath := filepath.Join(t.TempDir(), "audit.db")
	code, stdout, stderr := runBin(t, "--backend=sim", "--sim.root="+root, "clean", "--gpu", "1", "--store.path="+storePath)
	if code != 0 || !bytes.Contains([]byte(stdout), []byte("Nothing to do: below_threshold")) {
		t.Errorf("clean --gpu 1 on an idle node: exit %d\n%s%s", code, stdout, stderr)
	}
	if _, err := os.Stat(storePath); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a dry run created %s (stat: %v)", storePath, err)
	}
}

// TestFlagErrorsNameTheFlag: a wrong value names its flag and exits 2.
func TestFlagErrorsNameTheFlag(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--backend=foo", "ps"}, "gpu-orphan: invalid --backend \"foo\": want one of nvml, sim\n"},
		{[]string{"ps", "-o", "yaml"}, "gpu-orphan: invalid --output \"yaml\": want one of table, json\n"},
		{[]string{"clean", "--gpu=0", "--min-age=soon"}, "gpu-orphan: invalid --min-age \"soon\": want a duration such as 5s, 2m or 1h30m\n"},
		{[]string{"clean", "--gpu=0", "--min-bytes=1Gb"}, "gpu-orphan: invalid --min-bytes \"1Gb\": want a size in bytes, such as 268435456, 256MiB or 1GiB\n"},
		{[]string{"clean", "--gpu=0", "--policy=everything"}, "gpu-orphan: invalid --policy \"everything\": want one of dead-owner, orphaned, all-holders\n"},
	} {
		code, _, stderr := runBin(t, tc.args...)
		if code != 2 || stderr != tc.want {
			t.Errorf("gpu-orphan %v: exit %d, stderr %q; want 2, %q", tc.args, code, stderr, tc.want)
		}
	}
}

func TestDescribeGPUs(t *testing.T) {
	t.Parallel()
	with := func(indices ...int) *snapshot.Snapshot {
		s := &snapshot.Snapshot{}
		for _, i := range indices {
			s.GPUs = append(s.GPUs, snapshot.GPU{Device: gpu.Device{Index: i}})
		}
		return s
	}
	for _, tc := range []struct {
		s    *snapshot.Snapshot
		want string
	}{
		{with(), "it has no GPUs"},
		{with(0), "it has GPU 0"},
		{with(0, 1), "it has GPUs 0-1"},
		{with(3, 0, 1, 2, 5, 7, 6), "it has GPUs 0-3, 5-7"},
		{with(0, 2, 4), "it has GPUs 0, 2, 4"},
		{with(0, 0, 1), "it has GPUs 0-1"}, // MIG instances share their GPU's index
	} {
		if got := hooks.DescribeGPUs(tc.s); got != tc.want {
			t.Errorf("DescribeGPUs(%v) = %q, want %q", tc.s.GPUs, got, tc.want)
		}
	}
}
