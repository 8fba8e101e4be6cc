package remediate_test

import (
	"context"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/sim"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

// TestRecordedActionsOnMetrics: the node agent's /metrics counts the
// actions that the Slurm hooks recorded in the store it shares with them:
// those in the store before it started, and a real `gpu-orphan prolog`'s
// failure recorded while it runs.
func TestRecordedActionsOnMetrics(t *testing.T) {
	skipShort(t)
	t.Parallel()
	root := testenv.SimNode(t, 2)
	db := filepath.Join(t.TempDir(), "remediator.db")
	st, err := store.Open(context.Background(), db)
	if err != nil {
		t.Fatal(err)
	}
	uid := 1003
	now := time.Now()
	for _, a := range []remediate.Action{
		{Node: "node-a", Source: remediate.SourceEpilog, State: remediate.StateSucceeded, StartedAt: now, Job: &remediate.JobRef{SlurmJob: "700", UID: &uid, User: "carol"}},
		{Node: "node-a", Source: remediate.SourceEpilog, State: remediate.StateSucceeded, StartedAt: now, Job: &remediate.JobRef{SlurmJob: "701", UID: &uid, User: "carol"}},
		{Node: "node-a", Source: remediate.SourceWebhook, State: remediate.StateSucceeded, StartedAt: now},
		{Node: "node-a", Source: remediate.SourceEpilog, State: remediate.StateRunning, StartedAt: now}, // not finished: not counted
	} {
		if _, err := st.Insert(context.Background(), a); err != nil {
			t.Fatal(err)
		}
	}
	st.Close()
	// Memory that no process holds on GPU 1: the prolog below cannot clean it.
	if err := sim.WriteFaults(root, sim.Faults{GPU: sim.AllGPUs, Leaks: []sim.Leak{{GPU: 1, Bytes: 40 << 30}}}); err != nil {
		t.Fatal(err)
	}
	url, _ := startAgent(t, root, db)

	recorded := func(source string, state remediate.State) float64 {
		return metricValue(t, url, "gpu_orphan_remediator_recorded_actions_total", map[string]string{"source": source, "state": string(state)})
	}
	for _, c := range []struct {
		source string
		state  remediate.State
		want   float64
	}{
		{remediate.SourceEpilog, remediate.StateSucceeded, 2},
		{remediate.SourceWebhook, remediate.StateSucceeded, 1},
		{remediate.SourceProlog, remediate.StateFailed, 0},
		{remediate.SourceCLI, remediate.StateSucceeded, 0},
	} {
		if got := recorded(c.source, c.state); got != c.want {
			t.Errorf("recorded_actions_total{source=%q,state=%q} = %v, want %v", c.source, c.state, got, c.want)
		}
	}
	if v := metricValue(t, url, "gpu_orphan_remediator_recorded_actions_success", nil); v != 1 {
		t.Errorf("recorded_actions_success = %v, want 1", v)
	}

	// slurmd runs the prolog of a job given GPU 1 while the agent runs.
	cmd := exec.Command(testenv.Bin(t, "gpu-orphan"), "--backend=sim", "--sim.root="+root, "prolog", "--store.path="+db, "--log.syslog-socket=")
	cmd.Env = []string{"SLURM_JOB_ID=" + testenv.SlurmJobID(), "SLURM_JOB_UID=0", "SLURM_JOB_GPUS=1"}
	out, err := cmd.CombinedOutput()
	if code := cmd.ProcessState.ExitCode(); code != 1 || !strings.Contains(string(out), "GPU 1 holds 40 GiB with no owner") {
		t.Fatalf("prolog: exit %d (%v)\n%s", code, err, out)
	}
	testenv.Eventually(t, 15*time.Second, "the prolog's failure on /metrics", func() bool {
		return recorded(remediate.SourceProlog, remediate.StateFailed) == 1
	})
	if got := recorded(remediate.SourceEpilog, remediate.StateSucceeded); got != 2 {
		t.Errorf("epilog succeeded = %v after the prolog, want 2", got)
	}
}
