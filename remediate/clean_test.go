package remediate_test

import (
	"errors"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

// TestCleanByHand: `gpu-orphan clean` prints the plan, touches nothing
// without --act, and with --act kills the holders, verifies the memory
// back and records the action.
func TestCleanByHand(t *testing.T) {
	skipShort(t)
	t.Parallel()
	root := testenv.SimNode(t, 2)
	w := testenv.StartWorkload(t, root, 1, 3072, 2)
	// The node agent (a dry run) sees the job alive; clean reads in its
	// store which holders it proved the owner's inheritors.
	storePath := filepath.Join(t.TempDir(), "audit.db")
	startAgent(t, root, storePath)
	w.KillParent(t)
	cli := testenv.Bin(t, "gpu-orphan")
	run := func(args ...string) (string, error) {
		out, err := exec.Command(cli, append([]string{"--backend=sim", "--sim.root=" + root, "clean"}, args...)...).CombinedOutput()
		return string(out), err
	}

	out, err := run("--gpu", "1", "--grace=1s", "--store.path="+storePath)
	if err != nil {
		t.Fatalf("dry run: %v\n%s", err, out)
	}
	for _, want := range []string{"Would signal", strconv.Itoa(w.Children[0]), strconv.Itoa(w.Children[1]), "inherited_from_dead_owner", "Dry run: nothing was signalled"} {
		if !strings.Contains(out, want) {
			t.Errorf("dry run output lacks %q:\n%s", want, out)
		}
	}
	for _, c := range w.Children {
		if !testenv.Alive(c) {
			t.Fatalf("the dry run killed %d", c)
		}
	}

	var exit *exec.ExitError
	if out, err := run("--gpu", "GPU-no-such-gpu"); !errors.As(err, &exit) || exit.ExitCode() != 2 || !strings.Contains(out, "no GPU GPU-no-such-gpu on this node (it has GPUs 0-1)") {
		t.Errorf("an unknown GPU: %v, want exit 2 naming the node's GPUs\n%s", err, out)
	}

	out, err = run("--gpu", gpuUUID(t, root, 1), "--act", "--grace=1s", "--store.path="+storePath)
	if err != nil {
		t.Fatalf("--act: %v\n%s", err, out)
	}
	for _, want := range []string{"Will signal", "exited_after_sigterm", "Memory back: 3080 MiB freed", "Recorded as action"} {
		if !strings.Contains(out, want) {
			t.Errorf("--act output lacks %q:\n%s", want, out)
		}
	}
	for _, c := range w.Children {
		if testenv.Alive(c) {
			t.Errorf("holder %d survived", c)
		}
	}
	if got := usedMiB(t, root, 1); got != 0 {
		t.Errorf("GPU 1 uses %d MiB after clean --act", got)
	}
}
