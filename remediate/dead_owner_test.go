package remediate_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/remediate"
)

// slurmJob starts a 1 GiB job with one forked worker on GPU 1 of the node,
// under the cgroup v2 path that slurmstepd gives a job's step 0, and
// returns it with its job number.
func slurmJob(t *testing.T, root string) (*testenv.Workload, string) {
	t.Helper()
	w := testenv.StartWorkload(t, root, 1, 1024, 1)
	job := testenv.SlurmJobID()
	testenv.IntoCgroup(t, testenv.CgroupV2, testenv.SlurmV2Step(job), w.PID)
	return w, job
}

// actionsWhere lists an agent's actions that match the query.
func actionsWhere(t *testing.T, base string, q url.Values) []remediate.Action {
	t.Helper()
	var out []remediate.Action
	if code := getJSON(t, http.DefaultClient, base+"/api/v1/actions?"+q.Encode(), token, &out); code != http.StatusOK {
		t.Fatalf("GET /api/v1/actions?%s: %d", q.Encode(), code)
	}
	return out
}

// reportRow is one row of `gpu-orphan report -o json`.
type reportRow struct {
	Key        string    `json:"key"`
	Events     int       `json:"events"`
	GiBHours   float64   `json:"gib_hours"`
	FreedBytes uint64    `json:"freed_bytes"`
	Last       time.Time `json:"last"`
}

// runReport runs `gpu-orphan report -o json` with args and returns its rows.
func runReport(t *testing.T, args ...string) []reportRow {
	t.Helper()
	cmd := exec.Command(testenv.Bin(t, "gpu-orphan"), append([]string{"report", "-o", "json"}, args...)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("gpu-orphan report %v: %v: %s", args, err, stderr.String())
	}
	var r struct {
		Rows []reportRow `json:"rows"`
	}
	if err := json.Unmarshal(out, &r); err != nil {
		t.Fatalf("gpu-orphan report %v: %v\n%s", args, err, out)
	}
	return r.Rows
}

func rowOf(rows []reportRow, key string) (reportRow, bool) {
	for _, r := range rows {
		if r.Key == key {
			return r, true
		}
	}
	return reportRow{}, false
}

// TestAuditNamesDeadOwner: a job under a Slurm cgroup (v2) dies with -9
// while its forked worker keeps its context. The remediator, running since
// before the death, cleans it up, and the dead owner's identity is in the
// audit record, the per-user counters, the API's slurm_job and user
// filters, and `gpu-orphan report` from the store and from the API.
func TestAuditNamesDeadOwner(t *testing.T) {
	skipShort(t)
	t.Parallel()
	root := testenv.SimNode(t, 2)
	w, job := slurmJob(t, root)
	storePath := filepath.Join(t.TempDir(), "r.db")
	// Started after the job entered its cgroup: its first snapshot, taken
	// before it serves, sees the owner alive there.
	base, _ := startAgent(t, root, storePath, "--act")
	w.KillParent(t)

	a := alertAndWait(t, base, root, 1, fp(300))
	if a.State != remediate.StateSucceeded || a.FreedBytes < 1024<<20 {
		t.Fatalf("action %s (%s), freed %d MiB", a.State, a.Reason, a.FreedBytes>>20)
	}
	if len(a.DeadOwners) != 1 {
		t.Fatalf("dead owners %+v, want the dead trainer %d", a.DeadOwners, w.PID)
	}
	d := a.DeadOwners[0]
	if int(d.PID) != w.PID || !d.Known || d.SlurmJob != job || d.SlurmStep != "0" || d.User != "root" || d.UID == nil || *d.UID != 0 ||
		d.Comm != "gpu-orphan-sim" || !strings.Contains(d.Cmdline, "--mib 1024") || !strings.HasSuffix(d.Cgroup, testenv.SlurmV2Step(job)) ||
		d.UsedBytes != 1024<<20 || d.LastSeen.IsZero() || d.StartTime == 0 {
		t.Errorf("dead owner %+v, want PID %d of Slurm job %s step 0, root, gpu-orphan-sim, 1024 MiB", d, w.PID, job)
	}

	// The API's filters.
	for _, tc := range []struct {
		q    url.Values
		want int
	}{
		{url.Values{"slurm_job": {job}}, 1},
		{url.Values{"slurm_job": {job + "0"}}, 0},
		{url.Values{"user": {"root"}}, 1},
		{url.Values{"user": {"root"}, "slurm_job": {job}}, 1},
		{url.Values{"user": {"nobody"}}, 0},
	} {
		if got := actionsWhere(t, base, tc.q); len(got) != tc.want || tc.want == 1 && got[0].ID != a.ID {
			t.Errorf("GET /api/v1/actions?%s: %d actions, want %d", tc.q.Encode(), len(got), tc.want)
		}
	}

	// The counters, by user.
	_, mfs := testenv.Scrape(t, base+"/metrics")
	if v, _ := testenv.Value(mfs, "gpu_orphan_remediator_orphaned_events_total", map[string]string{"user": "root"}); v != 1 {
		t.Errorf("orphaned_events_total{user=root} = %v, want 1: %s", v, testenv.Describe(mfs, "gpu_orphan_remediator_orphaned_events_total"))
	}
	if v, _ := testenv.Value(mfs, "gpu_orphan_remediator_freed_bytes_total", map[string]string{"user": "root"}); v != float64(a.FreedBytes) {
		t.Errorf("freed_bytes_total{user=root} = %v, want %d: %s", v, a.FreedBytes, testenv.Describe(mfs, "gpu_orphan_remediator_freed_bytes_total"))
	}

	// The report, from the store (read while the remediator runs) and from
	// the API.
	for _, args := range [][]string{
		{"--store.path=" + storePath},
		{"--url=" + base, "--auth.token-file=" + tokenFile(t)},
	} {
		rows := runReport(t, append(args, "--by=slurm_job")...)
		r, ok := rowOf(rows, job)
		if !ok || len(rows) != 1 || r.Events != 1 || r.FreedBytes != a.FreedBytes || r.GiBHours <= 0 || r.Last.IsZero() {
			t.Errorf("report %v --by=slurm_job: %+v, want one row for job %s, 1 event, %d bytes freed", args, rows, job, a.FreedBytes)
		}
		if want := float64(a.Before.UnownedBytes) / (1 << 30) * a.Before.UnownedAgeSeconds / 3600; r.GiBHours != want {
			t.Errorf("report %v: %v GiB·h, want %v", args, r.GiBHours, want)
		}
	}
	if rows := runReport(t, "--store.path="+storePath, "--by=user"); len(rows) != 1 || rows[0].Key != "root" {
		t.Errorf("report --by=user: %+v", rows)
	}
}

// TestAuditDeadOwnerUnknown: a remediator started after the job died never
// saw the owner alive, nor its workers fork. It records the dead owner with
// known=false and no identity, never a guess, counts it under user
// "unknown", and signals nobody: nothing it saw proves who inherited the
// owner's context (issue 22).
func TestAuditDeadOwnerUnknown(t *testing.T) {
	skipShort(t)
	t.Parallel()
	root := testenv.SimNode(t, 2)
	w, _ := slurmJob(t, root)
	w.KillParent(t)
	storePath := filepath.Join(t.TempDir(), "r.db")
	base, _ := startAgent(t, root, storePath, "--act")

	a := alertAndWait(t, base, root, 1, fp(301))
	if a.State != remediate.StateSkipped || !strings.Contains(a.Reason, "nothing proves") {
		t.Fatalf("action %s (%s), want skipped: nothing proves who inherited", a.State, a.Reason)
	}
	for _, c := range w.Children {
		if !testenv.Alive(c) {
			t.Errorf("worker %d was signalled without proof", c)
		}
	}
	if len(a.DeadOwners) != 1 || int(a.DeadOwners[0].PID) != w.PID || a.DeadOwners[0].UsedBytes != 1024<<20 {
		t.Fatalf("dead owners %+v, want PID %d", a.DeadOwners, w.PID)
	}
	if d := a.DeadOwners[0]; d.Known || d.User != "" || d.UID != nil || d.SlurmJob != "" || d.Comm != "" || d.Cmdline != "" || d.Cgroup != "" || !d.LastSeen.IsZero() {
		t.Errorf("a remediator that never saw the owner alive named it: %+v", d)
	}
	// The JSON says known=false rather than leaving it out.
	var raw []map[string]any
	getJSON(t, http.DefaultClient, base+"/api/v1/actions", token, &raw)
	if owners, _ := raw[0]["dead_owners"].([]any); len(owners) != 1 || fmt.Sprint(owners[0].(map[string]any)["known"]) != "false" {
		t.Errorf("dead_owners as served: %v", raw[0]["dead_owners"])
	}
}
