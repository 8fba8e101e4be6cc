package exporter

import (
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

var fqName = regexp.MustCompile(`fqName: "([^"]+)"`)

// TestDocsListEveryMetric keeps the metric reference honest: every metric
// the collector can emit is in docs/metrics.md and the README.
func TestDocsListEveryMetric(t *testing.T) {
	ch := make(chan *prometheus.Desc, 64)
	NewCollector(staticSource{}, nil).Describe(ch)
	close(ch)
	var names []string
	for d := range ch {
		m := fqName.FindStringSubmatch(d.String())
		if m == nil {
			t.Fatalf("cannot read the name of %s", d)
		}
		names = append(names, m[1])
	}
	names = append(names, "gpu_orphan_exporter_build_info")
	for _, doc := range []string{"../docs/metrics.md", "../README.md"} {
		b, err := os.ReadFile(doc)
		if err != nil {
			t.Fatal(err)
		}
		for _, n := range names {
			if !strings.Contains(string(b), "`"+n+"`") {
				t.Errorf("%s does not document %s", doc, n)
			}
		}
	}
}
