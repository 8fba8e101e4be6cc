package main

// The hooks and the node agent at once (issue 24, items 7-9): one action
// per GPU at a time, the actions a killed hook leaves running, and a
// comm that tries to forge the hook's one line.

import (
	"bytes"
	"encoding/json"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/kill"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

// agentToken is testenv.NodeAgent's token.
const agentToken = "node-agent-test-token-0123456789abcdef"

// gpuUUID is the UUID of GPU index of the simulated node.
func gpuUUID(t *testing.T, root string, index int) string {
	t.Helper()
	return simGPU(t, root, index).Device.UUID
}

// alertAgent sends the node agent Alertmanager's webhook with one firing
// GPUOrphanMemory alert for the GPU uuid of node-a.
func alertAgent(t *testing.T, url, uuid string) {
	t.Helper()
	body, _ := json.Marshal(map[string]any{
		"version": "4", "groupKey": "{}:{alertname=\"GPUOrphanMemory\"}", "truncatedAlerts": 0, "status": "firing",
		"receiver": "gpu-orphan", "groupLabels": map[string]string{}, "commonLabels": map[string]string{},
		"commonAnnotations": map[string]string{}, "externalURL": "http://alertmanager",
		"alerts": []map[string]any{{
			"status": "firing", "labels": map[string]string{"alertname": "GPUOrphanMemory", "node": "node-a", "uuid": uuid},
			"annotations": map[string]string{}, "startsAt": time.Now().Format(time.RFC3339Nano), "endsAt": "0001-01-01T00:00:00Z",
			"generatorURL": "", "fingerprint": "00000000000000f1",
		}},
	})
	req, _ := http.NewRequest(http.MethodPost, url+"/api/v1/alerts", bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+agentToken)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("POST /api/v1/alerts: %s", resp.Status)
	}
}

// startEpilog starts the real epilog binary in the background, as slurmd
// does, and returns it with its output.
func startEpilog(t *testing.T, env []string, args ...string) (*exec.Cmd, *bytes.Buffer) {
	t.Helper()
	cmd := exec.Command(testenv.Bin(t, "gpu-orphan"), args...)
	cmd.Env = append([]string{}, env...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill() // our child: os.Process never reaches another
		cmd.Wait()
	})
	return cmd, &out
}

// sigtermed waits until the store holds an action of source whose SIGTERM
// to each of pids is recorded, and returns it.
func sigtermed(t *testing.T, db, source string, pids ...int) remediate.Action {
	t.Helper()
	var found remediate.Action
	testenv.Eventually(t, 30*time.Second, "the "+source+" to send SIGTERM to the workers", func() bool {
		as, events := actionsIfAny(t, db)
		for _, a := range as {
			if a.Source != source {
				continue
			}
			sent := map[int]bool{}
			for _, e := range events[a.ID] {
				var d struct {
					PID    int    `json:"pid"`
					Signal string `json:"signal"`
				}
				if e.Kind == "signal" && json.Unmarshal(e.Detail, &d) == nil && d.Signal == "SIGTERM" {
					sent[d.PID] = true
				}
			}
			if !slices.ContainsFunc(pids, func(p int) bool { return !sent[p] }) {
				found = a
				return true
			}
		}
		return false
	})
	return found
}

// actionsIfAny is actions, for a store that may not exist yet.
func actionsIfAny(t *testing.T, path string) ([]remediate.Action, map[string][]store.Event) {
	t.Helper()
	if _, err := os.Stat(path); err != nil {
		return nil, nil
	}
	as, events, _ := readActions(t, path)
	return as, events
}

// waitFinal waits until the store's first action that match picks
// (named what) has ended, and returns it with the store's events.
func waitFinal(t *testing.T, db, what string, match func(remediate.Action) bool) (remediate.Action, map[string][]store.Event) {
	t.Helper()
	var found remediate.Action
	var events map[string][]store.Event
	testenv.Eventually(t, 60*time.Second, what+" to end", func() bool {
		var as []remediate.Action
		as, events = actionsIfAny(t, db)
		i := slices.IndexFunc(as, match)
		if i < 0 || !as[i].State.Final() {
			return false
		}
		found = as[i]
		return true
	})
	return found, events
}

// eventDetail returns the detail of an action's first event of kind.
func eventDetail(es []store.Event, kind string) (map[string]any, bool) {
	for _, e := range es {
		if e.Kind == kind {
			var d map[string]any
			_ = json.Unmarshal(e.Detail, &d)
			return d, true
		}
	}
	return nil, false
}

// TestEpilogAndAgentTakeTurns (issue 24, item 8): job 7's trainer died
// and its two workers, which ignore SIGTERM, hold its 520 MiB; the epilog
// (--grace=30s) sends them SIGTERM, and while it waits out its grace the
// node agent (--act) gets an alert for the same GPU. The agent waits for
// the epilog's turn on the GPU, says whose it waited for (the epilog's
// action and PID), plans again from a fresh snapshot, and finds nothing
// left; the epilog's own SIGKILL ends the workers. One action signalled
// them, and the memory freed is counted once, in the store and in
// `gpu-orphan report`. The old code: the agent SIGKILLed them at once
// (exited_after_sigkill), the epilog recorded them exited_after_sigterm,
// and both actions claimed the memory.
func TestEpilogAndAgentTakeTurns(t *testing.T) {
	t.Parallel()
	requireRoot(t)
	root := testenv.SimNode(t, 1)
	uuid := gpuUUID(t, root, 0)
	job := testenv.SlurmJobID()
	w := testenv.StartWorkload(t, root, 0, 520, 2, "--ignore-sigterm")
	intoJob(t, job, append([]int{w.PID}, w.Children...)...)
	db := filepath.Join(t.TempDir(), "remediator.db")
	agent := testenv.NodeAgent(t, root, db, "--act", "--remediate.min-age=0s", "--remediate.grace=1s", "--remediate.verify-timeout=10s")
	w.KillParent(t)
	waitInherited(t, db, w.Children...)
	before := usedMiB(t, root, 0)

	epilog, out := startEpilog(t, []string{"SLURM_JOB_ID=" + job, "SLURM_JOB_UID=0", "SLURM_JOB_GPUS=0"},
		"--backend=sim", "--sim.root="+root, "epilog", "--store.path="+db, "--grace=30s", "--timeout=120s", "--log.syslog-socket=")
	ep := sigtermed(t, db, remediate.SourceEpilog, w.Children...)
	alertAgent(t, agent, uuid)

	err := epilog.Wait()
	if code := testenv.ExitCode(t, err); code != 0 {
		t.Fatalf("epilog: exit %d\n%s", code, out)
	}
	for _, c := range w.Children {
		testenv.WaitGone(t, c)
	}
	ag, _ := waitFinal(t, db, "the agent's action", func(a remediate.Action) bool { return a.Source == remediate.SourceWebhook })
	as, events := actions(t, db)
	i := slices.IndexFunc(as, func(a remediate.Action) bool { return a.ID == ep.ID })
	ep = as[i]
	if ep.State != remediate.StateSucceeded {
		t.Errorf("the epilog's action %s: %s (%s), want succeeded", ep.ID, ep.State, ep.Reason)
	}
	for _, tg := range ep.Targets {
		if tg.Outcome != kill.OutcomeExitedAfterSIGKILL {
			t.Errorf("the epilog's target %d: %s, want %s after its own 30 s grace: someone else signalled it meanwhile", tg.PID, tg.Outcome, kill.OutcomeExitedAfterSIGKILL)
		}
	}
	d, ok := eventDetail(events[ag.ID], "waited")
	if !ok || d["for_action"] != ep.ID || d["source"] != remediate.SourceEpilog || d["pid"] != float64(epilog.Process.Pid) {
		t.Errorf("the agent's action %s: waited event %v (found %v), want it to name the epilog's action %s and PID %d", ag.ID, d, ok, ep.ID, epilog.Process.Pid)
	}
	if _, signalled := eventDetail(events[ag.ID], "signal"); signalled || len(ag.Targets) != 0 {
		t.Errorf("the agent's action %s signalled %+v after the epilog's; want nothing left to signal", ag.ID, ag.Targets)
	}
	after := usedMiB(t, root, 0)
	var freed uint64
	for _, a := range as {
		freed += a.FreedBytes
	}
	if freed>>20 != before-after || ag.FreedBytes != 0 {
		t.Errorf("freed %d MiB over all actions (the agent's %d MiB), want the GPU's %d MiB once", freed>>20, ag.FreedBytes>>20, before-after)
	}
	rep, err := exec.Command(testenv.Bin(t, "gpu-orphan"), "report", "--store.path="+db, "--by=source", "-o", "json").Output()
	var r struct {
		Rows []struct {
			Key        string `json:"key"`
			FreedBytes uint64 `json:"freed_bytes"`
		} `json:"rows"`
	}
	if err != nil || json.Unmarshal(rep, &r) != nil {
		t.Fatalf("report: %v\n%s", err, rep)
	}
	var reported uint64
	for _, row := range r.Rows {
		reported += row.FreedBytes
	}
	if reported>>20 != before-after {
		t.Errorf("report counts %d MiB freed, want %d once\n%s", reported>>20, before-after, rep)
	}
}

// TestEpilogKilledDuringGrace (issue 24, item 9): the epilog is killed
// with SIGKILL while it waits out its grace between SIGTERM and SIGKILL;
// its workers, which ignore SIGTERM, live on. The node agent, as the next
// reader of the store, resolves the epilog's action as interrupted (its
// process is gone, named by PID and start time), takes it up again as it
// does its own, and cleans the workers from a fresh snapshot, with no
// alert. The old code left the action running until the agent restarted,
// and the workers holding the memory until an alert came.
func TestEpilogKilledDuringGrace(t *testing.T) {
	t.Parallel()
	requireRoot(t)
	root := testenv.SimNode(t, 1)
	job := testenv.SlurmJobID()
	w := testenv.StartWorkload(t, root, 0, 1024, 2, "--ignore-sigterm")
	intoJob(t, job, append([]int{w.PID}, w.Children...)...)
	db := filepath.Join(t.TempDir(), "remediator.db")
	testenv.NodeAgent(t, root, db, "--act", "--remediate.min-age=0s", "--remediate.grace=1s", "--remediate.verify-timeout=10s")
	w.KillParent(t)
	waitInherited(t, db, w.Children...)

	epilog, _ := startEpilog(t, []string{"SLURM_JOB_ID=" + job, "SLURM_JOB_UID=0", "SLURM_JOB_GPUS=0"},
		"--backend=sim", "--sim.root="+root, "epilog", "--store.path="+db, "--grace=30s", "--timeout=120s", "--log.syslog-socket=")
	ep := sigtermed(t, db, remediate.SourceEpilog, w.Children...)
	if err := epilog.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	epilog.Wait()
	for _, c := range w.Children {
		if !testenv.Alive(c) {
			t.Fatalf("worker %d died of the epilog's SIGTERM, which it ignores", c)
		}
	}

	for _, c := range w.Children {
		testenv.WaitGone(t, c)
	}
	next, events := waitFinal(t, db, "the agent's new attempt", func(a remediate.Action) bool { return a.RetryOf == ep.ID })
	as, _ := actions(t, db)
	ep = as[slices.IndexFunc(as, func(a remediate.Action) bool { return a.ID == ep.ID })]
	if want := "the epilog that ran it (PID " + strconv.Itoa(epilog.Process.Pid) + ") ended mid-action"; ep.State != remediate.StateInterrupted || ep.Reason != want {
		t.Errorf("the epilog's action: %s (%s), want interrupted (%s)", ep.State, ep.Reason, want)
	}
	if d, ok := eventDetail(events[ep.ID], "interrupted"); !ok || d["resumed_by"] != next.ID {
		t.Errorf("interrupted event %v, want it to name the new attempt %s", d, next.ID)
	}
	if next.State != remediate.StateSucceeded || next.Source != remediate.SourceEpilog || next.Job == nil || next.Job.SlurmJob != job {
		t.Errorf("the new attempt: %s (%s), source %s, job %+v; want succeeded, for the epilog's job %s", next.State, next.Reason, next.Source, next.Job, job)
	}
	var pids []int
	for _, tg := range next.Targets {
		pids = append(pids, tg.PID)
	}
	slices.Sort(pids)
	if want := slices.Sorted(slices.Values(w.Children)); !slices.Equal(pids, want) {
		t.Errorf("the new attempt signalled %v, want the workers %v", pids, want)
	}
}

// TestEpilogEscapesComm (issue 24, item 7): a worker that names itself
// "x\e[2J\nFAKE ok" holds memory on the job's GPU (no process of the job);
// the epilog fails naming it. Its one line, on stderr and to syslog, shows
// the escape and the newline escaped: nothing clears the terminal, and no
// forged second line reads "FAKE ok".
func TestEpilogEscapesComm(t *testing.T) {
	t.Parallel()
	requireRoot(t)
	root := testenv.SimNode(t, 1)
	job := testenv.SlurmJobID()
	const comm = "x\x1b[2J\nFAKE ok"
	other := testenv.StartWorkload(t, root, 0, 1024, 1, "--child-comm", comm)
	other.KillParent(t)
	sock := filepath.Join(t.TempDir(), "log")
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: sock, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()

	code, out := runHook(t, []string{"SLURM_JOB_ID=" + job, "SLURM_JOB_UID=0", "SLURM_JOB_GPUS=0"},
		"--backend=sim", "--sim.root="+root, "epilog", "--store.path=", "--grace=1s", "--verify-timeout=1s", "--log.syslog-socket="+sock)
	escaped := `(x\x1b[2J\nFAKE ok)`
	if code != 1 || !strings.Contains(out, escaped) || strings.ContainsAny(out, "\x1b") || strings.Count(strings.TrimSpace(out), "\n") != 0 {
		t.Errorf("epilog: exit %d, output %q; want exit 1 and one line naming the worker as %s", code, out, escaped)
	}
	if err := conn.SetReadDeadline(time.Now().Add(testenv.Scale(10 * time.Second))); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 8192)
	n, err := conn.Read(buf)
	if err != nil {
		t.Fatalf("no syslog message: %v", err)
	}
	msg := string(buf[:n])
	if !strings.Contains(msg, escaped) || strings.ContainsAny(msg, "\x1b") || strings.Contains(strings.TrimSuffix(msg, "\n"), "\n") {
		t.Errorf("syslog message %q: want the worker named as %s, on one line", msg, escaped)
	}
	if !testenv.Alive(other.Children[0]) {
		t.Errorf("the worker of no job was signalled")
	}
}

// TestEpilogWaitsForAgent (issue 24, item 8, the other order): the node
// agent (--act, an 8 s grace, stretched on a slow machine) is signalling
// job 7's SIGTERM-ignoring workers for an alert when the job's epilog
// runs. The epilog waits for
// the agent's turn on the GPU, says so in its one line (the agent's action
// and PID), plans again, finds nothing of the job left, and exits 0; its
// action is skipped and frees nothing. The agent's SIGKILL, after its own
// grace, ended the workers. The old code: the epilog signalled them
// during the agent's grace, and both claimed the memory.
func TestEpilogWaitsForAgent(t *testing.T) {
	t.Parallel()
	requireRoot(t)
	root := testenv.SimNode(t, 1)
	uuid := gpuUUID(t, root, 0)
	job := testenv.SlurmJobID()
	w := testenv.StartWorkload(t, root, 0, 520, 2, "--ignore-sigterm")
	intoJob(t, job, append([]int{w.PID}, w.Children...)...)
	db := filepath.Join(t.TempDir(), "remediator.db")
	// The epilog must start within the agent's grace: on a loaded machine
	// starting it took more than 5 s.
	grace := testenv.Scale(8 * time.Second)
	agent := testenv.NodeAgent(t, root, db, "--act", "--remediate.min-age=0s", "--remediate.grace="+grace.String(), "--remediate.verify-timeout=10s")
	w.KillParent(t)
	waitInherited(t, db, w.Children...)
	alertAgent(t, agent, uuid)
	ag := sigtermed(t, db, remediate.SourceWebhook, w.Children...)

	code, out := runHook(t, []string{"SLURM_JOB_ID=" + job, "SLURM_JOB_UID=0", "SLURM_JOB_GPUS=0"},
		"--backend=sim", "--sim.root="+root, "epilog", "--store.path="+db, "--grace=1s", "--timeout=120s", "--log.syslog-socket=")
	if want := "gpu-orphan epilog: job " + job + ": waited for action " + ag.ID + " (the remediator, PID "; code != 0 || !strings.Contains(out, want) ||
		!strings.Contains(out, "on GPU 0, which left nothing to signal") {
		t.Errorf("epilog: exit %d\n%s\nwant exit 0 and a line that says it waited for the agent's action: %q", code, out, want)
	}
	for _, c := range w.Children {
		testenv.WaitGone(t, c)
	}
	as, events := actions(t, db)
	ag = as[slices.IndexFunc(as, func(a remediate.Action) bool { return a.ID == ag.ID })]
	i := slices.IndexFunc(as, func(a remediate.Action) bool { return a.Source == remediate.SourceEpilog })
	if i < 0 {
		t.Fatalf("no epilog action: %+v", as)
	}
	ep := as[i]
	if ag.State != remediate.StateSucceeded || ag.FreedBytes == 0 {
		t.Errorf("the agent's action: %s (%s), freed %d", ag.State, ag.Reason, ag.FreedBytes)
	}
	for _, tg := range ag.Targets {
		if tg.Outcome != kill.OutcomeExitedAfterSIGKILL {
			t.Errorf("the agent's target %d: %s, want %s after its own grace: someone else signalled it meanwhile", tg.PID, tg.Outcome, kill.OutcomeExitedAfterSIGKILL)
		}
	}
	if _, signalled := eventDetail(events[ep.ID], "signal"); signalled || ep.State != remediate.StateSkipped || ep.FreedBytes != 0 {
		t.Errorf("the epilog's action: %s (%s), freed %d, signalled %v; want skipped, nothing freed or signalled", ep.State, ep.Reason, ep.FreedBytes, signalled)
	}
	if d, ok := eventDetail(events[ep.ID], "waited"); !ok || d["for_action"] != ag.ID || d["source"] != remediate.SourceWebhook {
		t.Errorf("the epilog's waited event %v, want the agent's action %s", d, ag.ID)
	}
}

// TestHookResolvesKilledEpilog (issue 24, item 9, with no node agent): an
// epilog killed with SIGKILL during its grace leaves its action running;
// the next hook that opens the store (the epilog of another job, which has
// nothing to do) resolves it as interrupted, naming the killed epilog's
// PID, and queues the attempt that a node agent will take up. The old
// code left it running.
func TestHookResolvesKilledEpilog(t *testing.T) {
	t.Parallel()
	requireRoot(t)
	root := testenv.SimNode(t, 1)
	job := testenv.SlurmJobID()
	w := testenv.StartWorkload(t, root, 0, 1024, 1, "--ignore-sigterm")
	intoJob(t, job, append([]int{w.PID}, w.Children...)...)
	w.KillParent(t)
	db := filepath.Join(t.TempDir(), "remediator.db")
	epilog, _ := startEpilog(t, []string{"SLURM_JOB_ID=" + job, "SLURM_JOB_UID=0", "SLURM_JOB_GPUS=0"},
		"--backend=sim", "--sim.root="+root, "epilog", "--store.path="+db, "--grace=30s", "--timeout=120s", "--log.syslog-socket=")
	ep := sigtermed(t, db, remediate.SourceEpilog, w.Children...)
	if err := epilog.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	epilog.Wait()

	code, out := runHook(t, []string{"SLURM_JOB_ID=" + testenv.SlurmJobID(), "SLURM_JOB_UID=0"},
		"--backend=sim", "--sim.root="+root, "epilog", "--store.path="+db, "--log.syslog-socket=")
	if code != 0 {
		t.Errorf("the next epilog: exit %d\n%s", code, out)
	}
	as, events := actions(t, db)
	ep = as[slices.IndexFunc(as, func(a remediate.Action) bool { return a.ID == ep.ID })]
	if want := "the epilog that ran it (PID " + strconv.Itoa(epilog.Process.Pid) + ") ended mid-action"; ep.State != remediate.StateInterrupted || ep.Reason != want {
		t.Errorf("the killed epilog's action: %s (%s), want interrupted (%s)", ep.State, ep.Reason, want)
	}
	d, _ := eventDetail(events[ep.ID], "interrupted")
	i := slices.IndexFunc(as, func(a remediate.Action) bool { return a.RetryOf == ep.ID })
	if i < 0 || as[i].State != remediate.StateQueued || d["resumed_by"] != as[i].ID {
		t.Errorf("actions %+v, interrupted event %v: want a queued attempt after %s", as, d, ep.ID)
	}
	if !testenv.Alive(w.Children[0]) {
		t.Errorf("worker %d died of a SIGTERM it ignores", w.Children[0])
	}
}
