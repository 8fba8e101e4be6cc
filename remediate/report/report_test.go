package report

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"maps"
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

// hookAction is a prolog's or an epilog's action for the job (id, user),
// with the dead owners NVML listed on the GPU.
func hookAction(source string, job, user string, uid int, freed uint64, owners ...remediate.DeadOwner) remediate.Action {
	a := action("node-a", remediate.StateSucceeded, time.Hour, freed, time.Hour, freed, owners...)
	a.Source = source
	a.Job = &remediate.JobRef{SlurmJob: job, UID: &uid, User: user}
	return a
}

// TestSplitHookActions: an epilog's action is its job's, by Slurm job and
// by user, whatever dead owners the GPU listed; a prolog's is the dead
// owners' it cleaned up after, never its own job's.
func TestSplitHookActions(t *testing.T) {
	alice := owner(10, 3*gib, "alice", "81234", "python")
	bob := owner(11, 1*gib, "bob", "81235", "torchrun")
	unknown := remediate.DeadOwner{PID: 20, UsedBytes: gib}
	noName := hookAction(remediate.SourceEpilog, "900", "", 1234, gib)
	noName.Job.User = ""
	noUID := hookAction(remediate.SourceEpilog, "901", "", 0, gib)
	noUID.Job.UID, noUID.Job.User = nil, ""
	for _, tc := range []struct {
		name string
		a    remediate.Action
		by   By
		want []Share
	}{
		// The epilog's targets are the job's live processes: no dead
		// owner, or one the remediator never saw alive.
		{"epilog, no dead owner, by job", hookAction(remediate.SourceEpilog, "700", "carol", 1003, gib), BySlurmJob, []Share{{"700", 1}}},
		{"epilog, no dead owner, by user", hookAction(remediate.SourceEpilog, "700", "carol", 1003, gib), ByUser, []Share{{"carol", 1}}},
		{"epilog, unknown dead owner, by job", hookAction(remediate.SourceEpilog, "700", "carol", 1003, gib, unknown), BySlurmJob, []Share{{"700", 1}}},
		// Its own trainer, named by the remediator's lineage: the same.
		{"epilog, its own dead trainer, by user", hookAction(remediate.SourceEpilog, "81234", "alice", 1010, gib, alice), ByUser, []Share{{"alice", 1}}},
		// Another job's dead owner listed on the same GPU: the epilog
		// signalled only its job's processes, so what came back is the job's.
		{"epilog, another job's dead owner listed, by job", hookAction(remediate.SourceEpilog, "700", "carol", 1003, gib, bob), BySlurmJob, []Share{{"700", 1}}},
		{"epilog, by comm: the dead owners'", hookAction(remediate.SourceEpilog, "700", "carol", 1003, gib, bob), ByComm, []Share{{"torchrun", 1}}},
		{"epilog, user not named on the node", noName, ByUser, []Share{{"1234", 1}}},
		{"epilog, no SLURM_JOB_UID", noUID, ByUser, []Share{{Unknown, 1}}},
		// The prolog's job is the one the orphan was in the way of.
		{"prolog, a previous job's orphan, by job", hookAction(remediate.SourceProlog, "800", "dave", 1004, 4*gib, alice, bob), BySlurmJob, []Share{{"81234", 0.75}, {"81235", 0.25}}},
		{"prolog, a previous job's orphan, by user", hookAction(remediate.SourceProlog, "800", "dave", 1004, 4*gib, alice), ByUser, []Share{{"alice", 1}}},
		{"prolog, a driver-level leak, by user", hookAction(remediate.SourceProlog, "800", "dave", 1004, 4*gib), ByUser, []Share{{Unknown, 1}}},
		{"prolog, unknown dead owner, by job", hookAction(remediate.SourceProlog, "800", "dave", 1004, gib, unknown), BySlurmJob, []Share{{Unknown, 1}}},
		// A job on an action of another source does not move it.
		{"webhook with a job", hookAction(remediate.SourceWebhook, "800", "dave", 1004, gib, bob), ByUser, []Share{{"bob", 1}}},
		{"by source", hookAction(remediate.SourceEpilog, "700", "carol", 1003, gib), BySource, []Share{{"epilog", 1}}},
		{"by node", hookAction(remediate.SourceEpilog, "700", "carol", 1003, gib), ByNode, []Share{{"node-a", 1}}},
		{"by source, none recorded", action("node-a", remediate.StateSucceeded, 0, gib, time.Hour, gib), BySource, []Share{{Unknown, 1}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := Split(tc.a, tc.by); !slices.Equal(got, tc.want) {
				t.Errorf("Split by %s = %v, want %v", tc.by, got, tc.want)
			}
		})
	}
}

// TestBuildHooksBesideWebhook: a node's day with the prolog, the epilog,
// an alert's cleanup and the CLI's: by source, each trigger's events; by
// Slurm job, the epilog's job beside the dead owners' jobs.
func TestBuildHooksBesideWebhook(t *testing.T) {
	alice := owner(10, 2*gib, "alice", "81234", "python")
	webhook := action("node-a", remediate.StateSucceeded, 0, 2*gib, time.Hour, 2*gib, alice)
	webhook.Source = remediate.SourceWebhook
	cli := action("node-a", remediate.StateSucceeded, 2*time.Hour, gib, time.Hour, gib)
	cli.Source = remediate.SourceCLI
	epilog := hookAction(remediate.SourceEpilog, "700", "carol", 1003, gib)
	prolog := hookAction(remediate.SourceProlog, "800", "dave", 1004, 2*gib, alice)
	// A prolog that found a leak it could not clean: failed, with the GPU's
	// memory as evidence; the leak's owner is unknown.
	leak := hookAction(remediate.SourceProlog, "801", "dave", 1004, 0)
	leak.State, leak.Before.UnownedBytes = remediate.StateFailed, 40*gib
	// A failure with no GPU named (the GPUs could not be read): no
	// evidence, so not an orphaned-memory event.
	unread := hookAction(remediate.SourceEpilog, "702", "carol", 1003, 0)
	unread.State, unread.Before = remediate.StateFailed, nil
	actions := []remediate.Action{webhook, cli, epilog, prolog, leak, unread}
	for i := range actions {
		actions[i].ID = fmt.Sprint("action-", i)
	}

	keys := func(r Report) map[string]int {
		m := map[string]int{}
		for _, row := range r.Rows {
			m[row.Key] = row.Events
		}
		return m
	}
	if got, want := keys(Build(actions, BySource, t0, t0)), map[string]int{"webhook": 1, "cli": 1, "epilog": 1, "prolog": 2}; !maps.Equal(got, want) {
		t.Errorf("by source: %v, want %v", got, want)
	}
	if got, want := keys(Build(actions, BySlurmJob, t0, t0)), map[string]int{"81234": 2, "700": 1, Unknown: 2}; !maps.Equal(got, want) {
		t.Errorf("by slurm_job: %v, want %v", got, want)
	}
	if got, want := keys(Build(actions, ByUser, t0, t0)), map[string]int{"alice": 2, "carol": 1, Unknown: 2}; !maps.Equal(got, want) {
		t.Errorf("by user: %v, want %v", got, want)
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
	for _, s := range []string{"user", "slurm_job", "comm", "node", "source"} {
		if b, err := ParseBy(s); err != nil || string(b) != s {
			t.Errorf("ParseBy(%q) = %q, %v", s, b, err)
		}
	}
	if _, err := ParseBy("job"); err == nil || err.Error() != `cannot group by "job": want one of user, slurm_job, comm, node, source` {
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
