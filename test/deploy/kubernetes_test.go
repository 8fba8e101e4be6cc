package deploy

import (
	"bufio"
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"
	"text/template"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	monitoringv1alpha1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1alpha1"
	amconfig "github.com/prometheus/alertmanager/config"
	"github.com/prometheus/prometheus/promql/parser"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	k8sjson "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"
)

var update = flag.Bool("update", false, "rewrite the generated files: deploy/kubernetes/gpu-orphan.yaml from the chart, the chart's copies of alerts/ and dashboards/")

const (
	k8sDir       = "../../deploy/kubernetes"
	k8sNamespace = "gpu-orphan"
	rulesFile    = "../../alerts/gpu-orphan.rules.yml"
	// Files of kubernetes/ that are not Kubernetes objects.
	receiverFile      = "alertmanager-receiver.yaml"
	kustomizationFile = "kustomization.yaml"
	// k8sValuesFile (helm_test.go): the chart's values for kubernetes/.
)

// kinds are the objects the manifests may hold, each with its Go type.
var kinds = map[string]func() metav1.Object{
	"v1/Namespace":      func() metav1.Object { return &corev1.Namespace{} },
	"v1/ServiceAccount": func() metav1.Object { return &corev1.ServiceAccount{} },
	"v1/Secret":         func() metav1.Object { return &corev1.Secret{} },
	"v1/ConfigMap":      func() metav1.Object { return &corev1.ConfigMap{} },
	"v1/Service":        func() metav1.Object { return &corev1.Service{} },
	"apps/v1/DaemonSet": func() metav1.Object { return &appsv1.DaemonSet{} },
	"apps/v1/Deployment": func() metav1.Object {
		return &appsv1.Deployment{}
	},
	"rbac.authorization.k8s.io/v1/Role":               func() metav1.Object { return &rbacv1.Role{} },
	"rbac.authorization.k8s.io/v1/RoleBinding":        func() metav1.Object { return &rbacv1.RoleBinding{} },
	"rbac.authorization.k8s.io/v1/ClusterRole":        func() metav1.Object { return &rbacv1.ClusterRole{} },
	"rbac.authorization.k8s.io/v1/ClusterRoleBinding": func() metav1.Object { return &rbacv1.ClusterRoleBinding{} },
	"monitoring.coreos.com/v1/ServiceMonitor":         func() metav1.Object { return &monitoringv1.ServiceMonitor{} },
	"monitoring.coreos.com/v1/PrometheusRule":         func() metav1.Object { return &monitoringv1.PrometheusRule{} },
	"monitoring.coreos.com/v1/PodMonitor":             func() metav1.Object { return &monitoringv1.PodMonitor{} },
	"monitoring.coreos.com/v1alpha1/AlertmanagerConfig": func() metav1.Object {
		return &monitoringv1alpha1.AlertmanagerConfig{}
	},
}

// clusterScoped kinds carry no namespace.
var clusterScoped = []string{"Namespace", "ClusterRole", "ClusterRoleBinding"}

// k8sObject is one decoded document of a manifest.
type k8sObject struct {
	file string
	kind string
	obj  metav1.Object
}

// strictUnmarshal decodes YAML as the API server decodes JSON: field names
// are case-sensitive, and unknown or duplicate fields are errors.
func strictUnmarshal(doc []byte, v any) error {
	j, err := yaml.YAMLToJSONStrict(doc)
	if err != nil {
		return err
	}
	strict, err := k8sjson.UnmarshalStrict(j, v, k8sjson.DisallowDuplicateFields, k8sjson.DisallowUnknownFields)
	if err != nil {
		return err
	}
	return errors.Join(strict...)
}

// decodeObject decodes one YAML document into its API type, rejecting
// unknown kinds, unknown fields and duplicate keys.
func decodeObject(doc []byte) (string, metav1.Object, error) {
	var tm metav1.TypeMeta
	if err := yaml.Unmarshal(doc, &tm); err != nil {
		return "", nil, err
	}
	newObj, ok := kinds[tm.APIVersion+"/"+tm.Kind]
	if !ok {
		return "", nil, fmt.Errorf("unknown kind %q of apiVersion %q", tm.Kind, tm.APIVersion)
	}
	obj := newObj()
	if err := strictUnmarshal(doc, obj); err != nil {
		return "", nil, fmt.Errorf("%s: %w", tm.Kind, err)
	}
	return tm.Kind, obj, nil
}

// decodeManifest decodes every document of a multi-document YAML stream.
func decodeManifest(r io.Reader) ([]k8sObject, error) {
	reader := utilyaml.NewYAMLReader(bufio.NewReader(r))
	var out []k8sObject
	for i := 0; ; i++ {
		doc, err := reader.Read()
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			return nil, err
		}
		if j, err := yaml.YAMLToJSON(doc); err == nil && (string(j) == "null" || len(bytes.TrimSpace(j)) == 0) {
			continue // comments only
		}
		kind, obj, err := decodeObject(doc)
		if err != nil {
			return nil, fmt.Errorf("document %d: %w", i+1, err)
		}
		out = append(out, k8sObject{kind: kind, obj: obj})
	}
}

// manifestFiles returns the Kubernetes manifests of kubernetes/.
func manifestFiles(t *testing.T) []string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(k8sDir, "*.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	files = slices.DeleteFunc(files, func(f string) bool {
		return filepath.Base(f) == receiverFile || filepath.Base(f) == kustomizationFile || filepath.Base(f) == k8sValuesFile
	})
	if len(files) == 0 {
		t.Fatal("no manifests in kubernetes/")
	}
	return files
}

func loadManifests(t *testing.T) []k8sObject {
	t.Helper()
	var all []k8sObject
	seen := map[string]string{}
	for _, file := range manifestFiles(t) {
		f, err := os.Open(file)
		if err != nil {
			t.Fatal(err)
		}
		objs, err := decodeManifest(f)
		f.Close()
		if err != nil {
			t.Fatalf("%s: %v", file, err)
		}
		if len(objs) == 0 {
			t.Errorf("%s: no objects", file)
		}
		for _, o := range objs {
			o.file = filepath.Base(file)
			key := o.kind + "/" + o.obj.GetNamespace() + "/" + o.obj.GetName()
			if prev, ok := seen[key]; ok {
				t.Errorf("%s: %s is also in %s", o.file, key, prev)
			}
			seen[key] = o.file
			all = append(all, o)
		}
	}
	return all
}

// find returns the object of type T with the name.
func find[T any](objs []k8sObject, name string) *T {
	for _, o := range objs {
		if v, ok := any(o.obj).(*T); ok && o.obj.GetName() == name {
			return v
		}
	}
	return nil
}

// all returns every object of type T.
func all[T any](objs []k8sObject) []*T {
	var out []*T
	for _, o := range objs {
		if v, ok := any(o.obj).(*T); ok {
			out = append(out, v)
		}
	}
	return out
}

func TestKubernetesManifestsDecodeStrictly(t *testing.T) {
	objs := loadManifests(t)
	for _, o := range objs {
		ns := o.obj.GetNamespace()
		switch {
		case slices.Contains(clusterScoped, o.kind) && ns != "":
			t.Errorf("%s: %s %s is cluster-scoped but names namespace %s", o.file, o.kind, o.obj.GetName(), ns)
		case !slices.Contains(clusterScoped, o.kind) && ns != k8sNamespace:
			t.Errorf("%s: %s %s: namespace %q, want %s", o.file, o.kind, o.obj.GetName(), ns, k8sNamespace)
		}
		if o.obj.GetLabels()["app.kubernetes.io/name"] != "gpu-orphan" {
			t.Errorf("%s: %s %s: no label app.kubernetes.io/name=gpu-orphan", o.file, o.kind, o.obj.GetName())
		}
	}
	if find[corev1.Namespace](objs, k8sNamespace) == nil {
		t.Errorf("no Namespace %s", k8sNamespace)
	}
}

func TestKubernetesDecodeRejects(t *testing.T) {
	for name, doc := range map[string]string{
		"unknown kind":    "apiVersion: v1\nkind: Pod2\nmetadata: {name: x}\n",
		"unknown version": "apiVersion: apps/v2\nkind: DaemonSet\nmetadata: {name: x}\n",
		"unknown field":   "apiVersion: apps/v1\nkind: DaemonSet\nmetadata: {name: x}\nspec:\n  template:\n    spec:\n      hostPIDs: true\n",
		"field case":      "apiVersion: apps/v1\nkind: DaemonSet\nmetadata: {name: x}\nspec:\n  template:\n    spec:\n      hostPid: true\n",
		"duplicate key":   "apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec: {}\nspec: {}\n",
		"wrong type":      "apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec: {ports: [{port: http}]}\n",
	} {
		if _, err := decodeManifest(strings.NewReader(doc)); err == nil {
			t.Errorf("%s: decoded without error", name)
		}
	}
	objs, err := decodeManifest(strings.NewReader("# comment\n---\napiVersion: v1\nkind: Service\nmetadata: {name: x}\n---\n"))
	if err != nil || len(objs) != 1 {
		t.Errorf("a valid stream: %d objects, %v", len(objs), err)
	}
}

// Capabilities a container may add; only the remediator needs KILL.
var (
	allowedK8sCaps = []corev1.Capability{"KILL", "SYS_PTRACE", "DAC_READ_SEARCH", "NET_ADMIN"}
	killerImages   = "gpu-orphan-remediator"
)

// podErrors checks the security invariants of a pod template.
func podErrors(name string, spec *corev1.PodSpec) []error {
	var errs []error
	// The host's network namespace only for the node agents (hostPID), whose
	// process events the kernel sends only there.
	if (spec.HostNetwork && !spec.HostPID) || spec.HostIPC {
		errs = append(errs, fmt.Errorf("%s: hostNetwork without hostPID, or hostIPC", name))
	}
	for _, c := range append(slices.Clone(spec.InitContainers), spec.Containers...) {
		where := name + "/" + c.Name
		sc := c.SecurityContext
		if sc == nil {
			errs = append(errs, fmt.Errorf("%s: no securityContext", where))
			continue
		}
		if sc.Privileged != nil && *sc.Privileged {
			errs = append(errs, fmt.Errorf("%s: privileged", where))
		}
		if sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
			errs = append(errs, fmt.Errorf("%s: allowPrivilegeEscalation is not false", where))
		}
		if sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
			errs = append(errs, fmt.Errorf("%s: readOnlyRootFilesystem is not true", where))
		}
		if sc.Capabilities == nil || !slices.Contains(sc.Capabilities.Drop, "ALL") {
			errs = append(errs, fmt.Errorf("%s: capabilities do not drop ALL", where))
			continue
		}
		for _, add := range sc.Capabilities.Add {
			if !slices.Contains(allowedK8sCaps, corev1.Capability(strings.TrimPrefix(string(add), "CAP_"))) {
				errs = append(errs, fmt.Errorf("%s: adds capability %s; allowed: %v", where, add, allowedK8sCaps))
			}
			if add == "KILL" && (len(c.Command) == 0 || c.Command[0] != killerImages || slices.Contains(c.Args, "--role=dispatcher")) {
				errs = append(errs, fmt.Errorf("%s: adds KILL but is not a node remediator", where))
			}
		}
	}
	return errs
}

func TestKubernetesPodSecurityRejects(t *testing.T) {
	yes, no := true, false
	ok := corev1.Container{Name: "c", Command: []string{"gpu-orphan-exporter"}, SecurityContext: &corev1.SecurityContext{
		AllowPrivilegeEscalation: &no, ReadOnlyRootFilesystem: &yes,
		Capabilities: &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}, Add: []corev1.Capability{"SYS_PTRACE"}},
	}}
	if errs := podErrors("ok", &corev1.PodSpec{Containers: []corev1.Container{ok}}); len(errs) != 0 {
		t.Errorf("a sound pod: %v", errs)
	}
	for name, mutate := range map[string]func(c *corev1.Container){
		"privileged":    func(c *corev1.Container) { c.SecurityContext.Privileged = &yes },
		"SYS_ADMIN":     func(c *corev1.Container) { c.SecurityContext.Capabilities.Add = []corev1.Capability{"SYS_ADMIN"} },
		"KILL exporter": func(c *corev1.Container) { c.SecurityContext.Capabilities.Add = []corev1.Capability{"KILL"} },
		"no drop":       func(c *corev1.Container) { c.SecurityContext.Capabilities.Drop = nil },
		"writable root": func(c *corev1.Container) { c.SecurityContext.ReadOnlyRootFilesystem = &no },
		"escalation":    func(c *corev1.Container) { c.SecurityContext.AllowPrivilegeEscalation = nil },
	} {
		c := ok
		sc := *ok.SecurityContext
		caps := *sc.Capabilities
		sc.Capabilities = &caps
		c.SecurityContext = &sc
		mutate(&c)
		if errs := podErrors(name, &corev1.PodSpec{Containers: []corev1.Container{c}}); len(errs) == 0 {
			t.Errorf("%s: no error", name)
		}
	}
}

// workload is a DaemonSet's or a Deployment's pod template.
type workload struct {
	name     string
	selector *metav1.LabelSelector
	template *corev1.PodTemplateSpec
}

func workloads(objs []k8sObject) []workload {
	var out []workload
	for _, d := range all[appsv1.DaemonSet](objs) {
		out = append(out, workload{"DaemonSet " + d.Name, d.Spec.Selector, &d.Spec.Template})
	}
	for _, d := range all[appsv1.Deployment](objs) {
		out = append(out, workload{"Deployment " + d.Name, d.Spec.Selector, &d.Spec.Template})
	}
	return out
}

func container(spec *corev1.PodSpec, name string) *corev1.Container {
	for i := range spec.Containers {
		if spec.Containers[i].Name == name {
			return &spec.Containers[i]
		}
	}
	return nil
}

func TestKubernetesWorkloads(t *testing.T) {
	objs := loadManifests(t)
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
			t.Errorf("%s: service account %q is not in the manifests", w.name, sa)
		}
		for _, c := range spec.Containers {
			where := w.name + "/" + c.Name
			argv := append(slices.Clone(c.Command), c.Args...)
			flags.check(t, where, argv)
			checkSecretFiles(t, objs, where, spec, &c, argv)
			if slices.Contains(argv, "--act") {
				t.Errorf("%s: --act is on; the shipped manifests must be a dry run", where)
			}
		}
	}

	ds := find[appsv1.DaemonSet](objs, "gpu-orphan-node")
	if ds == nil {
		t.Fatal("no DaemonSet gpu-orphan-node")
	}
	spec := &ds.Spec.Template.Spec
	if !spec.HostPID {
		t.Error("DaemonSet: hostPID is not true: NVML's PIDs are the host's")
	}
	exp, rem := container(spec, "exporter"), container(spec, "remediator")
	if exp == nil || rem == nil {
		t.Fatal("DaemonSet: want containers exporter and remediator")
	}
	if b, _ := flagValue(exp.Args, "backend"); b != "nvml" {
		t.Errorf("exporter: --backend=%s, want nvml", b)
	}
	if r, _ := flagValue(rem.Args, "role"); r != "node" {
		t.Errorf("remediator: --role=%s, want node", r)
	}
	// --node.name is the node, from the same field as the node label.
	if n, _ := flagValue(rem.Args, "node.name"); n != "$(NODE_NAME)" {
		t.Errorf("remediator: --node.name=%q, want $(NODE_NAME)", n)
	}
	if !slices.ContainsFunc(rem.Env, func(e corev1.EnvVar) bool {
		return e.Name == "NODE_NAME" && e.ValueFrom != nil && e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "spec.nodeName"
	}) {
		t.Error("remediator: NODE_NAME is not spec.nodeName from the downward API")
	}
	if store, _ := flagValue(rem.Args, "store.path"); !mountedFrom(spec, rem, store, func(v corev1.Volume) bool { return v.HostPath != nil }) {
		t.Errorf("remediator: --store.path=%s is not on a hostPath volume", store)
	}

	// The dispatcher finds the agents through their Service's
	// EndpointSlices (Kubernetes discovery), and runs as two replicas.
	dep := find[appsv1.Deployment](objs, "gpu-orphan-dispatcher")
	if dep == nil {
		t.Fatal("no Deployment gpu-orphan-dispatcher")
	}
	d := container(&dep.Spec.Template.Spec, "dispatcher")
	if d == nil {
		t.Fatal("Deployment gpu-orphan-dispatcher: no container dispatcher")
	}
	if !slices.Equal(d.Command, []string{"gpu-orphan-dispatcher"}) {
		t.Errorf("dispatcher: command %q, want [gpu-orphan-dispatcher]", d.Command)
	}
	if dep.Spec.Replicas == nil || *dep.Spec.Replicas != 2 {
		t.Error("dispatcher: want two replicas behind its Service")
	}
	svcName, _ := flagValue(d.Args, "dispatch.kubernetes.service")
	portName, _ := flagValue(d.Args, "dispatch.kubernetes.port-name")
	svc := find[corev1.Service](objs, svcName)
	if svc == nil {
		t.Fatalf("dispatcher: --dispatch.kubernetes.service=%q is not in the manifests", svcName)
	}
	if !labels.SelectorFromSet(svc.Spec.Selector).Matches(labels.Set(ds.Spec.Template.Labels)) ||
		!slices.ContainsFunc(svc.Spec.Ports, func(p corev1.ServicePort) bool {
			return p.Name == portName && p.TargetPort.StrVal == rem.Ports[0].Name && p.Port == rem.Ports[0].ContainerPort
		}) {
		t.Errorf("Service %s: does not lead port %q to the DaemonSet's remediator", svc.Name, portName)
	}
}

// expandURLTemplate renders the dispatcher's URL template for a node.
func expandURLTemplate(tmpl, node string) (*url.URL, error) {
	tp, err := template.New("url").Option("missingkey=error").Parse(tmpl)
	if err != nil {
		return nil, err
	}
	var b strings.Builder
	if err := tp.Execute(&b, struct{ Node string }{node}); err != nil {
		return nil, err
	}
	u, err := url.Parse(b.String())
	if err != nil {
		return nil, err
	}
	if u.Scheme != "http" && u.Scheme != "https" || u.Port() == "" {
		return nil, fmt.Errorf("%s: want http(s)://host:port", u)
	}
	return u, nil
}

// mountedFrom reports whether path lies under a mount of a volume that ok
// accepts.
func mountedFrom(spec *corev1.PodSpec, c *corev1.Container, path string, ok func(corev1.Volume) bool) bool {
	v, _ := volumeAt(spec, c, path)
	return v != nil && ok(*v)
}

// volumeAt returns the volume path lies in, and path relative to it.
func volumeAt(spec *corev1.PodSpec, c *corev1.Container, path string) (*corev1.Volume, string) {
	for _, m := range c.VolumeMounts {
		rel, err := filepath.Rel(m.MountPath, path)
		if err != nil || strings.HasPrefix(rel, "..") {
			continue
		}
		for i := range spec.Volumes {
			if spec.Volumes[i].Name == m.Name {
				return &spec.Volumes[i], rel
			}
		}
	}
	return nil, ""
}

// checkSecretFiles checks that every --*token-file flag names a key of a
// Secret in the manifests, mounted into the container.
func checkSecretFiles(t *testing.T, objs []k8sObject, where string, spec *corev1.PodSpec, c *corev1.Container, argv []string) {
	t.Helper()
	for _, arg := range argv {
		name, path, ok := strings.Cut(strings.TrimPrefix(arg, "--"), "=")
		if !ok || !strings.HasSuffix(name, "token-file") {
			continue
		}
		v, rel := volumeAt(spec, c, path)
		if v == nil || v.Secret == nil {
			t.Errorf("%s: --%s=%s is not in a mounted Secret", where, name, path)
			continue
		}
		key := rel
		if len(v.Secret.Items) > 0 {
			key = ""
			for _, it := range v.Secret.Items {
				if it.Path == rel {
					key = it.Key
				}
			}
		}
		sec := find[corev1.Secret](objs, v.Secret.SecretName)
		if sec == nil {
			t.Errorf("%s: Secret %s is not in the manifests", where, v.Secret.SecretName)
			continue
		}
		_, inData := sec.Data[key]
		_, inString := sec.StringData[key]
		if key == "" || !inData && !inString {
			t.Errorf("%s: --%s=%s: Secret %s has no key %q", where, name, path, sec.Name, key)
		}
	}
}

func TestKubernetesServices(t *testing.T) {
	objs := loadManifests(t)
	for _, svc := range all[corev1.Service](objs) {
		var pods []workload
		for _, w := range workloads(objs) {
			if len(svc.Spec.Selector) > 0 && labels.SelectorFromSet(svc.Spec.Selector).Matches(labels.Set(w.template.Labels)) {
				pods = append(pods, w)
			}
		}
		if len(pods) == 0 {
			t.Errorf("Service %s selects no workload", svc.Name)
			continue
		}
		for _, p := range svc.Spec.Ports {
			found := false
			for _, w := range pods {
				for _, c := range w.template.Spec.Containers {
					for _, cp := range c.Ports {
						if p.TargetPort.StrVal == cp.Name || p.TargetPort.IntVal == cp.ContainerPort || p.TargetPort.String() == "0" && p.Port == cp.ContainerPort {
							found = true
						}
					}
				}
			}
			if !found {
				t.Errorf("Service %s: port %s (target %s) is no container's port", svc.Name, p.Name, p.TargetPort.String())
			}
		}
	}
	for _, rb := range all[rbacv1.RoleBinding](objs) {
		if rb.RoleRef.Kind == "Role" && find[rbacv1.Role](objs, rb.RoleRef.Name) == nil {
			t.Errorf("RoleBinding %s: Role %s is not in the manifests", rb.Name, rb.RoleRef.Name)
		}
	}
	for _, rb := range all[rbacv1.ClusterRoleBinding](objs) {
		if find[rbacv1.ClusterRole](objs, rb.RoleRef.Name) == nil {
			t.Errorf("ClusterRoleBinding %s: ClusterRole %s is not in the manifests", rb.Name, rb.RoleRef.Name)
		}
	}
}

func TestKubernetesMonitors(t *testing.T) {
	objs := loadManifests(t)
	eps := monitorEndpoints(t, objs)
	if len(eps) == 0 {
		t.Fatal("no PodMonitor or ServiceMonitor endpoints")
	}
	jobs := map[string]bool{}
	for _, ep := range eps {
		if !slices.ContainsFunc(ep.relabelings, func(r monitoringv1.RelabelConfig) bool {
			return r.TargetLabel == "node" && slices.Equal(r.SourceLabels, []monitoringv1.LabelName{"__meta_kubernetes_pod_node_name"}) &&
				(r.Action == "" || strings.EqualFold(r.Action, "replace"))
		}) {
			t.Errorf("%s: does not set node from __meta_kubernetes_pod_node_name", ep.where)
		}
		jobs[relabeledJob(ep.relabelings)] = true
	}
	// The jobs the alerts select.
	for _, job := range []string{"gpu-orphan-exporter", "gpu-orphan-remediator", "gpu-orphan-dispatcher"} {
		if !jobs[job] {
			t.Errorf("no monitor scrapes job %s; jobs: %v", job, keys(jobs))
		}
	}
}

// loadRuleGroups reads a Prometheus rule file strictly into the
// PrometheusRule's types: what the file holds must fit into the CRD.
func loadRuleGroups(path string) ([]monitoringv1.RuleGroup, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var f struct {
		Groups []monitoringv1.RuleGroup `json:"groups"`
	}
	if err := strictUnmarshal(data, &f); err != nil {
		return nil, err
	}
	return f.Groups, nil
}

func TestKubernetesPrometheusRule(t *testing.T) {
	ruleFile := filepath.Join(k8sDir, k8sGeneratedFile)
	objs := loadManifests(t)
	prs := all[monitoringv1.PrometheusRule](objs)
	if len(prs) != 1 {
		t.Fatalf("%d PrometheusRules, want 1", len(prs))
	}
	pr := prs[0]
	p := parser.NewParser(parser.Options{})
	alerts := 0
	for _, g := range pr.Spec.Groups {
		for _, r := range g.Rules {
			if _, err := p.ParseExpr(r.Expr.String()); err != nil {
				t.Errorf("PrometheusRule group %s rule %s%s: %v", g.Name, r.Alert, r.Record, err)
			}
			if r.Alert != "" {
				alerts++
			}
		}
	}
	if alerts == 0 {
		t.Error("PrometheusRule: no alerts")
	}
	want, err := loadRuleGroups(rulesFile)
	if errors.Is(err, os.ErrNotExist) {
		t.Skipf("%s does not exist: nothing to keep in sync", rulesFile)
	}
	if err != nil {
		t.Fatalf("%s: %v", rulesFile, err)
	}
	if !reflect.DeepEqual(pr.Spec.Groups, want) {
		t.Errorf("%s's groups differ from %s; run: go test ./deploy/ -run 'TestHelmChartFilesMatch|TestKubernetesGenerated' -update", ruleFile, rulesFile)
	}
}

func TestKubernetesAlertmanagerReceiver(t *testing.T) {
	objs := loadManifests(t)
	cfg, err := amconfig.LoadFile(filepath.Join(k8sDir, receiverFile))
	if err != nil {
		t.Fatalf("%s: %v", receiverFile, err)
	}
	u, credentials := checkRemediatorReceiver(t, cfg, "GPUOrphanMemory")
	if !strings.HasPrefix(credentials, "/etc/alertmanager/secrets/") {
		t.Errorf("credentials_file %s: prometheus-operator mounts Alertmanager's secrets under /etc/alertmanager/secrets/", credentials)
	}
	// http://SERVICE.NAMESPACE.svc[.cluster.local]:PORT/api/v1/alerts
	parts := strings.Split(u.Hostname(), ".")
	if len(parts) < 3 || parts[2] != "svc" {
		t.Fatalf("webhook url %s: want a Service's DNS name", u)
	}
	svc := find[corev1.Service](objs, parts[0])
	if svc == nil || svc.Namespace != parts[1] {
		t.Fatalf("webhook url %s: no Service %s in namespace %s", u, parts[0], parts[1])
	}
	if !slices.ContainsFunc(svc.Spec.Ports, func(p corev1.ServicePort) bool { return strconv.Itoa(int(p.Port)) == u.Port() }) {
		t.Errorf("webhook url %s: Service %s has no port %s", u, svc.Name, u.Port())
	}
	dep := find[appsv1.Deployment](objs, "gpu-orphan-dispatcher")
	if dep == nil || !labels.SelectorFromSet(svc.Spec.Selector).Matches(labels.Set(dep.Spec.Template.Labels)) {
		t.Errorf("webhook url %s: Service %s does not reach the dispatcher", u, svc.Name)
	}
}

func TestKustomization(t *testing.T) {
	data, err := os.ReadFile(filepath.Join(k8sDir, kustomizationFile))
	if err != nil {
		t.Fatal(err)
	}
	type image struct {
		Name    string `json:"name"`
		NewName string `json:"newName,omitempty"`
		NewTag  string `json:"newTag,omitempty"`
	}
	var k struct {
		APIVersion string   `json:"apiVersion"`
		Kind       string   `json:"kind"`
		Resources  []string `json:"resources"`
		Images     []image  `json:"images"`
	}
	if err := strictUnmarshal(data, &k); err != nil {
		t.Fatalf("%s: %v", kustomizationFile, err)
	}
	if k.APIVersion != "kustomize.config.k8s.io/v1beta1" || k.Kind != "Kustomization" {
		t.Errorf("%s: %s %s", kustomizationFile, k.APIVersion, k.Kind)
	}
	var want []string
	for _, f := range manifestFiles(t) {
		want = append(want, filepath.Base(f))
	}
	got := slices.Clone(k.Resources)
	slices.Sort(got)
	if !slices.Equal(got, want) {
		t.Errorf("%s: resources %v, want every manifest %v", kustomizationFile, got, want)
	}
	// The image it sets is the one the workloads use.
	objs := loadManifests(t)
	for _, w := range workloads(objs) {
		for _, c := range w.template.Spec.Containers {
			name, _, _ := strings.Cut(c.Image, ":")
			if !slices.ContainsFunc(k.Images, func(i image) bool { return i.Name == name }) {
				t.Errorf("%s/%s: image %s is not in the kustomization's images", w.name, c.Name, c.Image)
			}
		}
	}

	// kubectl's kustomize builds it, where kubectl is installed.
	kubectl, err := exec.LookPath("kubectl")
	if err != nil {
		t.Log("kubectl is not installed: the kustomize build is not checked")
		return
	}
	out, err := exec.Command(kubectl, "kustomize", k8sDir).Output()
	if err != nil {
		t.Fatalf("kubectl kustomize %s: %v", k8sDir, err)
	}
	built, err := decodeManifest(bytes.NewReader(out))
	if err != nil {
		t.Fatalf("kubectl kustomize %s: %v", k8sDir, err)
	}
	if len(built) != len(objs) {
		t.Errorf("kubectl kustomize %s: %d objects, the manifests hold %d", k8sDir, len(built), len(objs))
	}
}
