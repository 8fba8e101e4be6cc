package remediate_test

import (
	"errors"
	"net"
	"net/http"
	"net/url"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"k8s.io/utils/ptr"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv/kubeapi"
	"github.com/gpu-orphan/gpu-orphan/remediate"
)

// TestDispatcherKubernetesDiscovery: the real dispatcher binary, whose
// only allow-list is Kubernetes discovery, lists and watches the agents'
// EndpointSlices on an API server over HTTP (through a kubeconfig). An
// alert for the node that a ready endpoint names reaches that node's real
// agent, which plans it; an alert for a node in no slice is rejected, and
// the listener standing for that node gets nothing. When the agent's
// slice is deleted, its node is rejected again, without a restart.
func TestDispatcherKubernetesDiscovery(t *testing.T) {
	skipShort(t)
	t.Parallel()
	const ns, service = "gpu-orphan", "gpu-orphan-node"
	root := testenv.SimNode(t, 2)
	w := testenv.StartWorkload(t, root, 1, 1024, 1)
	agent, _ := startAgent(t, root, filepath.Join(t.TempDir(), "a.db"), "--node.name=node-a")
	w.KillParent(t)
	u, err := url.Parse(agent)
	if err != nil {
		t.Fatal(err)
	}
	host, port, _ := net.SplitHostPort(u.Host)
	agentPort, _ := strconv.Atoi(port)
	undiscovered, got := listenerOn(t, "127.0.0.1", http.StatusOK)

	api := kubeapi.Start(t, ns)
	// The agent is a pod of the agents' DaemonSet on node-a (issue 24,
	// item 2: discovery checks the endpoint's targetRef).
	ds := api.AddDaemonSet(service)
	api.AddPod(kubeapi.AgentPod("agent-node-a", ds, "node-a", host, "remediator", int32(agentPort)))
	api.Apply(kubeapi.Slice("gpu-orphan-node-x7k2p", service, "remediator", int32(agentPort), kubeapi.Endpoint("node-a", host, ptr.To(true))))
	addr := testenv.FreeAddr(t)
	testenv.Daemon(t, testenv.Bin(t, "gpu-orphan-dispatcher"), "--web.listen-address="+addr,
		"--auth.token-file="+tokenFile(t), "--dispatch.token-file="+tokenFile(t),
		"--dispatch.kubernetes.service="+service, "--dispatch.kubernetes.namespace="+ns,
		"--dispatch.kubernetes.kubeconfig="+api.Kubeconfig(t),
		// Would reach the undiscovered listener for a node named 127.0.0.1.
		"--dispatch.url-template=http://{{.Node}}:"+undiscoveredPort(t, undiscovered.Listener.Addr()),
		"--dispatch.max-nodes=10", "--dispatch.max-fraction=1", "--dispatch.window=1h",
		"--store.path="+filepath.Join(t.TempDir(), "d.db"), "--log.level=debug")
	dispatcher := "http://" + addr
	waitReady(t, http.DefaultClient, dispatcher)

	startsAt := time.Now().Add(-time.Minute)
	uuid := gpuUUID(t, root, 1)
	code, body := post(t, dispatcher, token, payload(
		alert("firing", "node-a", uuid, fp(70), startsAt),
		alert("firing", "node-x", uuid, fp(71), startsAt),
		alert("firing", "127.0.0.1", uuid, fp(72), startsAt),
	))
	if code != http.StatusOK {
		t.Fatalf("dispatcher: %d %s", code, body)
	}
	if r := results(t, body); r["accepted"] != 1 || r["rejected"] != 2 {
		t.Errorf("results %v, want node-a accepted, node-x and 127.0.0.1 rejected", r)
	}
	testenv.Eventually(t, 20*time.Second, "node-a's agent to plan the alert", func() bool {
		as := actions(t, agent)
		return len(as) == 1 && as[0].State == remediate.StateDryRun && as[0].AlertFingerprint == fp(70)
	})
	_, mfs := testenv.Scrape(t, dispatcher+"/metrics")
	if v, _ := testenv.Value(mfs, "gpu_orphan_dispatcher_discovered_agents", nil); v != 1 {
		t.Errorf("gpu_orphan_dispatcher_discovered_agents = %v, want 1", v)
	}

	// The agent's pod goes away: its slice is deleted.
	api.Delete("gpu-orphan-node-x7k2p")
	testenv.Eventually(t, 20*time.Second, "node-a to be rejected", func() bool {
		_, mfs := testenv.Scrape(t, dispatcher+"/metrics")
		v, _ := testenv.Value(mfs, "gpu_orphan_dispatcher_discovered_agents", nil)
		return v == 0
	})
	code, body = post(t, dispatcher, token, payload(alert("firing", "node-a", uuid, fp(73), startsAt)))
	if code != http.StatusOK || results(t, body)["rejected"] != 1 {
		t.Errorf("node-a after its slice was deleted: %d %s, want rejected", code, body)
	}
	time.Sleep(2 * time.Second) // long enough for a forward
	if as := actions(t, agent); len(as) != 1 {
		t.Errorf("the agent has %d actions, want 1", len(as))
	}
	if g := got.get(); len(g) != 0 {
		t.Errorf("the undiscovered listener got %d requests, first: %s", len(g), g[0].authz)
	}
}

func undiscoveredPort(t *testing.T, a net.Addr) string {
	t.Helper()
	_, port, err := net.SplitHostPort(a.String())
	if err != nil {
		t.Fatal(err)
	}
	return port
}

// TestDispatcherKubernetesForbidden: the real binary, without RBAC for
// the slices, exits at start-up with an error that names the permission
// it needs, well before the sync timeout.
func TestDispatcherKubernetesForbidden(t *testing.T) {
	skipShort(t)
	t.Parallel()
	api := kubeapi.Start(t, "gpu-orphan")
	api.Forbid(true)
	cmd := exec.Command(testenv.Bin(t, "gpu-orphan-dispatcher"), "--web.listen-address="+testenv.FreeAddr(t),
		"--auth.token-file="+tokenFile(t), "--dispatch.kubernetes.service=gpu-orphan-node", "--dispatch.kubernetes.namespace=gpu-orphan",
		"--dispatch.kubernetes.kubeconfig="+api.Kubeconfig(t), "--dispatch.kubernetes.sync-timeout=30s",
		"--store.path="+filepath.Join(t.TempDir(), "d.db"))
	began := time.Now()
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 1 {
		t.Fatalf("exit: %v, want status 1\n%s", err, out)
	}
	if took := time.Since(began); took > 20*time.Second {
		t.Errorf("failing took %s, want well before the 30s sync timeout", took)
	}
	if !strings.Contains(string(out), "needs RBAC verbs list and watch on endpointslices (API group discovery.k8s.io)") {
		t.Errorf("the log does not name the permission:\n%s", out)
	}
}
