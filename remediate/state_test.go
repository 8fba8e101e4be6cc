package remediate_test

import (
	"context"
	"fmt"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

// TestStateSurvivesRemediatorRestart (issue 16, §2): the agent saw a
// trainer alive (not leading its group or session: a job script does) and
// recorded its workers' descent; it is restarted, and the trainer dies
// while it is down. The new agent still proves the workers are the
// trainer's, and names the trainer's user in its record, from its store.
func TestStateSurvivesRemediatorRestart(t *testing.T) {
	skipShort(t)
	t.Parallel()
	root := testenv.SimNode(t, 2)
	db := filepath.Join(t.TempDir(), "r.db")
	url, stop := startAgent(t, root, db, "--act")
	script := testenv.StartScript(t, fmt.Sprintf("%s run --root %s --gpu 1 --mib 2048 --children 2 & wait; sleep 300", simBin(t), root))
	w := script.Ready(t)
	waitRecorded(t, url, 2)
	testenv.Eventually(t, 10*time.Second, "the store to keep the recorded descent", func() bool {
		st, err := store.OpenReadOnly(context.Background(), db)
		if err != nil {
			return false
		}
		defer st.Close()
		b, ok, err := st.GetState(context.Background(), "lineage")
		return err == nil && ok && strings.Contains(string(b), "["+strconv.Itoa(w.Children[1])+",")
	})
	stop(syscall.SIGTERM)
	syscall.Kill(w.PID, syscall.SIGKILL)
	testenv.WaitGone(t, w.PID)

	url, _ = startAgent(t, root, db, "--act")
	a := alertAndWait(t, url, root, 1, fp(140))
	if a.State != remediate.StateSucceeded {
		t.Fatalf("action %s: %s", a.State, a.Reason)
	}
	wantTargets(t, a, w.Children...)
	wantAlive(t, "the job script", script.Cmd.Process.Pid)
	wantUsedMiB(t, root, 1, 0)
	if len(a.DeadOwners) != 1 || !a.DeadOwners[0].Known || a.DeadOwners[0].User != "root" || a.DeadOwners[0].Comm != "gpu-orphan-sim" {
		t.Errorf("dead owners %+v, want the trainer known: root, gpu-orphan-sim", a.DeadOwners)
	}
}
