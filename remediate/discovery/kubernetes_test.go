package discovery

import (
	"context"
	"log/slog"
	"maps"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/utils/ptr"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv/kubeapi"
)

const (
	ns      = "gpu-orphan"
	service = "gpu-orphan-node"
)

var (
	ready    = ptr.To(true)
	notReady = ptr.To(false)
)

// TestPickAgents: which endpoint is a node's agent, and at which URL.
func TestPickAgents(t *testing.T) {
	ep := kubeapi.Endpoint
	ipv6 := kubeapi.Slice("v6", service, "remediator", 10836, ep("gpu-v6", "fd00::5", ready))
	ipv6.AddressType = discoveryv1.AddressTypeIPv6
	// Slices and endpoints that name no agent (issue 16): only the
	// EndpointSlice controller's slices of the Service, and endpoints that
	// point at a Pod of the slice's namespace.
	handMade := kubeapi.Slice("hand-made", service, "remediator", 10836, ep("gpu-a", "10.0.0.66", ready))
	delete(handMade.Labels, discoveryv1.LabelManagedBy)
	mirrored := kubeapi.Slice("mirrored", service, "remediator", 10836, ep("gpu-a", "10.0.0.66", ready))
	mirrored.Labels[discoveryv1.LabelManagedBy] = "endpointslicemirroring-controller.k8s.io"
	otherOwner := kubeapi.Slice("other-owner", service, "remediator", 10836, ep("gpu-a", "10.0.0.66", ready))
	otherOwner.OwnerReferences[0].Name = "some-other-service"
	noOwner := kubeapi.Slice("no-owner", service, "remediator", 10836, ep("gpu-a", "10.0.0.66", ready))
	noOwner.OwnerReferences = nil
	notController := kubeapi.Slice("not-controller", service, "remediator", 10836, ep("gpu-a", "10.0.0.66", ready))
	notController.OwnerReferences[0].Controller = nil
	noTarget, nodeTarget, otherNamespace := ep("gpu-a", "10.0.0.66", ready), ep("gpu-a", "10.0.0.67", ready), ep("gpu-a", "10.0.0.68", ready)
	noTarget.TargetRef = nil
	nodeTarget.TargetRef.Kind = "Node"
	otherNamespace.TargetRef.Namespace = "elsewhere"
	for _, tc := range []struct {
		name   string
		slices []*discoveryv1.EndpointSlice
		scheme string
		want   map[string]string
	}{
		{"ready, and unset readiness (ready in the API)", []*discoveryv1.EndpointSlice{kubeapi.Slice("s", service, "remediator", 10836,
			ep("gpu-a", "10.0.0.5", ready), ep("gpu-b", "10.0.0.6", nil))}, "http",
			map[string]string{"gpu-a": "http://10.0.0.5:10836", "gpu-b": "http://10.0.0.6:10836"}},
		{"not ready", []*discoveryv1.EndpointSlice{kubeapi.Slice("s", service, "remediator", 10836,
			ep("gpu-a", "10.0.0.5", notReady))}, "http", map[string]string{}},
		{"no nodeName", []*discoveryv1.EndpointSlice{kubeapi.Slice("s", service, "remediator", 10836,
			ep("", "10.0.0.5", ready))}, "http", map[string]string{}},
		{"another port's name", []*discoveryv1.EndpointSlice{kubeapi.Slice("s", service, "metrics", 10835,
			ep("gpu-a", "10.0.0.5", ready))}, "http", map[string]string{}},
		{"IPv6 in brackets, https", []*discoveryv1.EndpointSlice{ipv6}, "https", map[string]string{"gpu-v6": "https://[fd00::5]:10836"}},
		{"several ready: the lowest address, numerically, across slices", []*discoveryv1.EndpointSlice{
			kubeapi.Slice("s1", service, "remediator", 10836, ep("gpu-a", "10.0.0.10", ready), ep("gpu-a", "10.0.0.200", notReady)),
			kubeapi.Slice("s2", service, "remediator", 10837, ep("gpu-a", "10.0.0.9", ready)),
		}, "http", map[string]string{"gpu-a": "http://10.0.0.9:10837"}},
		{"slices the controller did not make for the Service", []*discoveryv1.EndpointSlice{handMade, mirrored, otherOwner, noOwner, notController,
			kubeapi.Slice("s", service, "remediator", 10836, ep("gpu-b", "10.0.0.70", ready))}, "http",
			map[string]string{"gpu-b": "http://10.0.0.70:10836"}},
		{"endpoints that point at no Pod of the namespace, though lower", []*discoveryv1.EndpointSlice{kubeapi.Slice("s", service, "remediator", 10836,
			noTarget, nodeTarget, otherNamespace, ep("gpu-a", "10.0.0.100", ready))}, "http",
			map[string]string{"gpu-a": "http://10.0.0.100:10836"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := map[string]string{}
			for node, a := range pickAgents(tc.slices, service, "remediator", tc.scheme, slog.New(slog.DiscardHandler), nil, nil) {
				got[node] = a.url
			}
			if !maps.Equal(got, tc.want) {
				t.Errorf("agents %v, want %v", got, tc.want)
			}
		})
	}
}

// TestNamespace: the flag, or else the pod's own namespace; neither is an
// error that says so.
func TestNamespace(t *testing.T) {
	file := filepath.Join(t.TempDir(), "namespace")
	if err := os.WriteFile(file, []byte("gpu-system\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if got, err := namespace("ml", file); got != "ml" || err != nil {
		t.Errorf("with the flag: %q, %v", got, err)
	}
	if got, err := namespace("", file); got != "gpu-system" || err != nil {
		t.Errorf("from the service account: %q, %v", got, err)
	}
	if _, err := namespace("", filepath.Join(t.TempDir(), "none")); err == nil || !strings.Contains(err.Error(), "--dispatch.kubernetes.namespace") {
		t.Errorf("neither: %v, want an error naming the flag", err)
	}
}

func start(t *testing.T, api *kubeapi.Server, reg prometheus.Registerer) (*Kubernetes, error) {
	t.Helper()
	k, err := New(Config{Service: service, Namespace: ns, PortName: "remediator", Scheme: "http",
		Kubeconfig: api.Kubeconfig(t), SyncTimeout: 10 * time.Second, Registerer: reg,
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	if err != nil {
		t.Fatal(err)
	}
	return k, k.Start(t.Context())
}

// TestWatchesSlices: the real client-go informer against an API server
// over HTTP, as kube-apiserver with and without streaming lists. The
// first list is in when Start returns; a slice added, changed or deleted
// while the watch is open changes the agents without a restart; slices of
// another Service are not read, nor one with the Service's label that the
// EndpointSlice controller did not make; the gauge counts the agents.
func TestWatchesSlices(t *testing.T) {
	for _, watchList := range []bool{false, true} {
		t.Run(map[bool]string{false: "list then watch", true: "streaming list"}[watchList], func(t *testing.T) {
			api := kubeapi.Start(t, ns, kubeapi.WatchList(watchList))
			ds := api.AddDaemonSet(service)
			api.AddPod(kubeapi.AgentPod("agent-gpu-a", ds, "gpu-a", "10.0.0.5", "remediator", 10836))
			api.AddPod(kubeapi.AgentPod("agent-gpu-b", ds, "gpu-b", "10.0.0.6", "remediator", 10836))
			api.Apply(kubeapi.Slice("agents-a", service, "remediator", 10836, kubeapi.Endpoint("gpu-a", "10.0.0.5", ready)))
			api.Apply(kubeapi.Slice("other", "some-other-service", "remediator", 10836, kubeapi.Endpoint("gpu-z", "10.0.0.99", ready)))
			reg := prometheus.NewRegistry()
			k, err := start(t, api, reg)
			if err != nil {
				t.Fatal(err)
			}
			if got := k.Agents(); !maps.Equal(got, map[string]string{"gpu-a": "http://10.0.0.5:10836"}) {
				t.Fatalf("after the first list: %v", got)
			}
			// Each mode took its own path: a streaming list needs no LIST.
			if lists, watches := api.Requests(); watches == 0 || watchList != (lists == 0) {
				t.Errorf("%d lists, %d watches", lists, watches)
			}

			// A slice written by hand with the Service's label, for a new
			// node and with a lower address for gpu-a, arrives before the
			// change below, and is ignored.
			forged := kubeapi.Slice("forged", service, "remediator", 10836, kubeapi.Endpoint("gpu-f", "10.0.0.1", ready), kubeapi.Endpoint("gpu-a", "10.0.0.2", ready))
			delete(forged.Labels, discoveryv1.LabelManagedBy)
			api.Apply(forged)
			api.Apply(kubeapi.Slice("agents-a", service, "remediator", 10836,
				kubeapi.Endpoint("gpu-a", "10.0.0.5", ready), kubeapi.Endpoint("gpu-b", "10.0.0.6", ready)))
			waitAgents(t, k, map[string]string{"gpu-a": "http://10.0.0.5:10836", "gpu-b": "http://10.0.0.6:10836"})
			if v := testutil.ToFloat64(k.discovered); v != 2 {
				t.Errorf("gpu_orphan_dispatcher_discovered_agents = %v, want 2", v)
			}
			api.Apply(kubeapi.Slice("agents-a", service, "remediator", 10836,
				kubeapi.Endpoint("gpu-a", "10.0.0.5", notReady), kubeapi.Endpoint("gpu-b", "10.0.0.6", ready)))
			waitAgents(t, k, map[string]string{"gpu-b": "http://10.0.0.6:10836"})
			api.Delete("agents-a")
			waitAgents(t, k, map[string]string{})
			if v := testutil.ToFloat64(k.discovered); v != 0 {
				t.Errorf("gpu_orphan_dispatcher_discovered_agents = %v, want 0", v)
			}
		})
	}
}

func waitAgents(t *testing.T, k *Kubernetes, want map[string]string) {
	t.Helper()
	testenv.Eventually(t, 10*time.Second, "agents "+strings.Join(sortedKeys(want), ","), func() bool {
		return maps.Equal(k.Agents(), want)
	})
}

func sortedKeys(m map[string]string) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	return keys
}

// TestForbiddenFailsStart: without RBAC the start fails at once, and says
// which permission is missing.
func TestForbiddenFailsStart(t *testing.T) {
	api := kubeapi.Start(t, ns)
	api.Forbid(true)
	began := time.Now()
	_, err := start(t, api, nil)
	if err == nil {
		t.Fatal("started without the permission to list")
	}
	for _, says := range []string{"list", "watch", "endpointslices", "discovery.k8s.io", ns} {
		if !strings.Contains(err.Error(), says) {
			t.Errorf("the error does not say %q: %v", says, err)
		}
	}
	if d := time.Since(began); d > 5*time.Second {
		t.Errorf("failing took %s: a 403 must not wait for the sync timeout", d)
	}
}

// TestUnreachableFailsStart: no API server within the sync timeout is an
// error that names the flag, and why the list failed.
func TestUnreachableFailsStart(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(kubeconfig, []byte("apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: http://"+addr+
		"\ncontexts:\n- name: c\n  context:\n    cluster: c\ncurrent-context: c\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	k, err := New(Config{Service: service, Namespace: ns, PortName: "remediator", Scheme: "http", Kubeconfig: kubeconfig, SyncTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if err := k.Start(t.Context()); err == nil || !strings.Contains(err.Error(), "--dispatch.kubernetes.sync-timeout") || !strings.Contains(err.Error(), addr) {
		t.Errorf("Start: %v, want an error naming the sync timeout and the API server's address", err)
	}
}

// TestMetricDocumented: the gauge and the counter are in docs/metrics.md.
func TestMetricDocumented(t *testing.T) {
	b, err := os.ReadFile("../../docs/metrics.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"gpu_orphan_dispatcher_discovered_agents", "gpu_orphan_dispatcher_discovery_errors_total"} {
		if !strings.Contains(string(b), "`"+name+"`") {
			t.Errorf("docs/metrics.md does not document %s", name)
		}
	}
}

// TestPodsReadOncePerEndpoint: the check of an endpoint against its pod
// reads the API server when the endpoint's slice changes, not at each
// look-up (each alert) nor when another slice changes: gpu-a's pod, gone
// from the API server after the first check, stays an agent while its
// slice is unchanged.
func TestPodsReadOncePerEndpoint(t *testing.T) {
	api := kubeapi.Start(t, ns)
	ds := api.AddDaemonSet(service)
	api.AddPod(kubeapi.AgentPod("agent-gpu-a", ds, "gpu-a", "10.0.0.5", "remediator", 10836))
	api.AddPod(kubeapi.AgentPod("agent-gpu-b", ds, "gpu-b", "10.0.0.6", "remediator", 10836))
	api.Apply(kubeapi.Slice("agents-a", service, "remediator", 10836, kubeapi.Endpoint("gpu-a", "10.0.0.5", ready)))
	k, err := start(t, api, nil)
	if err != nil {
		t.Fatal(err)
	}
	waitAgents(t, k, map[string]string{"gpu-a": "http://10.0.0.5:10836"})
	gets := api.PodGets()
	if gets == 0 {
		t.Fatal("no pod was read")
	}
	for range 100 {
		k.Agents()
	}
	if got := api.PodGets(); got != gets {
		t.Errorf("100 look-ups read the API server %d times, want 0", got-gets)
	}

	api.DeletePod("agent-gpu-a")
	api.Apply(kubeapi.Slice("agents-b", service, "remediator", 10836, kubeapi.Endpoint("gpu-b", "10.0.0.6", ready)))
	waitAgents(t, k, map[string]string{"gpu-a": "http://10.0.0.5:10836", "gpu-b": "http://10.0.0.6:10836"})
}

// TestRetryStopsWithDiscovery: the retry of a check that the API server
// could not answer (a 403 on pods) reads the pod again while discovery
// runs, counted in gpu_orphan_dispatcher_discovery_errors_total, and is
// neither tried nor scheduled once discovery's context has ended (it
// was, every retryCheck, for as long as the process lived).
func TestRetryStopsWithDiscovery(t *testing.T) {
	api := kubeapi.Start(t, ns)
	ds := api.AddDaemonSet(service)
	api.AddPod(kubeapi.AgentPod("agent-gpu-a", ds, "gpu-a", "10.0.0.5", "remediator", 10836))
	api.AddPod(kubeapi.AgentPod("agent-gpu-b", ds, "gpu-b", "10.0.0.6", "remediator", 10836))
	api.Apply(kubeapi.Slice("agents-a", service, "remediator", 10836, kubeapi.Endpoint("gpu-a", "10.0.0.5", ready)))
	reg := prometheus.NewRegistry()
	k, err := New(Config{Service: service, Namespace: ns, PortName: "remediator", Scheme: "http",
		Kubeconfig: api.Kubeconfig(t), SyncTimeout: 10 * time.Second, Registerer: reg,
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	if err != nil {
		t.Fatal(err)
	}
	k.retryAfter = 20 * time.Millisecond
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	if err := k.Start(ctx); err != nil {
		t.Fatal(err)
	}

	api.ForbidPods(true)
	api.Apply(kubeapi.Slice("agents-b", service, "remediator", 10836, kubeapi.Endpoint("gpu-b", "10.0.0.6", ready)))
	gets := api.PodGets()
	testenv.Eventually(t, 10*time.Second, "gpu-b's pod to be read again, and again", func() bool { return api.PodGets() >= gets+3 })
	if got := k.Agents(); !maps.Equal(got, map[string]string{"gpu-a": "http://10.0.0.5:10836"}) {
		t.Errorf("while pods are forbidden: %v, want gpu-a only (known before), not gpu-b (its pod unread)", got)
	}
	if v := testutil.ToFloat64(k.podsFailed.counter); v < 3 {
		t.Errorf("discovery_errors_total{resource=\"pods\"} = %v, want a count of the failed reads", v)
	}

	cancel()
	// Let the informer's shutdown and a timer already due run out.
	testenv.Eventually(t, 10*time.Second, "discovery to stop", func() bool {
		k.rebuildMu.Lock()
		defer k.rebuildMu.Unlock()
		return k.stopped
	})
	time.Sleep(50 * time.Millisecond)
	gets, failed := api.PodGets(), testutil.ToFloat64(k.podsFailed.counter)
	// Absence has no condition to wait on: 25 retry periods.
	time.Sleep(25 * k.retryAfter)
	if got := api.PodGets(); got != gets {
		t.Errorf("the pod was read %d times after discovery stopped", got-gets)
	}
	if got := testutil.ToFloat64(k.podsFailed.counter); got != failed {
		t.Errorf("%v more reads of the pod were tried after discovery stopped", got-failed)
	}
}
