package remediate

import (
	"os"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// TestDocsListEveryMetric: every remediator metric is in docs/metrics.md
// and the README.
func TestDocsListEveryMetric(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := NewMetrics(reg)
	m.Requests.WithLabelValues("200")
	m.LastAction.WithLabelValues(string(StateSucceeded))
	m.CountOrphan(Action{State: StateSucceeded})
	m.CountEscalation(Action{State: StateFailed, Escalation: EscalationHiddenHolder})
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
