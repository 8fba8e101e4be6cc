package main

import (
	"context"
	"encoding/json"
	"maps"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

// reportActions are a day of one node's actions: alice's job 81234 twice,
// bob's 81235 once, and one owner the remediator never saw alive.
func reportActions() []remediate.Action {
	now := time.Now().UTC().Truncate(time.Second)
	uid := 1001
	alice := remediate.DeadOwner{PID: 10, UsedBytes: 4 << 30, Known: true, Comm: "python", User: "alice", UID: &uid, SlurmJob: "81234"}
	bob := remediate.DeadOwner{PID: 11, UsedBytes: 1 << 30, Known: true, Comm: "torchrun", User: "bob", UID: &uid, SlurmJob: "81235"}
	act := func(ago time.Duration, state remediate.State, unowned uint64, age time.Duration, freed uint64, owners ...remediate.DeadOwner) remediate.Action {
		fin := now.Add(-ago)
		return remediate.Action{Node: "gpu-node-1", GPUUUID: "GPU-1", State: state, Source: "webhook", StartedAt: fin.Add(-2 * time.Second),
			FinishedAt: &fin, FreedBytes: freed, Before: &remediate.MemoryEvidence{UnownedBytes: unowned, UnownedAgeSeconds: age.Seconds()},
			DeadOwners: owners}
	}
	return []remediate.Action{
		act(3*time.Hour, remediate.StateSucceeded, 4<<30, time.Hour, 4<<30, alice),                                                    // 4 GiB·h
		act(2*time.Hour, remediate.StateSucceeded, 4<<30, 30*time.Minute, 4<<30, alice),                                               // 2 GiB·h
		act(time.Hour, remediate.StateFailed, 1<<30, time.Hour, 0, bob),                                                               // 1 GiB·h
		act(30*time.Minute, remediate.StateSucceeded, 2<<30, 15*time.Minute, 2<<30, remediate.DeadOwner{PID: 12, UsedBytes: 2 << 30}), // 0.5
		act(20*time.Minute, remediate.StateSkipped, 8<<30, 10*time.Hour, 0, bob),                                                      // not an event
		act(9*24*time.Hour, remediate.StateSucceeded, 8<<30, 10*time.Hour, 8<<30, bob),                                                // before --since
	}
}

func reportStore(t *testing.T) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "remediator.db")
	st, err := store.Open(context.Background(), path)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	for _, a := range reportActions() {
		if _, err := st.Insert(context.Background(), a); err != nil {
			t.Fatal(err)
		}
	}
	return path
}

type reportJSON struct {
	By     string `json:"by"`
	Events int    `json:"events"`
	Rows   []struct {
		Key        string    `json:"key"`
		Events     int       `json:"events"`
		GiBHours   float64   `json:"gib_hours"`
		FreedBytes uint64    `json:"freed_bytes"`
		Last       time.Time `json:"last"`
	} `json:"rows"`
}

func decodeReport(t *testing.T, stdout string) reportJSON {
	t.Helper()
	var r reportJSON
	if err := json.Unmarshal([]byte(stdout), &r); err != nil {
		t.Fatalf("report -o json: %v\n%s", err, stdout)
	}
	return r
}

// TestReportFromStore: the report of an audit database, by Slurm job and by
// user, in each format, sorted by GiB·hours; the database is only read.
func TestReportFromStore(t *testing.T) {
	t.Parallel()
	path := reportStore(t)
	before, _ := os.Stat(path)

	code, stdout, stderr := runBin(t, "report", "--store.path="+path, "--by=slurm_job", "-o", "json")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	r := decodeReport(t, stdout)
	type row struct {
		key      string
		events   int
		gibHours float64
		freedGiB uint64
	}
	var got []row
	for _, x := range r.Rows {
		got = append(got, row{x.Key, x.Events, x.GiBHours, x.FreedBytes >> 30})
	}
	want := []row{{"81234", 2, 6, 8}, {"81235", 1, 1, 0}, {"unknown", 1, 0.5, 2}}
	if r.By != "slurm_job" || r.Events != 4 || len(got) != len(want) {
		t.Fatalf("report: by %s, %d events, rows %v; want 4 events, rows %v", r.By, r.Events, got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("row %d: %v, want %v", i, got[i], want[i])
		}
	}

	code, stdout, _ = runBin(t, "report", "--store.path="+path, "--by=user", "-o", "csv", "--since=90m")
	if lines := strings.Split(strings.TrimSpace(stdout), "\n"); code != 0 || len(lines) != 3 ||
		lines[0] != "user,events,gib_hours,freed_bytes,last" || !strings.HasPrefix(lines[1], "bob,1,1,0,") || !strings.HasPrefix(lines[2], "unknown,1,0.5,2147483648,") {
		t.Errorf("--by=user -o csv --since=90m: exit %d\n%s", code, stdout)
	}

	code, stdout, _ = runBin(t, "report", "--store.path="+path, "--by=comm")
	for _, s := range []string{"Orphaned GPU memory by comm, ", ": 4 events.", "COMM", "python", "torchrun", "unknown", "8.0 GiB"} {
		if code != 0 || !strings.Contains(stdout, s) {
			t.Errorf("table lacks %q (exit %d):\n%s", s, code, stdout)
		}
	}
	if after, _ := os.Stat(path); !after.ModTime().Equal(before.ModTime()) || after.Size() != before.Size() {
		t.Error("the report wrote to the audit database")
	}
}

// TestReportFromURL: --url reads a remediator's API with the bearer token
// of --auth.token-file.
func TestReportFromURL(t *testing.T) {
	t.Parallel()
	const tok = "0123456789abcdef0123"
	var queries []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer "+tok {
			http.Error(w, `{"error":"unauthorized"}`, http.StatusUnauthorized)
			return
		}
		queries = append(queries, r.URL.RawQuery)
		as := reportActions()[:4]
		for i := range as {
			as[i].ID = strings.Repeat(string(rune('a'+i)), 24)
		}
		_ = json.NewEncoder(w).Encode(as)
	}))
	defer srv.Close()
	tokenFile := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(tokenFile, []byte(tok+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}

	code, stdout, stderr := runBin(t, "report", "--url="+srv.URL, "--auth.token-file="+tokenFile, "--by=node", "-o", "json")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	if r := decodeReport(t, stdout); r.Events != 4 || len(r.Rows) != 1 || r.Rows[0].Key != "gpu-node-1" || r.Rows[0].GiBHours != 7.5 {
		t.Errorf("report by node: %+v", r)
	}
	if len(queries) != 1 || !strings.Contains(queries[0], "since=") || !strings.Contains(queries[0], "limit=1000") {
		t.Errorf("queries %q", queries)
	}

	code, _, stderr = runBin(t, "report", "--url="+srv.URL)
	if code != 1 || !strings.Contains(stderr, "refused the request (401 Unauthorized): give its bearer token with --auth.token-file") {
		t.Errorf("no token: exit %d, %s", code, stderr)
	}
}

// TestReportBadInput: each mistake is named, with exit status 2.
func TestReportBadInput(t *testing.T) {
	t.Parallel()
	path := reportStore(t)
	for _, tc := range []struct {
		args []string
		code int
		says string
	}{
		{[]string{"--since=7x"}, 2, `invalid --since "7x": want a duration such as 7d, 12h or 2w`},
		{[]string{"--since=-1d"}, 2, `invalid --since "-1d"`},
		{[]string{"--since=0"}, 2, `invalid --since "0"`},
		{[]string{"--by=job"}, 2, `invalid --by: cannot group by "job": want one of user, slurm_job, comm, node, source`},
		{[]string{"-o", "yaml"}, 2, `invalid --output "yaml": want one of table, json, csv`},
		{[]string{"--url=http://127.0.0.1:9"}, 2, "give --store.path or --url, not both"},
		{[]string{"--auth.token-file=/dev/null"}, 2, "--auth.token-file is for --url"},
		{[]string{"--store.path=" + filepath.Join(t.TempDir(), "none.db")}, 1, "no audit database at "},
		{[]string{"--store.path=/etc/hostname"}, 1, "is not a database"},
	} {
		args := append([]string{"report"}, tc.args...)
		if !strings.HasPrefix(tc.args[0], "--store.path") {
			args = append(args, "--store.path="+path)
		}
		code, stdout, stderr := runBin(t, args...)
		if code != tc.code || !strings.Contains(stderr, tc.says) || stdout != "" || strings.Count(stderr, "\n") != 1 {
			t.Errorf("report %v: exit %d, stderr %q, stdout %q; want exit %d and %q", tc.args, code, stderr, stdout, tc.code, tc.says)
		}
	}
	code, _, stderr := runBin(t, "report", "--url=ftp://host")
	if code != 2 || !strings.Contains(stderr, `invalid remediator URL "ftp://host": want http(s)://host:port`) {
		t.Errorf("--url=ftp://host: exit %d, %s", code, stderr)
	}
}

// TestReportHookActions: the prolog's and the epilog's actions, recorded
// with their job, beside an alert's cleanup. By Slurm job and by user, an
// epilog's cleanup is its job's; a prolog's, the dead owner's it cleaned up
// after; by source, each trigger's events.
func TestReportHookActions(t *testing.T) {
	t.Parallel()
	now := time.Now().UTC().Truncate(time.Second)
	uidAlice, uidCarol, uidDave := 1001, 1003, 1004
	alice := remediate.DeadOwner{PID: 10, UsedBytes: 2 << 30, Known: true, Comm: "python", User: "alice", UID: &uidAlice, SlurmJob: "81234"}
	act := func(ago time.Duration, source string, job *remediate.JobRef, freed uint64, owners ...remediate.DeadOwner) remediate.Action {
		fin := now.Add(-ago)
		return remediate.Action{Node: "gpu-node-1", GPUUUID: "GPU-1", State: remediate.StateSucceeded, Source: source, Job: job,
			StartedAt: fin.Add(-time.Second), FinishedAt: &fin, FreedBytes: freed,
			Before: &remediate.MemoryEvidence{UnownedBytes: freed, UnownedAgeSeconds: 60}, DeadOwners: owners}
	}
	path := filepath.Join(t.TempDir(), "remediator.db")
	st, err := store.Open(context.Background(), path)
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range []remediate.Action{
		act(4*time.Hour, remediate.SourceWebhook, nil, 2<<30, alice),
		act(3*time.Hour, remediate.SourceEpilog, &remediate.JobRef{SlurmJob: "700", UID: &uidCarol, User: "carol"}, 1<<30),
		act(2*time.Hour, remediate.SourceEpilog, &remediate.JobRef{SlurmJob: "701", UID: &uidCarol, User: "carol"}, 1<<30, remediate.DeadOwner{PID: 30}),
		act(time.Hour, remediate.SourceProlog, &remediate.JobRef{SlurmJob: "800", UID: &uidDave, User: "dave"}, 2<<30, alice),
	} {
		if _, err := st.Insert(context.Background(), a); err != nil {
			t.Fatal(err)
		}
	}
	st.Close()

	for _, tc := range []struct {
		by   string
		want map[string]int // events by key
	}{
		{"slurm_job", map[string]int{"81234": 2, "700": 1, "701": 1}},
		{"user", map[string]int{"alice": 2, "carol": 2}},
		{"source", map[string]int{"webhook": 1, "epilog": 2, "prolog": 1}},
	} {
		code, stdout, stderr := runBin(t, "report", "--store.path="+path, "--by="+tc.by, "-o", "json")
		if code != 0 {
			t.Fatalf("--by=%s: exit %d: %s", tc.by, code, stderr)
		}
		got := map[string]int{}
		for _, row := range decodeReport(t, stdout).Rows {
			got[row.Key] = row.Events
		}
		if !maps.Equal(got, tc.want) {
			t.Errorf("--by=%s: events by key %v, want %v", tc.by, got, tc.want)
		}
	}
	code, stdout, _ := runBin(t, "report", "--store.path="+path, "--by=source")
	for _, s := range []string{"Orphaned GPU memory by source, ", ": 4 events.", "SOURCE", "epilog", "prolog", "webhook"} {
		if code != 0 || !strings.Contains(stdout, s) {
			t.Errorf("table by source lacks %q (exit %d):\n%s", s, code, stdout)
		}
	}
}
