//go:build kubernetes

package kubernetes

import (
	"cmp"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/kubernetes"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv/kubereal"
	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/dispatch"
	"github.com/gpu-orphan/gpu-orphan/remediate/remediatetest"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

// roundTripper is an http.RoundTripper made of a function.
type roundTripper func(*http.Request) (*http.Response, error)

func (f roundTripper) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// TestTaintWhileNodeUpdated: the dispatcher, with the chart's ClusterRole
// and Role only (escalate.taint), taints a real Node while another client
// (the kubelet, a label controller) updates the same Node between the
// dispatcher's read and its patch, with a label and a taint of its own.
// The API server refuses the patch that tests the stale resourceVersion
// (a patch without that test would write the taints it read, and the
// other client's taint would be lost); the taint must still be there in
// the end (the conflict retried, not lost), the other client's changes kept,
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
				n.Spec.Taints = append(n.Spec.Taints, corev1.Taint{Key: "example.com/other-writer", Effect: corev1.TaintEffectPreferNoSchedule})
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
	if !slices.ContainsFunc(n.Spec.Taints, func(tt corev1.Taint) bool { return tt.Key == "example.com/other-writer" }) {
		t.Errorf("the other writer's taint is gone: %v", n.Spec.Taints)
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

// nodeAccess is each of verbs on the Node node, for kubereal.WaitAccess.
func nodeAccess(node string, verbs ...string) []authorizationv1.ResourceAttributes {
	var out []authorizationv1.ResourceAttributes
	for _, v := range verbs {
		out = append(out, authorizationv1.ResourceAttributes{Verb: v, Resource: "nodes", Name: node})
	}
	return out
}

func hasTaint(n *corev1.Node, gpu string) bool {
	for _, tt := range n.Spec.Taints {
		if tt.Key == dispatch.TaintKey && tt.Value == gpu && tt.Effect == corev1.TaintEffectNoSchedule {
			return true
		}
	}
	return false
}

// taintFleet is four Nodes of the test's own, each with a fake agent in
// the targets, and a dispatcher (package dispatch, driven as the engine
// drives it) that taints as the chart's dispatcher ServiceAccount, with
// --dispatch.max-fraction 0.5: at most 2 of the 4 known nodes tainted.
type taintFleet struct {
	r     *release
	admin kubernetes.Interface
	// nodes are the Nodes' names, by the short name the test uses.
	nodes  map[string]string
	agents map[string]*testenv.FakeAgent
	d      *dispatch.Dispatcher
	st     *store.Store
}

func newTaintFleet(t *testing.T, name string) *taintFleet {
	t.Helper()
	cp := kubereal.Get(t)
	r := installRBAC(t, cp, newNamespace(t, cp, name), dispatcherValues(true, false))
	f := &taintFleet{r: r, admin: cp.Admin(t), nodes: map[string]string{}, agents: map[string]*testenv.FakeAgent{}, st: remediatetest.OpenStore(t)}
	targets := map[string]string{}
	for _, short := range []string{"gpu-a", "gpu-b", "gpu-c", "gpu-d"} {
		// Nodes are cluster-wide: named after the test.
		node := name + "-" + short
		createNodes(t, cp, node)
		f.nodes[short], f.agents[short] = node, testenv.NewFakeAgent(t, "127.0.0.1")
		targets[node] = f.agents[short].URL
	}
	taints, err := dispatch.NewTaints(dispatch.TaintConfig{RESTConfig: cp.TokenConfig(cp.ServiceAccountToken(t, r.namespace, r.dispatcherName())),
		MaxFraction: 0.5, Identity: "test"})
	if err != nil {
		t.Fatal(err)
	}
	f.d = newDispatch(t, dispatch.Config{Targets: targets, Taints: taints})
	return f
}

// run forwards an alert for the node's GPU, has its agent end the action
// as end says, follows it, and returns the dispatcher's action's ID.
func (f *taintFleet) run(t *testing.T, short, gpu, fingerprint string, attempt int, end func(a *remediate.Action)) string {
	t.Helper()
	node, ag := f.nodes[short], f.agents[short]
	action := remediate.Action{ID: "ag-" + fingerprint, Node: node, GPUUUID: gpu, State: remediate.StateRunning, Source: "webhook"}
	ag.SetAction(t, action)
	ag.SetReply(`{"alerts":[{"fingerprint":"` + fingerprint + `","result":"accepted","action_id":"ag-` + fingerprint + `"}]}`)
	a, _ := f.d.Execute(t.Context(), remediate.Action{Node: node, GPUUUID: gpu, AlertFingerprint: fingerprint, Attempt: attempt,
		AlertStartsAt: time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC), StartedAt: time.Now()})
	if a.Agent == nil || a.Agent.ActionID == "" {
		t.Fatalf("forwarding %s: %s %s", node, a.State, a.Reason)
	}
	id, err := f.st.Insert(t.Context(), a)
	if err != nil {
		t.Fatal(err)
	}
	fin := time.Now()
	action.FinishedAt = &fin
	end(&action)
	ag.SetAction(t, action)
	f.d.FollowOnce(t.Context(), f.st)
	return id
}

// node is the Node of the short name, as the API server has it now.
func (f *taintFleet) node(t *testing.T, short string) *corev1.Node {
	t.Helper()
	n, err := f.admin.CoreV1().Nodes().Get(t.Context(), f.nodes[short], metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// events are the Events on the Node of the short name, oldest first.
func (f *taintFleet) events(t *testing.T, short string) []corev1.Event {
	t.Helper()
	return nodeEvents(t, f.admin, f.nodes[short])
}

// nodeEvents are the Events on the Node node, in namespace default, oldest
// first.
func nodeEvents(t *testing.T, admin kubernetes.Interface, node string) []corev1.Event {
	t.Helper()
	evs, err := admin.CoreV1().Events(dispatch.EventNamespace).List(t.Context(), metav1.ListOptions{
		FieldSelector: fields.Set{"involvedObject.kind": "Node", "involvedObject.name": node}.String()})
	if err != nil {
		t.Fatal(err)
	}
	// resourceVersions are etcd's revisions, increasing (Events' timestamps
	// are whole seconds).
	rv := func(e corev1.Event) int64 { n, _ := strconv.ParseInt(e.ResourceVersion, 10, 64); return n }
	slices.SortFunc(evs.Items, func(a, b corev1.Event) int { return cmp.Compare(rv(a), rv(b)) })
	return evs.Items
}

// escalated ends an agent's action as the cleanup ends one whose targets
// are gone while the memory stays, held by nothing visible.
func escalated(a *remediate.Action) {
	a.State, a.Reason, a.Escalation = remediate.StateFailed, "the memory stays after every target exited", remediate.EscalationHiddenHolder
	a.Leftover = []remediate.Leftover{{Kind: "driver", Detail: "no process holds the GPU"}}
}

func cleaned(a *remediate.Action) { a.State, a.FreedBytes = remediate.StateSucceeded, 4<<30 }

// held ends an agent's action failed with the memory held, no escalation.
func held(a *remediate.Action) {
	a.State, a.Reason = remediate.StateFailed, "the memory stays"
	a.Leftover = []remediate.Leftover{{PID: 7, Kind: "d_state"}}
}

// taintOf is the node's gpu-orphan taint, value:effect, or "".
func taintOf(n *corev1.Node) string {
	for _, t := range n.Spec.Taints {
		if t.Key == dispatch.TaintKey {
			return t.Value + ":" + string(t.Effect)
		}
	}
	return ""
}

// lastEvent is the action's last audit event, its kind and detail.
func lastEvent(t *testing.T, st *store.Store, id string) (string, map[string]any) {
	t.Helper()
	evs, err := st.Events(t.Context(), id)
	if err != nil || len(evs) == 0 {
		t.Fatalf("events of %s: %v %v", id, evs, err)
	}
	var d map[string]any
	_ = json.Unmarshal(evs[len(evs)-1].Detail, &d)
	return evs[len(evs)-1].Kind, d
}

// TestTaintEscalationBoundedAndRemoved: a failed cleanup that escalated
// taints its node, with an Event on the Node; the bound refuses a taint
// beyond --dispatch.max-fraction of the known nodes (counting a node that
// another GPU's taint holds), recorded; exhausted attempts taint; a
// cleanup that brings the memory back, and a resolved alert, untaint.
// The real API server takes every patch (none is recorded as failed).
func TestTaintEscalationBoundedAndRemoved(t *testing.T) {
	f := newTaintFleet(t, "taint-bounded")
	ctx := t.Context()

	id := f.run(t, "gpu-a", "GPU-A", "fa1", 1, escalated)
	if got := taintOf(f.node(t, "gpu-a")); got != "GPU-A:NoSchedule" {
		t.Fatalf("gpu-a's taint %q", got)
	}
	kind, detail := lastEvent(t, f.st, id)
	if kind != "taint" || detail["node"] != f.nodes["gpu-a"] || detail["gpu"] != "GPU-A" || detail["result"] != dispatch.TaintAdded ||
		!strings.Contains(detail["reason"].(string), "hidden_holder") || !strings.Contains(detail["reason"].(string), "driver") {
		t.Fatalf("audit: %s %v", kind, detail)
	}
	evs := f.events(t, "gpu-a")
	if len(evs) != 1 || evs[0].Type != corev1.EventTypeWarning || evs[0].Reason != "GPUOrphanTainted" ||
		evs[0].Namespace != "default" || !strings.Contains(evs[0].Message, "hidden_holder") {
		t.Fatalf("Events: %+v (audit %v)", evs, detail)
	}

	// The same node's next escalation writes nothing.
	rv := f.node(t, "gpu-a").ResourceVersion
	f.run(t, "gpu-a", "GPU-A", "fa2", 1, escalated)
	if n := f.node(t, "gpu-a"); n.ResourceVersion != rv || taintOf(n) != "GPU-A:NoSchedule" {
		t.Fatalf("gpu-a after a second escalation: resourceVersion %s (was %s), taint %q", n.ResourceVersion, rv, taintOf(n))
	}

	// gpu-b: 2 of 4 may be tainted, gpu-a is; gpu-b makes 2.
	f.run(t, "gpu-b", "GPU-B", "fb1", 1, escalated)
	// gpu-c would make 3: refused, and recorded.
	id = f.run(t, "gpu-c", "GPU-C", "fc1", 1, escalated)
	if got := taintOf(f.node(t, "gpu-c")); got != "" {
		t.Fatalf("gpu-c tainted beyond the bound: %q", got)
	}
	if kind, detail := lastEvent(t, f.st, id); kind != "taint_refused" || !strings.Contains(detail["refused"].(string), "2 of the 4 known nodes") {
		t.Fatalf("refusal: %s %v", kind, detail)
	}

	// gpu-a's memory comes back: untainted, with an Event.
	id = f.run(t, "gpu-a", "GPU-A", "fa3", 1, cleaned)
	if got := taintOf(f.node(t, "gpu-a")); got != "" {
		t.Fatalf("gpu-a still tainted: %q", got)
	}
	if kind, detail := lastEvent(t, f.st, id); kind != "untaint" || detail["result"] != dispatch.TaintRemoved {
		t.Fatalf("untaint audit: %s %v", kind, detail)
	}
	if evs := f.events(t, "gpu-a"); len(evs) != 2 || evs[1].Reason != "GPUOrphanUntainted" || evs[1].Type != corev1.EventTypeNormal {
		t.Fatalf("gpu-a's Events after the untaint: %+v", evs)
	}

	// gpu-c: a failure without escalation taints only on the last attempt.
	f.run(t, "gpu-c", "GPU-C", "fc2", 2, held)
	if got := taintOf(f.node(t, "gpu-c")); got != "" {
		t.Fatalf("gpu-c tainted before its attempts ran out: %q", got)
	}
	id = f.run(t, "gpu-c", "GPU-C", "fc3", store.DefaultMaxAttempts, held)
	if got := taintOf(f.node(t, "gpu-c")); got != "GPU-C:NoSchedule" {
		t.Fatalf("gpu-c after its last attempt: %q", got)
	}
	if kind, detail := lastEvent(t, f.st, id); kind != "taint" || !strings.Contains(detail["reason"].(string), "attempt 3 of at most 3") {
		t.Fatalf("exhausted audit: %s %v", kind, detail)
	}

	// gpu-c's alert resolves: untainted, recorded on its latest action.
	f.d.AlertResolved(ctx, f.st, f.nodes["gpu-c"], "GPU-C")
	if got := taintOf(f.node(t, "gpu-c")); got != "" {
		t.Fatalf("gpu-c after its alert resolved: %q", got)
	}
	if kind, detail := lastEvent(t, f.st, id); kind != "untaint" || detail["reason"] != "the alert resolved" {
		t.Fatalf("resolved audit: %s %v", kind, detail)
	}
	// Another GPU's resolution leaves gpu-b's taint.
	f.d.AlertResolved(ctx, f.st, f.nodes["gpu-b"], "GPU-X")
	if got := taintOf(f.node(t, "gpu-b")); got != "GPU-B:NoSchedule" {
		t.Fatalf("gpu-b after another GPU's alert resolved: %q", got)
	}
	n := 0
	for short := range f.nodes {
		n += len(f.events(t, short))
	}
	if n != 5 {
		t.Errorf("%d Events, want 5 (tainted a, b, c; untainted a, c)", n)
	}
}

// TestTaintWithoutRBAC: without the chart's ClusterRoleBinding for get and
// patch on nodes, the refusal is recorded and the agent's result kept;
// without its RoleBinding for creating Events in default, the taint is
// made, and the Event's refusal recorded. Each binding is deleted, and
// restored, while the dispatcher runs; the authorizer sees it a moment
// later (kubereal.WaitAccess).
func TestTaintWithoutRBAC(t *testing.T) {
	f := newTaintFleet(t, "taint-no-rbac")
	r, cp := f.r, f.r.cp
	binding := find(t, r.objects, "ClusterRoleBinding", r.dispatcherName()+"-"+r.namespace+"-taint")
	remove(t, cp, []*unstructured.Unstructured{binding})
	cp.WaitAccess(t, r.namespace, r.dispatcherName(), false, nodeAccess(f.nodes["gpu-a"], "get", "patch")...)
	id := f.run(t, "gpu-a", "GPU-A", "fa1", 1, escalated)
	got, err := f.st.Action(t.Context(), id)
	if err != nil {
		t.Fatal(err)
	}
	if got.Agent.State != remediate.StateFailed || got.Escalation != remediate.EscalationHiddenHolder {
		t.Fatalf("the agent's result is not recorded: %+v", got.Agent)
	}
	if kind, detail := lastEvent(t, f.st, id); kind != "taint_failed" || !strings.Contains(detail["error"].(string), "forbidden") {
		t.Fatalf("refusal audit: %s %v", kind, detail)
	}

	binding.SetResourceVersion("")
	apply(t, cp, []*unstructured.Unstructured{binding})
	cp.WaitAccess(t, r.namespace, r.dispatcherName(), true, nodeAccess(f.nodes["gpu-a"], "get", "patch")...)
	events := find(t, r.objects, "RoleBinding", r.dispatcherName()+"-"+r.namespace+"-node-events")
	remove(t, cp, []*unstructured.Unstructured{events})
	cp.WaitAccess(t, r.namespace, r.dispatcherName(), false,
		authorizationv1.ResourceAttributes{Namespace: dispatch.EventNamespace, Verb: "create", Resource: "events"})
	id = f.run(t, "gpu-a", "GPU-A", "fa2", 1, escalated)
	if got := taintOf(f.node(t, "gpu-a")); got != "GPU-A:NoSchedule" {
		t.Fatalf("gpu-a's taint without the Event's RBAC: %q", got)
	}
	if kind, detail := lastEvent(t, f.st, id); kind != "taint" || !strings.Contains(fmt.Sprint(detail["event_error"]), "forbidden") {
		t.Fatalf("Event refusal audit: %s %v", kind, detail)
	}
	if evs := f.events(t, "gpu-a"); len(evs) != 0 {
		t.Fatalf("Events without their RBAC: %+v", evs)
	}
}

// TestEscalateTaint: the dispatcher binary with --escalate.taint, as the
// chart's dispatcher ServiceAccount, forwards an alert to a fake node
// agent, whose cleanup ends failed with an escalation (memory that no
// visible process holds): the dispatcher taints the Node and posts an
// Event on it. When the alert resolves, the taint goes, with an Event.
func TestEscalateTaint(t *testing.T) {
	cp := kubereal.Get(t)
	r := installRBAC(t, cp, newNamespace(t, cp, "escalate-taint"), dispatcherValues(true, false))
	node := "escalate-taint-gpu-a"
	createNodes(t, cp, node)
	fin := time.Now()
	agent := testenv.NewFakeAgent(t, "127.0.0.1")
	agent.SetReply(`{"received":1,"results":{"accepted":1},"alerts":[{"fingerprint":"f00d","result":"accepted","action_id":"ag1"}]}`)
	agent.SetAction(t, remediate.Action{ID: "ag1", Node: node, GPUUUID: "GPU-1", State: remediate.StateFailed,
		Reason: "the memory stays after every target exited", Escalation: remediate.EscalationHiddenHolder, FinishedAt: &fin,
		Leftover: []remediate.Leftover{{Kind: "driver", Detail: "no process holds the GPU"}}})
	targets := filepath.Join(t.TempDir(), "targets.json")
	if err := os.WriteFile(targets, []byte(`{"`+node+`": "`+agent.URL+`"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	_, base := startDispatcherBinary(t, r, "--dispatch.targets-file="+targets, "--escalate.taint")

	admin := cp.Admin(t)
	tainted := func() string {
		n, err := admin.CoreV1().Nodes().Get(t.Context(), node, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return taintOf(n)
	}
	alert := testenv.Alert{Status: "firing", Node: node, UUID: "GPU-1", Fingerprint: "f00d", StartsAt: time.Now().Add(-time.Minute)}
	if _, err := testenv.PostWebhook(base, "", alert); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 20*time.Second, node+" to be tainted", func() bool { return tainted() == "GPU-1:NoSchedule" })
	// The Event is posted after the taint: wait for it, then check it.
	testenv.Eventually(t, 20*time.Second, "an Event on "+node, func() bool { return len(nodeEvents(t, admin, node)) > 0 })
	if evs := nodeEvents(t, admin, node); len(evs) != 1 || evs[0].Reason != "GPUOrphanTainted" || !strings.Contains(evs[0].Message, "hidden_holder") {
		t.Fatalf("Events: %+v", evs)
	}
	alert.Status = "resolved"
	if _, err := testenv.PostWebhook(base, "", alert); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 20*time.Second, node+" to be untainted, with an Event", func() bool {
		evs := nodeEvents(t, admin, node)
		return tainted() == "" && len(evs) == 2 && evs[1].Reason == "GPUOrphanUntainted"
	})
}
