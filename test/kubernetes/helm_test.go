//go:build kubernetes

package kubernetes

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/kube"
	corev1 "k8s.io/api/core/v1"
	nodev1 "k8s.io/api/node/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv/kubereal"
)

// TestChartHelmInstallUninstall (issue 25): the chart installed by Helm's
// own install action (Helm checks the chart's kubeVersion against the
// server's, and validates each object against the server's OpenAPI
// schema), with every prometheus-operator object on (PodMonitor,
// ServiceMonitor, PrometheusRule, AlertmanagerConfig: the operator's CRDs,
// from its module, created first) and the Role that lets a Prometheus of
// another namespace discover the targets. Every object of the release is
// in the API server, in its namespace, the monitors with the labels that
// kube-prometheus-stack selects; the node agents' pods pass Pod Security
// admission only with the namespace label that the README sets; Helm's
// uninstall then leaves none of the objects behind, nor the release's
// record.
func TestChartHelmInstallUninstall(t *testing.T) {
	cp := kubereal.Get(t)
	installOperatorCRDs(t, cp)
	ns := newNamespace(t, cp, "helm")
	monitoringNS := newNamespace(t, cp, "helm-monitoring")
	values := map[string]any{
		"monitoring": map[string]any{
			"labels":         map[string]any{"release": "kube-prometheus-stack"},
			"prometheusRBAC": map[string]any{"enabled": true, "namespace": monitoringNS},
		},
		"serviceMonitor": map[string]any{"enabled": true},
	}
	for k, v := range dispatcherValues(true, true) {
		values[k] = v
	}
	ch, err := loader.Load(chartDir)
	if err != nil {
		t.Fatal(err)
	}
	// As the README's install says: the node agents need hostPID and
	// SYS_PTRACE, which Pod Security's baseline level refuses.
	labelNamespace(t, cp, ns, "pod-security.kubernetes.io/enforce", "privileged")
	cfg := helmConfig(t, cp, ns)
	install := action.NewInstall(cfg)
	install.ReleaseName, install.Namespace = "go", ns
	rel, err := install.RunWithContext(t.Context(), ch, values)
	if err != nil {
		t.Fatalf("helm install: %v", err)
	}
	objs := manifestObjects(t, rel.Manifest)
	kinds := map[string]int{}
	resource := resources(t, cp)
	for _, o := range objs {
		kinds[o.GetKind()]++
		want := ns
		switch {
		case o.GetKind() == "ClusterRole" || o.GetKind() == "ClusterRoleBinding":
			want = ""
		case o.GetNamespace() == monitoringNS:
			want = monitoringNS
		case o.GetNamespace() == "default" && strings.HasSuffix(o.GetName(), "-node-events"):
			// Events about Nodes are recorded in "default".
			want = "default"
		}
		got, err := resource(withNamespace(o, ns)).Get(t.Context(), o.GetName(), metav1.GetOptions{})
		if err != nil {
			t.Errorf("%s %s after helm install: %v", o.GetKind(), o.GetName(), err)
			continue
		}
		if got.GetNamespace() != want {
			t.Errorf("%s %s in namespace %q, want %q", o.GetKind(), o.GetName(), got.GetNamespace(), want)
		}
		if strings.HasPrefix(o.GetAPIVersion(), "monitoring.coreos.com/") && got.GetLabels()["release"] != "kube-prometheus-stack" {
			t.Errorf("%s %s: labels %v, want monitoring.labels' release=kube-prometheus-stack", o.GetKind(), o.GetName(), got.GetLabels())
		}
	}
	t.Logf("helm install: %d objects by kind: %v", len(objs), kinds)
	for _, k := range []string{"PodMonitor", "ServiceMonitor", "PrometheusRule", "AlertmanagerConfig", "DaemonSet", "Deployment", "Role", "ClusterRole"} {
		if kinds[k] == 0 {
			t.Errorf("the release has no %s", k)
		}
	}

	// The DaemonSet's pods, as its controller would create them (there is
	// none here: a server-side dry run), with the RuntimeClass that the
	// GPU operator creates, pass Pod Security admission in the namespace
	// labelled as the README says, and not while it enforces baseline:
	// the label is needed.
	rc := &nodev1.RuntimeClass{ObjectMeta: metav1.ObjectMeta{Name: "nvidia"}, Handler: "nvidia"}
	if _, err := cp.Admin(t).NodeV1().RuntimeClasses().Create(t.Context(), rc, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	ds := find(t, objs, "DaemonSet", "go-gpu-orphan-node")
	if err := createAgentPod(t, cp, ds, ns); err != nil {
		t.Errorf("a node agent's pod in namespace %s (enforce=privileged): %v", ns, err)
	}
	labelNamespace(t, cp, ns, "pod-security.kubernetes.io/enforce", "baseline")
	// PodSecurity admission reads the namespace's labels from an informer:
	// right after the update it may still see the old ones (a pod was
	// admitted right after the label, beside other tests). The pod is a
	// dry run, so asking again changes nothing.
	testenv.EventuallyNil(t, testenv.Scale(10*time.Second), "a node agent's pod refused by PodSecurity in a namespace that enforces baseline", func() error {
		err := createAgentPod(t, cp, ds, ns)
		switch {
		case err == nil:
			return errors.New("admitted")
		case !strings.Contains(err.Error(), "PodSecurity"):
			return fmt.Errorf("refused, but not by PodSecurity: %w", err)
		}
		t.Logf("enforce=baseline: %v", err)
		return nil
	})
	labelNamespace(t, cp, ns, "pod-security.kubernetes.io/enforce", "privileged")

	uninstall := action.NewUninstall(cfg)
	uninstall.Wait, uninstall.Timeout = true, testenv.Scale(2*time.Minute)
	resp, err := uninstall.Run("go")
	if err != nil {
		t.Fatalf("helm uninstall: %v", err)
	}
	if resp.Info != "" {
		t.Errorf("helm uninstall: %s, want every resource deleted", resp.Info)
	}
	for _, o := range objs {
		got, err := resource(withNamespace(o, ns)).Get(t.Context(), o.GetName(), metav1.GetOptions{})
		if err == nil && got.GetDeletionTimestamp() == nil {
			t.Errorf("%s %s/%s is still there after helm uninstall", o.GetKind(), got.GetNamespace(), o.GetName())
		} else if err != nil && !apierrors.IsNotFound(err) {
			t.Error(err)
		}
	}
	secrets, err := cp.Admin(t).CoreV1().Secrets(ns).List(t.Context(), metav1.ListOptions{LabelSelector: "owner=helm"})
	if err != nil {
		t.Fatal(err)
	}
	if len(secrets.Items) != 0 {
		t.Errorf("helm's release record is still there: %d secrets", len(secrets.Items))
	}
}

// labelNamespace sets a label on a namespace.
func labelNamespace(t *testing.T, cp *kubereal.ControlPlane, name, key, value string) {
	t.Helper()
	patch := fmt.Sprintf(`{"metadata":{"labels":{%q:%q}}}`, key, value)
	if _, err := cp.Admin(t).CoreV1().Namespaces().Patch(t.Context(), name, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
}

// createAgentPod creates, as a server-side dry run, a pod of the
// DaemonSet's template on a node in namespace, as the DaemonSet controller
// would, and returns the API server's answer.
func createAgentPod(t *testing.T, cp *kubereal.ControlPlane, ds *unstructured.Unstructured, namespace string) error {
	t.Helper()
	tmpl, _, err := unstructured.NestedMap(ds.Object, "spec", "template")
	if err != nil {
		t.Fatal(err)
	}
	var pt corev1.PodTemplateSpec
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(tmpl, &pt); err != nil {
		t.Fatal(err)
	}
	pod := &corev1.Pod{ObjectMeta: pt.ObjectMeta, Spec: pt.Spec}
	pod.Name, pod.Namespace, pod.Spec.NodeName = "agent", namespace, "node-a"
	_, err = cp.Admin(t).CoreV1().Pods(namespace).Create(t.Context(), pod, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
	return err
}

// helmConfig is Helm's action configuration for namespace, as the helm CLI
// makes it from a kubeconfig (the admin's), with its records in Secrets.
func helmConfig(t *testing.T, cp *kubereal.ControlPlane, namespace string) *action.Configuration {
	t.Helper()
	flags := kube.GetConfig(cp.AdminKubeconfig(t), "", namespace)
	cache := t.TempDir() // not the user's ~/.kube/cache
	flags.CacheDir = &cache
	cfg := new(action.Configuration)
	if err := cfg.Init(flags, namespace, "secret", t.Logf); err != nil {
		t.Fatal(err)
	}
	return cfg
}

// withNamespace is o with namespace where its manifest names none (Helm
// installs those in the release's).
func withNamespace(o *unstructured.Unstructured, namespace string) *unstructured.Unstructured {
	if o.GetNamespace() != "" {
		return o
	}
	o = o.DeepCopy()
	o.SetNamespace(namespace)
	return o
}

// manifestObjects decodes a release's manifest.
func manifestObjects(t *testing.T, manifest string) []*unstructured.Unstructured {
	t.Helper()
	var objs []*unstructured.Unstructured
	d := utilyaml.NewYAMLOrJSONDecoder(strings.NewReader(manifest), 4096)
	for {
		var m map[string]any
		if err := d.Decode(&m); errors.Is(err, io.EOF) {
			return objs
		} else if err != nil {
			t.Fatal(err)
		}
		if len(m) > 0 {
			objs = append(objs, &unstructured.Unstructured{Object: m})
		}
	}
}

// installOperatorCRDs creates the prometheus-operator CRDs that
// scripts/kube-tools.sh took from the operator's module, unless there,
// and waits until each is established.
func installOperatorCRDs(t *testing.T, cp *kubereal.ControlPlane) {
	t.Helper()
	dir, err := kubereal.Dir()
	if err != nil {
		t.Fatal(err)
	}
	files, err := filepath.Glob(filepath.Join(dir, "prometheus-operator-crds", "*.yaml"))
	if err != nil || len(files) < 4 {
		t.Fatalf("the prometheus-operator CRDs are not in %s (%v): run `make kube-tools`", dir, err)
	}
	resource := resources(t, cp)
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var m map[string]any
		if err := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(b), 4096).Decode(&m); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		crd := &unstructured.Unstructured{Object: m}
		if _, err := resource(crd).Create(t.Context(), crd, metav1.CreateOptions{FieldValidation: metav1.FieldValidationStrict}); err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatalf("the API server refused the CRD %s: %v", crd.GetName(), err)
		}
		testenv.Eventually(t, 30*time.Second, "the CRD "+crd.GetName()+" to be established", func() bool {
			got, err := resource(crd).Get(t.Context(), crd.GetName(), metav1.GetOptions{})
			if err != nil {
				return false
			}
			conds, _, _ := unstructured.NestedSlice(got.Object, "status", "conditions")
			for _, c := range conds {
				if c, ok := c.(map[string]any); ok && c["type"] == "Established" && c["status"] == "True" {
					return true
				}
			}
			return false
		})
	}
}
