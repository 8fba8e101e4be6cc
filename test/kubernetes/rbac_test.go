//go:build kubernetes

package kubernetes

import (
	"fmt"
	"strings"
	"sync/atomic"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv/kubereal"
	"github.com/gpu-orphan/gpu-orphan/remediate/dispatch"
)

// rbacRuns numbers the runs of TestTaintRBACTakenAway (-count): a
// namespace is never gone from a control plane without its controllers,
// and Nodes are cluster-wide, so each run has names of its own.
var rbacRuns atomic.Int32

// TestTaintRBACTakenAway: the chart's ClusterRoleBinding for the taints
// deleted while the dispatcher runs. The real RBAC authorizer reads
// bindings from an informer cache: once it has seen the deletion (a
// SubjectAccessReview says denied), the next read of a Node is refused;
// the error says what was refused and for whom; nothing is written; the
// Taints client goes on working once the authorizer has seen the binding
// back, with no restart.
func TestTaintRBACTakenAway(t *testing.T) {
	cp := kubereal.Get(t)
	run := rbacRuns.Add(1)
	ns := newNamespace(t, cp, fmt.Sprintf("rbac-taken-%d", run))
	r := installRBAC(t, cp, ns, dispatcherValues(true, false))
	admin := cp.Admin(t)
	nodeA, nodeB := fmt.Sprintf("rbac-node-a-%d", run), fmt.Sprintf("rbac-node-b-%d", run)
	createNodes(t, cp, nodeA, nodeB)
	taints, err := dispatch.NewTaints(dispatch.TaintConfig{RESTConfig: cp.TokenConfig(cp.ServiceAccountToken(t, ns, r.dispatcherName())),
		MaxFraction: 1, Identity: "test"})
	if err != nil {
		t.Fatal(err)
	}
	known := []string{nodeA, nodeB}
	if res, _, err := taints.Taint(t.Context(), nodeA, "GPU-A", "test", known); err != nil || res != dispatch.TaintAdded {
		t.Fatalf("Taint with the chart's RBAC: %q, %v", res, err)
	}

	binding := find(t, r.objects, "ClusterRoleBinding", r.dispatcherName()+"-"+ns+"-taint")
	remove(t, cp, []*unstructured.Unstructured{binding})
	cp.WaitAccess(t, ns, r.dispatcherName(), false, nodeAccess(nodeB, "get", "patch")...)
	_, _, err = taints.Taint(t.Context(), nodeB, "GPU-B", "test", known)
	if err == nil {
		t.Fatal("Taint went through after its ClusterRoleBinding was deleted")
	}
	for _, says := range []string{"forbidden", "nodes", "system:serviceaccount:" + ns + ":" + r.dispatcherName()} {
		if !strings.Contains(err.Error(), says) {
			t.Errorf("the error does not say %q: %v", says, err)
		}
	}
	if n, err := admin.CoreV1().Nodes().Get(t.Context(), nodeB, metav1.GetOptions{}); err != nil || hasTaint(n, "GPU-B") {
		t.Errorf("%s was tainted without the permission (%v)", nodeB, err)
	}

	// The binding is back: the same client works again, no restart.
	binding.SetResourceVersion("")
	apply(t, cp, []*unstructured.Unstructured{binding})
	cp.WaitAccess(t, ns, r.dispatcherName(), true, nodeAccess(nodeB, "get", "patch")...)
	if res, _, err := taints.Taint(t.Context(), nodeB, "GPU-B", "test", known); err != nil || res != dispatch.TaintAdded {
		t.Errorf("Taint once the binding is back: %q, %v", res, err)
	}
}
