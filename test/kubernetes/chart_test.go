//go:build kubernetes

package kubernetes

import (
	"testing"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv/kubereal"
)

// TestChartObjectsAccepted: every object the chart renders with its
// defaults, except the prometheus-operator ones (PodMonitor,
// PrometheusRule, AlertmanagerConfig: TestChartHelmInstallUninstall
// installs them with their CRDs), is accepted by the real API server's validation with strict field
// validation (an unknown or misspelt field is refused, not dropped), with
// the taint escalation on too; deleting them leaves none behind.
func TestChartObjectsAccepted(t *testing.T) {
	cp := kubereal.Get(t)
	ns := newNamespace(t, cp, "chart")
	values := dispatcherValues(true, true)
	for _, k := range []string{"podMonitor", "prometheusRule", "alertmanagerConfig", "serviceMonitor"} {
		values[k] = map[string]any{"enabled": false}
	}
	objs := render(t, ns, values)
	if len(objs) < 10 {
		t.Fatalf("the chart rendered %d objects", len(objs))
	}
	kinds := map[string]int{}
	for _, o := range objs {
		kinds[o.GetKind()]++
		if o.GetAPIVersion() == "monitoring.coreos.com/v1" || o.GetAPIVersion() == "monitoring.coreos.com/v1alpha1" {
			t.Fatalf("%s %s rendered with its value off", o.GetKind(), o.GetName())
		}
	}
	t.Logf("objects by kind: %v", kinds)
	apply(t, cp, objs)
	remove(t, cp, objs)

	resource := resources(t, cp)
	for _, o := range objs {
		got, err := resource(o).Get(t.Context(), o.GetName(), metav1.GetOptions{})
		if err == nil && got.GetDeletionTimestamp() == nil {
			t.Errorf("%s %s/%s is still there after its deletion", o.GetKind(), o.GetNamespace(), o.GetName())
		} else if err != nil && !apierrors.IsNotFound(err) {
			t.Error(err)
		}
	}
}
