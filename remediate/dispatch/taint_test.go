package dispatch

import (
	"encoding/json"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv/kubeapi"
	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/discovery"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

// taintFleet is four nodes, each with its fake agent, on the test API
// server, and a dispatcher that taints with --dispatch.max-fraction 0.5:
// at most 2 of the 4 known nodes tainted.
type taintFleet struct {
	api    *kubeapi.Server
	agents map[string]*fakeAgent
	d      *Dispatcher
	st     *store.Store
}

func newTaintFleet(t *testing.T) *taintFleet {
	t.Helper()
	f := &taintFleet{api: kubeapi.Start(t, "gpu-orphan"), agents: map[string]*fakeAgent{}, st: openStore(t)}
	targets := map[string]string{}
	for _, n := range []string{"gpu-a", "gpu-b", "gpu-c", "gpu-d"} {
		f.agents[n] = &fakeAgent{}
		srv := httptest.NewServer(f.agents[n])
		t.Cleanup(srv.Close)
		targets[n] = srv.URL
		f.api.AddNode(n)
	}
	rc, err := discovery.ClientConfig(f.api.Kubeconfig(t))
	if err != nil {
		t.Fatal(err)
	}
	taints, err := NewTaints(TaintConfig{RESTConfig: rc, MaxFraction: 0.5, Identity: "test"})
	if err != nil {
		t.Fatal(err)
	}
	f.d = newDispatcher(t, Config{Targets: targets, Taints: taints})
	return f
}

// run forwards an alert for node's GPU, has its agent end the action as
// end says, follows it, and returns the dispatcher's action's ID.
func (f *taintFleet) run(t *testing.T, node, gpu, fingerprint string, attempt int, end func(a *remediate.Action)) string {
	t.Helper()
	ag := f.agents[node]
	ag.set(func(ag *fakeAgent) {
		ag.action = remediate.Action{ID: "ag-" + fingerprint, Node: node, GPUUUID: gpu, State: remediate.StateRunning, Source: "webhook"}
		ag.reply = `{"alerts":[{"fingerprint":"` + fingerprint + `","result":"accepted","action_id":"ag-` + fingerprint + `"}]}`
	})
	a, _ := f.d.Execute(t.Context(), remediate.Action{Node: node, GPUUUID: gpu, AlertFingerprint: fingerprint, Attempt: attempt,
		AlertStartsAt: time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC), StartedAt: time.Now()})
	if a.Agent == nil || a.Agent.ActionID == "" {
		t.Fatalf("forwarding %s: %s %s", node, a.State, a.Reason)
	}
	id, err := f.st.Insert(t.Context(), a)
	if err != nil {
		t.Fatal(err)
	}
	ag.set(func(ag *fakeAgent) {
		fin := time.Now()
		ag.action.FinishedAt = &fin
		end(&ag.action)
	})
	f.d.FollowOnce(t.Context(), f.st)
	return id
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

func taintOf(n *corev1.Node) string {
	for _, t := range n.Spec.Taints {
		if t.Key == TaintKey {
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
// taints its node with an Event on the Node; the bound refuses a taint
// beyond --dispatch.max-fraction of the known nodes (counting a node that
// another GPU's taint holds), recorded; exhausted attempts taint; a
// cleanup that brings the memory back, and a resolved alert, untaint.
// Every patch is the strict JSON patch the test API server takes.
func TestTaintEscalationBoundedAndRemoved(t *testing.T) {
	f := newTaintFleet(t)
	ctx := t.Context()

	id := f.run(t, "gpu-a", "GPU-A", "fa1", 1, escalated)
	if got := taintOf(f.api.Node("gpu-a")); got != "GPU-A:NoSchedule" {
		t.Fatalf("gpu-a's taint %q", got)
	}
	kind, detail := lastEvent(t, f.st, id)
	if kind != "taint" || detail["node"] != "gpu-a" || detail["gpu"] != "GPU-A" || detail["result"] != TaintAdded ||
		!strings.Contains(detail["reason"].(string), "hidden_holder") || !strings.Contains(detail["reason"].(string), "driver") {
		t.Fatalf("audit: %s %v", kind, detail)
	}
	evs := f.api.NodeEvents()
	if len(evs) != 1 || evs[0].InvolvedObject.Name != "gpu-a" || evs[0].Type != corev1.EventTypeWarning || evs[0].Reason != "GPUOrphanTainted" ||
		evs[0].Namespace != "default" || !strings.Contains(evs[0].Message, "hidden_holder") {
		t.Fatalf("Events: %+v (audit %v)", evs, detail)
	}

	// The same node's next escalation changes nothing.
	f.run(t, "gpu-a", "GPU-A", "fa2", 1, escalated)
	if applied, refused := f.api.Patches(); applied != 1 || refused != 0 {
		t.Fatalf("patches: %d applied, %d refused", applied, refused)
	}

	// gpu-b: 2 of 4 may be tainted, gpu-a is; gpu-b makes 2.
	f.run(t, "gpu-b", "GPU-B", "fb1", 1, escalated)
	// gpu-c would make 3: refused, and recorded.
	id = f.run(t, "gpu-c", "GPU-C", "fc1", 1, escalated)
	if got := taintOf(f.api.Node("gpu-c")); got != "" {
		t.Fatalf("gpu-c tainted beyond the bound: %q", got)
	}
	if kind, detail := lastEvent(t, f.st, id); kind != "taint_refused" || !strings.Contains(detail["refused"].(string), "2 of the 4 known nodes") {
		t.Fatalf("refusal: %s %v", kind, detail)
	}

	// gpu-a's memory comes back: untainted, with an Event.
	id = f.run(t, "gpu-a", "GPU-A", "fa3", 1, cleaned)
	if got := taintOf(f.api.Node("gpu-a")); got != "" {
		t.Fatalf("gpu-a still tainted: %q", got)
	}
	if kind, detail := lastEvent(t, f.st, id); kind != "untaint" || detail["result"] != TaintRemoved {
		t.Fatalf("untaint audit: %s %v", kind, detail)
	}
	if evs := f.api.NodeEvents(); evs[len(evs)-1].Reason != "GPUOrphanUntainted" || evs[len(evs)-1].Type != corev1.EventTypeNormal {
		t.Fatalf("untaint Event: %+v", evs[len(evs)-1])
	}

	// gpu-c: a failure without escalation taints only on the last attempt.
	f.run(t, "gpu-c", "GPU-C", "fc2", 2, held)
	if got := taintOf(f.api.Node("gpu-c")); got != "" {
		t.Fatalf("gpu-c tainted before its attempts ran out: %q", got)
	}
	id = f.run(t, "gpu-c", "GPU-C", "fc3", store.DefaultMaxAttempts, held)
	if got := taintOf(f.api.Node("gpu-c")); got != "GPU-C:NoSchedule" {
		t.Fatalf("gpu-c after its last attempt: %q", got)
	}
	if kind, detail := lastEvent(t, f.st, id); kind != "taint" || !strings.Contains(detail["reason"].(string), "attempt 3 of at most 3") {
		t.Fatalf("exhausted audit: %s %v", kind, detail)
	}

	// gpu-c's alert resolves: untainted, recorded on its latest action.
	f.d.AlertResolved(ctx, f.st, "gpu-c", "GPU-C")
	if got := taintOf(f.api.Node("gpu-c")); got != "" {
		t.Fatalf("gpu-c after its alert resolved: %q", got)
	}
	if kind, detail := lastEvent(t, f.st, id); kind != "untaint" || detail["reason"] != "the alert resolved" {
		t.Fatalf("resolved audit: %s %v", kind, detail)
	}
	// Another GPU's resolution leaves gpu-b's taint.
	f.d.AlertResolved(ctx, f.st, "gpu-b", "GPU-X")
	if got := taintOf(f.api.Node("gpu-b")); got != "GPU-B:NoSchedule" {
		t.Fatalf("gpu-b after another GPU's alert resolved: %q", got)
	}
	if _, refused := f.api.Patches(); refused != 0 {
		t.Errorf("%d patches refused by the strict API server", refused)
	}
	if n := len(f.api.NodeEvents()); n != 5 {
		t.Errorf("%d Events, want 5 (tainted a, b, c; untainted a, c): %+v", n, f.api.NodeEvents())
	}
}

// TestTaintWithoutRBAC: without get/patch on nodes the refusal is logged
// and recorded, and the follow-up goes on; without create on events the
// taint is made, and the Event's refusal recorded.
func TestTaintWithoutRBAC(t *testing.T) {
	f := newTaintFleet(t)
	f.api.ForbidNodes(true)
	id := f.run(t, "gpu-a", "GPU-A", "fa1", 1, escalated)
	got, _ := f.st.Action(t.Context(), id)
	if got.Agent.State != remediate.StateFailed || got.Escalation != remediate.EscalationHiddenHolder {
		t.Fatalf("the agent's result is not recorded: %+v", got.Agent)
	}
	if kind, detail := lastEvent(t, f.st, id); kind != "taint_failed" || !strings.Contains(detail["error"].(string), "forbidden") {
		t.Fatalf("refusal audit: %s %v", kind, detail)
	}
	f.api.ForbidNodes(false)
	f.api.ForbidEvents(true)
	id = f.run(t, "gpu-a", "GPU-A", "fa2", 1, escalated)
	if taintOf(f.api.Node("gpu-a")) != "GPU-A:NoSchedule" {
		t.Fatal("not tainted without the Event's RBAC")
	}
	if kind, detail := lastEvent(t, f.st, id); kind != "taint" || !strings.Contains(detail["event_error"].(string), "forbidden") {
		t.Fatalf("Event refusal audit: %s %v", kind, detail)
	}
	if len(f.api.NodeEvents()) != 0 {
		t.Fatal("an Event without RBAC")
	}
}

// TestTaintPatchStrict: the test API server takes only the dispatcher's
// JSON patch, and refuses a stale resourceVersion with a conflict, so
// that nothing is written over a node changed meanwhile.
func TestTaintPatchStrict(t *testing.T) {
	f := newTaintFleet(t)
	n := f.api.Node("gpu-a")
	client := f.d.cfg.Taints.client
	for _, c := range []struct {
		typ, body string
	}{
		{"application/merge-patch+json", `{"spec":{"taints":[]}}`},
		{"application/strategic-merge-patch+json", `{"spec":{"taints":[]}}`},
		{"application/json-patch+json", `[{"op":"add","path":"/spec/taints","value":[]}]`},
		{"application/json-patch+json", `[{"op":"test","path":"/metadata/resourceVersion","value":"` + n.ResourceVersion + `"},{"op":"add","path":"/spec/unschedulable","value":true}]`},
		{"application/json-patch+json", `[{"op":"test","path":"/metadata/resourceVersion","value":"1"},{"op":"add","path":"/spec/taints","value":[]}]`},
	} {
		err := client.CoreV1().RESTClient().Patch(typeOf(c.typ)).Resource("nodes").Name("gpu-a").Body([]byte(c.body)).Do(t.Context()).Error()
		if err == nil {
			t.Errorf("%s %s accepted", c.typ, c.body)
		}
	}
	if applied, refused := f.api.Patches(); applied != 0 || refused != 5 {
		t.Fatalf("patches: %d applied, %d refused", applied, refused)
	}
}

func typeOf(s string) types.PatchType { return types.PatchType(s) }
