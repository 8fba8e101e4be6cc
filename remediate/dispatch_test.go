package remediate_test

import (
	"encoding/json"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/remediate"
)

// TestDispatcherRoutesAndLimits: one dispatcher in front of two node agents
// on loopback. Each alert reaches the agent of the node it names, and the
// fleet limit (one node per window) holds the second node back.
func TestDispatcherRoutesAndLimits(t *testing.T) {
	skipShort(t)
	t.Parallel()
	rootA, rootB := testenv.SimNode(t, 2), testenv.SimNode(t, 2)
	var jobs []*testenv.Workload
	for _, root := range []string{rootA, rootB} {
		jobs = append(jobs, testenv.StartWorkload(t, root, 1, 1024, 1))
	}
	// The agents run before the jobs die, as on a node: they see the owners
	// alive with their workers.
	urlA, _ := startAgent(t, rootA, filepath.Join(t.TempDir(), "a.db"), "--node.name=node-a")
	urlB, _ := startAgent(t, rootB, filepath.Join(t.TempDir(), "b.db"), "--node.name=node-b")
	for _, w := range jobs {
		w.KillParent(t)
	}

	targets := filepath.Join(t.TempDir(), "targets.json")
	b, _ := json.Marshal(map[string]string{"node-a": urlA, "node-b": urlB})
	if err := os.WriteFile(targets, b, 0o600); err != nil {
		t.Fatal(err)
	}
	addr := testenv.FreeAddr(t)
	testenv.Daemon(t, testenv.Bin(t, "gpu-orphan-dispatcher"), "--web.listen-address="+addr,
		"--auth.token-file="+tokenFile(t), "--dispatch.token-file="+tokenFile(t), "--dispatch.targets-file="+targets,
		"--dispatch.max-nodes=1", "--dispatch.max-fraction=1", "--dispatch.window=1h",
		"--store.path="+filepath.Join(t.TempDir(), "d.db"), "--log.level=debug")
	dispatcher := "http://" + addr
	waitReady(t, http.DefaultClient, dispatcher)

	startsAt := time.Now().Add(-time.Minute)
	code, body := post(t, dispatcher, token, payload(
		alert("firing", "node-a", gpuUUID(t, rootA, 1), fp(10), startsAt),
		alert("firing", "node-b", gpuUUID(t, rootB, 1), fp(11), startsAt),
		alert("firing", "node-c", gpuUUID(t, rootB, 1), fp(12), startsAt), // on no allow-list: rejected
	))
	if code != http.StatusOK {
		t.Fatalf("dispatcher: %d %s", code, body)
	}
	if r := results(t, body); r["accepted"] != 2 || r["rejected"] != 1 {
		t.Fatalf("dispatcher results %v", r)
	}

	// Exactly one node's agent gets its alert and plans (dry run); the
	// other is held back by the fleet limit: forwarded nowhere, kept queued.
	agents := map[string]string{"node-a": urlA, "node-b": urlB}
	fps := map[string]string{"node-a": fp(10), "node-b": fp(11)}
	var served string
	testenv.Eventually(t, 20*time.Second, "one node's agent to act", func() bool {
		for node, url := range agents {
			if as := actions(t, url); len(as) == 1 && as[0].State == remediate.StateDryRun {
				served = node
				if as[0].AlertFingerprint != fps[node] || as[0].Node != node || len(as[0].Targets) != 1 {
					t.Errorf("%s action: %+v", node, as[0])
				}
				return true
			}
		}
		return false
	})
	held := "node-a"
	if served == "node-a" {
		held = "node-b"
	}
	time.Sleep(2 * time.Second)
	if as := actions(t, agents[held]); len(as) != 0 {
		t.Fatalf("%s got %d actions despite the fleet limit", held, len(as))
	}
	var queued bool
	for _, d := range actions(t, dispatcher) {
		if d.Node == held {
			queued = d.State == remediate.StateQueued
			t.Logf("dispatcher's %s record: %s %s", held, d.State, d.Reason)
		}
	}
	if !queued {
		t.Errorf("%s's alert must stay queued behind the fleet limit: %+v", held, actions(t, dispatcher))
	}
	_, mfs := testenv.Scrape(t, dispatcher+"/metrics")
	if v, _ := testenv.Value(mfs, "gpu_orphan_remediator_limited_total", map[string]string{"limit": "fleet_rate"}); v < 1 {
		t.Errorf("fleet_rate limit not counted: %s", testenv.Describe(mfs, "gpu_orphan_remediator_limited_total"))
	}
}

// TestDispatcherKeepsAgentResults: two node agents, each with a Slurm job
// that died leaving a worker on its memory, behind one dispatcher. The
// dispatcher forwards each alert, follows the agent's action to its end,
// and keeps the agent's result with the dead owner's identity: its API
// filters by Slurm job and `gpu-orphan report --url` of the dispatcher
// covers both nodes in one call.
func TestDispatcherKeepsAgentResults(t *testing.T) {
	skipShort(t)
	t.Parallel()
	type node struct {
		name, root, url, job string
		w                    *testenv.Workload
	}
	nodes := []*node{{name: "node-a"}, {name: "node-b"}}
	targets := map[string]string{}
	for _, n := range nodes {
		n.root = testenv.SimNode(t, 2)
		n.w, n.job = slurmJob(t, n.root)
		n.url, _ = startAgent(t, n.root, filepath.Join(t.TempDir(), n.name+".db"), "--node.name="+n.name, "--act")
		targets[n.name] = n.url
	}
	for _, n := range nodes {
		n.w.KillParent(t)
	}
	targetsFile := filepath.Join(t.TempDir(), "targets.json")
	b, _ := json.Marshal(targets)
	if err := os.WriteFile(targetsFile, b, 0o600); err != nil {
		t.Fatal(err)
	}
	addr := testenv.FreeAddr(t)
	testenv.Daemon(t, testenv.Bin(t, "gpu-orphan-dispatcher"), "--web.listen-address="+addr,
		"--auth.token-file="+tokenFile(t), "--dispatch.token-file="+tokenFile(t), "--dispatch.targets-file="+targetsFile,
		"--dispatch.max-nodes=2", "--dispatch.max-fraction=1", "--dispatch.window=1h",
		"--store.path="+filepath.Join(t.TempDir(), "d.db"), "--log.level=debug")
	dispatcher := "http://" + addr
	waitReady(t, http.DefaultClient, dispatcher)

	startsAt := time.Now().Add(-time.Minute)
	code, body := post(t, dispatcher, token, payload(
		alert("firing", "node-a", gpuUUID(t, nodes[0].root, 1), fp(20), startsAt),
		alert("firing", "node-b", gpuUUID(t, nodes[1].root, 1), fp(21), startsAt),
	))
	if code != http.StatusOK || results(t, body)["accepted"] != 2 {
		t.Fatalf("dispatcher: %d %s", code, body)
	}

	// The dispatcher's record of each alert ends with its agent's result.
	byNode := map[string]remediate.Action{}
	testenv.Eventually(t, 40*time.Second, "the dispatcher to hold both agents' results", func() bool {
		clear(byNode)
		for _, a := range actions(t, dispatcher) {
			if a.Agent != nil && a.Agent.State.Final() {
				byNode[a.Node] = a
			}
		}
		return len(byNode) == 2
	})
	for _, n := range nodes {
		d := byNode[n.name]
		as := actions(t, n.url)
		if len(as) != 1 {
			t.Fatalf("%s's agent has %d actions, want 1", n.name, len(as))
		}
		ag := as[0]
		if ag.State != remediate.StateSucceeded || d.Agent.State != ag.State || d.Agent.ActionID != ag.ID || d.Agent.URL != n.url || d.Source != "dispatch" {
			t.Errorf("%s: dispatcher's record %s (agent %+v), agent's action %s %s (%s)", n.name, d.State, d.Agent, ag.ID, ag.State, ag.Reason)
		}
		if d.FreedBytes != ag.FreedBytes || d.FreedBytes < 1024<<20 || d.Before == nil || d.After == nil ||
			d.Before.UnownedAgeSeconds != ag.Before.UnownedAgeSeconds || len(d.Targets) != 1 || d.Targets[0].PID != n.w.Children[0] {
			t.Errorf("%s: the dispatcher kept freed %d, before %+v, targets %+v; the agent has freed %d, before %+v",
				n.name, d.FreedBytes, d.Before, d.Targets, ag.FreedBytes, ag.Before)
		}
		if len(d.DeadOwners) != 1 || !d.DeadOwners[0].Known || d.DeadOwners[0].SlurmJob != n.job || d.DeadOwners[0].User != "root" ||
			int(d.DeadOwners[0].PID) != n.w.PID || d.DeadOwners[0].Comm != "gpu-orphan-sim" {
			t.Errorf("%s: the dispatcher's dead owners %+v, want PID %d of Slurm job %s", n.name, d.DeadOwners, n.w.PID, n.job)
		}
		if got := actionsWhere(t, dispatcher, url.Values{"slurm_job": {n.job}}); len(got) != 1 || got[0].Node != n.name {
			t.Errorf("dispatcher ?slurm_job=%s: %+v", n.job, got)
		}
	}

	// One call for the fleet.
	rows := runReport(t, "--url="+dispatcher, "--auth.token-file="+tokenFile(t), "--by=slurm_job")
	if len(rows) != 2 {
		t.Fatalf("report --by=slurm_job of the dispatcher: %+v, want both jobs", rows)
	}
	for _, n := range nodes {
		if r, ok := rowOf(rows, n.job); !ok || r.Events != 1 || r.FreedBytes != byNode[n.name].FreedBytes || r.GiBHours <= 0 {
			t.Errorf("report row of job %s: %+v (rows %+v)", n.job, r, rows)
		}
	}
	rows = runReport(t, "--url="+dispatcher, "--auth.token-file="+tokenFile(t), "--by=node")
	if _, a := rowOf(rows, "node-a"); !a || len(rows) != 2 {
		t.Errorf("report --by=node of the dispatcher: %+v", rows)
	}
}
