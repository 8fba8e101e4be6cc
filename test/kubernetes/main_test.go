//go:build kubernetes

package kubernetes

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/restmapper"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv/kubereal"
)

// TestMain stops the control plane and removes the binaries that
// testenv.Bin built (kubereal.Main runs the tests with testenv.Main).
func TestMain(m *testing.M) { os.Exit(kubereal.Main(m)) }

const chartDir = "../../charts/gpu-orphan"

// release is the chart installed (or only its RBAC) as release "go" in a
// namespace of the test's own.
type release struct {
	cp        *kubereal.ControlPlane
	namespace string
	objects   []*unstructured.Unstructured
}

// dispatcherName is the chart's dispatcher ServiceAccount, Role and Lease.
func (r *release) dispatcherName() string { return "go-gpu-orphan-dispatcher" }

// agentsService is the chart's Service of the node agents.
func (r *release) agentsService() string { return "go-gpu-orphan-remediator" }

// newNamespace creates a namespace of the test's own, named after it.
func newNamespace(t *testing.T, cp *kubereal.ControlPlane, name string) string {
	t.Helper()
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}
	if _, err := cp.Admin(t).CoreV1().Namespaces().Create(t.Context(), ns, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	return name
}

// render renders the chart, as `helm template` does, with values over
// the chart's defaults, into objects.
func render(t *testing.T, namespace string, values map[string]any) []*unstructured.Unstructured {
	t.Helper()
	ch, err := loader.Load(chartDir)
	if err != nil {
		t.Fatal(err)
	}
	rv, err := chartutil.ToRenderValues(ch, values, chartutil.ReleaseOptions{Name: "go", Namespace: namespace, Revision: 1, IsInstall: true},
		chartutil.DefaultCapabilities)
	if err != nil {
		t.Fatal(err)
	}
	out, err := engine.Engine{Strict: true}.Render(ch, rv)
	if err != nil {
		t.Fatal(err)
	}
	names := make([]string, 0, len(out))
	for n := range out {
		if strings.HasSuffix(n, ".yaml") && !strings.HasPrefix(filepath.Base(n), "_") {
			names = append(names, n)
		}
	}
	slices.Sort(names)
	var objs []*unstructured.Unstructured
	for _, n := range names {
		d := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader([]byte(out[n])), 4096)
		for {
			var m map[string]any
			if err := d.Decode(&m); errors.Is(err, io.EOF) {
				break
			} else if err != nil {
				t.Fatalf("%s: %v", n, err)
			}
			if len(m) == 0 {
				continue
			}
			objs = append(objs, &unstructured.Unstructured{Object: m})
		}
	}
	return objs
}

// rbacOnly is the chart's ServiceAccounts, Roles, ClusterRoles and their
// bindings.
func rbacOnly(objs []*unstructured.Unstructured) []*unstructured.Unstructured {
	var out []*unstructured.Unstructured
	for _, o := range objs {
		switch o.GetKind() {
		case "ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding":
			out = append(out, o)
		}
	}
	return out
}

// apply creates objs with the admin's credentials, each through the API
// server's full validation (strict field validation: an unknown field is
// an error, not dropped).
func apply(t *testing.T, cp *kubereal.ControlPlane, objs []*unstructured.Unstructured) {
	t.Helper()
	resource := resources(t, cp)
	for _, o := range objs {
		if _, err := resource(o).Create(t.Context(), o, metav1.CreateOptions{FieldValidation: metav1.FieldValidationStrict}); err != nil {
			t.Fatalf("the API server refused %s %s/%s: %v", o.GetKind(), o.GetNamespace(), o.GetName(), err)
		}
	}
}

// remove deletes objs with the admin's credentials; a missing one is fine.
func remove(t *testing.T, cp *kubereal.ControlPlane, objs []*unstructured.Unstructured) {
	t.Helper()
	resource := resources(t, cp)
	for _, o := range objs {
		if err := resource(o).Delete(context.Background(), o.GetName(), metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			t.Fatal(err)
		}
	}
}

// resources returns, for an object, the admin's dynamic client of its
// resource (in its namespace, where the resource has one).
func resources(t *testing.T, cp *kubereal.ControlPlane) func(*unstructured.Unstructured) dynamic.ResourceInterface {
	t.Helper()
	dyn, err := dynamic.NewForConfig(cp.AdminConfig())
	if err != nil {
		t.Fatal(err)
	}
	dc, err := discovery.NewDiscoveryClientForConfig(cp.AdminConfig())
	if err != nil {
		t.Fatal(err)
	}
	mapper := restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(dc))
	return func(o *unstructured.Unstructured) dynamic.ResourceInterface {
		t.Helper()
		gvk := o.GroupVersionKind()
		m, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
		if err != nil {
			t.Fatalf("%s %s: %v", gvk, o.GetName(), err)
		}
		if m.Scope.Name() == meta.RESTScopeNameNamespace {
			return dyn.Resource(m.Resource).Namespace(o.GetNamespace())
		}
		return dyn.Resource(m.Resource)
	}
}

// createNodes creates Nodes of these names, with nothing but a name.
func createNodes(t *testing.T, cp *kubereal.ControlPlane, names ...string) {
	t.Helper()
	for _, n := range names {
		if _, err := cp.Admin(t).CoreV1().Nodes().Create(t.Context(), &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
}

// find is the object of objs of that kind and name.
func find(t *testing.T, objs []*unstructured.Unstructured, kind, name string) *unstructured.Unstructured {
	t.Helper()
	for _, o := range objs {
		if o.GetKind() == kind && o.GetName() == name {
			return o
		}
	}
	t.Fatalf("the chart renders no %s %s", kind, name)
	return nil
}
