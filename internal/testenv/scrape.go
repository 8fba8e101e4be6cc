package testenv

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// Scrape fetches url and returns the body and its parsed families.
func Scrape(t testing.TB, url string) (string, map[string]*dto.MetricFamily) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatalf("scrape %s: %v", url, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("scrape %s: %d %v", url, resp.StatusCode, err)
	}
	mfs, err := ParseMetrics(string(body))
	if err != nil {
		t.Fatalf("parse scrape: %v\n%s", err, body)
	}
	return string(body), mfs
}

// ParseMetrics parses Prometheus's text exposition format.
func ParseMetrics(body string) (map[string]*dto.MetricFamily, error) {
	p := expfmt.NewTextParser(model.UTF8Validation)
	return p.TextToMetricFamilies(strings.NewReader(body))
}

// Series returns the metrics of a family whose labels include want.
func Series(mfs map[string]*dto.MetricFamily, name string, want map[string]string) []*dto.Metric {
	mf, ok := mfs[name]
	if !ok {
		return nil
	}
	var out []*dto.Metric
	for _, m := range mf.GetMetric() {
		if hasLabels(m, want) {
			out = append(out, m)
		}
	}
	return out
}

// Value returns the single value of name{want...}, and whether it exists.
func Value(mfs map[string]*dto.MetricFamily, name string, want map[string]string) (float64, bool) {
	s := Series(mfs, name, want)
	if len(s) != 1 {
		return 0, false
	}
	m := s[0]
	switch {
	case m.Gauge != nil:
		return m.GetGauge().GetValue(), true
	case m.Counter != nil:
		return m.GetCounter().GetValue(), true
	case m.Untyped != nil:
		return m.GetUntyped().GetValue(), true
	}
	return 0, false
}

// Label returns a label's value of a metric.
func Label(m *dto.Metric, name string) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}

func hasLabels(m *dto.Metric, want map[string]string) bool {
	for k, v := range want {
		if Label(m, k) != v {
			return false
		}
	}
	return true
}

// MiB formats n MiB as the float Prometheus prints for bytes.
func MiB(n int) float64 { return float64(n) * (1 << 20) }

// Describe is a short form of a family for failure messages.
func Describe(mfs map[string]*dto.MetricFamily, name string) string {
	mf := mfs[name]
	if mf == nil {
		return name + ": absent"
	}
	var b strings.Builder
	for _, m := range mf.GetMetric() {
		fmt.Fprintf(&b, "%s%v ", name, m.GetLabel())
	}
	return b.String()
}
