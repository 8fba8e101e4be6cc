//go:build kubernetes

package kubernetes

import (
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv/kubereal"
	"github.com/gpu-orphan/gpu-orphan/remediate/dispatch"
)

// roundTripper is an http.RoundTripper made of a function.
type roundTripper func(*http.Request) (*http.Response, error)

func (f roundTripper) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// TestTaintWhileNodeUpdated: the dispatcher, with the chart's ClusterRole
// and Role only (escalate.taint), taints a real Node while another client
// (the kubelet, a label controller) updates the same Node between the
// dispatcher's read and its patch. The API server refuses the patch that
// tests the stale resourceVersion; the taint must still be there in the
// end (the conflict retried, not lost), the other client's change kept,
// the Event on the Node visible in namespace default, and the taint not
// removed by anything gpu-orphan does for the second GPU of the node.
func TestTaintWhileNodeUpdated(t *testing.T) {
	cp := kubereal.Get(t)
	ns := newNamespace(t, cp, "taint")
	r := installRBAC(t, cp, ns, dispatcherValues(true, false))
	admin := cp.Admin(t)
	node := "gpu-node-taint"
	createNodes(t, cp, node)
	rc := cp.TokenConfig(cp.ServiceAccountToken(t, ns, r.dispatcherName()))
	// Before the dispatcher's first patch of the Node goes out, another
	// client updates the Node: the patch's test of the resourceVersion
	// that the dispatcher read fails.
	var interfered atomic.Int32
	rc.WrapTransport = func(rt http.RoundTripper) http.RoundTripper {
		return roundTripper(func(req *http.Request) (*http.Response, error) {
			if req.Method == http.MethodPatch && strings.HasSuffix(req.URL.Path, "/nodes/"+node) && interfered.Add(1) == 1 {
				n, err := admin.CoreV1().Nodes().Get(req.Context(), node, metav1.GetOptions{})
				if err != nil {
					return nil, err
				}
				if n.Labels == nil {
					n.Labels = map[string]string{}
				}
				n.Labels["example.com/other-writer"] = "was-here"
				if _, err := admin.CoreV1().Nodes().Update(req.Context(), n, metav1.UpdateOptions{}); err != nil {
					return nil, err
				}
			}
			return rt.RoundTrip(req)
		})
	}
	taints, err := dispatch.NewTaints(dispatch.TaintConfig{RESTConfig: rc, MaxFraction: 1, Identity: "test"})
	if err != nil {
		t.Fatal(err)
	}
	result, evErr, err := taints.Taint(t.Context(), node, "GPU-1", "the test's reason", []string{node})
	if err != nil {
		t.Errorf("Taint with another writer on the Node: %v (the conflict was not retried)", err)
	}
	if interfered.Load() == 0 {
		t.Fatal("the dispatcher never patched the Node")
	}
	n, err := admin.CoreV1().Nodes().Get(t.Context(), node, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if n.Labels["example.com/other-writer"] != "was-here" {
		t.Errorf("the other writer's label is gone: %v", n.Labels)
	}
	if !hasTaint(n, "GPU-1") {
		t.Fatalf("node %s has no %s=GPU-1:NoSchedule after Taint returned %q: %v", node, dispatch.TaintKey, result, n.Spec.Taints)
	}
	if evErr != nil {
		t.Errorf("the Event was not posted: %v", evErr)
	}
	evs, err := admin.CoreV1().Events(dispatch.EventNamespace).List(t.Context(), metav1.ListOptions{
		FieldSelector: fields.Set{"involvedObject.kind": "Node", "involvedObject.name": node, "reason": "GPUOrphanTainted"}.String()})
	if err != nil {
		t.Fatal(err)
	}
	if len(evs.Items) != 1 {
		t.Errorf("%d GPUOrphanTainted Events on node %s, want 1", len(evs.Items), node)
	}

	// A second GPU of the same node: the taint stays (one per key and
	// effect), it is not replaced or removed.
	if result, _, err := taints.Taint(t.Context(), node, "GPU-2", "another GPU", []string{node}); err != nil || !strings.HasPrefix(result, dispatch.TaintAlready) {
		t.Errorf("Taint for a second GPU: %q, %v; want %q", result, err, dispatch.TaintAlready)
	}
	if result, _, err := taints.Untaint(t.Context(), node, "GPU-2", "the other GPU's alert resolved"); err != nil || result != dispatch.TaintAbsent {
		t.Errorf("Untaint of GPU-2: %q, %v; want %q", result, err, dispatch.TaintAbsent)
	}
	if n, err = admin.CoreV1().Nodes().Get(t.Context(), node, metav1.GetOptions{}); err != nil || !hasTaint(n, "GPU-1") {
		t.Errorf("GPU-1's taint is gone (%v): %v", err, n.Spec.Taints)
	}
}

func hasTaint(n *corev1.Node, gpu string) bool {
	for _, tt := range n.Spec.Taints {
		if tt.Key == dispatch.TaintKey && tt.Value == gpu && tt.Effect == corev1.TaintEffectNoSchedule {
			return true
		}
	}
	return false
}
