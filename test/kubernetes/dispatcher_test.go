//go:build kubernetes

package kubernetes

import (
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpu-orphan/gpu-orphan/internal/sim"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv/kubereal"
	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/app"
	"github.com/gpu-orphan/gpu-orphan/remediate/limits"
	"github.com/gpu-orphan/gpu-orphan/remediate/remediatetest"
)

// fleetToken is the fleet's secret: the agents' --auth.token-file and the
// dispatcher's --dispatch.token-file. The dispatcher signs each webhook
// for its node with a key derived from it, and never sends it.
const fleetToken = "issue25-fleet-secret-0123456789abcdef"

// fleetTokenFile writes fleetToken into a file of the test's own.
func fleetTokenFile(t *testing.T) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "fleet-token")
	if err := os.WriteFile(p, []byte(fleetToken+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// withFleetToken has an in-process dispatcher sign its webhooks with
// fleetToken.
func withFleetToken(t *testing.T) func(*app.Options) {
	token := fleetTokenFile(t)
	return func(o *app.Options) { o.Dispatch.TokenFile = token }
}

// dispatcherCommand is gpu-orphan-dispatcher as the chart's dispatcher
// ServiceAccount (a kubeconfig of its token), webhooks taken without
// credentials, the fleet's token for its agents, its store in storeDir,
// and args: for instance the chart's --dispatch.kubernetes.* flags
// (r.kubernetesFlags).
func dispatcherCommand(t *testing.T, r *release, storeDir string, args ...string) *exec.Cmd {
	t.Helper()
	kubeconfig := r.cp.Kubeconfig(t, r.cp.ServiceAccountToken(t, r.namespace, r.dispatcherName()))
	return exec.Command(testenv.Bin(t, "gpu-orphan-dispatcher"), append([]string{"--auth.insecure-none",
		"--store.path=" + filepath.Join(storeDir, "dispatcher.db"), "--dispatch.kubernetes.kubeconfig=" + kubeconfig,
		"--dispatch.token-file=" + fleetTokenFile(t)}, args...)...)
}

// startDispatcherBinary starts dispatcherCommand on a socket the test
// holds, and returns the process and its base URL once it is ready.
func startDispatcherBinary(t *testing.T, r *release, args ...string) (*exec.Cmd, string) {
	t.Helper()
	cmd := dispatcherCommand(t, r, t.TempDir(), append([]string{"--web.systemd-socket"}, args...)...)
	base := "http://" + testenv.PassListener(t, cmd)
	testenv.DaemonCmd(t, cmd)
	testenv.WaitReady(t, base, "the dispatcher", 30*time.Second)
	return cmd, base
}

// kubernetesFlags are the chart's --dispatch.kubernetes.* flags.
func (r *release) kubernetesFlags(t *testing.T) []string {
	t.Helper()
	var out []string
	for k, v := range r.dispatcherFlags(t) {
		if strings.HasPrefix(k, "dispatch.kubernetes.") {
			out = append(out, "--"+k+"="+v)
		}
	}
	return out
}

// TestDispatcherBinaryDiscoversRealAgent: the dispatcher binary, whose
// only allow-list is Kubernetes discovery (the chart's flags and RBAC),
// and a real node agent (gpu-orphan-remediator on a simulated node, a dry
// run) that its EndpointSlice names: an alert for the agent's node
// reaches it, signed with the fleet's key, and the agent plans it; an
// alert for a node in no slice is rejected, and the listener that
// --dispatch.url-template would name for a node called 127.0.0.1 gets
// nothing. When the agent's slice is deleted, its node is rejected again,
// without a restart.
func TestDispatcherBinaryDiscoversRealAgent(t *testing.T) {
	cp := kubereal.Get(t)
	r, f := chartFleet(t, cp, "binary-discovery", dispatcherValues(false, false))
	root := testenv.SimNode(t, 2)
	w := testenv.StartWorkload(t, root, 1, 1024, 1)
	cmd := exec.Command(testenv.Bin(t, "gpu-orphan-remediator"), "--backend=sim", "--sim.root="+root,
		"--store.path="+filepath.Join(t.TempDir(), "agent.db"), "--auth.token-file="+fleetTokenFile(t), "--node.name=node-a",
		"--collector.interval=200ms", "--remediate.min-age=500ms", "--log.level=debug", "--web.systemd-socket")
	addr := testenv.PassListenerOn(t, cmd, testenv.HostIP(t))
	testenv.DaemonCmd(t, cmd)
	agent := "http://" + addr
	testenv.WaitReady(t, agent, "the node agent", 20*time.Second)
	w.KillParent(t)
	host, port, _ := net.SplitHostPort(addr)
	agentPort, _ := strconv.Atoi(port)
	f.Add(t, "node-a", host, int32(agentPort))
	templated := testenv.NewFakeAgent(t, "127.0.0.1")
	_, base := startDispatcherBinary(t, r, append(r.kubernetesFlags(t),
		"--dispatch.url-template=http://{{.Node}}:"+strconv.Itoa(int(templated.Port(t))),
		"--dispatch.max-nodes=10", "--dispatch.max-fraction=1", "--dispatch.window=1h", "--log.level=debug")...)

	n, err := sim.Load(root)
	if err != nil {
		t.Fatal(err)
	}
	uuid, startsAt := n.GPUs[1].UUID, time.Now().Add(-time.Minute)
	res, err := testenv.PostWebhook(base, "",
		testenv.Alert{Status: "firing", Node: "node-a", UUID: uuid, Fingerprint: "f00d0070", StartsAt: startsAt},
		testenv.Alert{Status: "firing", Node: "node-x", UUID: uuid, Fingerprint: "f00d0071", StartsAt: startsAt},
		testenv.Alert{Status: "firing", Node: "127.0.0.1", UUID: uuid, Fingerprint: "f00d0072", StartsAt: startsAt})
	if err != nil || res["accepted"] != 1 || res["rejected"] != 2 {
		t.Fatalf("results %v (%v), want node-a accepted, node-x and 127.0.0.1 rejected", res, err)
	}
	testenv.Eventually(t, 20*time.Second, "node-a's agent to plan the alert", func() bool {
		as := testenv.Actions[remediate.Action](t, agent, fleetToken)
		return len(as) == 1 && as[0].State == remediate.StateDryRun && as[0].AlertFingerprint == "f00d0070"
	})
	_, mfs := testenv.Scrape(t, base+"/metrics")
	if v, _ := testenv.Value(mfs, "gpu_orphan_dispatcher_discovered_agents", nil); v != 1 {
		t.Errorf("gpu_orphan_dispatcher_discovered_agents = %v, want 1", v)
	}

	// The agent's pod goes away: its slice is deleted.
	f.DeleteSlice(t, f.SliceName("node-a"))
	testenv.Eventually(t, 20*time.Second, "node-a to be forgotten", func() bool {
		_, mfs := testenv.Scrape(t, base+"/metrics")
		v, _ := testenv.Value(mfs, "gpu_orphan_dispatcher_discovered_agents", nil)
		return v == 0
	})
	res, err = testenv.PostWebhook(base, "", testenv.Alert{Status: "firing", Node: "node-a", UUID: uuid, Fingerprint: "f00d0073", StartsAt: startsAt})
	if err != nil || res["rejected"] != 1 {
		t.Errorf("node-a after its slice was deleted: %v (%v), want rejected", res, err)
	}
	// A rejected alert makes no action: nothing is ever sent for it.
	if got := actionsOf(t, base); len(got) != 1 || len(got["node-a"]) != 1 {
		t.Errorf("the dispatcher's actions by node: %v, want node-a's first alert only", got)
	}
	if as := testenv.Actions[remediate.Action](t, agent, fleetToken); len(as) != 1 {
		t.Errorf("the agent has %d actions, want 1", len(as))
	}
	if got := templated.Requests(); len(got) != 0 {
		t.Errorf("the listener that the URL template names got %v", got)
	}
}

// TestTargetsFileWinsOverDiscovery: with both allow-lists, the targets
// file's URL is used for the nodes it names; discovery serves the others.
func TestTargetsFileWinsOverDiscovery(t *testing.T) {
	r, _, fromSlices, nodeB := twoAgents(t, "targets-win", dispatcherValues(false, false))
	fromFile := testenv.NewFakeAgent(t, "127.0.0.1")
	targets := filepath.Join(t.TempDir(), "targets.json")
	if err := os.WriteFile(targets, []byte(`{"node-a": "`+fromFile.URL+`"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	base, _ := startDispatcher(t, r, func(o *app.Options) { o.Dispatch.TargetsFile = targets })
	if res := testenv.MustPostAlerts(t, base, "node-a", "node-b"); res["accepted"] != 2 {
		t.Fatalf("results %v, want 2 accepted", res)
	}
	testenv.Eventually(t, 20*time.Second, "the targets file's agent of node-a, and node-b's discovered one, to get their alerts", func() bool {
		return len(fromFile.Alerts()) == 1 && len(nodeB.Alerts()) == 1
	})
	// node-a's one alert has gone to the targets file's agent.
	if got := fromSlices.Requests(); len(got) != 0 {
		t.Errorf("node-a's discovered agent, which the targets file overrides, got %v", got)
	}
}

// TestFleetCountsDiscoveredNodes: --dispatch.max-fraction is a fraction of
// the known nodes, discovered ones included: with 4 discovered nodes and
// a fraction of 0.5, two nodes are served in the window, and the third is
// held back, queued.
func TestFleetCountsDiscoveredNodes(t *testing.T) {
	r, f, a, b := twoAgents(t, "fleet-fraction", dispatcherValues(false, false))
	c, d := newAgent(t), newAgent(t)
	f.addAgent(t, "node-c", c)
	f.addAgent(t, "node-d", d)
	base, _ := startDispatcher(t, r, func(o *app.Options) {
		o.Dispatch.MaxNodes, o.Dispatch.MaxFraction, o.Dispatch.Window = 100, 0.5, time.Hour
	})
	if res := testenv.MustPostAlerts(t, base, "node-a", "node-b", "node-c"); res["accepted"] != 3 {
		t.Fatalf("results %v, want 3 accepted", res)
	}
	var held string
	testenv.Eventually(t, 20*time.Second, "two nodes served and the third held back", func() bool {
		served := 0
		for node, as := range actionsOf(t, base) {
			switch {
			case len(as) != 1:
				return false
			case as[0].State == remediate.StateSucceeded:
				served++
			case as[0].State == remediate.StateQueued && strings.Contains(as[0].Reason, limits.LimitFleetRate):
				held = node
			}
		}
		return served == 2 && held != ""
	})
	agents := map[string]*testenv.FakeAgent{"node-a": a, "node-b": b, "node-c": c}
	for node, ag := range agents {
		if want := map[bool]int{true: 0, false: 1}[node == held]; len(ag.Alerts()) != want {
			t.Errorf("%s's agent got %v, want %d alerts (%s held back: half of 4 known nodes served)", node, ag.Alerts(), want, held)
		}
	}
}

// TestDiscoveryWaitsForFirstList: the dispatcher serves only once the
// first list is in, however slow: while the API server's answer is held
// back (a proxy holds the dispatcher's connections for 2 s), it does not
// serve; an alert that comes as soon as it serves, for a node in a
// slice, is accepted, not rejected.
func TestDiscoveryWaitsForFirstList(t *testing.T) {
	cp := kubereal.Get(t)
	r, f := chartFleet(t, cp, "first-list", dispatcherValues(false, false))
	a := newAgent(t)
	f.addAgent(t, "node-a", a)
	proxy := newAPIProxy(t, cp.URL)
	proxy.Cut(true)
	addr, servedEarly := make(chan string, 1), make(chan bool, 1)
	go func() {
		base := <-addr
		// The slow answer: the dispatcher's first request waits 2 s.
		for deadline := time.Now().Add(testenv.Scale(time.Minute)); proxy.heldFor() < 2*time.Second && time.Now().Before(deadline); {
			time.Sleep(20 * time.Millisecond)
		}
		servedEarly <- testenv.Healthy(base)
		proxy.Release()
	}()
	base, _ := startDispatcher(t, r, func(o *app.Options) {
		proxied(t, proxy, &logLines{})(o)
		addr <- "http://" + (*o.Web.WebListenAddresses)[0]
	})
	if <-servedEarly {
		t.Error("the dispatcher served while its first list was held back")
	}
	if res := testenv.MustPostAlerts(t, base, "node-a"); res["accepted"] != 1 {
		t.Fatalf("results %v: node-a was rejected before the first list was in", res)
	}
	testenv.Eventually(t, 20*time.Second, "node-a's agent to get its alert", func() bool { return len(a.Alerts()) == 1 })
}

// TestForgedSlicesNameNoAgent: issues 16 and 24. Whoever may write
// EndpointSlices wrote slices with the agents' Service label: discovery
// used to accept them, and their listeners got the alerts (and, before
// the signatures, the token). A slice that the EndpointSlice controller
// did not make for the Service (no managed-by label, or the mirroring
// controller's), and an endpoint that points at a Node, name no agent.
// Nor does a slice with the controller's label copied and the Service as
// owner, unless its endpoint names a pod that exists, is controlled by
// the agents' DaemonSet (name and UID), runs on the endpoint's node, and
// has the endpoint's address and port. The forged slices for node-a name
// an address lower than the genuine agent's (the dispatcher picks the
// lowest): taken, they would win. The genuine agent gets node-a's alert,
// signed for node-a; the other nodes are rejected, and no forged listener
// gets a request.
func TestForgedSlicesNameNoAgent(t *testing.T) {
	cp := kubereal.Get(t)
	r, f := chartFleet(t, cp, "forged", dispatcherValues(false, false))
	ip := testenv.HostIP(t)
	genuine := newAgent(t)
	genuinePod := f.addAgent(t, "node-a", genuine)
	// An address below any the genuine agent can have, which an
	// EndpointSlice may hold (not loopback, not unspecified).
	const lower = "0.0.0.1"

	forged := map[string]*testenv.FakeAgent{}
	// forge writes slice name for listener l: its one endpoint names pod,
	// on node, at address; edit, when not nil, changes the slice.
	forge := func(name, node string, pod *corev1.Pod, address string, l *testenv.FakeAgent, edit func(*discoveryv1.EndpointSlice)) {
		t.Helper()
		forged[name] = l
		e := f.Endpoint(pod, ptr(true))
		e.NodeName, e.Addresses = ptr(node), []string{address}
		s := f.Slice("forged-"+strings.ToLower(strings.ReplaceAll(name, " ", "-")), l.Port(t), e)
		if edit != nil {
			edit(s)
		}
		f.Apply(t, s)
	}
	ghost := genuinePod.DeepCopy()
	ghost.Name, ghost.UID = "ghost", ""
	forge("no pod", "node-a", ghost, lower, newAgent(t), nil)
	forge("the genuine pod at another address", "node-a", genuinePod, lower, newAgent(t), nil)
	// forgeFor is forge of an agent pod on podNode, real, at the listener's
	// address and port (editPod, when not nil, changes it): each check
	// alone must refuse its slice.
	forgeFor := func(name, node, podNode string, editPod func(*corev1.Pod), edit func(*discoveryv1.EndpointSlice)) {
		t.Helper()
		l := newAgent(t)
		p := f.AddPod(t, podNode, ip, l.Port(t))
		if editPod != nil {
			editPod(p)
			var err error
			if p, err = f.Admin.CoreV1().Pods(p.Namespace).Update(t.Context(), p, metav1.UpdateOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		forge(name, node, p, ip, l, edit)
	}
	forgeFor("a pod on another node", "node-b", "node-c", nil, nil)
	forgeFor("a pod not of the DaemonSet", "node-d", "node-d", func(p *corev1.Pod) {
		p.OwnerReferences = []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "ReplicaSet", Name: "notebook-7d9f", UID: "uid-rs", Controller: ptr(true)}}
	}, nil)
	forgeFor("a made-up DaemonSet UID", "node-e", "node-e", func(p *corev1.Pod) { p.OwnerReferences[0].UID = "uid-made-up" }, nil)
	forgeFor("a hand-written slice", "node-f", "node-f", nil, func(s *discoveryv1.EndpointSlice) {
		delete(s.Labels, discoveryv1.LabelManagedBy)
		s.OwnerReferences = nil
	})
	forgeFor("a mirrored slice", "node-m", "node-m", nil, func(s *discoveryv1.EndpointSlice) {
		s.Labels[discoveryv1.LabelManagedBy] = "endpointslicemirroring-controller.k8s.io"
	})
	forgeFor("an endpoint pointing at a Node", "node-n", "node-n", nil, func(s *discoveryv1.EndpointSlice) {
		s.Endpoints[0].TargetRef = &corev1.ObjectReference{Kind: "Node", Name: "node-n"}
	})

	base, _ := startDispatcher(t, r, withFleetToken(t))
	rejected := []string{"node-b", "node-d", "node-e", "node-f", "node-m", "node-n"}
	if res := testenv.MustPostAlerts(t, base, append([]string{"node-a"}, rejected...)...); res["accepted"] != 1 || res["rejected"] != len(rejected) {
		t.Fatalf("results %v, want node-a accepted; %v rejected", res, rejected)
	}
	testenv.Eventually(t, 20*time.Second, "node-a's genuine agent to get its alert", func() bool { return len(genuine.Requests()) == 1 })
	if got := genuine.Requests()[0]; got.Method != http.MethodPost || got.Node != "node-a" || !remediatetest.SignedFor(got.Auth, "node-a", fleetToken) {
		t.Errorf("the genuine agent got %+v, want node-a's alert signed for it, without the token", got)
	}
	// A rejected alert makes no action: nothing is ever sent for it.
	if got := actionsOf(t, base); len(got) != 1 || len(got["node-a"]) != 1 {
		t.Errorf("the dispatcher's actions by node: %v, want node-a's only", got)
	}
	for name, l := range forged {
		if got := l.Requests(); len(got) != 0 {
			t.Errorf("the listener of the forged slice (%s) got %v", name, got)
		}
	}
	_, mfs := testenv.Scrape(t, base+"/metrics")
	if v, _ := testenv.Value(mfs, "gpu_orphan_dispatcher_discovered_agents", nil); v != 1 {
		t.Errorf("gpu_orphan_dispatcher_discovered_agents = %v, want 1", v)
	}
}
