package deploy

import (
	"bytes"
	"encoding/json"
	"fmt"
	"maps"
	"net/url"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	monitoringv1alpha1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1alpha1"
	"github.com/prometheus/prometheus/promql/parser"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	"helm.sh/helm/v3/pkg/lint"
	"helm.sh/helm/v3/pkg/lint/support"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
)

const (
	chartDir      = "../../charts/gpu-orphan"
	dashboardsDir = "../../dashboards"
	// The value sets the chart is rendered with besides its defaults.
	helmTestdata = "testdata/helm"
	// deploy/kubernetes/ is the chart rendered with these values.
	k8sValuesFile    = "values.yaml"
	k8sGeneratedFile = "gpu-orphan.yaml"
	k8sRelease       = "gpu-orphan"
)

// chartValues are the values the checks compare the rendered objects
// with, read from the coalesced values (defaults and the value set).
type chartValues struct {
	Act bool `json:"act"`
	UI  struct {
		Open bool `json:"open"`
	} `json:"ui"`
	Ports struct {
		Exporter   int32 `json:"exporter"`
		Remediator int32 `json:"remediator"`
	} `json:"ports"`
	Remediation map[string]any `json:"remediation"`
	Limits      map[string]any `json:"limits"`
	Auth        struct {
		ExistingSecret string `json:"existingSecret"`
	} `json:"auth"`
	Node struct {
		NodeSelector map[string]string   `json:"nodeSelector"`
		Tolerations  []corev1.Toleration `json:"tolerations"`
		HostPort     int32               `json:"hostPort"`
	} `json:"node"`
	Dispatcher struct {
		Replicas     int32 `json:"replicas"`
		SharedLimits struct {
			Enabled bool `json:"enabled"`
		} `json:"sharedLimits"`
		Discovery struct {
			Enabled bool   `json:"enabled"`
			Scheme  string `json:"scheme"`
		} `json:"discovery"`
		Escalate struct {
			Taint bool `json:"taint"`
		} `json:"escalate"`
		Targets      map[string]string `json:"targets"`
		URLTemplate  string            `json:"urlTemplate"`
		Limits       map[string]any    `json:"limits"`
		NodeSelector map[string]string `json:"nodeSelector"`
	} `json:"dispatcher"`
	Monitoring struct {
		Labels map[string]string `json:"labels"`
		Jobs   struct {
			Exporter   string `json:"exporter"`
			Remediator string `json:"remediator"`
			Dispatcher string `json:"dispatcher"`
		} `json:"jobs"`
	} `json:"monitoring"`
	PodMonitor     struct{ Enabled bool } `json:"podMonitor"`
	ServiceMonitor struct{ Enabled bool } `json:"serviceMonitor"`
	PrometheusRule struct {
		Enabled        bool     `json:"enabled"`
		ExporterJob    string   `json:"exporterJob"`
		RemediatorJobs []string `json:"remediatorJobs"`
	} `json:"prometheusRule"`
	Dashboards struct {
		Enabled    bool   `json:"enabled"`
		Label      string `json:"label"`
		LabelValue string `json:"labelValue"`
		Namespace  string `json:"namespace"`
	} `json:"dashboards"`
	AlertmanagerConfig struct {
		Enabled        bool     `json:"enabled"`
		Alertname      string   `json:"alertname"`
		GroupBy        []string `json:"groupBy"`
		RepeatInterval string   `json:"repeatInterval"`
	} `json:"alertmanagerConfig"`
}

// exporterJob and remediatorJobs are the jobs the rules should select.
func (v *chartValues) exporterJob() string {
	if v.PrometheusRule.ExporterJob != "" {
		return v.PrometheusRule.ExporterJob
	}
	return v.Monitoring.Jobs.Exporter
}

func (v *chartValues) remediatorJobs() []string {
	if len(v.PrometheusRule.RemediatorJobs) > 0 {
		return v.PrometheusRule.RemediatorJobs
	}
	return slices.Compact([]string{v.Monitoring.Jobs.Remediator, v.Monitoring.Jobs.Dispatcher})
}

// chartRender is the chart rendered with one value set.
type chartRender struct {
	release, namespace string
	values             chartValues
	// templates maps each template that rendered something to its text.
	templates map[string]string
	// notes is NOTES.txt, what helm prints after an install.
	notes string
}

// renderChart renders the chart as `helm template` does, with the values
// of valuesFile ("" for the defaults) over the chart's, in strict mode: a
// template that reads a value the chart does not define fails.
func renderChart(t *testing.T, valuesFile, release, namespace string) *chartRender {
	t.Helper()
	ch, err := loader.Load(chartDir)
	if err != nil {
		t.Fatalf("load %s: %v", chartDir, err)
	}
	var vals map[string]any
	if valuesFile != "" {
		v, err := chartutil.ReadValuesFile(valuesFile)
		if err != nil {
			t.Fatal(err)
		}
		vals = v
	}
	rv, err := chartutil.ToRenderValues(ch, vals, chartutil.ReleaseOptions{
		Name: release, Namespace: namespace, Revision: 1, IsInstall: true,
	}, chartutil.DefaultCapabilities)
	if err != nil {
		t.Fatalf("%s: %v", valuesFile, err)
	}
	out, err := engine.Engine{Strict: true}.Render(ch, rv)
	if err != nil {
		t.Fatalf("render with %q: %v", valuesFile, err)
	}
	r := &chartRender{release: release, namespace: namespace, templates: map[string]string{}}
	for name, text := range out {
		if strings.HasSuffix(name, "NOTES.txt") {
			r.notes = text
		}
		if strings.HasSuffix(name, "NOTES.txt") || strings.HasPrefix(filepath.Base(name), "_") || strings.TrimSpace(text) == "" {
			continue
		}
		r.templates[name] = text
	}
	coalesced, _ := rv["Values"].(chartutil.Values)
	j, err := json.Marshal(coalesced)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(j, &r.values); err != nil {
		t.Fatalf("values: %v", err)
	}
	return r
}

// manifest joins the rendered templates into one YAML stream, in the order
// of their names, each under a `# Source:` line as `helm template` writes.
func (r *chartRender) manifest() []byte {
	names := make([]string, 0, len(r.templates))
	for n := range r.templates {
		names = append(names, n)
	}
	slices.Sort(names)
	var b bytes.Buffer
	for _, n := range names {
		fmt.Fprintf(&b, "---\n# Source: %s\n%s\n", n, strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(r.templates[n]), "---")))
	}
	return b.Bytes()
}

// objects strictly decodes every rendered object.
func (r *chartRender) objects(t *testing.T) []k8sObject {
	t.Helper()
	objs, err := decodeManifest(bytes.NewReader(r.manifest()))
	if err != nil {
		t.Fatalf("rendered chart: %v", err)
	}
	return objs
}

// helmCase is a value set: its file ("" for the chart's defaults), and the
// release it is rendered as.
type helmCase struct {
	name, file, release, namespace string
}

func helmCases(t *testing.T) []helmCase {
	t.Helper()
	cases := []helmCase{
		{"defaults", "", "gpu-orphan", "gpu-orphan"},
		{"deploy/kubernetes", filepath.Join(k8sDir, k8sValuesFile), k8sRelease, k8sNamespace},
	}
	files, _ := filepath.Glob(filepath.Join(helmTestdata, "*.yaml"))
	if len(files) < 2 {
		t.Fatalf("%s: want at least two value sets, have %d", helmTestdata, len(files))
	}
	for _, f := range files {
		// Another release name and namespace: nothing may assume the defaults.
		cases = append(cases, helmCase{strings.TrimSuffix(filepath.Base(f), ".yaml"), f, "site", "gpus"})
	}
	return cases
}

// The chart's copies of the rules and the dashboards (Helm reads no file
// outside the chart) are those of alerts/ and dashboards/.
func TestHelmChartFilesMatch(t *testing.T) {
	pairs := map[string]string{filepath.Join(chartDir, "files", "gpu-orphan.rules.yml"): rulesFile}
	dashboards, _ := filepath.Glob(filepath.Join(dashboardsDir, "*.json"))
	if len(dashboards) == 0 {
		t.Fatalf("no dashboards in %s", dashboardsDir)
	}
	for _, d := range dashboards {
		pairs[filepath.Join(chartDir, "files", "dashboards", filepath.Base(d))] = d
	}
	if *update {
		old, _ := filepath.Glob(filepath.Join(chartDir, "files", "dashboards", "*.json"))
		for _, f := range old {
			if _, ok := pairs[f]; !ok {
				if err := os.Remove(f); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	copies, _ := filepath.Glob(filepath.Join(chartDir, "files", "dashboards", "*.json"))
	for _, c := range copies {
		if _, ok := pairs[c]; !ok {
			t.Errorf("%s is in no %s; run: go test ./deploy/ -run TestHelmChartFilesMatch -update", c, dashboardsDir)
		}
	}
	for dst, src := range pairs {
		want, err := os.ReadFile(src)
		if err != nil {
			t.Fatal(err)
		}
		if *update {
			if err := os.WriteFile(dst, want, 0o644); err != nil {
				t.Fatal(err)
			}
		}
		got, err := os.ReadFile(dst)
		if err != nil || !bytes.Equal(got, want) {
			t.Errorf("%s differs from %s (%v); run: go test ./deploy/ -run TestHelmChartFilesMatch -update", dst, src, err)
		}
	}
}

// Helm's own linter (`helm lint`), with the defaults and each value set:
// no warnings, no errors.
func TestHelmLint(t *testing.T) {
	for _, c := range helmCases(t) {
		t.Run(c.name, func(t *testing.T) {
			var vals map[string]any
			if c.file != "" {
				v, err := chartutil.ReadValuesFile(c.file)
				if err != nil {
					t.Fatal(err)
				}
				vals = v
			}
			linter := lint.All(chartDir, vals, c.namespace, false)
			for _, m := range linter.Messages {
				if m.Severity >= support.WarningSev {
					t.Error(m)
				} else {
					t.Log(m)
				}
			}
		})
	}
}

// TestHelmRender renders the chart with each value set, strictly decodes
// every object into its API type, and checks what ties them together.
func TestHelmRender(t *testing.T) {
	exporterPort, remediatorPort := defaultPort(t, "gpu-orphan-exporter"), defaultPort(t, "gpu-orphan-remediator")
	for _, c := range helmCases(t) {
		t.Run(c.name, func(t *testing.T) {
			r := renderChart(t, c.file, c.release, c.namespace)
			objs := r.objects(t)
			v := &r.values
			if c.file == "" && (int(v.Ports.Exporter) != exporterPort || int(v.Ports.Remediator) != remediatorPort) {
				t.Errorf("values.yaml ports %d, %d; the binaries' defaults are %d, %d", v.Ports.Exporter, v.Ports.Remediator, exporterPort, remediatorPort)
			}
			checkChartObjects(t, r, objs)
			checkChartWorkloads(t, r, objs)
			checkChartServices(t, objs)
			checkChartDispatcher(t, r, objs)
			checkChartMonitors(t, r, objs)
			checkChartRule(t, r, objs)
			checkChartDashboards(t, r, objs)
			checkChartAlertmanagerConfig(t, r, objs)
		})
	}
}

// checkChartObjects: namespaces, names, labels, and that every optional
// object is there exactly when its value says so.
func checkChartObjects(t *testing.T, r *chartRender, objs []k8sObject) {
	t.Helper()
	v := &r.values
	seen := map[string]bool{}
	count := map[string]int{}
	for _, o := range objs {
		key := o.kind + "/" + o.obj.GetNamespace() + "/" + o.obj.GetName()
		if seen[key] {
			t.Errorf("%s rendered twice", key)
		}
		seen[key] = true
		count[o.kind]++
		wantNS := r.namespace
		if o.kind == "ConfigMap" && v.Dashboards.Namespace != "" && o.obj.GetLabels()[v.Dashboards.Label] != "" {
			wantNS = v.Dashboards.Namespace
		}
		// The taint's grants (escalate.taint): nodes are cluster-scoped,
		// and Node events go to namespace default.
		taintRBAC := v.Dispatcher.Escalate.Taint && strings.HasSuffix(o.obj.GetName(), "-"+r.namespace+"-taint")
		if taintRBAC && (o.kind == "ClusterRole" || o.kind == "ClusterRoleBinding") {
			// checkChartDispatcher checks what they grant.
		} else if v.Dispatcher.Escalate.Taint && strings.HasSuffix(o.obj.GetName(), "-"+r.namespace+"-node-events") && (o.kind == "Role" || o.kind == "RoleBinding") {
			if o.obj.GetNamespace() != "default" {
				t.Errorf("%s: namespace %q, want default, where Node events go", key, o.obj.GetNamespace())
			}
		} else if slices.Contains(clusterScoped, o.kind) {
			t.Errorf("%s: the chart renders no cluster-scoped objects but the taint's", key)
		} else if o.obj.GetNamespace() != wantNS {
			t.Errorf("%s: namespace %q, want %q", key, o.obj.GetNamespace(), wantNS)
		}
		l := o.obj.GetLabels()
		if l["app.kubernetes.io/name"] != "gpu-orphan" || l["app.kubernetes.io/instance"] != r.release {
			t.Errorf("%s: labels %v lack app.kubernetes.io/name=gpu-orphan and instance=%s", key, l, r.release)
		}
		if !strings.HasPrefix(o.obj.GetName(), fullname(r)) {
			t.Errorf("%s: name does not start with %s", key, fullname(r))
		}
	}
	want := map[string]int{
		"DaemonSet": 1, "Deployment": 1, "Service": 3,
		"PodMonitor":         b2i(v.PodMonitor.Enabled),
		"ServiceMonitor":     b2i(v.ServiceMonitor.Enabled),
		"PrometheusRule":     b2i(v.PrometheusRule.Enabled),
		"AlertmanagerConfig": b2i(v.AlertmanagerConfig.Enabled),
		"Secret":             b2i(v.Auth.ExistingSecret == ""),
	}
	for kind, n := range want {
		if count[kind] != n {
			t.Errorf("%d %s objects, want %d", count[kind], kind, n)
		}
	}
	// Prometheus-operator's objects carry the labels its selectors match.
	for _, o := range objs {
		switch o.kind {
		case "PodMonitor", "ServiceMonitor", "PrometheusRule", "AlertmanagerConfig":
			for k, val := range v.Monitoring.Labels {
				if o.obj.GetLabels()[k] != val {
					t.Errorf("%s %s: no label %s=%s (monitoring.labels)", o.kind, o.obj.GetName(), k, val)
				}
			}
		}
	}
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// checkChartWorkloads: pod security, flags, tokens, ports, the dry run,
// node selection.
func checkChartWorkloads(t *testing.T, r *chartRender, objs []k8sObject) {
	t.Helper()
	v := &r.values
	flags := flagChecker{}
	for _, w := range workloads(objs) {
		sel, err := metav1.LabelSelectorAsSelector(w.selector)
		if err != nil || sel.Empty() || !sel.Matches(labels.Set(w.template.Labels)) {
			t.Errorf("%s: selector %v does not select its own pods (%v)", w.name, w.selector, err)
		}
		spec := &w.template.Spec
		for _, err := range podErrors(w.name, spec) {
			t.Error(err)
		}
		if sa := spec.ServiceAccountName; sa == "" || find[corev1.ServiceAccount](objs, sa) == nil {
			t.Errorf("%s: service account %q is not rendered", w.name, sa)
		}
		for _, c := range spec.Containers {
			where := w.name + "/" + c.Name
			argv := append(slices.Clone(c.Command), c.Args...)
			flags.check(t, where, argv)
			if v.Auth.ExistingSecret == "" {
				checkSecretFiles(t, objs, where, spec, &c, argv)
			}
			// The port it listens on is the one it declares.
			listen, _ := flagValue(c.Args, "web.listen-address")
			if len(c.Ports) != 1 || listen != ":"+strconv.Itoa(int(c.Ports[0].ContainerPort)) {
				t.Errorf("%s: --web.listen-address=%s, ports %v", where, listen, c.Ports)
			}
		}
		for _, vol := range spec.Volumes {
			if vol.Secret != nil && vol.Secret.SecretName != secretName(r) {
				t.Errorf("%s: volume %s: Secret %s, want %s", w.name, vol.Name, vol.Secret.SecretName, secretName(r))
			}
		}
	}

	dss := all[appsv1.DaemonSet](objs)
	if len(dss) != 1 {
		t.Fatalf("%d DaemonSets", len(dss))
	}
	spec := &dss[0].Spec.Template.Spec
	if !spec.HostPID || spec.RuntimeClassName == nil || *spec.RuntimeClassName != "nvidia" || spec.PriorityClassName != "system-node-critical" {
		t.Errorf("DaemonSet: hostPID %v, runtimeClassName %v, priorityClassName %q", spec.HostPID, spec.RuntimeClassName, spec.PriorityClassName)
	}
	if !reflect.DeepEqual(spec.NodeSelector, v.Node.NodeSelector) || !reflect.DeepEqual(spec.Tolerations, v.Node.Tolerations) {
		t.Errorf("DaemonSet: nodeSelector %v, tolerations %v; values say %v, %v", spec.NodeSelector, spec.Tolerations, v.Node.NodeSelector, v.Node.Tolerations)
	}
	exp, rem := container(spec, "exporter"), container(spec, "remediator")
	if exp == nil || rem == nil {
		t.Fatal("DaemonSet: want containers exporter and remediator")
	}
	if exp.Ports[0].ContainerPort != v.Ports.Exporter || rem.Ports[0].ContainerPort != v.Ports.Remediator {
		t.Errorf("DaemonSet: ports %d, %d; values say %d, %d", exp.Ports[0].ContainerPort, rem.Ports[0].ContainerPort, v.Ports.Exporter, v.Ports.Remediator)
	}
	if rem.Ports[0].HostPort != v.Node.HostPort {
		t.Errorf("remediator: hostPort %d, node.hostPort %d", rem.Ports[0].HostPort, v.Node.HostPort)
	}
	if want := []corev1.Capability{"KILL", "DAC_READ_SEARCH", "SYS_PTRACE", "NET_ADMIN"}; !reflect.DeepEqual(rem.SecurityContext.Capabilities.Add, want) {
		t.Errorf("remediator: adds %v, want %v", rem.SecurityContext.Capabilities.Add, want)
	}
	if r, _ := flagValue(rem.Args, "role"); r != "node" {
		t.Errorf("remediator: --role=%s", r)
	}
	if n, _ := flagValue(rem.Args, "node.name"); n != "$(NODE_NAME)" {
		t.Errorf("remediator: --node.name=%q, want $(NODE_NAME)", n)
	}
	// --act exactly when act is true, and only on the node remediator.
	if got := slices.Contains(rem.Args, "--act"); got != v.Act {
		t.Errorf("remediator: --act is %v, act is %v", got, v.Act)
	}
	for _, w := range workloads(objs) {
		for _, c := range w.template.Spec.Containers {
			if c.Name != "remediator" && slices.Contains(c.Args, "--act") {
				t.Errorf("%s/%s: --act", w.name, c.Name)
			}
			// --web.ui.open exactly when ui.open is true, on the node
			// remediators and the dispatcher, which serve /actions.
			serves := c.Name == "remediator" || c.Name == "dispatcher"
			if got := slices.Contains(c.Args, "--web.ui.open"); got != (serves && v.UI.Open) {
				t.Errorf("%s/%s: --web.ui.open is %v, ui.open is %v", w.name, c.Name, got, v.UI.Open)
			}
		}
	}
	// Each value that is set becomes its flag; the others are left out.
	wantFlags := map[string]any{}
	for key, flag := range map[string]string{"policy": "remediate.policy", "minAge": "remediate.min-age", "minBytes": "remediate.min-bytes", "grace": "remediate.grace", "verifyTimeout": "remediate.verify-timeout"} {
		wantFlags[flag] = v.Remediation[key]
	}
	for key, flag := range map[string]string{"cooldown": "limit.cooldown", "rate": "limit.rate", "burst": "limit.burst", "concurrency": "limit.concurrency", "breakerFailures": "limit.breaker-failures", "breakerWindow": "limit.breaker-window"} {
		wantFlags[flag] = v.Limits[key]
	}
	checkFlagValues(t, "remediator", rem.Args, wantFlags)
	protect, _ := v.Remediation["protect"].([]any)
	for _, p := range protect {
		if !slices.Contains(rem.Args, fmt.Sprintf("--remediate.protect=%v", p)) {
			t.Errorf("remediator: no --remediate.protect=%v", p)
		}
	}
}

// checkFlagValues checks --flag=value for each set value, and that no
// flag is given for an empty one.
func checkFlagValues(t *testing.T, where string, args []string, want map[string]any) {
	t.Helper()
	for flag, val := range want {
		got, ok := flagValue(args, flag)
		s := fmt.Sprint(val)
		if val == nil {
			s = ""
		}
		switch {
		case s == "" && ok:
			t.Errorf("%s: --%s=%s, but its value is empty", where, flag, got)
		case s != "" && got != s:
			t.Errorf("%s: --%s=%q, want %q", where, flag, got, s)
		}
	}
}

func secretName(r *chartRender) string {
	if r.values.Auth.ExistingSecret != "" {
		return r.values.Auth.ExistingSecret
	}
	return fullname(r) + "-token"
}

// fullname is the prefix of the chart's object names (_helpers.tpl).
func fullname(r *chartRender) string {
	if strings.Contains(r.release, "gpu-orphan") {
		return r.release
	}
	return r.release + "-gpu-orphan"
}

// checkChartServices: every Service port is the port of the container
// port it targets, by name, so the ports of the values hold everywhere.
func checkChartServices(t *testing.T, objs []k8sObject) {
	t.Helper()
	for _, svc := range all[corev1.Service](objs) {
		sel := labels.SelectorFromSet(svc.Spec.Selector)
		for _, p := range svc.Spec.Ports {
			n := 0
			for _, w := range workloads(objs) {
				if len(svc.Spec.Selector) == 0 || !sel.Matches(labels.Set(w.template.Labels)) {
					continue
				}
				for _, c := range w.template.Spec.Containers {
					for _, cp := range c.Ports {
						if cp.Name != p.TargetPort.StrVal {
							continue
						}
						n++
						if cp.ContainerPort != p.Port {
							t.Errorf("Service %s: port %s is %d, its target %s/%s %d", svc.Name, p.Name, p.Port, w.name, c.Name, cp.ContainerPort)
						}
					}
				}
			}
			if n == 0 {
				t.Errorf("Service %s: port %s targets %q, no selected container's port name", svc.Name, p.Name, p.TargetPort.String())
			}
		}
	}
}

// checkChartDispatcher: replicas, discovery (the agents' Service and
// RBAC), the static allow-list.
func checkChartDispatcher(t *testing.T, r *chartRender, objs []k8sObject) {
	t.Helper()
	v := &r.values
	deps := all[appsv1.Deployment](objs)
	if len(deps) != 1 {
		t.Fatalf("%d Deployments", len(deps))
	}
	dep := deps[0]
	spec := &dep.Spec.Template.Spec
	d := container(spec, "dispatcher")
	if d == nil {
		t.Fatal("Deployment: no container dispatcher")
	}
	if !slices.Equal(d.Command, []string{"gpu-orphan-dispatcher"}) {
		t.Errorf("dispatcher: command %q, want [gpu-orphan-dispatcher]", d.Command)
	}
	if dep.Spec.Replicas == nil || *dep.Spec.Replicas != v.Dispatcher.Replicas {
		t.Errorf("dispatcher: replicas %v, want %d", dep.Spec.Replicas, v.Dispatcher.Replicas)
	}
	if !reflect.DeepEqual(spec.NodeSelector, v.Dispatcher.NodeSelector) && len(spec.NodeSelector)+len(v.Dispatcher.NodeSelector) > 0 {
		t.Errorf("dispatcher: nodeSelector %v, values say %v", spec.NodeSelector, v.Dispatcher.NodeSelector)
	}
	checkFlagValues(t, "dispatcher", d.Args, map[string]any{
		"dispatch.max-nodes":    v.Dispatcher.Limits["maxNodes"],
		"dispatch.max-fraction": v.Dispatcher.Limits["maxFraction"],
		"dispatch.window":       v.Dispatcher.Limits["window"],
		"dispatch.url-template": v.Dispatcher.URLTemplate,
	})
	sa := find[corev1.ServiceAccount](objs, spec.ServiceAccountName)

	// The Roles bound to the dispatcher grant list and watch on
	// EndpointSlices with discovery on, its own Lease with shared limits
	// on, and nothing more.
	var grants []rbacv1.PolicyRule
	var eventGrants, nodeGrants []rbacv1.PolicyRule
	for _, rb := range all[rbacv1.RoleBinding](objs) {
		if !slices.ContainsFunc(rb.Subjects, func(s rbacv1.Subject) bool {
			return s.Kind == "ServiceAccount" && s.Name == spec.ServiceAccountName && s.Namespace == r.namespace
		}) {
			continue
		}
		role := find[rbacv1.Role](objs, rb.RoleRef.Name)
		if rb.RoleRef.Kind != "Role" || role == nil || role.Namespace != rb.Namespace {
			t.Errorf("RoleBinding %s: %s %s is not rendered in its namespace", rb.Name, rb.RoleRef.Kind, rb.RoleRef.Name)
			continue
		}
		if rb.Namespace == "default" && r.namespace != "default" {
			eventGrants = append(eventGrants, role.Rules...)
			continue
		}
		grants = append(grants, role.Rules...)
	}
	for _, rb := range all[rbacv1.ClusterRoleBinding](objs) {
		role := find[rbacv1.ClusterRole](objs, rb.RoleRef.Name)
		if rb.RoleRef.Kind != "ClusterRole" || role == nil || len(rb.Subjects) != 1 || rb.Subjects[0].Name != spec.ServiceAccountName || rb.Subjects[0].Namespace != r.namespace {
			t.Errorf("ClusterRoleBinding %s: binds %+v to %s %s", rb.Name, rb.Subjects, rb.RoleRef.Kind, rb.RoleRef.Name)
			continue
		}
		nodeGrants = append(nodeGrants, role.Rules...)
	}
	if n := len(all[rbacv1.ClusterRole](objs)); n != len(nodeGrants) && n > 0 {
		t.Errorf("%d ClusterRoles, %d bound", n, len(nodeGrants))
	}
	// escalate.taint: get and patch on nodes, create on events in
	// namespace default, nothing more; and --escalate.taint.
	var wantNodes, wantEvents []rbacv1.PolicyRule
	if v.Dispatcher.Escalate.Taint {
		wantNodes = []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"nodes"}, Verbs: []string{"get", "patch"}}}
		wantEvents = []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"events"}, Verbs: []string{"create"}}}
	}
	if !reflect.DeepEqual(nodeGrants, wantNodes) || !reflect.DeepEqual(eventGrants, wantEvents) {
		t.Errorf("dispatcher's taint RBAC: nodes %+v, events %+v; want exactly %+v and %+v", nodeGrants, eventGrants, wantNodes, wantEvents)
	}
	if has := slices.Contains(d.Args, "--escalate.taint"); has != v.Dispatcher.Escalate.Taint {
		t.Errorf("dispatcher: --escalate.taint %v, dispatcher.escalate.taint %v", has, v.Dispatcher.Escalate.Taint)
	}
	service, hasService := flagValue(d.Args, "dispatch.kubernetes.service")
	lease, hasLease := flagValue(d.Args, "dispatch.kubernetes.lease")
	targetsFile, hasTargets := flagValue(d.Args, "dispatch.targets-file")
	var want []rbacv1.PolicyRule
	if v.Dispatcher.Discovery.Enabled {
		want = append(want, rbacv1.PolicyRule{APIGroups: []string{"discovery.k8s.io"}, Resources: []string{"endpointslices"}, Verbs: []string{"list", "watch"}},
			rbacv1.PolicyRule{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"get"}},
			rbacv1.PolicyRule{APIGroups: []string{"apps"}, Resources: []string{"daemonsets"}, Verbs: []string{"get"}})
		checkAgentsService(t, r, objs, d.Args, service, hasService)
	} else if hasService {
		t.Errorf("dispatcher: discovery is off, but --dispatch.kubernetes.service=%q", service)
	}
	// Shared limits: the replicas keep one fleet window in a Lease of
	// their namespace; more than one replica without it would exceed the
	// fleet limit together.
	if v.Dispatcher.SharedLimits.Enabled {
		if ns, _ := flagValue(d.Args, "dispatch.kubernetes.namespace"); !hasLease || lease != dep.Name || ns != r.namespace {
			t.Errorf("dispatcher: --dispatch.kubernetes.lease=%q (set: %v) in namespace %q, want the Lease %s in %s", lease, hasLease, ns, dep.Name, r.namespace)
		}
		want = append(want,
			rbacv1.PolicyRule{APIGroups: []string{"coordination.k8s.io"}, Resources: []string{"leases"}, Verbs: []string{"create"}},
			rbacv1.PolicyRule{APIGroups: []string{"coordination.k8s.io"}, Resources: []string{"leases"}, ResourceNames: []string{lease}, Verbs: []string{"get", "update"}})
	} else {
		if hasLease {
			t.Errorf("dispatcher: shared limits are off, but --dispatch.kubernetes.lease=%q", lease)
		}
		if v.Dispatcher.Replicas > 1 {
			t.Errorf("dispatcher: %d replicas without shared limits would each keep a fleet limit", v.Dispatcher.Replicas)
		}
	}
	if !reflect.DeepEqual(grants, want) {
		t.Errorf("dispatcher RBAC: %+v, want exactly %+v", grants, want)
	}
	mounted := spec.AutomountServiceAccountToken != nil && *spec.AutomountServiceAccountToken && sa != nil && sa.AutomountServiceAccountToken != nil && *sa.AutomountServiceAccountToken
	if needed := len(want)+len(wantNodes) > 0; mounted != needed {
		t.Errorf("dispatcher: the API token mounted: %v; want it only for discovery, shared limits or taints (%v)", mounted, needed)
	}

	// The static allow-list: a ConfigMap mounted as --dispatch.targets-file,
	// only when listed.
	if len(v.Dispatcher.Targets) == 0 {
		if hasTargets {
			t.Errorf("dispatcher: --dispatch.targets-file=%s without dispatcher.targets", targetsFile)
		}
		return
	}
	vol, rel := volumeAt(spec, d, targetsFile)
	if !hasTargets || vol == nil || vol.ConfigMap == nil {
		t.Fatalf("dispatcher: --dispatch.targets-file=%q is not in a mounted ConfigMap", targetsFile)
	}
	cm := find[corev1.ConfigMap](objs, vol.ConfigMap.Name)
	if cm == nil {
		t.Fatalf("dispatcher: ConfigMap %s is not rendered", vol.ConfigMap.Name)
	}
	var got map[string]string
	if err := json.Unmarshal([]byte(cm.Data[rel]), &got); err != nil || !reflect.DeepEqual(got, v.Dispatcher.Targets) {
		t.Errorf("ConfigMap %s key %s: %v (%v), want dispatcher.targets %v", cm.Name, rel, got, err, v.Dispatcher.Targets)
	}
	// A node listed with "" is reached through the URL template, on the
	// agent's hostPort.
	for node, u := range got {
		if u != "" {
			continue
		}
		tu, err := expandURLTemplate(v.Dispatcher.URLTemplate, node)
		if err != nil || tu.Hostname() != node || tu.Port() != strconv.Itoa(int(v.Node.HostPort)) {
			t.Errorf("target %s: --dispatch.url-template=%q gives %v (%v); want the node name and node.hostPort %d", node, v.Dispatcher.URLTemplate, tu, err, v.Node.HostPort)
		}
	}
}

// checkAgentsService: the Service the dispatcher discovers agents through
// selects the DaemonSet's pods and names its port as the dispatcher's
// --dispatch.kubernetes.port-name, which leads to the remediator.
func checkAgentsService(t *testing.T, r *chartRender, objs []k8sObject, args []string, service string, ok bool) {
	t.Helper()
	ns, _ := flagValue(args, "dispatch.kubernetes.namespace")
	portName, _ := flagValue(args, "dispatch.kubernetes.port-name")
	scheme, _ := flagValue(args, "dispatch.kubernetes.scheme")
	if ns != r.namespace || portName != "remediator" || scheme != r.values.Dispatcher.Discovery.Scheme {
		t.Errorf("dispatcher: --dispatch.kubernetes.namespace=%q port-name=%q scheme=%q", ns, portName, scheme)
	}
	svc := find[corev1.Service](objs, service)
	if !ok || svc == nil {
		t.Fatalf("dispatcher: --dispatch.kubernetes.service=%q is no rendered Service", service)
	}
	ds := all[appsv1.DaemonSet](objs)[0]
	if len(svc.Spec.Selector) == 0 || !labels.SelectorFromSet(svc.Spec.Selector).Matches(labels.Set(ds.Spec.Template.Labels)) {
		t.Errorf("Service %s: selector %v does not select the DaemonSet's pods %v", svc.Name, svc.Spec.Selector, ds.Spec.Template.Labels)
	}
	for _, w := range workloads(objs) {
		if w.name != "DaemonSet "+ds.Name && labels.SelectorFromSet(svc.Spec.Selector).Matches(labels.Set(w.template.Labels)) {
			t.Errorf("Service %s also selects %s", svc.Name, w.name)
		}
	}
	rem := container(&ds.Spec.Template.Spec, "remediator")
	i := slices.IndexFunc(svc.Spec.Ports, func(p corev1.ServicePort) bool { return p.Name == portName })
	if i < 0 {
		t.Fatalf("Service %s: no port named %s", svc.Name, portName)
	}
	p := svc.Spec.Ports[i]
	if p.TargetPort.StrVal != rem.Ports[0].Name || p.Port != rem.Ports[0].ContainerPort {
		t.Errorf("Service %s: port %s -> %s, want the remediator's %s (%d)", svc.Name, p.Name, p.TargetPort.String(), rem.Ports[0].Name, rem.Ports[0].ContainerPort)
	}
}

// monitorEndpoint is a PodMonitor's or a ServiceMonitor's endpoint with
// the container port it scrapes.
type monitorEndpoint struct {
	where       string
	port        *corev1.ContainerPort
	workload    string
	relabelings []monitoringv1.RelabelConfig
}

// monitorEndpoints resolves every monitor's endpoints to container ports.
func monitorEndpoints(t *testing.T, objs []k8sObject) []monitorEndpoint {
	t.Helper()
	var out []monitorEndpoint
	// The pods a selector and a port name lead to.
	resolve := func(where string, sel labels.Selector, port string, relabel []monitoringv1.RelabelConfig) {
		n := 0
		for _, w := range workloads(objs) {
			if !sel.Matches(labels.Set(w.template.Labels)) {
				continue
			}
			for _, c := range w.template.Spec.Containers {
				for i := range c.Ports {
					if c.Ports[i].Name == port {
						out = append(out, monitorEndpoint{where, &c.Ports[i], w.name + "/" + c.Name, relabel})
						n++
					}
				}
			}
		}
		if n == 0 {
			t.Errorf("%s: port %q is no selected container's port", where, port)
		}
	}
	for _, pm := range all[monitoringv1.PodMonitor](objs) {
		sel, err := metav1.LabelSelectorAsSelector(&pm.Spec.Selector)
		if err != nil || sel.Empty() {
			t.Errorf("PodMonitor %s: selector: %v", pm.Name, err)
			continue
		}
		for _, ep := range pm.Spec.PodMetricsEndpoints {
			port := ""
			if ep.Port != nil {
				port = *ep.Port
			}
			resolve("PodMonitor "+pm.Name+" port "+port, sel, port, ep.RelabelConfigs)
		}
	}
	for _, sm := range all[monitoringv1.ServiceMonitor](objs) {
		sel, err := metav1.LabelSelectorAsSelector(&sm.Spec.Selector)
		if err != nil || sel.Empty() {
			t.Errorf("ServiceMonitor %s: selector: %v", sm.Name, err)
			continue
		}
		for _, ep := range sm.Spec.Endpoints {
			where := "ServiceMonitor " + sm.Name + " port " + ep.Port
			n := 0
			for _, svc := range all[corev1.Service](objs) {
				inNS := sm.Spec.NamespaceSelector.Any || len(sm.Spec.NamespaceSelector.MatchNames) == 0 && svc.Namespace == sm.Namespace ||
					slices.Contains(sm.Spec.NamespaceSelector.MatchNames, svc.Namespace)
				if !inNS || !sel.Matches(labels.Set(svc.Labels)) {
					continue
				}
				for _, p := range svc.Spec.Ports {
					if p.Name == ep.Port {
						n++
						resolve(where+" (Service "+svc.Name+")", labels.SelectorFromSet(svc.Spec.Selector), p.TargetPort.StrVal, ep.RelabelConfigs)
					}
				}
			}
			if n == 0 {
				t.Errorf("%s: on no selected Service", where)
			}
		}
	}
	return out
}

// relabeledJob returns the job a relabeling sets, or "".
func relabeledJob(rs []monitoringv1.RelabelConfig) string {
	job := ""
	for _, r := range rs {
		if r.TargetLabel == "job" && (r.Action == "" || strings.EqualFold(r.Action, "replace")) && len(r.SourceLabels) == 0 && r.Replacement != nil {
			job = *r.Replacement
		}
	}
	return job
}

// checkChartMonitors: every program is scraped, with the node label and
// the job the rules select.
func checkChartMonitors(t *testing.T, r *chartRender, objs []k8sObject) {
	t.Helper()
	v := &r.values
	if !v.PodMonitor.Enabled && !v.ServiceMonitor.Enabled {
		return
	}
	jobs := map[string]string{} // workload/container -> job
	for _, ep := range monitorEndpoints(t, objs) {
		if !slices.ContainsFunc(ep.relabelings, func(r monitoringv1.RelabelConfig) bool {
			return r.TargetLabel == "node" && slices.Equal(r.SourceLabels, []monitoringv1.LabelName{"__meta_kubernetes_pod_node_name"}) &&
				(r.Action == "" || strings.EqualFold(r.Action, "replace"))
		}) {
			t.Errorf("%s: does not set node from __meta_kubernetes_pod_node_name", ep.where)
		}
		job := relabeledJob(ep.relabelings)
		if prev, ok := jobs[ep.workload]; ok && prev != job {
			t.Errorf("%s: job %q, and %q elsewhere", ep.workload, job, prev)
		}
		jobs[ep.workload] = job
	}
	ds, dep := all[appsv1.DaemonSet](objs)[0], all[appsv1.Deployment](objs)[0]
	want := map[string]string{
		"DaemonSet " + ds.Name + "/exporter":     v.Monitoring.Jobs.Exporter,
		"DaemonSet " + ds.Name + "/remediator":   v.Monitoring.Jobs.Remediator,
		"Deployment " + dep.Name + "/dispatcher": v.Monitoring.Jobs.Dispatcher,
	}
	if !reflect.DeepEqual(jobs, want) {
		t.Errorf("scraped jobs %v, want %v", jobs, want)
	}
	// The alert rules select exactly these jobs.
	if v.PrometheusRule.Enabled {
		if v.exporterJob() != want["DaemonSet "+ds.Name+"/exporter"] ||
			!slices.Equal(v.remediatorJobs(), []string{v.Monitoring.Jobs.Remediator, v.Monitoring.Jobs.Dispatcher}) {
			t.Errorf("the rules select %s and %v; the monitors make %v", v.exporterJob(), v.remediatorJobs(), jobs)
		}
	}
}

// jobSelector matches a job matcher in PromQL: job="x" or job=~"x".
var jobSelector = regexp.MustCompile(`\bjob\s*(=~|=)\s*"((?:[^"\\]|\\.)*)"`)

// checkChartRule: the rule groups equal alerts/gpu-orphan.rules.yml with
// the jobs of the values in place of the file's, and parse as PromQL.
func checkChartRule(t *testing.T, r *chartRender, objs []k8sObject) {
	t.Helper()
	v := &r.values
	prs := all[monitoringv1.PrometheusRule](objs)
	if !v.PrometheusRule.Enabled {
		return
	}
	if len(prs) != 1 {
		t.Fatalf("%d PrometheusRules", len(prs))
	}
	want, err := loadRuleGroups(rulesFile)
	if err != nil {
		t.Fatal(err)
	}
	p := parser.NewParser(parser.Options{})
	selected := map[string]bool{}
	for _, g := range prs[0].Spec.Groups {
		for _, rule := range g.Rules {
			if _, err := p.ParseExpr(rule.Expr.String()); err != nil {
				t.Errorf("group %s rule %s%s: %v", g.Name, rule.Alert, rule.Record, err)
			}
			for _, m := range jobSelector.FindAllStringSubmatch(rule.Expr.String(), -1) {
				job, err := strconv.Unquote(`"` + m[2] + `"`)
				if err != nil {
					t.Errorf("rule %s: %s: %v", rule.Alert, m[0], err)
				}
				selected[m[1]+job] = true
			}
		}
	}
	// What the values ask for.
	var quoted []string
	for _, j := range v.remediatorJobs() {
		quoted = append(quoted, regexp.QuoteMeta(j))
	}
	wantSel := map[string]bool{"=" + v.exporterJob(): true, "=~" + strings.Join(quoted, "|"): true}
	if !reflect.DeepEqual(selected, wantSel) {
		t.Errorf("the rules select jobs %v, want %v", keys(selected), keys(wantSel))
	}
	defaults := v.exporterJob() == "gpu-orphan-exporter" && slices.Equal(v.remediatorJobs(), []string{"gpu-orphan-remediator", "gpu-orphan-dispatcher"})
	if defaults {
		if !reflect.DeepEqual(prs[0].Spec.Groups, want) {
			t.Errorf("PrometheusRule's groups differ from %s", rulesFile)
		}
		return
	}
	// With other jobs, nothing else changes: put the file's selectors back
	// and compare.
	got := slices.Clone(prs[0].Spec.Groups)
	for gi := range got {
		got[gi].Rules = slices.Clone(got[gi].Rules)
		for ri := range got[gi].Rules {
			rule := &got[gi].Rules[ri]
			expr := rule.Expr.String()
			expr = strings.ReplaceAll(expr, fmt.Sprintf("job=%q", v.exporterJob()), `job="gpu-orphan-exporter"`)
			expr = strings.ReplaceAll(expr, fmt.Sprintf("job=~%q", strings.Join(quoted, "|")), `job=~"gpu-orphan-remediator|gpu-orphan-dispatcher"`)
			rule.Expr.StrVal = expr
			rule.Annotations = maps.Clone(rule.Annotations)
			for k, a := range rule.Annotations {
				rule.Annotations[k] = restoreJobProse(a, v)
			}
		}
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("PrometheusRule's groups, job selectors aside, differ from %s", rulesFile)
	}
	for _, g := range prs[0].Spec.Groups {
		for _, rule := range g.Rules {
			if s := rule.Annotations["description"]; strings.Contains(s, "in job gpu-orphan-") {
				t.Errorf("%s: description still names the default job: %s", rule.Alert, s)
			}
		}
	}
}

// restoreJobProse turns the descriptions' "in job X" back into the file's.
func restoreJobProse(s string, v *chartValues) string {
	s = strings.ReplaceAll(s, "in job "+v.exporterJob()+" ", "in job gpu-orphan-exporter ")
	return strings.ReplaceAll(s, "in job "+strings.Join(v.remediatorJobs(), " or ")+" ", "in job gpu-orphan-remediator or gpu-orphan-dispatcher ")
}

func keys(m map[string]bool) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

// checkChartDashboards: one ConfigMap per dashboard, with the sidecar's
// label, holding the JSON of dashboards/.
func checkChartDashboards(t *testing.T, r *chartRender, objs []k8sObject) {
	t.Helper()
	v := &r.values
	files, _ := filepath.Glob(filepath.Join(dashboardsDir, "*.json"))
	found := map[string]bool{}
	for _, cm := range all[corev1.ConfigMap](objs) {
		if cm.Labels[v.Dashboards.Label] == "" {
			continue
		}
		if cm.Labels[v.Dashboards.Label] != v.Dashboards.LabelValue {
			t.Errorf("ConfigMap %s: %s=%q, want %q", cm.Name, v.Dashboards.Label, cm.Labels[v.Dashboards.Label], v.Dashboards.LabelValue)
		}
		for name, text := range cm.Data {
			want, err := os.ReadFile(filepath.Join(dashboardsDir, name))
			if err != nil {
				t.Errorf("ConfigMap %s: %s is no dashboard of %s", cm.Name, name, dashboardsDir)
				continue
			}
			var got, w any
			if err := json.Unmarshal([]byte(text), &got); err != nil {
				t.Errorf("ConfigMap %s: %s: %v", cm.Name, name, err)
			}
			_ = json.Unmarshal(want, &w)
			if !reflect.DeepEqual(got, w) {
				t.Errorf("ConfigMap %s: %s differs from %s", cm.Name, name, filepath.Join(dashboardsDir, name))
			}
			found[name] = true
		}
	}
	n := 0
	if v.Dashboards.Enabled {
		n = len(files)
	}
	if len(found) != n {
		t.Errorf("%d dashboards in ConfigMaps labelled %s=%s, want %d", len(found), v.Dashboards.Label, v.Dashboards.LabelValue, n)
	}
}

// checkChartAlertmanagerConfig: the route and the webhook receiver, which
// reaches the dispatcher's Service with the webhook token.
func checkChartAlertmanagerConfig(t *testing.T, r *chartRender, objs []k8sObject) {
	t.Helper()
	v := &r.values
	amcs := all[monitoringv1alpha1.AlertmanagerConfig](objs)
	if !v.AlertmanagerConfig.Enabled {
		return
	}
	if len(amcs) != 1 {
		t.Fatalf("%d AlertmanagerConfigs", len(amcs))
	}
	spec := amcs[0].Spec
	route := spec.Route
	if route == nil || !slices.Equal(route.GroupBy, v.AlertmanagerConfig.GroupBy) || route.RepeatInterval == nil ||
		string(*route.RepeatInterval) != v.AlertmanagerConfig.RepeatInterval ||
		!reflect.DeepEqual(route.Matchers, []monitoringv1alpha1.Matcher{{Name: "alertname", Value: v.AlertmanagerConfig.Alertname, MatchType: "="}}) {
		t.Fatalf("AlertmanagerConfig route %+v", route)
	}
	if len(spec.Receivers) != 1 || spec.Receivers[0].Name != route.Receiver || len(spec.Receivers[0].WebhookConfigs) != 1 {
		t.Fatalf("AlertmanagerConfig: receivers %+v; want one webhook, %s", spec.Receivers, route.Receiver)
	}
	wh := spec.Receivers[0].WebhookConfigs[0]
	if wh.URL == nil {
		t.Fatal("AlertmanagerConfig: no webhook url")
	}
	u, err := url.Parse(*wh.URL)
	if err != nil || u.Path != "/api/v1/alerts" {
		t.Fatalf("webhook url %s: %v; want the path /api/v1/alerts", *wh.URL, err)
	}
	checkDispatcherURL(t, objs, u)
	if strconv.Itoa(int(v.Ports.Remediator)) != u.Port() {
		t.Errorf("webhook url %s: port is not ports.remediator %d", u, v.Ports.Remediator)
	}
	// The bearer token: the Secret's `webhook` key, the one the
	// dispatcher reads as --auth.token-file.
	hc := wh.HTTPConfig
	if hc == nil || hc.Authorization == nil || hc.Authorization.Credentials == nil || !strings.EqualFold(hc.Authorization.Type, "Bearer") {
		t.Fatalf("webhook: httpConfig %+v; want Bearer credentials from a Secret", hc)
	}
	cred := hc.Authorization.Credentials
	if cred.Name != secretName(r) || cred.Key != "webhook" {
		t.Errorf("webhook credentials: Secret %s key %s, want %s key webhook", cred.Name, cred.Key, secretName(r))
	}
	if v.Auth.ExistingSecret == "" {
		sec := find[corev1.Secret](objs, cred.Name)
		if sec == nil || len(sec.Data[cred.Key])+len(sec.StringData[cred.Key]) < 16 {
			t.Errorf("webhook credentials: Secret %s has no key %s of 16 characters or more", cred.Name, cred.Key)
		}
	}
	dep := all[appsv1.Deployment](objs)[0]
	d := container(&dep.Spec.Template.Spec, "dispatcher")
	tokenFile, _ := flagValue(d.Args, "auth.token-file")
	vol, rel := volumeAt(&dep.Spec.Template.Spec, d, tokenFile)
	if vol == nil || vol.Secret == nil || vol.Secret.SecretName != cred.Name ||
		!slices.ContainsFunc(vol.Secret.Items, func(it corev1.KeyToPath) bool { return it.Key == cred.Key && it.Path == rel }) {
		t.Errorf("dispatcher: --auth.token-file=%s is not key %s of Secret %s", tokenFile, cred.Key, cred.Name)
	}
}

// checkDispatcherURL checks that http://SERVICE.NAMESPACE.svc:PORT/ is a
// rendered Service's port that leads to the dispatcher's container port.
func checkDispatcherURL(t *testing.T, objs []k8sObject, u *url.URL) {
	t.Helper()
	parts := strings.Split(u.Hostname(), ".")
	if len(parts) < 3 || parts[2] != "svc" {
		t.Fatalf("webhook url %s: want a Service's DNS name", u)
	}
	svc := find[corev1.Service](objs, parts[0])
	if svc == nil || svc.Namespace != parts[1] {
		t.Fatalf("webhook url %s: no Service %s in namespace %s", u, parts[0], parts[1])
	}
	i := slices.IndexFunc(svc.Spec.Ports, func(p corev1.ServicePort) bool { return strconv.Itoa(int(p.Port)) == u.Port() })
	if i < 0 {
		t.Fatalf("webhook url %s: Service %s has no port %s", u, svc.Name, u.Port())
	}
	deps := all[appsv1.Deployment](objs)
	if len(deps) != 1 || !labels.SelectorFromSet(svc.Spec.Selector).Matches(labels.Set(deps[0].Spec.Template.Labels)) {
		t.Fatalf("webhook url %s: Service %s does not reach the dispatcher", u, svc.Name)
	}
	d := container(&deps[0].Spec.Template.Spec, "dispatcher")
	target := svc.Spec.Ports[i].TargetPort
	if !slices.ContainsFunc(d.Ports, func(p corev1.ContainerPort) bool {
		return p.Name == target.StrVal || p.ContainerPort == target.IntVal
	}) {
		t.Errorf("webhook url %s: Service %s's port %s leads to no dispatcher port", u, svc.Name, target.String())
	}
}

// Values the chart must refuse.
// TestHelmNotesActionsPage: what helm prints after an install says how a
// browser opens /actions: the port-forward, and the sign-in form with the
// webhook token, or ui.open.
func TestHelmNotesActionsPage(t *testing.T) {
	for _, c := range helmCases(t) {
		t.Run(c.name, func(t *testing.T) {
			r := renderChart(t, c.file, c.release, c.namespace)
			var dispatcher string
			for _, o := range r.objects(t) {
				if o.kind == "Deployment" {
					dispatcher = o.obj.GetName()
				}
			}
			port := strconv.Itoa(int(r.values.Ports.Remediator))
			want := []string{"port-forward svc/" + dispatcher + " " + port, "http://localhost:" + port + "/actions"}
			if r.values.UI.Open {
				want = append(want, "without authentication (ui.open=true)")
			} else {
				want = append(want, "sign-in form", "--set ui.open=true")
			}
			for _, w := range want {
				if !strings.Contains(r.notes, w) {
					t.Errorf("NOTES.txt does not say %q:\n%s", w, r.notes)
				}
			}
		})
	}
}

func TestHelmRejects(t *testing.T) {
	ch, err := loader.Load(chartDir)
	if err != nil {
		t.Fatal(err)
	}
	for name, vals := range map[string]map[string]any{
		"no allow-list": {"dispatcher": map[string]any{"discovery": map[string]any{"enabled": false}}},
		// Each replica would keep its own fleet limit (issue 16).
		"replicas without shared limits": {"dispatcher": map[string]any{"replicas": 2, "sharedLimits": map[string]any{"enabled": false}}},
		"short token":                    {"auth": map[string]any{"webhookToken": "short"}},
		"unknown top key":                {"actt": true},
		"unknown policy":                 {"remediation": map[string]any{"policy": "everything"}},
	} {
		rv, err := chartutil.ToRenderValues(ch, vals, chartutil.ReleaseOptions{Name: "x", Namespace: "y", IsInstall: true}, chartutil.DefaultCapabilities)
		if err == nil {
			_, err = engine.Engine{Strict: true}.Render(ch, rv)
		}
		if err == nil {
			t.Errorf("%s: rendered without error", name)
		} else {
			t.Logf("%s: %v", name, err)
		}
	}
}

const generatedHeader = `# Generated from charts/gpu-orphan/ with deploy/kubernetes/values.yaml
# (release gpu-orphan, namespace gpu-orphan) by
#   cd test && go test ./deploy/ -run TestKubernetesGenerated -update
# Edit the chart or values.yaml, not this file: the test fails when they
# differ. Set the two tokens of the Secret gpu-orphan-token before you
# apply (see deploy/kubernetes/values.yaml).
`

// deploy/kubernetes/gpu-orphan.yaml is the chart rendered with
// deploy/kubernetes/values.yaml: one source.
func TestKubernetesGenerated(t *testing.T) {
	r := renderChart(t, filepath.Join(k8sDir, k8sValuesFile), k8sRelease, k8sNamespace)
	want := append([]byte(generatedHeader), r.manifest()...)
	path := filepath.Join(k8sDir, k8sGeneratedFile)
	if *update {
		if err := os.WriteFile(path, want, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	got, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("%s is not the chart rendered with %s; run: go test ./deploy/ -run TestKubernetesGenerated -update", path, k8sValuesFile)
	}
}
