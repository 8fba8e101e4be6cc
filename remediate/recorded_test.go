package remediate

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// fakeCounter is an audit store's counts, and how often it was asked.
type fakeCounter struct {
	counts []RecordedCount
	err    error
	calls  int
}

func (f *fakeCounter) CountFinished(context.Context) ([]RecordedCount, error) {
	f.calls++
	return f.counts, f.err
}

// TestRecordedCollector: the store's counts by source and state, with the
// node's sources at 0 before their first action; a failed query gives
// success 0, a log line and no counts; counts are reused for MinInterval.
func TestRecordedCollector(t *testing.T) {
	src := &fakeCounter{counts: []RecordedCount{
		{Source: SourceWebhook, State: StateSucceeded, Count: 3}, {Source: SourceWebhook, State: StateSkipped, Count: 7},
		{Source: SourceEpilog, State: StateSucceeded, Count: 2}, {Source: SourceProlog, State: StateFailed, Count: 1},
		{Source: "", State: StateSucceeded, Count: 1},
	}}
	var logs bytes.Buffer
	c := NewRecordedCollector(src, []string{SourceWebhook, SourceCLI, SourceProlog, SourceEpilog}, slog.New(slog.NewTextHandler(&logs, nil)))
	now := time.Date(2026, 12, 2, 7, 0, 0, 0, time.UTC)
	c.now = func() time.Time { return now }

	const head = `
# HELP gpu_orphan_remediator_recorded_actions_success 1 if the audit store's actions could be counted for this scrape; 0 if not (logged), and recorded_actions_total is then absent.
# TYPE gpu_orphan_remediator_recorded_actions_success gauge
`
	want := head + `gpu_orphan_remediator_recorded_actions_success 1
# HELP gpu_orphan_remediator_recorded_actions_total ` + recordedHelp + `
# TYPE gpu_orphan_remediator_recorded_actions_total counter
gpu_orphan_remediator_recorded_actions_total{source="cli",state="failed"} 0
gpu_orphan_remediator_recorded_actions_total{source="cli",state="succeeded"} 0
gpu_orphan_remediator_recorded_actions_total{source="epilog",state="failed"} 0
gpu_orphan_remediator_recorded_actions_total{source="epilog",state="succeeded"} 2
gpu_orphan_remediator_recorded_actions_total{source="prolog",state="failed"} 1
gpu_orphan_remediator_recorded_actions_total{source="prolog",state="succeeded"} 0
gpu_orphan_remediator_recorded_actions_total{source="unknown",state="succeeded"} 1
gpu_orphan_remediator_recorded_actions_total{source="webhook",state="failed"} 0
gpu_orphan_remediator_recorded_actions_total{source="webhook",state="skipped"} 7
gpu_orphan_remediator_recorded_actions_total{source="webhook",state="succeeded"} 3
`
	if err := testutil.CollectAndCompare(c, strings.NewReader(want)); err != nil {
		t.Fatal(err)
	}
	if problems, err := testutil.CollectAndLint(c); err != nil || len(problems) > 0 {
		t.Errorf("lint: %v %v", problems, err)
	}

	// Within MinInterval, the counts are the last read's.
	calls := src.calls
	src.counts = append(src.counts, RecordedCount{Source: SourceEpilog, State: StateFailed, Count: 4})
	now = now.Add(c.MinInterval - time.Millisecond)
	if err := testutil.CollectAndCompare(c, strings.NewReader(want), "gpu_orphan_remediator_recorded_actions_total"); err != nil {
		t.Errorf("within MinInterval: %v", err)
	}
	if src.calls != calls {
		t.Errorf("the store was asked %d times within MinInterval", src.calls-calls)
	}
	now = now.Add(time.Millisecond)
	if got := recordedValue(t, c, SourceEpilog, string(StateFailed)); got != 4 {
		t.Errorf("after MinInterval: epilog failed %v, want 4", got)
	}

	// The store cannot be read: success 0, no counts, one log line.
	src.err = errors.New("database is locked")
	now = now.Add(c.MinInterval)
	if err := testutil.CollectAndCompare(c, strings.NewReader(head+"gpu_orphan_remediator_recorded_actions_success 0\n")); err != nil {
		t.Error(err)
	}
	if !strings.Contains(logs.String(), "level=ERROR") || !strings.Contains(logs.String(), "err=\"database is locked\"") {
		t.Errorf("log: %s", logs.String())
	}
}

// recordedValue is c's count for source and state, or -1 when absent.
func recordedValue(t *testing.T, c prometheus.Collector, source, state string) float64 {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(c)
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "gpu_orphan_remediator_recorded_actions_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			got := map[string]string{}
			for _, l := range m.GetLabel() {
				got[l.GetName()] = l.GetValue()
			}
			if got["source"] == source && got["state"] == state {
				return m.GetCounter().GetValue()
			}
		}
	}
	return -1
}
