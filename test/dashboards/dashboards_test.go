package dashboards

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/promql/parser"
)

// metricsDoc is the reference every query is checked against.
const metricsDoc = "../../docs/metrics.md"

// dashboard is the part of Grafana's dashboard model that the checks read.
type dashboard struct {
	UID           string `json:"uid"`
	Title         string `json:"title"`
	SchemaVersion int    `json:"schemaVersion"`
	Panels        []panel
	Templating    struct {
		List []variable `json:"list"`
	} `json:"templating"`
	Annotations struct {
		List []annotation `json:"list"`
	} `json:"annotations"`
}

type panel struct {
	ID         int         `json:"id"`
	Type       string      `json:"type"`
	Title      string      `json:"title"`
	Datasource *datasource `json:"datasource"`
	Targets    []target    `json:"targets"`
	// Panels holds the panels of a collapsed row.
	Panels []panel `json:"panels"`
}

type target struct {
	RefID      string      `json:"refId"`
	Expr       string      `json:"expr"`
	Datasource *datasource `json:"datasource"`
}

type datasource struct {
	Type string `json:"type"`
	UID  string `json:"uid"`
}

type variable struct {
	Name  string          `json:"name"`
	Type  string          `json:"type"`
	Query json.RawMessage `json:"query"`
}

type annotation struct {
	Name       string      `json:"name"`
	Expr       string      `json:"expr"`
	Datasource *datasource `json:"datasource"`
}

// knownMetrics maps every documented metric name to its type.
type knownMetrics map[string]string

var (
	// A row of a metrics table: | `gpu_orphan_x` | type | labels | meaning |
	docRow = regexp.MustCompile("^\\|\\s*`(gpu_orphan_[a-z0-9_]+)`\\s*\\|\\s*([^|]*?)\\s*\\|")
	// Grafana's interval variables, with or without braces, and their
	// _ms/_s forms.
	intervalVar = regexp.MustCompile(`\$\{?__(rate_interval|interval|range)(_ms|_s)?\}?`)
	// Any other variable: ${name}, ${name:format} or $name.
	bracedVar = regexp.MustCompile(`\$\{([A-Za-z_][A-Za-z0-9_]*)(?::[^}]*)?\}`)
	plainVar  = regexp.MustCompile(`\$([A-Za-z_][A-Za-z0-9_]*)`)
	// label_values(selector, label) in a variable's query.
	labelValues = regexp.MustCompile(`^\s*label_values\((.+),\s*[A-Za-z_][A-Za-z0-9_]*\s*\)\s*$`)
	queryResult = regexp.MustCompile(`^\s*query_result\((.+)\)\s*$`)
)

// loadKnownMetrics reads the metric names out of the tables of
// docs/metrics.md.
func loadKnownMetrics(path string) (knownMetrics, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	known := knownMetrics{}
	s := bufio.NewScanner(f)
	for s.Scan() {
		if m := docRow.FindStringSubmatch(s.Text()); m != nil {
			known[m[1]] = m[2]
		}
	}
	if err := s.Err(); err != nil {
		return nil, err
	}
	if len(known) == 0 {
		return nil, fmt.Errorf("%s: no metric table rows found", path)
	}
	return known, nil
}

// externalMetrics are other exporters' series that a dashboard may join,
// each only where the panel still shows its rows without them
// (TestPodNamesFromKubeStateMetrics).
var externalMetrics = map[string]string{
	"kube_pod_info": "kube-state-metrics",
	// The dispatcher's taint (--escalate.taint), in "Nodes out of
	// scheduling" beside the exporter's Slurm drain.
	"kube_node_spec_taint": "kube-state-metrics",
}

// allows reports whether a query may use the series name.
func (k knownMetrics) allows(name string) bool {
	if _, ok := externalMetrics[name]; ok || name == "up" {
		return true
	}
	if _, ok := k[name]; ok {
		return true
	}
	for _, suffix := range []string{"_bucket", "_sum", "_count"} {
		if base, ok := strings.CutSuffix(name, suffix); ok && strings.HasPrefix(k[base], "histogram") {
			return true
		}
	}
	return false
}

// expandVariables replaces Grafana's variables with values that keep the
// expression valid PromQL: a duration for the interval variables, a plain
// word for the others (which dashboards use inside label matchers).
func expandVariables(expr string) string {
	expr = intervalVar.ReplaceAllStringFunc(expr, func(v string) string {
		switch {
		case strings.Contains(v, "_ms"):
			return "300000"
		case strings.HasSuffix(strings.TrimSuffix(v, "}"), "_s"):
			return "300"
		}
		return "5m"
	})
	expr = bracedVar.ReplaceAllString(expr, "placeholder")
	return plainVar.ReplaceAllString(expr, "placeholder")
}

// variablesIn returns the names of the non-builtin variables an
// expression refers to.
func variablesIn(expr string) []string {
	var names []string
	for _, re := range []*regexp.Regexp{bracedVar, plainVar} {
		for _, m := range re.FindAllStringSubmatch(expr, -1) {
			if !strings.HasPrefix(m[1], "__") {
				names = append(names, m[1])
			}
		}
	}
	return names
}

// metricNames parses a Grafana query and returns the series names it
// selects.
func metricNames(expr string) ([]string, error) {
	node, err := parser.NewParser(parser.Options{}).ParseExpr(expandVariables(expr))
	if err != nil {
		return nil, fmt.Errorf("parsing %q: %w", expr, err)
	}
	var names []string
	var errs []error
	parser.Inspect(node, func(n parser.Node, _ []parser.Node) error {
		vs, ok := n.(*parser.VectorSelector)
		if !ok {
			return nil
		}
		if vs.Name != "" {
			names = append(names, vs.Name)
		}
		for _, m := range vs.LabelMatchers {
			if m.Name != model.MetricNameLabel || m.Value == vs.Name {
				continue
			}
			if m.Type != labels.MatchEqual {
				errs = append(errs, fmt.Errorf("%q: a %s matcher on __name__ cannot be checked; name the metric", expr, m.Type))
				continue
			}
			names = append(names, m.Value)
		}
		return nil
	})
	return names, errors.Join(errs...)
}

// checkExpr fails when expr does not parse or uses a metric that
// docs/metrics.md does not list.
func checkExpr(expr string, known knownMetrics) error {
	names, err := metricNames(expr)
	if err != nil {
		return err
	}
	if len(names) == 0 {
		return fmt.Errorf("%q selects no metric", expr)
	}
	var errs []error
	for _, name := range names {
		if !known.allows(name) {
			errs = append(errs, fmt.Errorf("%q uses %s, which %s does not list", expr, name, metricsDoc))
		}
	}
	return errors.Join(errs...)
}

// variableExpr returns the PromQL inside a query variable's definition,
// or "" when it has none (label_values(label), a datasource variable).
func variableExpr(v variable) (string, error) {
	if v.Type != "query" {
		return "", nil
	}
	var q string
	if err := json.Unmarshal(v.Query, &q); err != nil {
		var obj struct {
			Query string `json:"query"`
		}
		if err := json.Unmarshal(v.Query, &obj); err != nil {
			return "", fmt.Errorf("variable %s: query is neither a string nor an object: %w", v.Name, err)
		}
		q = obj.Query
	}
	for _, re := range []*regexp.Regexp{labelValues, queryResult} {
		if m := re.FindStringSubmatch(q); m != nil {
			return m[1], nil
		}
	}
	if strings.HasPrefix(strings.TrimSpace(q), "label_values(") {
		return "", nil // label_values(label): no selector
	}
	return "", fmt.Errorf("variable %s: cannot read query %q", v.Name, q)
}

// flatten returns every panel, including those nested in rows.
func flatten(panels []panel) []panel {
	var out []panel
	for _, p := range panels {
		out = append(out, p)
		out = append(out, flatten(p.Panels)...)
	}
	return out
}

func loadDashboards(t *testing.T) map[string]dashboard {
	t.Helper()
	files, err := filepath.Glob("../../dashboards/*.json")
	if err != nil {
		t.Fatal(err)
	}
	if len(files) == 0 {
		t.Fatal("no dashboards (*.json) in dashboards/")
	}
	out := map[string]dashboard{}
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var d dashboard
		if err := json.Unmarshal(data, &d); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		out[f] = d
	}
	return out
}

func TestDashboardQueriesUseDocumentedMetrics(t *testing.T) {
	known, err := loadKnownMetrics(metricsDoc)
	if err != nil {
		t.Fatal(err)
	}
	for file, d := range loadDashboards(t) {
		t.Run(file, func(t *testing.T) {
			defined := map[string]bool{}
			for _, v := range d.Templating.List {
				defined[v.Name] = true
			}
			check := func(where, expr string) {
				if err := checkExpr(expr, known); err != nil {
					t.Errorf("%s: %v", where, err)
				}
				for _, name := range variablesIn(expr) {
					if !defined[name] {
						t.Errorf("%s: %q uses $%s, which the dashboard does not define", where, expr, name)
					}
				}
			}
			queries := 0
			for _, p := range flatten(d.Panels) {
				for _, tg := range p.Targets {
					where := fmt.Sprintf("panel %d %q target %s", p.ID, p.Title, tg.RefID)
					if tg.Expr == "" {
						t.Errorf("%s: empty expr", where)
						continue
					}
					check(where, tg.Expr)
					queries++
				}
			}
			for _, a := range d.Annotations.List {
				if a.Expr != "" {
					check(fmt.Sprintf("annotation %q", a.Name), a.Expr)
				}
			}
			for _, v := range d.Templating.List {
				expr, err := variableExpr(v)
				if err != nil {
					t.Error(err)
					continue
				}
				if expr != "" {
					check(fmt.Sprintf("variable %s", v.Name), expr)
				}
			}
			if queries == 0 {
				t.Error("no queries")
			}
		})
	}
}

func TestDashboardStructure(t *testing.T) {
	uids := map[string]string{}
	for file, d := range loadDashboards(t) {
		t.Run(file, func(t *testing.T) {
			if d.UID == "" || len(d.UID) > 40 {
				t.Errorf("uid %q: must be set and at most 40 characters", d.UID)
			}
			if other, ok := uids[d.UID]; ok {
				t.Errorf("uid %q is also the uid of %s", d.UID, other)
			}
			uids[d.UID] = file
			if d.Title == "" {
				t.Error("no title")
			}
			if d.SchemaVersion < 36 {
				t.Errorf("schemaVersion %d: want 36 or later (datasource references by uid)", d.SchemaVersion)
			}

			vars := map[string]bool{}
			dsVar := false
			for _, v := range d.Templating.List {
				if vars[v.Name] {
					t.Errorf("variable %s is defined twice", v.Name)
				}
				vars[v.Name] = true
				if v.Name == "datasource" && v.Type == "datasource" && string(v.Query) == `"prometheus"` {
					dsVar = true
				}
			}
			if !dsVar {
				t.Error(`no "datasource" variable of type datasource for prometheus`)
			}

			ids := map[int]string{}
			for _, p := range flatten(d.Panels) {
				if p.ID <= 0 {
					t.Errorf("panel %q: no id", p.Title)
				}
				if prev, ok := ids[p.ID]; ok {
					t.Errorf("panel id %d is used by %q and %q", p.ID, prev, p.Title)
				}
				ids[p.ID] = p.Title
				if p.Type == "row" {
					continue
				}
				if p.Title == "" {
					t.Errorf("panel %d: no title", p.ID)
				}
				// Every query goes through the datasource variable, so that
				// the dashboard works with any Prometheus it is imported into.
				if p.Datasource == nil || p.Datasource.UID != "${datasource}" {
					t.Errorf("panel %d %q: datasource %+v, want uid ${datasource}", p.ID, p.Title, p.Datasource)
				}
				for _, tg := range p.Targets {
					if tg.Datasource != nil && tg.Datasource.UID != "${datasource}" {
						t.Errorf("panel %d %q target %s: datasource uid %q, want ${datasource}", p.ID, p.Title, tg.RefID, tg.Datasource.UID)
					}
				}
			}
		})
	}
}

// TestCheckExprRejects makes sure the checker can fail.
func TestCheckExprRejects(t *testing.T) {
	known := knownMetrics{
		"gpu_orphan_unowned_memory_bytes":                     "gauge",
		"gpu_orphan_remediator_action_duration_seconds":       "histogram",
		"gpu_orphan_remediator_freed_bytes_total":             "counter",
		"gpu_orphan_remediator_actions_total":                 "counter",
		"gpu_orphan_remediator_notifications_total":           "counter",
		"gpu_orphan_remediator_last_action_timestamp_seconds": "gauge",
	}
	for _, tc := range []struct {
		expr string
		ok   bool
	}{
		{`gpu_orphan_unowned_memory_bytes{node=~"$node",gpu=~"${gpu}"}`, true},
		{`sum by (state) (increase(gpu_orphan_remediator_actions_total[$__rate_interval]))`, true},
		{`histogram_quantile(0.9, sum by (le) (rate(gpu_orphan_remediator_action_duration_seconds_bucket[${__rate_interval}])))`, true},
		{`sum(increase(gpu_orphan_remediator_freed_bytes_total[$__range])) / count(up)`, true},
		{`{__name__="gpu_orphan_unowned_memory_bytes"}`, true},
		{`rate(gpu_orphan_made_up_total[5m])`, false},
		{`gpu_orphan_unowned_memory_bytes / on(gpu) gpu_orphan_memory_total_bytes`, false},
		{`gpu_orphan_remediator_freed_bytes_total_bucket`, false},  // not a histogram
		{`gpu_orphan_remediator_notifications_total_count`, false}, // not a histogram
		{`{__name__=~"gpu_orphan_.*"}`, false},                     // cannot be checked
		{`sum(gpu_orphan_unowned_memory_bytes`, false},             // does not parse
		{`vector(1)`, false}, // selects nothing
		{`node_memory_MemFree_bytes * on() group_left vector(0)`, false},
	} {
		err := checkExpr(tc.expr, known)
		if (err == nil) != tc.ok {
			t.Errorf("checkExpr(%q) = %v, want ok=%v", tc.expr, err, tc.ok)
		}
	}
}

func TestLoadKnownMetrics(t *testing.T) {
	known, err := loadKnownMetrics(metricsDoc)
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"gpu_orphan_unowned_memory_bytes", "gpu_orphan_remediator_actions_total"} {
		if !known.allows(name) {
			t.Errorf("%s not read from %s", name, metricsDoc)
		}
	}
	if !known.allows("gpu_orphan_remediator_action_duration_seconds_bucket") {
		t.Errorf("histogram suffixes not allowed")
	}
}
