//go:build kubernetes

package kubernetes

import (
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv/kubereal"
	"github.com/gpu-orphan/gpu-orphan/remediate/dispatch"
)

// TestTaintRBACTakenAway: the chart's ClusterRoleBinding for the taints
// deleted while the dispatcher runs. The real RBAC authorizer refuses the
// next read of a Node at once (no cache to wait out); the error says what
// was refused and for whom; nothing is written; the Taints client goes on
// working once the binding is back.
func TestTaintRBACTakenAway(t *testing.T) {
	cp := kubereal.Get(t)
	ns := newNamespace(t, cp, "rbac-taken")
	r := installRBAC(t, cp, ns, dispatcherValues(true, false))
	admin := cp.Admin(t)
	createNodes(t, cp, "rbac-node-a", "rbac-node-b")
	taints, err := dispatch.NewTaints(dispatch.TaintConfig{RESTConfig: cp.TokenConfig(cp.ServiceAccountToken(t, ns, r.dispatcherName())),
		MaxFraction: 1, Identity: "test"})
	if err != nil {
		t.Fatal(err)
	}
	known := []string{"rbac-node-a", "rbac-node-b"}
	if res, _, err := taints.Taint(t.Context(), "rbac-node-a", "GPU-A", "test", known); err != nil || res != dispatch.TaintAdded {
		t.Fatalf("Taint with the chart's RBAC: %q, %v", res, err)
	}

	binding := find(t, r.objects, "ClusterRoleBinding", r.dispatcherName()+"-"+ns+"-taint")
	remove(t, cp, []*unstructured.Unstructured{binding})
	_, _, err = taints.Taint(t.Context(), "rbac-node-b", "GPU-B", "test", known)
	if err == nil {
		t.Fatal("Taint went through after its ClusterRoleBinding was deleted")
	}
	for _, says := range []string{"forbidden", "nodes", "system:serviceaccount:" + ns + ":" + r.dispatcherName()} {
		if !strings.Contains(err.Error(), says) {
			t.Errorf("the error does not say %q: %v", says, err)
		}
	}
	if n, err := admin.CoreV1().Nodes().Get(t.Context(), "rbac-node-b", metav1.GetOptions{}); err != nil || hasTaint(n, "GPU-B") {
		t.Errorf("rbac-node-b was tainted without the permission (%v)", err)
	}

	// The binding is back: the same client works again, no restart.
	binding.SetResourceVersion("")
	apply(t, cp, []*unstructured.Unstructured{binding})
	if res, _, err := taints.Taint(t.Context(), "rbac-node-b", "GPU-B", "test", known); err != nil || res != dispatch.TaintAdded {
		t.Errorf("Taint once the binding is back: %q, %v", res, err)
	}
}
