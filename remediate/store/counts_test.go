package store

import (
	"context"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/remediate"
)

// TestCountFinished: the finished actions by source and state, whoever
// recorded them; queued and running ones are not counted yet.
func TestCountFinished(t *testing.T) {
	ctx := context.Background()
	s := openTest(t, "")
	got, err := s.CountFinished(ctx)
	if err != nil || len(got) != 0 {
		t.Fatalf("empty store: %v, %v", got, err)
	}
	for i, a := range []struct {
		source string
		state  remediate.State
	}{
		{"webhook", remediate.StateSucceeded}, {"webhook", remediate.StateSucceeded}, {"webhook", remediate.StateSkipped},
		{"webhook", remediate.StateQueued}, {"webhook", remediate.StateRunning},
		{"epilog", remediate.StateSucceeded}, {"epilog", remediate.StateFailed}, {"prolog", remediate.StateFailed},
		{"cli", remediate.StateDryRun}, {"cli", remediate.StateInterrupted},
	} {
		if _, err := s.Insert(ctx, remediate.Action{Node: "n", Source: a.source, State: a.state, StartedAt: t0.Add(time.Duration(i) * time.Second)}); err != nil {
			t.Fatal(err)
		}
	}
	got, err = s.CountFinished(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := []remediate.RecordedCount{
		{Source: "cli", State: remediate.StateDryRun, Count: 1}, {Source: "cli", State: remediate.StateInterrupted, Count: 1},
		{Source: "epilog", State: remediate.StateFailed, Count: 1}, {Source: "epilog", State: remediate.StateSucceeded, Count: 1},
		{Source: "prolog", State: remediate.StateFailed, Count: 1},
		{Source: "webhook", State: remediate.StateSkipped, Count: 1}, {Source: "webhook", State: remediate.StateSucceeded, Count: 2},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("counts:\ngot  %v\nwant %v", got, want)
	}

	// The query reads the index, not the table.
	var plan []string
	rows, err := s.db.QueryContext(ctx, `EXPLAIN QUERY PLAN SELECT source, state, count(*) FROM actions GROUP BY source, state ORDER BY source, state`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var id, parent, unused int
		var detail string
		if err := rows.Scan(&id, &parent, &unused, &detail); err != nil {
			t.Fatal(err)
		}
		plan = append(plan, detail)
	}
	if p := strings.Join(plan, "; "); !strings.Contains(p, "COVERING INDEX actions_source_state") || strings.Contains(p, "TEMP B-TREE") {
		t.Errorf("query plan %q: want the covering index actions_source_state, no sort", p)
	}
}
