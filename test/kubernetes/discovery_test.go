//go:build kubernetes

package kubernetes

import (
	"io"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv/kubereal"
	"github.com/gpu-orphan/gpu-orphan/remediate/app"
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
	r := installRBAC(t, cp, newNamespace(t, cp, "watch-expires"), dispatcherValues(false, false))
	f := newFleet(t, cp, r)
	a, b := newAgent(t), newAgent(t)
	f.addAgent(t, "node-a", a)
	logs := &logLines{}
	proxy := newAPIProxy(t, cp.URL)
	base, _ := startDispatcher(t, r, proxied(t, proxy, logs))
	if res := postAlerts(t, base, "node-a", "node-b"); res["accepted"] != 1 || res["rejected"] != 1 {
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
		return postAlerts(t, base, "node-b")["accepted"] == 1
	})
	testenv.Eventually(t, 20*time.Second, "node-b's agent to get its alert", func() bool { return slices.Contains(b.received(), "node-b") })
	if res := postAlerts(t, base, "node-a"); res["accepted"] != 1 {
		t.Errorf("node-a after the expiry: %v, want accepted", res)
	}
	testenv.Eventually(t, 20*time.Second, "node-a's agent to get its second alert", func() bool { return len(a.received()) == 2 })
	if got := b.received(); slices.ContainsFunc(got, func(n string) bool { return n != "node-b" }) {
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
	r := installRBAC(t, cp, newNamespace(t, cp, "discovery-rbac"), dispatcherValues(false, false))
	f := newFleet(t, cp, r)
	a, b, c := newAgent(t), newAgent(t), newAgent(t)
	f.addAgent(t, "node-a", a)
	logs := &logLines{}
	proxy := newAPIProxy(t, cp.URL)
	base, _ := startDispatcher(t, r, proxied(t, proxy, logs))
	if res := postAlerts(t, base, "node-a"); res["accepted"] != 1 {
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
	roles := f.admin.RbacV1().Roles(r.namespace)
	role, err := roles.Get(t.Context(), r.dispatcherName(), metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	granted := role.Rules
	setRules := func(rules []rbacv1.PolicyRule) {
		t.Helper()
		role, err := roles.Get(t.Context(), r.dispatcherName(), metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		role.Rules = rules
		if _, err := roles.Update(t.Context(), role, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	without := func(resource string) []rbacv1.PolicyRule {
		return slices.DeleteFunc(slices.Clone(granted), func(p rbacv1.PolicyRule) bool { return slices.Contains(p.Resources, resource) })
	}

	// Get on pods goes: node-b's slice comes through the open watch, but
	// its pod cannot be read, so node-b is no agent.
	began := time.Now()
	setRules(without("pods"))
	f.addAgent(t, "node-b", b)
	testenv.Eventually(t, 30*time.Second, "reads of node-b's pod to fail, and be retried", func() bool { return errorsOf("pods") >= 2 })
	if res := postAlerts(t, base, "node-a", "node-b"); res["accepted"] != 1 || res["rejected"] != 1 {
		t.Errorf("without get on pods: %v, want node-a (known before) accepted, node-b rejected", res)
	}
	if n := logs.count(`level=ERROR msg="Kubernetes discovery: reading the pods that the agents' endpoints name is refused`); n != 1 {
		t.Errorf("the refused pod reads were logged %d times at error, want once", n)
	}
	setRules(granted)
	testenv.Eventually(t, 30*time.Second, "node-b to be discovered once get on pods is back", func() bool {
		return postAlerts(t, base, "node-b")["accepted"] == 1
	})
	t.Logf("pods: taken away and given back, node-b found, in %s", time.Since(began).Round(time.Millisecond))
	if logs.count("reading the pods that the agents' endpoints name works again") != 1 {
		t.Error("the pods' recovery was not logged")
	}

	// List and watch on EndpointSlices go, and the watch ends.
	began = time.Now()
	setRules(without("endpointslices"))
	proxy.waitSettled(t)
	proxy.Cut(false)
	refused := `level=ERROR msg="Kubernetes discovery: listing and watching the agents' EndpointSlices is refused`
	testenv.Eventually(t, 60*time.Second, "the dispatcher to log that the EndpointSlices are refused", func() bool { return logs.count(refused) > 0 })
	// node-c's agent comes while discovery cannot see it.
	f.addAgent(t, "node-c", c)
	failed := errorsOf("endpointslices")
	testenv.Eventually(t, 60*time.Second, "the informer to try again, and fail again", func() bool { return errorsOf("endpointslices") >= failed+2 })
	if res := postAlerts(t, base, "node-a", "node-b", "node-c"); res["accepted"] != 2 || res["rejected"] != 1 {
		t.Errorf("without list and watch on EndpointSlices: %v, want node-a and node-b (known before) accepted, node-c rejected", res)
	}
	if n := logs.count(refused); n != 1 {
		t.Errorf("%v failed lists were logged %d times at error, want once (at most once a minute)", errorsOf("endpointslices"), n)
	}
	setRules(granted)
	testenv.Eventually(t, 90*time.Second, "node-c to be discovered once list and watch are back", func() bool {
		return postAlerts(t, base, "node-c")["accepted"] == 1
	})
	t.Logf("endpointslices: taken away, the watch cut, given back, node-c found, in %s", time.Since(began).Round(time.Millisecond))
	if logs.count("listing and watching the agents' EndpointSlices works again") != 1 {
		t.Error("the EndpointSlices' recovery was not logged")
	}
	testenv.Eventually(t, 20*time.Second, "every agent to get its alerts", func() bool {
		return len(a.received()) == 3 && len(b.received()) == 2 && len(c.received()) == 1
	})
	for node, ag := range map[string]*agent{"node-a": a, "node-b": b, "node-c": c} {
		if got := ag.received(); slices.ContainsFunc(got, func(n string) bool { return n != node }) {
			t.Errorf("%s's agent got alerts for %v", node, got)
		}
	}
}

// proxied has the dispatcher reach kube-apiserver through proxy, and log
// into logs.
func proxied(t *testing.T, proxy *apiProxy, logs *logLines) func(*app.Options) {
	return func(o *app.Options) {
		o.Logger = logs.logger(t)
		o.Dispatch.Kubernetes.Kubeconfig = proxy.kubeconfig(t, o.Dispatch.Kubernetes.Kubeconfig)
	}
}

// logLines keeps the dispatcher's log lines, also written to the test's
// log, to count those that say something.
type logLines struct {
	mu    sync.Mutex
	lines []string
}

func (l *logLines) logger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(io.MultiWriter(testWriter{t}, l), &slog.HandlerOptions{Level: slog.LevelDebug}))
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
