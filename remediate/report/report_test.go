package report

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/remediate"
)

var t0 = time.Date(2026, 12, 1, 7, 0, 0, 0, time.UTC)

const gib = 1 << 30

func owner(pid uint32, used uint64, user, job, comm string) remediate.DeadOwner {
	uid := 1000 + int(pid)
	return remediate.DeadOwner{PID: pid, UsedBytes: used, Known: true, User: user, UID: &uid, SlurmJob: job, Comm: comm}
}

func action(node string, state remediate.State, at time.Duration, unowned uint64, age time.Duration, freed uint64, owners ...remediate.DeadOwner) remediate.Action {
	fin := t0.Add(at + time.Second)
	return remediate.Action{
		ID: fmt.Sprintf("%s-%s", node, at), Node: node, State: state, StartedAt: t0.Add(at), FinishedAt: &fin, FreedBytes: freed,
		Before:     &remediate.MemoryEvidence{UnownedBytes: unowned, UnownedAgeSeconds: age.Seconds()},
		DeadOwners: owners,
	}
}

// fleet is a week of actions on two nodes and a dispatcher's copies.
func fleet() []remediate.Action {
	alice := owner(10, 3*gib, "alice", "81234", "python")
	bob := owner(11, 1*gib, "bob", "81235", "torchrun")
	notSlurm := owner(12, 2*gib, "alice", "", "python")
	dispatched := action("node-c", remediate.StateSucceeded, 5*time.Hour, 2*gib, time.Hour, 2*gib, bob)
	agentDone := t0.Add(5*time.Hour + 3*time.Second)
	dispatched.Agent = &remediate.AgentResult{URL: "http://node-c:10836", ActionID: "x", State: remediate.StateSucceeded, FinishedAt: &agentDone}
	waiting := action("node-c", remediate.StateSucceeded, 6*time.Hour, 2*gib, time.Hour, 0, bob)
	waiting.Agent = &remediate.AgentResult{URL: "http://node-c:10836", ActionID: "y", State: remediate.StateRunning}
	return []remediate.Action{
		// 4 GiB for 30 min = 2 GiB·h, shared 3:1 by alice's and bob's jobs.
		action("node-a", remediate.StateSucceeded, 0, 4*gib, 30*time.Minute, 4*gib, alice, bob),
		// Unknown owner: 2 GiB for 1 h, not freed.
		action("node-b", remediate.StateFailed, time.Hour, 2*gib, time.Hour, 0, remediate.DeadOwner{PID: 20, UsedBytes: 2 * gib}),
		// A dry run: 1 GiB for 2 h, nothing freed.
		action("node-a", remediate.StateDryRun, 2*time.Hour, 1*gib, 2*time.Hour, 0, notSlurm),
		// Not events.
		action("node-a", remediate.StateSkipped, 3*time.Hour, 8*gib, 10*time.Hour, 0, alice),
		action("node-a", remediate.StateInterrupted, 4*time.Hour, 8*gib, 10*time.Hour, 0, alice),
		waiting,
		// The dispatcher's copy of an agent's action: by the agent's outcome.
		dispatched,
		// Nobody listed dead (policy orphaned): unknown.
		action("node-b", remediate.StateSucceeded, 7*time.Hour, 1*gib, 30*time.Minute, 1*gib),
	}
}

func TestBuild(t *testing.T) {
	type row struct {
		key      string
		events   int
		gibHours float64
		freedGiB float64
		last     time.Duration // after t0
	}
	for _, tc := range []struct {
		by   By
		want []row
	}{
		{ByUser, []row{
			{"alice", 2, 1.5 + 2, 3, 2*time.Hour + time.Second},
			{"bob", 2, 0.5 + 2, 1 + 2, 5*time.Hour + 3*time.Second},
			{"unknown", 2, 2 + 0.5, 1, 7*time.Hour + time.Second},
		}},
		{BySlurmJob, []row{
			{"81235", 2, 2.5, 3, 5*time.Hour + 3*time.Second},
			{"unknown", 2, 2.5, 1, 7*time.Hour + time.Second},
			{"none", 1, 2, 0, 2*time.Hour + time.Second},
			{"81234", 1, 1.5, 3, time.Second},
		}},
		{ByComm, []row{
			{"python", 2, 3.5, 3, 2*time.Hour + time.Second},
			{"torchrun", 2, 2.5, 3, 5*time.Hour + 3*time.Second},
			{"unknown", 2, 2.5, 1, 7*time.Hour + time.Second},
		}},
		{ByNode, []row{
			{"node-a", 2, 2 + 2, 4, 2*time.Hour + time.Second},
			{"node-b", 2, 2 + 0.5, 1, 7*time.Hour + time.Second},
			{"node-c", 1, 2, 2, 5*time.Hour + 3*time.Second},
		}},
	} {
		t.Run(string(tc.by), func(t *testing.T) {
			r := Build(fleet(), tc.by, t0, t0.Add(7*24*time.Hour))
			if r.Events != 5 || r.By != tc.by {
				t.Errorf("events %d by %s, want 5 by %s", r.Events, r.By, tc.by)
			}
			var got []row
			for _, g := range r.Rows {
				got = append(got, row{g.Key, g.Events, math.Round(g.GiBHours*1e6) / 1e6, float64(g.FreedBytes) / gib, g.Last.Sub(t0)})
			}
			if !slices.Equal(got, tc.want) {
				t.Errorf("rows:\ngot  %v\nwant %v", got, tc.want)
			}
		})
	}
}

func TestSplitBytesAddsUp(t *testing.T) {
	for _, n := range []uint64{0, 1, 7, 1<<30 + 1, 1<<64 - 1} {
		for _, shares := range [][]Share{{{"a", 1}}, {{"a", 1.0 / 3}, {"b", 1.0 / 3}, {"c", 1.0 / 3}}, {{"a", 0.75}, {"b", 0.25}}} {
			var sum uint64
			for _, b := range splitBytes(n, shares) {
				sum += b
			}
			if sum != n {
				t.Errorf("splitBytes(%d, %v) adds up to %d", n, shares, sum)
			}
		}
	}
}

func TestParseBy(t *testing.T) {
	for _, s := range []string{"user", "slurm_job", "comm", "node"} {
		if b, err := ParseBy(s); err != nil || string(b) != s {
			t.Errorf("ParseBy(%q) = %q, %v", s, b, err)
		}
	}
	if _, err := ParseBy("job"); err == nil || err.Error() != `cannot group by "job": want one of user, slurm_job, comm, node` {
		t.Errorf("ParseBy(job): %v", err)
	}
}

func TestWrite(t *testing.T) {
	r := Build(fleet(), BySlurmJob, t0, t0.Add(7*24*time.Hour))
	var b bytes.Buffer
	if err := Write(&b, r, "csv"); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(b.String()), "\n")
	if lines[0] != "slurm_job,events,gib_hours,freed_bytes,last" || lines[1] != "81235,2,2.5,3221225472,2026-12-01T12:00:03Z" || len(lines) != 5 {
		t.Errorf("csv:\n%s", b.String())
	}

	b.Reset()
	if err := Write(&b, r, "json"); err != nil {
		t.Fatal(err)
	}
	var j struct {
		By     string `json:"by"`
		Events int    `json:"events"`
		Rows   []struct {
			Key        string  `json:"key"`
			Events     int     `json:"events"`
			GiBHours   float64 `json:"gib_hours"`
			FreedBytes uint64  `json:"freed_bytes"`
			Last       string  `json:"last"`
		} `json:"rows"`
	}
	if err := json.Unmarshal(b.Bytes(), &j); err != nil || j.By != "slurm_job" || j.Events != 5 || len(j.Rows) != 4 || j.Rows[3].Key != "81234" || j.Rows[3].FreedBytes != 3*gib {
		t.Errorf("json (%v):\n%s", err, b.String())
	}

	b.Reset()
	if err := Write(&b, r, "table"); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"Orphaned GPU memory by slurm_job, 2026-12-01 07:00 to 2026-12-08 07:00 UTC: 5 events.",
		"  SLURM_JOB  EVENTS  GIB·HOURS    FREED                 LAST\n", "\n  81235           2       2.50  3.0 GiB  2026-12-01 12:00:03\n"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, b.String())
		}
	}

	b.Reset()
	if err := Write(&b, Build(nil, ByUser, t0, t0.Add(time.Hour)), "table"); err != nil {
		t.Fatal(err)
	}
	if b.String() != "No orphaned-memory events from 2026-12-01 07:00 to 2026-12-01 08:00 UTC.\n" {
		t.Errorf("empty table: %q", b.String())
	}
	if err := Write(&b, r, "yaml"); err == nil {
		t.Error("Write accepted format yaml")
	}
}

// pages is a Source over a list of actions, newest first, as the store
// and the API answer.
type pages struct {
	actions []remediate.Action
	calls   int
}

func (p *pages) Actions(_ context.Context, since, until time.Time, limit int) ([]remediate.Action, error) {
	p.calls++
	var out []remediate.Action
	for _, a := range p.actions {
		if !a.StartedAt.Before(since) && a.StartedAt.Before(until) && len(out) < limit {
			out = append(out, a)
		}
	}
	return out, nil
}

// TestCollectPages: more actions than a page holds, some started in the
// same nanosecond across a page's edge, are all read once.
func TestCollectPages(t *testing.T) {
	src := &pages{}
	n := 2*pageSize + 10
	for i := range n {
		// Three actions per instant, newest first.
		src.actions = append(src.actions, remediate.Action{ID: fmt.Sprintf("%06d", n-i), StartedAt: t0.Add(time.Duration(n-i) / 3 * time.Second)})
	}
	got, err := Collect(context.Background(), src, t0, t0.Add(24*time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, a := range got {
		seen[a.ID] = true
	}
	if len(got) != n || len(seen) != n {
		t.Fatalf("collected %d actions (%d distinct) of %d in %d calls", len(got), len(seen), n, src.calls)
	}
}

// TestAttemptsAreOneEvent (issue 16): the attempts of one alert (a failed
// one, one a restart interrupted, the one that brought the memory back)
// are one event: its memory counted once, at the longest age, what each
// freed added up, and the attempts shown.
func TestAttemptsAreOneEvent(t *testing.T) {
	alice := owner(10, 4*gib, "alice", "81234", "python")
	one := action("node-a", remediate.StateFailed, 0, 4*gib, 10*time.Minute, 0, alice)
	two := action("node-a", remediate.StateInterrupted, time.Minute, 4*gib, 11*time.Minute, 0, alice)
	three := action("node-a", remediate.StateSucceeded, 20*time.Minute, 4*gib, 30*time.Minute, 4*gib, alice)
	one.Attempt = 1
	two.Attempt, two.FirstActionID, two.RetryOf = 2, one.ID, one.ID
	three.Attempt, three.FirstActionID, three.RetryOf = 3, one.ID, two.ID
	other := action("node-a", remediate.StateSucceeded, time.Hour, 1*gib, 30*time.Minute, 1*gib, alice)

	r := Build([]remediate.Action{three, other, two, one}, ByUser, t0, t0.Add(2*time.Hour))
	if r.Events != 2 || r.Attempts != 4 || len(r.Rows) != 1 {
		t.Fatalf("report %+v, want 2 events in 4 attempts, one row", r)
	}
	row := r.Rows[0]
	if row.Key != "alice" || row.Events != 2 || row.Attempts != 4 || math.Abs(row.GiBHours-(2+0.5)) > 1e-9 || row.FreedBytes != 5*gib ||
		!row.Last.Equal(*other.FinishedAt) {
		t.Errorf("row %+v, want 2 events, 4 attempts, 2.5 GiB·h, 5 GiB freed", row)
	}
	var b bytes.Buffer
	if err := Write(&b, r, "table"); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(b.String(), "4 attempts for the 2 events") {
		t.Errorf("table does not show the attempts:\n%s", b.String())
	}
	b.Reset()
	if err := Write(&b, Build(fleet(), ByUser, t0, t0.Add(7*24*time.Hour)), "table"); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(b.String(), "attempts") {
		t.Errorf("a report without retries mentions attempts:\n%s", b.String())
	}
}
