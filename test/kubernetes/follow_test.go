//go:build kubernetes

package kubernetes

import (
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv/kubereal"
	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/dispatch"
	"github.com/gpu-orphan/gpu-orphan/remediate/limits"
	"github.com/gpu-orphan/gpu-orphan/remediate/remediatetest"
)

// newDispatch is the dispatcher's forwarding (package dispatch, driven by
// the test as the engine drives it) on cfg, with a fleet limit of 5 nodes
// an hour.
func newDispatch(t *testing.T, cfg dispatch.Config) *dispatch.Dispatcher {
	t.Helper()
	cfg.Fleet = limits.NewFleet(limits.FleetConfig{MaxNodes: 5, MaxFraction: 1, Window: time.Hour, BreakerFailures: 3, BreakerWindow: time.Hour}, limits.RealClock{})
	cfg.Metrics = remediate.NewMetrics(prometheus.NewRegistry())
	cfg.Logger = testenv.Logger(t)
	d, err := dispatch.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// TestFollowAsksTheNodesAgentNow: issue 16, under Kubernetes discovery.
// gpu-a's agent pod is replaced: its new pod serves elsewhere, and the
// old address now serves gpu-b's agent. The follow-up of gpu-a's action
// goes to gpu-a's agent as discovery names it now, never to the stored
// address; once gpu-a leaves the slices, nobody is asked, and the
// follow-up ends.
func TestFollowAsksTheNodesAgentNow(t *testing.T) {
	cp := kubereal.Get(t)
	r, f := chartFleet(t, cp, "follow-now", dispatcherValues(false, false))
	ip, gpuA, gpuB := testenv.HostIP(t), "follow-gpu-a", "follow-gpu-b"
	oldPod, newPod := newAgent(t), newAgent(t)
	for _, ag := range []*testenv.FakeAgent{oldPod, newPod} {
		ag.SetReply(`{"alerts":[{"fingerprint":"fp1","result":"accepted","action_id":"ag1"}]}`)
		ag.SetAction(t, remediate.Action{ID: "ag1", State: remediate.StateRunning})
	}
	podA := f.AddPod(t, gpuA, ip, oldPod.Port(t))
	f.Apply(t, f.Slice("agents-1", oldPod.Port(t), f.Endpoint(podA, nil)))
	f.Apply(t, f.Slice("agents-2", newPod.Port(t)))
	k := startDiscovery(t, r, nil)
	st := remediatetest.OpenStore(t)
	d := newDispatch(t, dispatch.Config{Discovery: k, Token: fleetToken})
	id := remediatetest.ForwardAndStore(t, d, st, gpuA, "fp1")

	// The pod is replaced (a new UID); its old address is gpu-b's agent's
	// now.
	f.DeletePod(t, gpuA)
	newA := f.AddPod(t, gpuA, ip, newPod.Port(t))
	podB := f.AddPod(t, gpuB, ip, oldPod.Port(t))
	f.Apply(t, f.Slice("agents-1", oldPod.Port(t), f.Endpoint(podB, nil)))
	f.Apply(t, f.Slice("agents-2", newPod.Port(t), f.Endpoint(newA, nil)))
	testenv.Eventually(t, 20*time.Second, "discovery to see the new pods", func() bool {
		a := k.Agents()
		return a[gpuA] == newPod.URL && a[gpuB] == oldPod.URL
	})
	newPod.SetAction(t, remediate.Action{ID: "ag1", State: remediate.StateSucceeded})
	d.FollowOnce(t.Context(), st)
	if got := oldPod.Requests(); len(got) != 1 || got[0].Node != gpuA || !remediatetest.SignedFor(got[0].Auth, gpuA, fleetToken) {
		t.Errorf("the old address, gpu-b's agent now, got %+v, want only gpu-a's first webhook", got)
	}
	if n, last := newPod.ActionGets(), newPod.Last(); n != 1 || !remediatetest.SignedFor(last.Auth, gpuA, fleetToken) {
		t.Errorf("gpu-a's agent now was asked %d times (last %+v), want once, signed for gpu-a", n, last)
	}
	got, err := st.Action(t.Context(), id)
	if err != nil {
		t.Fatal(err)
	}
	if got.Agent.URL != newPod.URL || got.Agent.State != remediate.StateSucceeded {
		t.Errorf("the record: %+v, want the result from %s", got.Agent, newPod.URL)
	}

	// Another action of gpu-a, then its agent leaves the slices.
	newPod.SetAction(t, remediate.Action{ID: "ag2", State: remediate.StateRunning})
	newPod.SetReply(`{"alerts":[{"fingerprint":"fp2","result":"accepted","action_id":"ag2"}]}`)
	id2 := remediatetest.ForwardAndStore(t, d, st, gpuA, "fp2")
	f.DeleteSlice(t, "agents-2")
	testenv.Eventually(t, 20*time.Second, "gpu-a to leave discovery", func() bool { _, ok := k.Agents()[gpuA]; return !ok })
	before := len(newPod.Requests())
	d.FollowOnce(t.Context(), st)
	if after := len(newPod.Requests()); after != before {
		t.Errorf("gpu-a's agent, off the slices, got %d more requests", after-before)
	}
	if got := oldPod.Requests(); len(got) != 1 {
		t.Errorf("the old address got %+v", got)
	}
	got, err = st.Action(t.Context(), id2)
	if err != nil {
		t.Fatal(err)
	}
	if got.Agent.State != remediate.StateSkipped || !strings.Contains(got.Agent.Reason, "no allow-list") {
		t.Errorf("the follow-up of gpu-a's second action: %+v, want ended", got.Agent)
	}
}
