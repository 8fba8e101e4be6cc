package dashboards

import (
	"context"
	"encoding/json"
	"os"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/prometheus/promql/promqltest"
)

// The node where the series below live, and the exporter's own pod: with
// prometheus-operator, every series it scrapes carries the target's pod and
// namespace, which are not the holder's.
const kubeSeries = `
load 1m
  gpu_orphan_holder_info{instance="10.0.0.5:10835",job="gpu-orphan-exporter",namespace="gpu-orphan",pod="gpu-orphan-agent-x7",node="n1",gpu="0",pid="10",pod_uid="uid-trainer",comm="python"} 1
  gpu_orphan_holder_info{instance="10.0.0.5:10835",job="gpu-orphan-exporter",namespace="gpu-orphan",pod="gpu-orphan-agent-x7",node="n1",gpu="0",pid="11",pod_uid="uid-trainer",comm="pt_data_worker"} 1
  gpu_orphan_holder_info{instance="10.0.0.5:10835",job="gpu-orphan-exporter",namespace="gpu-orphan",pod="gpu-orphan-agent-x7",node="n1",gpu="1",pid="12",pod_uid="",comm="python"} 1
  gpu_orphan_dead_owner_info{instance="10.0.0.5:10835",job="gpu-orphan-exporter",namespace="gpu-orphan",pod="gpu-orphan-agent-x7",node="n1",gpu="0",pid="9",pod_uid="uid-trainer",user="alice"} 1
  gpu_orphan_dead_owner_info{instance="10.0.0.5:10835",job="gpu-orphan-exporter",namespace="gpu-orphan",pod="gpu-orphan-agent-x7",node="n1",gpu="1",pid="8",pod_uid="",user="bob"} 1
`

// Two kube-state-metrics replicas report the same pod, and another pod
// has no GPU at all.
const kubeStateMetrics = `  kube_pod_info{instance="ksm-0",job="kube-state-metrics",namespace="ml",pod="trainer-0",uid="uid-trainer",node="n1",host_ip="10.0.0.5"} 1
  kube_pod_info{instance="ksm-1",job="kube-state-metrics",namespace="ml",pod="trainer-0",uid="uid-trainer",node="n1",host_ip="10.0.0.5"} 1
  kube_pod_info{instance="ksm-0",job="kube-state-metrics",namespace="web",pod="nginx-1",uid="uid-nginx",node="n2",host_ip="10.0.0.6"} 1
`

// organizeOptions is the part of Grafana's organize transformation that
// decides which columns a table shows, and under which names.
type organizeOptions struct {
	ExcludeByName map[string]bool   `json:"excludeByName"`
	RenameByName  map[string]string `json:"renameByName"`
}

type tablePanel struct {
	Title   string `json:"title"`
	Targets []struct {
		Expr string `json:"expr"`
	} `json:"targets"`
	Transformations []struct {
		ID      string          `json:"id"`
		Options organizeOptions `json:"options"`
	} `json:"transformations"`
	Panels []tablePanel `json:"panels"`
}

// kubePanels returns the panels whose queries join kube_pod_info.
func kubePanels(t *testing.T) []tablePanel {
	t.Helper()
	b, err := os.ReadFile("../../dashboards/gpu-orphan-node.json")
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		Panels []tablePanel `json:"panels"`
	}
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatal(err)
	}
	var out []tablePanel
	var walk func([]tablePanel)
	walk = func(ps []tablePanel) {
		for _, p := range ps {
			for _, tg := range p.Targets {
				if strings.Contains(tg.Expr, "kube_pod_info") {
					out = append(out, p)
					break
				}
			}
			walk(p.Panels)
		}
	}
	walk(d.Panels)
	return out
}

// row is one result series: pid and the pod name and namespace it shows.
type row struct{ pid, pod, namespace string }

func evalPanel(t *testing.T, expr, series string) []row {
	t.Helper()
	expr = strings.NewReplacer(`$node`, `n1`, `$gpu`, `.*`).Replace(expr)
	storage := promqltest.LoadedStorage(t, series)
	engine := promqltest.NewTestEngine(t, false, 0, promqltest.DefaultMaxSamplesPerQuery)
	q, err := engine.NewInstantQuery(context.Background(), storage, nil, expr, time.Unix(0, 0))
	if err != nil {
		t.Fatalf("%s: %v", expr, err)
	}
	defer q.Close()
	res := q.Exec(context.Background())
	if res.Err != nil {
		t.Fatalf("%s: %v", expr, res.Err)
	}
	vec, err := res.Vector()
	if err != nil {
		t.Fatal(err)
	}
	var rows []row
	for _, s := range vec {
		rows = append(rows, row{s.Metric.Get("pid"), s.Metric.Get("k8s_pod"), s.Metric.Get("k8s_namespace")})
	}
	sort.Slice(rows, func(i, j int) bool { return rows[i].pid < rows[j].pid })
	return rows
}

// The holder tables show the pod's namespace and name from kube-state-metrics
// where it runs, every row where it does not, and never the exporter's own
// pod (prometheus-operator's target label) as the holder's.
func TestPodNamesFromKubeStateMetrics(t *testing.T) {
	panels := kubePanels(t)
	if len(panels) < 2 {
		t.Fatalf("%d panels join kube_pod_info; want the suspect holders and the dead owners tables", len(panels))
	}
	for _, p := range panels {
		t.Run(p.Title, func(t *testing.T) {
			expr := p.Targets[0].Expr
			holders := strings.HasPrefix(strings.TrimLeft(expr, "( "), "gpu_orphan_holder_info")
			withKSM, without := []row{{"10", "trainer-0", "ml"}, {"11", "trainer-0", "ml"}, {"12", "", ""}}, []row{{"10", "", ""}, {"11", "", ""}, {"12", "", ""}}
			if !holders {
				withKSM, without = []row{{"8", "", ""}, {"9", "trainer-0", "ml"}}, []row{{"8", "", ""}, {"9", "", ""}}
			}
			if got := evalPanel(t, expr, kubeSeries+kubeStateMetrics); !equalRows(got, withKSM) {
				t.Errorf("with kube-state-metrics: rows %v, want %v", got, withKSM)
			}
			if got := evalPanel(t, expr, kubeSeries); !equalRows(got, without) {
				t.Errorf("without kube-state-metrics: rows %v, want %v (a row may not vanish)", got, without)
			}
			var organize *organizeOptions
			for i := range p.Transformations {
				if p.Transformations[i].ID == "organize" {
					organize = &p.Transformations[i].Options
				}
			}
			if organize == nil {
				t.Fatal("no organize transformation: the exporter's own pod would show as a column")
			}
			for _, own := range []string{"pod", "namespace"} {
				if !organize.ExcludeByName[own] {
					t.Errorf("column %q (the exporter's own pod, from prometheus-operator) is not hidden", own)
				}
			}
			for _, k := range []string{"k8s_pod", "k8s_namespace"} {
				if organize.ExcludeByName[k] || organize.RenameByName[k] == "" {
					t.Errorf("column %s is hidden or unnamed", k)
				}
			}
		})
	}
}

func equalRows(a, b []row) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// The runbook shows the dashboards' join, not a variant of it.
func TestRunbookShowsTheTestedJoin(t *testing.T) {
	b, err := os.ReadFile("../../docs/runbook.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range kubePanels(t) {
		expr := p.Targets[0].Expr
		_, join, ok := strings.Cut(expr, " * ")
		join, _, _ = strings.Cut(join, ") or on")
		if !ok || !strings.Contains(strings.Join(strings.Fields(string(b)), " "), join) {
			t.Errorf("docs/runbook.md does not show panel %q's join %q", p.Title, join)
		}
	}
}
