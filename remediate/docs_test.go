package remediate

import (
	"os"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// TestDocsListEveryMetric: every remediator metric, those that
// RecordedCollector reads from the store included, is in docs/metrics.md
// and the README.
func TestDocsListEveryMetric(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := NewMetrics(reg)
	m.Requests.WithLabelValues("200")
	m.LastAction.WithLabelValues(string(StateSucceeded))
	m.CountOrphan(Action{State: StateSucceeded})
	m.CountEscalation(Action{State: StateFailed, Escalation: EscalationHiddenHolder})
	// Read from the store at scrape time: the counts, and the query's success.
	reg.MustRegister(NewRecordedCollector(&fakeCounter{}, []string{SourceEpilog}, nil))
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	if len(mfs) < 13 {
		t.Fatalf("gathered only %d families", len(mfs))
	}
	for _, doc := range []string{"../docs/metrics.md", "../README.md"} {
		b, err := os.ReadFile(doc)
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			if !strings.Contains(string(b), "`"+mf.GetName()+"`") {
				t.Errorf("%s does not document %s", doc, mf.GetName())
			}
		}
	}
}
