package dispatcher

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"k8s.io/utils/ptr"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv/kubeapi"
	"github.com/gpu-orphan/gpu-orphan/remediate/app"
	"github.com/gpu-orphan/gpu-orphan/remediate/intake"
)

const (
	agentsNamespace = "gpu-orphan"
	agentsService   = "gpu-orphan-node"
)

// agentListener is a real HTTP listener standing for one node's agent: it
// counts the webhooks it gets and accepts them.
type agentListener struct {
	*httptest.Server
	mu    sync.Mutex
	nodes []string // the node label of each alert received
}

func newAgentListener(t *testing.T) *agentListener {
	t.Helper()
	a := newUnstartedAgentListener()
	a.Start()
	t.Cleanup(a.Close)
	return a
}

func newUnstartedAgentListener() *agentListener {
	a := &agentListener{}
	a.Server = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var msg intake.Message
		if err := json.NewDecoder(r.Body).Decode(&msg); err != nil || msg.Data == nil || len(msg.Alerts) != 1 {
			http.Error(w, "bad webhook", http.StatusBadRequest)
			return
		}
		a.mu.Lock()
		a.nodes = append(a.nodes, msg.Alerts[0].Labels["node"])
		a.mu.Unlock()
		_, _ = w.Write([]byte(`{"received":1}`))
	}))
	return a
}

func (a *agentListener) received() []string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]string(nil), a.nodes...)
}

func (a *agentListener) port(t *testing.T) int32 {
	t.Helper()
	_, p, _ := net.SplitHostPort(a.Listener.Addr().String())
	n, err := strconv.Atoi(p)
	if err != nil {
		t.Fatal(err)
	}
	return int32(n)
}

// applyAgent puts node's agent, at the listener, in a slice of its own
// (each listener has its own port, and a slice's ports are the slice's).
func applyAgent(t *testing.T, api *kubeapi.Server, node string, a *agentListener, ready *bool) {
	t.Helper()
	addAgentPod(api, node, a.port(t))
	api.Apply(kubeapi.Slice("agents-"+node, agentsService, "remediator", a.port(t), kubeapi.Endpoint(node, "127.0.0.1", ready)))
}

// addAgentPod adds the pod of the agents' DaemonSet (named as the Service,
// the dispatcher's default) on node, at 127.0.0.1:port, that
// kubeapi.Endpoint(node, "127.0.0.1", ...) names.
func addAgentPod(api *kubeapi.Server, node string, port int32) {
	ds := api.AddDaemonSet(agentsService)
	api.AddPod(kubeapi.AgentPod("agent-"+node, ds, node, "127.0.0.1", "remediator", port))
}

// startDispatcher runs a dispatcher in this process with Kubernetes
// discovery through api; targets is its targets file, or "". It has no
// fleet limit (no window) unless tune sets one.
func startDispatcher(t *testing.T, api *kubeapi.Server, targets string, tune func(*app.Options)) string {
	t.Helper()
	wc := webConfig(t)
	o := app.Options{
		Web: wc, Auth: intake.AuthConfig{InsecureNone: true}, NodeLabel: "node", UUIDLabel: "uuid",
		StorePath: filepath.Join(t.TempDir(), "d.db"), Logger: testLogger(t),
		Dispatch: app.Dispatch{TargetsFile: targets, Timeout: 5 * time.Second, MaxAttempts: 1,
			Kubernetes: app.Kubernetes{Service: agentsService, Namespace: agentsNamespace, PortName: "remediator", Scheme: "http",
				Kubeconfig: api.Kubeconfig(t), SyncTimeout: 10 * time.Second}},
	}
	if tune != nil {
		tune(&o)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- Run(ctx, o, Escalate{}) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("the dispatcher ended with %v", err)
			}
		case <-time.After(15 * time.Second):
			t.Error("the dispatcher did not stop")
		}
	})
	base := "http://" + (*wc.WebListenAddresses)[0]
	testenv.Eventually(t, 30*time.Second, "the dispatcher to serve", func() bool {
		select {
		case err := <-done:
			t.Fatalf("the dispatcher stopped: %v", err)
		default:
		}
		resp, err := http.Get(base + "/-/healthy")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	return base
}

// testLogger logs to the test's log, shown when it fails.
func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(b []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(b)))
	return len(b), nil
}

var alertSeq int

// postAlerts posts one webhook with a firing alert per node and returns
// the counts by result.
func postAlerts(t *testing.T, base string, nodes ...string) map[string]int {
	t.Helper()
	var alerts []map[string]any
	for _, node := range nodes {
		alertSeq++
		alerts = append(alerts, map[string]any{
			"status": "firing", "labels": map[string]string{"alertname": "GPUOrphanMemory", "node": node, "uuid": "GPU-" + strconv.Itoa(alertSeq)},
			"annotations": map[string]string{}, "startsAt": time.Now().Add(-time.Minute).Format(time.RFC3339Nano),
			"endsAt": "0001-01-01T00:00:00Z", "generatorURL": "http://prometheus", "fingerprint": fmt.Sprintf("%016x", alertSeq),
		})
	}
	body, _ := json.Marshal(map[string]any{"version": "4", "groupKey": "{}:{}", "truncatedAlerts": 0, "status": "firing", "receiver": "gpu-orphan",
		"groupLabels": map[string]string{}, "commonLabels": map[string]string{}, "commonAnnotations": map[string]string{},
		"externalURL": "http://alertmanager", "alerts": alerts})
	resp, err := http.Post(base+"/api/v1/alerts", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var reply struct {
		Results map[string]int `json:"results"`
	}
	if resp.StatusCode != http.StatusOK || json.Unmarshal(b, &reply) != nil {
		t.Fatalf("webhook: %d %s", resp.StatusCode, b)
	}
	return reply.Results
}

func waitReceived(t *testing.T, a *agentListener, n int, what string) {
	t.Helper()
	testenv.Eventually(t, 20*time.Second, what, func() bool { return len(a.received()) >= n })
}

// wantNothing waits long enough for a forward (the dispatcher's queue
// runs at once), then checks that a listener got nothing more than before.
func wantNothing(t *testing.T, a *agentListener, before int, what string) {
	t.Helper()
	time.Sleep(time.Second)
	if got := a.received(); len(got) != before {
		t.Errorf("%s received %d webhooks, want %d: %v", what, len(got), before, got)
	}
}

// TestDiscoveredAgents: a dispatcher whose only allow-list is Kubernetes
// discovery, against an API server over HTTP and real listeners as the
// agents. A node in a slice, ready, is served at its URL; a node in no
// slice is rejected, and neither its listener nor a listener that the URL
// template would reach gets anything; an endpoint that is not ready, or
// has no nodeName, is not used; a DELETED slice makes its node unknown
// again, and a MODIFIED one that adds a node makes it known, without a
// restart.
func TestDiscoveredAgents(t *testing.T) {
	api := kubeapi.Start(t, agentsNamespace)
	nodeA, nodeB, nodeX, notReady, noNode := newAgentListener(t), newAgentListener(t), newAgentListener(t), newAgentListener(t), newAgentListener(t)
	applyAgent(t, api, "node-a", nodeA, ptr.To(true))
	applyAgent(t, api, "node-n", notReady, ptr.To(false))
	api.Apply(kubeapi.Slice("agents-nameless", agentsService, "remediator", noNode.port(t), kubeapi.Endpoint("", "127.0.0.1", nil)))
	base := startDispatcher(t, api, "", func(o *app.Options) {
		// Would reach nodeX's listener for an alert naming 127.0.0.1.
		o.Dispatch.URLTemplate = "http://{{.Node}}:" + strconv.Itoa(int(nodeX.port(t)))
	})

	if r := postAlerts(t, base, "node-a", "node-x", "127.0.0.1", "node-n"); r["accepted"] != 1 || r["rejected"] != 3 {
		t.Fatalf("results %v, want node-a accepted; node-x, 127.0.0.1 and node-n rejected", r)
	}
	waitReceived(t, nodeA, 1, "node-a's agent to get its alert")
	wantNothing(t, nodeX, 0, "the listener of node-x, in no slice")
	wantNothing(t, notReady, 0, "the agent whose endpoint is not ready")
	wantNothing(t, noNode, 0, "the agent whose endpoint has no nodeName")
	_, mfs := testenv.Scrape(t, base+"/metrics")
	if v, _ := testenv.Value(mfs, "gpu_orphan_dispatcher_discovered_agents", nil); v != 1 {
		t.Errorf("gpu_orphan_dispatcher_discovered_agents = %v, want 1", v)
	}

	// node-a's pod goes: its slice is deleted.
	api.Delete("agents-node-a")
	testenv.Eventually(t, 10*time.Second, "node-a to be rejected", func() bool {
		return postAlerts(t, base, "node-a")["rejected"] == 1
	})
	wantNothing(t, nodeA, 1, "node-a's agent, after its slice was deleted")

	// node-b's agent becomes ready in node-n's slice: MODIFIED.
	addAgentPod(api, "node-b", nodeB.port(t))
	api.Apply(kubeapi.Slice("agents-node-n", agentsService, "remediator", nodeB.port(t),
		kubeapi.Endpoint("node-n", "127.0.0.1", ptr.To(false)), kubeapi.Endpoint("node-b", "127.0.0.1", ptr.To(true))))
	testenv.Eventually(t, 10*time.Second, "node-b to be accepted", func() bool {
		return postAlerts(t, base, "node-b")["accepted"] == 1
	})
	waitReceived(t, nodeB, 1, "node-b's agent to get its alert")
	if got := nodeB.received(); got[0] != "node-b" {
		t.Errorf("node-b's agent got an alert for %v", got)
	}
}

// TestDiscoveryWaitsForFirstList: the dispatcher serves only once the
// first list is in, however slow: an alert that comes as soon as it
// serves, for a node in a slice, is accepted, not rejected.
func TestDiscoveryWaitsForFirstList(t *testing.T) {
	api := kubeapi.Start(t, agentsNamespace, kubeapi.Delay(2*time.Second))
	nodeA := newAgentListener(t)
	applyAgent(t, api, "node-a", nodeA, ptr.To(true))
	base := startDispatcher(t, api, "", nil)
	if r := postAlerts(t, base, "node-a"); r["accepted"] != 1 {
		t.Fatalf("results %v: node-a was rejected before the first list was in", r)
	}
	waitReceived(t, nodeA, 1, "node-a's agent to get its alert")
}

// TestTargetsFileWinsOverDiscovery: with both allow-lists, the targets
// file's URL is used for the nodes it names; discovery serves the others.
func TestTargetsFileWinsOverDiscovery(t *testing.T) {
	api := kubeapi.Start(t, agentsNamespace)
	fromFile, fromSlices, nodeB := newAgentListener(t), newAgentListener(t), newAgentListener(t)
	applyAgent(t, api, "node-a", fromSlices, ptr.To(true))
	applyAgent(t, api, "node-b", nodeB, ptr.To(true))
	targets := filepath.Join(t.TempDir(), "targets.json")
	if err := os.WriteFile(targets, []byte(`{"node-a": "`+fromFile.URL+`"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	base := startDispatcher(t, api, targets, nil)
	if r := postAlerts(t, base, "node-a", "node-b"); r["accepted"] != 2 {
		t.Fatalf("results %v, want 2 accepted", r)
	}
	waitReceived(t, fromFile, 1, "the targets file's agent of node-a")
	waitReceived(t, nodeB, 1, "node-b's discovered agent")
	wantNothing(t, fromSlices, 0, "node-a's discovered agent, which the targets file overrides")
}

// TestFleetCountsDiscoveredNodes: --dispatch.max-fraction is a fraction of
// the known nodes, discovered ones included: with 4 discovered nodes and
// a fraction of 0.5, two nodes are served in the window, and the third is
// held back.
func TestFleetCountsDiscoveredNodes(t *testing.T) {
	api := kubeapi.Start(t, agentsNamespace)
	var agents []*agentListener
	for _, node := range []string{"node-a", "node-b", "node-c", "node-d"} {
		a := newAgentListener(t)
		applyAgent(t, api, node, a, ptr.To(true))
		agents = append(agents, a)
	}
	base := startDispatcher(t, api, "", func(o *app.Options) {
		o.Dispatch.MaxNodes, o.Dispatch.MaxFraction, o.Dispatch.Window = 100, 0.5, time.Hour
	})
	if r := postAlerts(t, base, "node-a", "node-b", "node-c"); r["accepted"] != 3 {
		t.Fatalf("results %v, want 3 accepted", r)
	}
	testenv.Eventually(t, 20*time.Second, "two nodes' agents to get their alerts", func() bool {
		return len(agents[0].received())+len(agents[1].received())+len(agents[2].received()) >= 2
	})
	time.Sleep(time.Second)
	if n := len(agents[0].received()) + len(agents[1].received()) + len(agents[2].received()); n != 2 {
		t.Errorf("%d nodes' agents got alerts, want 2 (half of 4 known nodes)", n)
	}
}

// TestForbiddenDiscoveryFailsStart: without RBAC for the slices, the
// dispatcher does not start, says which permission it needs, and leaves
// no audit database behind.
func TestForbiddenDiscoveryFailsStart(t *testing.T) {
	api := kubeapi.Start(t, agentsNamespace)
	api.Forbid(true)
	storeDir := filepath.Join(t.TempDir(), "var")
	o := app.Options{Web: webConfig(t), Auth: intake.AuthConfig{InsecureNone: true}, NodeLabel: "node",
		StorePath: filepath.Join(storeDir, "d.db"),
		Dispatch: app.Dispatch{Timeout: time.Second, Kubernetes: app.Kubernetes{Service: agentsService, Namespace: agentsNamespace,
			PortName: "remediator", Scheme: "http", Kubeconfig: api.Kubeconfig(t), SyncTimeout: 10 * time.Second}}}
	err := Run(t.Context(), o, Escalate{})
	if err == nil {
		t.Fatal("the dispatcher started without the permission to list its agents")
	}
	for _, says := range []string{"list", "watch", "endpointslices", "discovery.k8s.io"} {
		if !strings.Contains(err.Error(), says) {
			t.Errorf("the error does not say %q: %v", says, err)
		}
	}
	if _, err := os.Stat(storeDir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a failed start left %s behind (stat: %v)", storeDir, err)
	}
}
