package alerts

import (
	"bufio"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"unicode"

	"sigs.k8s.io/yaml"
)

const (
	runbookPath = "../docs/runbook.md"
	metricsPath = "../docs/metrics.md"
	runbookURL  = "https://github.com/gpu-orphan/gpu-orphan/blob/main/docs/runbook.md#"
)

var (
	alertName = regexp.MustCompile(`^GPUOrphan[A-Z][A-Za-z0-9]*$`)
	// metricName finds the project's metrics, and `up`, in an expression.
	metricName = regexp.MustCompile(`\b(?:gpu_orphan_[a-z0-9_]*[a-z0-9]|up)\b`)
	severities = []string{"critical", "warning", "info"}
	localLink  = regexp.MustCompile(`\]\(#([^)\s]+)\)`)
	// builtin are series that Prometheus makes itself, for every target.
	builtin = []string{"up"}
)

// rule and ruleFile are Prometheus's rule file format, decoded strictly so
// that a misspelt key (anotations, label) fails here rather than silently.
type rule struct {
	Alert         string            `json:"alert"`
	Record        string            `json:"record"`
	Expr          string            `json:"expr"`
	For           string            `json:"for"`
	KeepFiringFor string            `json:"keep_firing_for"`
	Labels        map[string]string `json:"labels"`
	Annotations   map[string]string `json:"annotations"`
}

type ruleFile struct {
	Groups []struct {
		Name     string `json:"name"`
		Interval string `json:"interval"`
		Limit    int    `json:"limit"`
		Rules    []rule `json:"rules"`
	} `json:"groups"`
}

// testFile is the part of promtool's test file format that says which
// alerts each case expects.
type testFile struct {
	Tests []struct {
		AlertRuleTest []struct {
			AlertName string `json:"alertname"`
			ExpAlerts []any  `json:"exp_alerts"`
		} `json:"alert_rule_test"`
	} `json:"tests"`
}

// loadAlerts returns every alerting rule of alerts/*.rules.yml, by file.
func loadAlerts(t *testing.T) map[string][]rule {
	t.Helper()
	files, err := filepath.Glob("*.rules.yml")
	if err != nil || len(files) == 0 {
		t.Fatalf("no *.rules.yml in alerts/ (err %v)", err)
	}
	out := map[string][]rule{}
	for _, f := range files {
		var rf ruleFile
		readYAML(t, f, &rf)
		for _, g := range rf.Groups {
			for _, r := range g.Rules {
				if r.Alert != "" {
					out[f] = append(out[f], r)
				}
			}
		}
		if len(out[f]) == 0 {
			t.Errorf("%s: no alerting rules", f)
		}
	}
	return out
}

func readYAML(t *testing.T, path string, v any) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.UnmarshalStrict(b, v); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
}

func TestAlertsHaveLabelsAndAnnotations(t *testing.T) {
	for file, rules := range loadAlerts(t) {
		for _, r := range rules {
			if !alertName.MatchString(r.Alert) {
				t.Errorf("%s: alert %q: want CamelCase with the prefix GPUOrphan", file, r.Alert)
			}
			if s := r.Labels["severity"]; !slices.Contains(severities, s) {
				t.Errorf("%s: alert %s: severity %q, want one of %v", file, r.Alert, s, severities)
			}
			for _, a := range []string{"summary", "description", "runbook_url"} {
				if strings.TrimSpace(r.Annotations[a]) == "" {
					t.Errorf("%s: alert %s: no %s annotation", file, r.Alert, a)
				}
			}
		}
	}
}

func TestRunbookHasAnAnchorPerAlert(t *testing.T) {
	anchors := headingAnchors(t, runbookPath)
	for file, rules := range loadAlerts(t) {
		for _, r := range rules {
			u := r.Annotations["runbook_url"]
			frag, ok := strings.CutPrefix(u, runbookURL)
			if !ok || frag == "" {
				t.Errorf("%s: alert %s: runbook_url %q, want %s<anchor>", file, r.Alert, u, runbookURL)
				continue
			}
			if !anchors[frag] {
				t.Errorf("%s: alert %s: runbook_url's #%s is no heading of %s", file, r.Alert, frag, runbookPath)
			}
		}
	}
}

// TestRunbookLinksResolve checks the runbook's links to its own sections.
func TestRunbookLinksResolve(t *testing.T) {
	b, err := os.ReadFile(runbookPath)
	if err != nil {
		t.Fatal(err)
	}
	anchors := headingAnchors(t, runbookPath)
	for _, m := range localLink.FindAllStringSubmatch(string(b), -1) {
		if !anchors[m[1]] {
			t.Errorf("%s: link to #%s, which is no heading", runbookPath, m[1])
		}
	}
}

func TestExpressionsUseDocumentedMetrics(t *testing.T) {
	b, err := os.ReadFile(metricsPath)
	if err != nil {
		t.Fatal(err)
	}
	documented := map[string]bool{}
	for _, m := range metricName.FindAllString(string(b), -1) {
		documented[m] = true
	}
	for _, m := range builtin {
		documented[m] = true
	}
	for file, rules := range loadAlerts(t) {
		for _, r := range rules {
			used := metricName.FindAllString(r.Expr, -1)
			if len(used) == 0 {
				t.Errorf("%s: alert %s: expression uses no gpu_orphan_ metric nor %v: %q", file, r.Alert, builtin, r.Expr)
			}
			for _, m := range used {
				if !documented[m] && !documented[histogramBase(m)] {
					t.Errorf("%s: alert %s: metric %s is not in %s", file, r.Alert, m, metricsPath)
				}
			}
		}
	}
}

// TestEveryAlertIsUnitTested asks the promtool tests for at least one case
// where each alert fires and one where it must not.
func TestEveryAlertIsUnitTested(t *testing.T) {
	files, err := filepath.Glob("*_test.yml")
	if err != nil || len(files) == 0 {
		t.Fatalf("no *_test.yml in alerts/ (err %v)", err)
	}
	fires, silent := map[string]bool{}, map[string]bool{}
	for _, f := range files {
		var tf testFile
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		// Not strict: promtool's format has more fields than these.
		if err := yaml.Unmarshal(b, &tf); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		for _, tc := range tf.Tests {
			for _, a := range tc.AlertRuleTest {
				if len(a.ExpAlerts) > 0 {
					fires[a.AlertName] = true
				} else {
					silent[a.AlertName] = true
				}
			}
		}
	}
	for file, rules := range loadAlerts(t) {
		for _, r := range rules {
			if !fires[r.Alert] {
				t.Errorf("%s: alert %s: no promtool test where it fires", file, r.Alert)
			}
			if !silent[r.Alert] {
				t.Errorf("%s: alert %s: no promtool test where it must not fire", file, r.Alert)
			}
		}
	}
}

func histogramBase(m string) string {
	for _, s := range []string{"_bucket", "_sum", "_count"} {
		if b, ok := strings.CutSuffix(m, s); ok {
			return b
		}
	}
	return m
}

// headingAnchors returns the anchors GitHub gives the Markdown file's ATX
// headings, fenced code blocks left out.
func headingAnchors(t *testing.T, path string) map[string]bool {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	anchors, seen := map[string]bool{}, map[string]int{}
	var fence string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if fence != "" {
			if strings.HasPrefix(line, fence) {
				fence = ""
			}
			continue
		}
		if strings.HasPrefix(line, "```") || strings.HasPrefix(line, "~~~") {
			fence = line[:3]
			continue
		}
		level := len(line) - len(strings.TrimLeft(line, "#"))
		if level == 0 || level > 6 || !strings.HasPrefix(line[level:], " ") {
			continue
		}
		a := githubAnchor(strings.TrimRight(strings.TrimSpace(line[level:]), "#"))
		if n := seen[a]; n > 0 {
			seen[a]++
			a = a + "-" + strconv.Itoa(n)
		} else {
			seen[a] = 1
		}
		anchors[a] = true
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return anchors
}

// githubAnchor is GitHub's slug of a heading: lower case, punctuation
// dropped (but - and _), spaces turned into hyphens.
func githubAnchor(heading string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(strings.TrimSpace(heading)) {
		switch {
		case unicode.IsLetter(r), unicode.IsDigit(r), r == '-', r == '_':
			b.WriteRune(r)
		case r == ' ':
			b.WriteByte('-')
		}
	}
	return b.String()
}

func TestGithubAnchor(t *testing.T) {
	for in, want := range map[string]string{
		"GPUOrphanMemory":                       "gpuorphanmemory",
		"How the `node` label gets there":       "how-the-node-label-gets-there",
		"Kubernetes (DaemonSet, hostPID: true)": "kubernetes-daemonset-hostpid-true",
		"What to do when it cannot: D state":    "what-to-do-when-it-cannot-d-state",
	} {
		if got := githubAnchor(in); got != want {
			t.Errorf("githubAnchor(%q) = %q, want %q", in, got, want)
		}
	}
}
