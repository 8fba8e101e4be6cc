package dispatcher

import (
	"context"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv/kubeapi"
	"github.com/gpu-orphan/gpu-orphan/remediate/app"
	"github.com/gpu-orphan/gpu-orphan/remediate/intake"
)

// agentListenerOn is newAgentListener on another loopback address.
func agentListenerOn(t *testing.T, ip string) *agentListener {
	t.Helper()
	l, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		t.Fatal(err)
	}
	a := newUnstartedAgentListener()
	a.Listener.Close()
	a.Listener = l
	a.Start()
	t.Cleanup(a.Close)
	return a
}

// TestForgedSliceWithCopiedOwnerNamesNoAgent: issue 24, item 2, against
// the test API server internal/testenv/kubeapi (not a real kube-apiserver).
// Whoever may write EndpointSlices copied the controller's managed-by label
// and made up the Service as owner: such a slice for node-a, at a lower
// address than the genuine agent's, used to win (the dispatcher picks the
// lowest), and slices for nodes without an agent made them known. Now an
// endpoint is an agent only if its targetRef names a pod that exists, is
// controlled by the agents' DaemonSet (name and UID), runs on the
// endpoint's node, and has the endpoint's address and port: node-a's alert
// goes to its genuine agent, the others are rejected, and the forged
// listeners get nothing.
func TestForgedSliceWithCopiedOwnerNamesNoAgent(t *testing.T) {
	api := kubeapi.Start(t, agentsNamespace)
	ds := api.AddDaemonSet(agentsService)
	genuine := agentListenerOn(t, "127.0.0.2")
	api.AddPod(kubeapi.AgentPod("agent-node-a", ds, "node-a", "127.0.0.2", "remediator", genuine.port(t)))
	api.Apply(kubeapi.Slice("agents-node-a", agentsService, "remediator", genuine.port(t), kubeapi.Endpoint("node-a", "127.0.0.2", ptr.To(true))))
	// node-c's genuine pod, in no slice; a user's notebook on node-d; a
	// pod on node-e that names the DaemonSet with a made-up UID.
	api.AddPod(kubeapi.AgentPod("agent-node-c", ds, "node-c", "127.0.0.3", "remediator", 10836))
	notebook := kubeapi.AgentPod("notebook", ds, "node-d", "127.0.0.1", "remediator", 10836)
	notebook.OwnerReferences = []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "ReplicaSet", Name: "notebook-7d9f", UID: "uid-rs", Controller: ptr.To(true)}}
	fakeOwner := kubeapi.AgentPod("agent-node-e", ds, "node-e", "127.0.0.1", "remediator", 10836)
	fakeOwner.OwnerReferences[0].UID = "uid-made-up"

	forged := map[string]*agentListener{}
	forge := func(name, node, pod string, add *corev1.Pod) {
		l := newAgentListener(t)
		forged[name] = l
		if add != nil {
			add = add.DeepCopy()
			add.Spec.Containers[0].Ports[0].ContainerPort = l.port(t)
			api.AddPod(add)
		}
		e := kubeapi.Endpoint(node, "127.0.0.1", ptr.To(true))
		e.TargetRef.Name = pod
		// kubeapi.Slice copies the controller's label and names the
		// Service as controlling owner, with a made-up UID.
		api.Apply(kubeapi.Slice("forged-"+name, agentsService, "remediator", l.port(t), e))
	}
	forge("no pod", "node-a", "ghost", nil)
	forge("the genuine pod, another address", "node-a", "agent-node-a", nil)
	forge("a pod on another node", "node-b", "agent-node-c", nil)
	forge("a pod not of the DaemonSet", "node-d", "notebook", notebook)
	forge("a made-up DaemonSet UID", "node-e", "agent-node-e", fakeOwner)

	base := startDispatcher(t, api, "", nil)
	if r := postAlerts(t, base, "node-a", "node-b", "node-d", "node-e"); r["accepted"] != 1 || r["rejected"] != 3 {
		t.Fatalf("results %v, want node-a accepted; node-b, node-d and node-e rejected", r)
	}
	waitReceived(t, genuine, 1, "node-a's genuine agent to get its alert")
	for name, l := range forged {
		if got := l.received(); len(got) != 0 {
			t.Errorf("the listener of the forged slice (%s) got %v", name, got)
		}
	}
	_, mfs := testenv.Scrape(t, base+"/metrics")
	if v, _ := testenv.Value(mfs, "gpu_orphan_dispatcher_discovered_agents", nil); v != 1 {
		t.Errorf("gpu_orphan_dispatcher_discovered_agents = %v, want 1", v)
	}
}

// TestPodsForbiddenFailsStart: without RBAC get on pods the dispatcher
// cannot check its agents, does not start, and says what it needs.
func TestPodsForbiddenFailsStart(t *testing.T) {
	api := kubeapi.Start(t, agentsNamespace)
	a := newAgentListener(t)
	applyAgent(t, api, "node-a", a, ptr.To(true))
	api.ForbidPods(true)
	wc := webConfig(t)
	o := app.Options{Web: wc, Auth: intake.AuthConfig{InsecureNone: true}, NodeLabel: "node",
		StorePath: t.TempDir() + "/d.db",
		Dispatch: app.Dispatch{Timeout: time.Second, Kubernetes: app.Kubernetes{Service: agentsService, Namespace: agentsNamespace,
			PortName: "remediator", Scheme: "http", Kubeconfig: api.Kubeconfig(t), SyncTimeout: 10 * time.Second}}}
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- Run(ctx, o, Escalate{}) }()
	var err error
	testenv.Eventually(t, 20*time.Second, "the dispatcher to refuse to start", func() bool {
		select {
		case err = <-done:
			return true
		default:
		}
		if resp, e := http.Get("http://" + (*wc.WebListenAddresses)[0] + "/-/healthy"); e == nil {
			resp.Body.Close()
			t.Fatal("the dispatcher started without RBAC get on pods")
		}
		return false
	})
	for _, says := range []string{"get on pods", "daemonsets"} {
		if err == nil || !strings.Contains(err.Error(), says) {
			t.Errorf("Run without RBAC for pods: %v; want it to say %q", err, says)
		}
	}
}
