package dashboards

import (
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/promql/parser"
	"sigs.k8s.io/yaml"
)

// jobVariables are the variables that stand for scrape jobs, and the
// metric whose targets each finds them by: any job name works.
var jobVariables = map[string]string{
	"exporter_job":   "gpu_orphan_exporter_build_info",
	"remediator_job": "gpu_orphan_remediator_build_info",
}

// TestChartDashboardsFollowJobNames: the chart's dashboards (the ConfigMaps
// of charts/gpu-orphan/files/dashboards/) select the scrape jobs that the
// chart's monitors name (monitoring.jobs), or any others: no query names a
// job, the job variables find the jobs by the daemons' build_info, and with
// those variables set as Grafana sets them (All: the values it found, as a
// regex), the up queries select the chart's jobs and no other. Issue 23:
// "Exporters up: 0" under kube-prometheus-stack with jobs named after the
// chart's services.
func TestChartDashboardsFollowJobNames(t *testing.T) {
	b, err := os.ReadFile("../../charts/gpu-orphan/values.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var values struct {
		Monitoring struct {
			Jobs struct{ Exporter, Remediator, Dispatcher string }
		}
	}
	if err := yaml.Unmarshal(b, &values); err != nil {
		t.Fatal(err)
	}
	chart := values.Monitoring.Jobs
	if chart.Exporter == "" || chart.Remediator == "" || chart.Dispatcher == "" {
		t.Fatalf("values.yaml monitoring.jobs: %+v", chart)
	}
	files, err := filepath.Glob("../../charts/gpu-orphan/files/dashboards/*.json")
	if err != nil || len(files) == 0 {
		t.Fatalf("no chart dashboards: %v", err)
	}
	for _, jobs := range []struct{ name, exporter, remediator, dispatcher string }{
		{"values.yaml", chart.Exporter, chart.Remediator, chart.Dispatcher},
		// kube-prometheus-stack: jobs named after the chart's Services.
		{"service names", "monitoring/kps-gpu-orphan-metrics", "kps-gpu-orphan-remediator", "kps-gpu-orphan-dispatcher"},
	} {
		found := map[string][]string{
			"exporter_job":   {jobs.exporter},
			"remediator_job": {jobs.remediator, jobs.dispatcher},
		}
		for _, f := range files {
			t.Run(jobs.name+"/"+filepath.Base(f), func(t *testing.T) {
				data, err := os.ReadFile(f)
				if err != nil {
					t.Fatal(err)
				}
				var d dashboard
				if err := json.Unmarshal(data, &d); err != nil {
					t.Fatal(err)
				}
				for _, v := range d.Templating.List {
					metric, ok := jobVariables[v.Name]
					if !ok {
						continue
					}
					expr, err := variableExpr(v)
					if err != nil || expr != metric {
						t.Errorf("variable %s: finds jobs by %q (%v), want label_values(%s, job)", v.Name, expr, err, metric)
					}
				}
				ups := 0
				for _, p := range flatten(d.Panels) {
					for _, tg := range p.Targets {
						where := p.Title + " " + tg.RefID
						expr := tg.Expr
						for name, vals := range found {
							quoted := make([]string, len(vals))
							for i, v := range vals {
								quoted[i] = regexp.QuoteMeta(v)
							}
							// Grafana's regex format of a multi-value variable.
							all := strings.ReplaceAll("("+strings.Join(quoted, "|")+")", `\`, `\\`)
							expr = strings.ReplaceAll(expr, "${"+name+"}", all)
							expr = strings.ReplaceAll(expr, "$"+name, all)
						}
						node, err := parser.NewParser(parser.Options{}).ParseExpr(expandVariables(expr))
						if err != nil {
							t.Errorf("%s: %v", where, err)
							continue
						}
						parser.Inspect(node, func(n parser.Node, _ []parser.Node) error {
							vs, ok := n.(*parser.VectorSelector)
							if !ok {
								return nil
							}
							for _, m := range vs.LabelMatchers {
								if m.Name != "job" {
									continue
								}
								if !strings.Contains(tg.Expr, "$") {
									t.Errorf("%s: %q names its jobs; select them with $exporter_job or $remediator_job", where, tg.Expr)
								}
								if vs.Name != "up" {
									continue
								}
								ups++
								want := []string{jobs.exporter}
								if strings.Contains(tg.Expr, "remediator_job") {
									want = append(want, jobs.remediator, jobs.dispatcher)
								}
								for _, j := range want {
									if !m.Matches(j) {
										t.Errorf("%s: %q does not select job %q", where, tg.Expr, j)
									}
								}
								for _, other := range []string{"node-exporter", "kubelet", "gpu-orphan-other"} {
									if m.Matches(other) {
										t.Errorf("%s: %q selects job %q", where, tg.Expr, other)
									}
								}
								if m.Type == labels.MatchEqual || m.Type == labels.MatchNotEqual {
									t.Errorf("%s: %q: want a regex matcher for a multi-value variable", where, tg.Expr)
								}
							}
							return nil
						})
					}
				}
				if ups == 0 {
					t.Error("no up query selects a job")
				}
			})
		}
	}
}
