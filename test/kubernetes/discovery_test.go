//go:build kubernetes

package kubernetes

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv/kubereal"
	"github.com/gpu-orphan/gpu-orphan/remediate/app"
	"github.com/gpu-orphan/gpu-orphan/remediate/discovery"
)

// TestDiscoveryWatchExpires: the dispatcher's watch of the agents'
// EndpointSlices is cut (a proxy between it and kube-apiserver closes every
// connection and holds new ones, as a partition does); meanwhile an agent
// is added and etcd's history is compacted past every revision that the
// informer has seen. When the partition heals, the informer watches again
// from its old resourceVersion and gets 410 Gone; discovery lists again,
// and the agent added during the partition is found and its node's alert
// forwarded to it.
//
// kube-apiserver runs with --watch-cache=false, so that a watch is read
// from etcd at the client's resourceVersion (the watch cache would answer
// from its own window, and only rarely 410). --min-request-timeout would
// not end the watch sooner: client-go's reflector asks for timeoutSeconds
// of its own (5 to 10 minutes), which the API server honours.
//
// That the 410 happened is read from the dispatcher's log (client-go says
// it only at klog's -v=4).
func TestDiscoveryWatchExpires(t *testing.T) {
	cp := kubereal.Own(t, "--watch-cache=false")
	r, f := chartFleet(t, cp, "watch-expires", dispatcherValues(false, false))
	a, b := newAgent(t), newAgent(t)
	f.addAgent(t, "node-a", a)
	logs := &logLines{}
	proxy := newAPIProxy(t, cp.URL)
	base, _ := startDispatcher(t, r, proxied(t, proxy, logs))
	if res := testenv.MustPostAlerts(t, base, "node-a", "node-b"); res["accepted"] != 1 || res["rejected"] != 1 {
		t.Fatalf("results %v, want node-a accepted, node-b (no agent yet) rejected", res)
	}

	proxy.waitSettled(t)
	began := time.Now()
	proxy.Cut(true)
	// During the partition: an agent comes, and etcd forgets the history
	// that the informer would need to catch up.
	f.addAgent(t, "node-b", b)
	compacted := cp.CompactEtcd(t)
	proxy.Release()
	t.Logf("etcd compacted at revision %d during the partition; healed after %s", compacted, time.Since(began).Round(time.Millisecond))
	testenv.Eventually(t, 60*time.Second, "the dispatcher's watch to get 410 Gone", func() bool {
		return logs.count("410 Gone") > 0
	})
	// The agent that came during the partition: found by the new list.
	testenv.Eventually(t, 30*time.Second, "node-b's agent to be discovered", func() bool {
		return testenv.MustPostAlerts(t, base, "node-b")["accepted"] == 1
	})
	testenv.Eventually(t, 20*time.Second, "node-b's agent to get its alert", func() bool { return slices.Contains(b.Alerts(), "node-b") })
	if res := testenv.MustPostAlerts(t, base, "node-a"); res["accepted"] != 1 {
		t.Errorf("node-a after the expiry: %v, want accepted", res)
	}
	testenv.Eventually(t, 20*time.Second, "node-a's agent to get its second alert", func() bool { return len(a.Alerts()) == 2 })
	if got := b.Alerts(); slices.ContainsFunc(got, func(n string) bool { return n != "node-b" }) {
		t.Errorf("node-b's agent got alerts for %v", got)
	}
	_, mfs := testenv.Scrape(t, base+"/metrics")
	if v, _ := testenv.Value(mfs, "gpu_orphan_dispatcher_discovered_agents", nil); v != 2 {
		t.Errorf("gpu_orphan_dispatcher_discovered_agents = %v, want 2", v)
	}
	t.Logf("from the partition to node-b's alert forwarded: %s", time.Since(began).Round(time.Millisecond))
}

// TestDiscoveryRBACTakenAway: the chart's Role for the dispatcher loses
// its rules while the dispatcher runs on the chart's ServiceAccount token,
// first get on pods, then list and watch on EndpointSlices; each time the
// dispatcher logs the refusal once (not at every retry), counts it in
// gpu_orphan_dispatcher_discovery_errors_total, keeps the agent it knew
// and forwards to it, rejects the node whose agent came meanwhile and
// never contacts that agent; once the rule is back, discovery finds it
// without a restart.
//
// An open watch is not ended by RBAC (the authorizer decides at the
// request): to make the informer ask again, its connection is cut (a proxy
// between the dispatcher and kube-apiserver), as a load balancer's restart
// or a control-plane upgrade would.
func TestDiscoveryRBACTakenAway(t *testing.T) {
	cp := kubereal.Get(t)
	r, f := chartFleet(t, cp, "discovery-rbac", dispatcherValues(false, false))
	a, b, c := newAgent(t), newAgent(t), newAgent(t)
	f.addAgent(t, "node-a", a)
	logs := &logLines{}
	proxy := newAPIProxy(t, cp.URL)
	base, _ := startDispatcher(t, r, proxied(t, proxy, logs))
	if res := testenv.MustPostAlerts(t, base, "node-a"); res["accepted"] != 1 {
		t.Fatalf("node-a with the chart's RBAC: %v", res)
	}
	errorsOf := func(resource string) float64 {
		_, mfs := testenv.Scrape(t, base+"/metrics")
		v, ok := testenv.Value(mfs, "gpu_orphan_dispatcher_discovery_errors_total", map[string]string{"resource": resource})
		if !ok {
			t.Fatalf("no gpu_orphan_dispatcher_discovery_errors_total{resource=%q}", resource)
		}
		return v
	}
	if v := errorsOf("pods") + errorsOf("endpointslices"); v != 0 {
		t.Fatalf("%v discovery errors before any permission was taken", v)
	}
	granted := r.roleRules(t)

	// Get on pods goes: node-b's slice comes through the open watch, but
	// its pod cannot be read, so node-b is no agent.
	began := time.Now()
	r.setRoleRules(t, without(granted, "pods"))
	f.addAgent(t, "node-b", b)
	testenv.Eventually(t, 30*time.Second, "reads of node-b's pod to fail, and be retried", func() bool { return errorsOf("pods") >= 2 })
	if res := testenv.MustPostAlerts(t, base, "node-a", "node-b"); res["accepted"] != 1 || res["rejected"] != 1 {
		t.Errorf("without get on pods: %v, want node-a (known before) accepted, node-b rejected", res)
	}
	if n := logs.count(`level=ERROR msg="Kubernetes discovery: reading the pods that the agents' endpoints name is refused`); n != 1 {
		t.Errorf("the refused pod reads were logged %d times at error, want once", n)
	}
	r.setRoleRules(t, granted)
	testenv.Eventually(t, 30*time.Second, "node-b to be discovered once get on pods is back", func() bool {
		return testenv.MustPostAlerts(t, base, "node-b")["accepted"] == 1
	})
	t.Logf("pods: taken away and given back, node-b found, in %s", time.Since(began).Round(time.Millisecond))
	if logs.count("reading the pods that the agents' endpoints name works again") != 1 {
		t.Error("the pods' recovery was not logged")
	}

	// List and watch on EndpointSlices go, and the watch ends.
	began = time.Now()
	r.setRoleRules(t, without(granted, "endpointslices"))
	proxy.waitSettled(t)
	proxy.Cut(false)
	refused := `level=ERROR msg="Kubernetes discovery: listing and watching the agents' EndpointSlices is refused`
	testenv.Eventually(t, 60*time.Second, "the dispatcher to log that the EndpointSlices are refused", func() bool { return logs.count(refused) > 0 })
	// node-c's agent comes while discovery cannot see it.
	f.addAgent(t, "node-c", c)
	failed := errorsOf("endpointslices")
	testenv.Eventually(t, 60*time.Second, "the informer to try again, and fail again", func() bool { return errorsOf("endpointslices") >= failed+2 })
	if res := testenv.MustPostAlerts(t, base, "node-a", "node-b", "node-c"); res["accepted"] != 2 || res["rejected"] != 1 {
		t.Errorf("without list and watch on EndpointSlices: %v, want node-a and node-b (known before) accepted, node-c rejected", res)
	}
	if n := logs.count(refused); n != 1 {
		t.Errorf("%v failed lists were logged %d times at error, want once (at most once a minute)", errorsOf("endpointslices"), n)
	}
	r.setRoleRules(t, granted)
	testenv.Eventually(t, 90*time.Second, "node-c to be discovered once list and watch are back", func() bool {
		return testenv.MustPostAlerts(t, base, "node-c")["accepted"] == 1
	})
	t.Logf("endpointslices: taken away, the watch cut, given back, node-c found, in %s", time.Since(began).Round(time.Millisecond))
	if logs.count("listing and watching the agents' EndpointSlices works again") != 1 {
		t.Error("the EndpointSlices' recovery was not logged")
	}
	testenv.Eventually(t, 20*time.Second, "every agent to get its alerts", func() bool {
		return len(a.Alerts()) == 3 && len(b.Alerts()) == 2 && len(c.Alerts()) == 1
	})
	for node, ag := range map[string]*testenv.FakeAgent{"node-a": a, "node-b": b, "node-c": c} {
		if got := ag.Alerts(); slices.ContainsFunc(got, func(n string) bool { return n != node }) {
			t.Errorf("%s's agent got alerts for %v", node, got)
		}
	}
}

// proxied has the dispatcher reach kube-apiserver through proxy, and log
// into logs.
func proxied(t *testing.T, proxy *apiProxy, logs *logLines) func(*app.Options) {
	return func(o *app.Options) {
		o.Logger = testenv.Logger(t, logs)
		o.Dispatch.Kubernetes.Kubeconfig = proxy.kubeconfig(t, o.Dispatch.Kubernetes.Kubeconfig)
	}
}

// logLines keeps the dispatcher's log lines, also written to the test's
// log, to count those that say something.
type logLines struct {
	mu    sync.Mutex
	lines []string
}

func (l *logLines) Write(b []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, string(b))
	return len(b), nil
}

// count is how many lines contain s.
func (l *logLines) count(s string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, line := range l.lines {
		if strings.Contains(line, s) {
			n++
		}
	}
	return n
}

// startDiscovery starts Kubernetes discovery (package discovery, as the
// dispatcher runs it) with the chart's flags, as the chart's dispatcher
// ServiceAccount, until the test ends; reg, when not nil, gets its
// metrics. It returns once the first list is in.
func startDiscovery(t *testing.T, r *release, reg prometheus.Registerer) *discovery.Kubernetes {
	t.Helper()
	flags := r.dispatcherFlags(t)
	k, err := discovery.New(discovery.Config{Service: flags["dispatch.kubernetes.service"], Namespace: flags["dispatch.kubernetes.namespace"],
		PortName: flags["dispatch.kubernetes.port-name"], Scheme: flags["dispatch.kubernetes.scheme"], DaemonSet: flags["dispatch.kubernetes.daemonset"],
		Kubeconfig: r.cp.Kubeconfig(t, r.cp.ServiceAccountToken(t, r.namespace, r.dispatcherName())), SyncTimeout: 20 * time.Second,
		Registerer: reg, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	if err := k.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	return k
}

// waitAgents waits until discovery's agents are want, node to URL.
func waitAgents(t *testing.T, k *discovery.Kubernetes, want map[string]string) {
	t.Helper()
	testenv.Eventually(t, 20*time.Second, fmt.Sprintf("the agents to be %v", want), func() bool { return maps.Equal(k.Agents(), want) })
}

// gauge is the value of the gauge name that reg gathers.
func gauge(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name && len(mf.GetMetric()) == 1 {
			return mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatalf("no gauge %s", name)
	return 0
}

// TestWatchesSlices: discovery's informer against kube-apiserver with its
// streaming lists (WatchList, on by default) and without them (the
// feature gate off: client-go's watch with sendInitialEvents is refused,
// and it lists, then watches). The first list is in when Start returns;
// a slice added, changed or deleted while the watch is open changes the
// agents without a restart; a slice of another Service is not read, nor
// one with the Service's label that the EndpointSlice controller did not
// make (its endpoint a genuine agent pod's); the gauge counts the agents.
// Each mode takes its own path: a streaming list makes no LIST request.
// Against a release without streaming lists by default (make oldest), both
// modes list.
func TestWatchesSlices(t *testing.T) {
	for _, mode := range []struct {
		name  string
		flags []string
	}{
		{"streaming list", nil},
		{"list then watch", []string{"--feature-gates=WatchList=false"}},
	} {
		t.Run(mode.name, func(t *testing.T) {
			cp := kubereal.Get(t)
			if mode.flags != nil {
				cp = kubereal.Own(t, mode.flags...)
			}
			r, f := chartFleet(t, cp, "watches-"+strings.ReplaceAll(mode.name, " ", "-"), dispatcherValues(false, false))
			// The agents are never contacted: one listener's port for all.
			ip, l := testenv.HostIP(t), newAgent(t)
			port, url := l.Port(t), l.URL
			pod := map[string]*corev1.Pod{}
			for _, node := range []string{"watch-gpu-a", "watch-gpu-b", "watch-gpu-f", "watch-gpu-z"} {
				pod[node] = f.AddPod(t, node, ip, port)
			}
			f.Apply(t, f.Slice("agents-a", port, f.Endpoint(pod["watch-gpu-a"], ptr(true))))
			other := f.Slice("other", port, f.Endpoint(pod["watch-gpu-z"], ptr(true)))
			other.Labels[discoveryv1.LabelServiceName], other.OwnerReferences[0].Name = "some-other-service", "some-other-service"
			f.Apply(t, other)
			lists := map[string]string{"verb": "LIST", "resource": "endpointslices"}
			listed := cp.Requests(t, lists)
			reg := prometheus.NewRegistry()
			k := startDiscovery(t, r, reg)
			if got := k.Agents(); !maps.Equal(got, map[string]string{"watch-gpu-a": url}) {
				t.Fatalf("after the first list: %v", got)
			}
			// A LIST is counted once answered, a moment after the client has
			// the answer: wait for any, then count. A server whose WatchList
			// is off by default (v1.30, the oldest the chart supports, where
			// it is alpha) refuses the streaming list as it does with the
			// flag (422: sendInitialEvents is forbidden), and the informer
			// lists, as in the other mode. The difference is the server's,
			// not discovery's: the rest of the test holds either way.
			// (A release that no longer knows the gate streams always.)
			streaming := mode.flags == nil
			if on, known := cp.FeatureGate(t, "WatchList"); known {
				streaming = streaming && on
			}
			if streaming {
				if n := cp.Requests(t, lists) - listed; n != 0 {
					t.Errorf("%v LIST requests of the EndpointSlices with streaming lists on, want none", n)
				}
			} else {
				testenv.Eventually(t, 10*time.Second, "a LIST of the EndpointSlices", func() bool { return cp.Requests(t, lists) > listed })
			}

			// A slice written by hand with the Service's label, naming a
			// genuine agent pod on a node of its own, arrives before the
			// change below, and is ignored.
			forged := f.Slice("forged", port, f.Endpoint(pod["watch-gpu-f"], ptr(true)))
			delete(forged.Labels, discoveryv1.LabelManagedBy)
			f.Apply(t, forged)
			f.Apply(t, f.Slice("agents-a", port, f.Endpoint(pod["watch-gpu-a"], ptr(true)), f.Endpoint(pod["watch-gpu-b"], ptr(true))))
			waitAgents(t, k, map[string]string{"watch-gpu-a": url, "watch-gpu-b": url})
			if v := gauge(t, reg, "gpu_orphan_dispatcher_discovered_agents"); v != 2 {
				t.Errorf("gpu_orphan_dispatcher_discovered_agents = %v, want 2", v)
			}
			f.Apply(t, f.Slice("agents-a", port, f.Endpoint(pod["watch-gpu-a"], ptr(false)), f.Endpoint(pod["watch-gpu-b"], ptr(true))))
			waitAgents(t, k, map[string]string{"watch-gpu-b": url})
			f.DeleteSlice(t, "agents-a")
			waitAgents(t, k, map[string]string{})
			if v := gauge(t, reg, "gpu_orphan_dispatcher_discovered_agents"); v != 0 {
				t.Errorf("gpu_orphan_dispatcher_discovered_agents = %v, want 0", v)
			}
		})
	}
}

// TestPodsReadOncePerEndpoint: the check of an endpoint against its pod
// reads the API server when the endpoint's slice changes, not at each
// look-up (each alert) nor when another slice changes: gpu-a's pod,
// deleted after the first check, stays an agent while its slice is
// unchanged. kube-apiserver's own count of pod reads says how many.
func TestPodsReadOncePerEndpoint(t *testing.T) {
	cp := kubereal.Get(t)
	r, f := chartFleet(t, cp, "pods-read-once", dispatcherValues(false, false))
	ip, a, b := testenv.HostIP(t), newAgent(t), newAgent(t)
	f.addAgent(t, "once-gpu-a", a)
	podB := f.AddPod(t, "once-gpu-b", ip, b.Port(t))
	podGets := map[string]string{"verb": "GET", "resource": "pods"}
	before := cp.Requests(t, podGets)
	k := startDiscovery(t, r, nil)
	waitAgents(t, k, map[string]string{"once-gpu-a": a.URL})
	testenv.Eventually(t, 10*time.Second, "gpu-a's pod to have been read", func() bool { return cp.Requests(t, podGets) > before })
	gets := cp.Requests(t, podGets)
	if gets != before+1 {
		t.Errorf("the first check read %v pods, want 1", gets-before)
	}
	for range 100 {
		k.Agents()
	}
	if got := cp.Requests(t, podGets); got != gets {
		t.Errorf("100 look-ups read the API server %v times, want 0", got-gets)
	}

	f.DeletePod(t, "once-gpu-a")
	f.Apply(t, f.Slice(f.SliceName("once-gpu-b"), b.Port(t), f.Endpoint(podB, ptr(true))))
	waitAgents(t, k, map[string]string{"once-gpu-a": a.URL, "once-gpu-b": b.URL})
}
