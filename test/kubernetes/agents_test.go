//go:build kubernetes

package kubernetes

import (
	"context"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/exporter-toolkit/web"
	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	nodev1 "k8s.io/api/node/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv/kubereal"
	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/app"
	"github.com/gpu-orphan/gpu-orphan/remediate/app/dispatcher"
	"github.com/gpu-orphan/gpu-orphan/remediate/intake"
)

// newAgent is a node agent that accepts every webhook, on this machine's
// address outside the loopback range (testenv.HostIP): an EndpointSlice
// may not name a loopback one.
func newAgent(t *testing.T) *testenv.FakeAgent {
	t.Helper()
	return testenv.NewFakeAgent(t, testenv.HostIP(t))
}

// fleet is the chart's node agents' Service and DaemonSet, with what
// kube-controller-manager and the kubelets would make for them
// (kubereal.Agents): each agent's pod bound to its node, and the
// Service's EndpointSlices.
type fleet struct {
	*kubereal.Agents
}

// newFleet creates the chart's agents' Service and node DaemonSet (no
// controller runs: the DaemonSet makes no pod by itself).
func newFleet(t *testing.T, cp *kubereal.ControlPlane, r *release) *fleet {
	t.Helper()
	admin := cp.Admin(t)
	apply(t, cp, []*unstructured.Unstructured{find(t, r.objects, "Service", r.agentsService()), find(t, r.objects, "DaemonSet", "go-gpu-orphan-node")})
	svc, err := admin.CoreV1().Services(r.namespace).Get(t.Context(), r.agentsService(), metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ds, err := admin.AppsV1().DaemonSets(r.namespace).Get(t.Context(), "go-gpu-orphan-node", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// The chart's DaemonSet runs with runtimeClassName nvidia (the GPU
	// operator's): without that RuntimeClass, the API server's admission
	// refuses its pods.
	if rc := ds.Spec.Template.Spec.RuntimeClassName; rc != nil {
		_, err := admin.NodeV1().RuntimeClasses().Create(t.Context(), &nodev1.RuntimeClass{ObjectMeta: metav1.ObjectMeta{Name: *rc}, Handler: *rc}, metav1.CreateOptions{})
		if err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatal(err)
		}
	}
	return &fleet{&kubereal.Agents{Admin: admin, Service: svc, DaemonSet: ds, PortName: r.dispatcherFlags(t)["dispatch.kubernetes.port-name"]}}
}

// chartFleet is a namespace of the test's own on cp, named name, with the
// chart's RBAC for values (installRBAC), and its agents' Service and
// DaemonSet (newFleet), no agent yet.
func chartFleet(t *testing.T, cp *kubereal.ControlPlane, name string, values map[string]any) (*release, *fleet) {
	t.Helper()
	r := installRBAC(t, cp, newNamespace(t, cp, name), values)
	return r, newFleet(t, cp, r)
}

// twoAgents is chartFleet on the shared control plane, with the agents of
// node-a and node-b.
func twoAgents(t *testing.T, name string, values map[string]any) (*release, *fleet, *testenv.FakeAgent, *testenv.FakeAgent) {
	t.Helper()
	r, f := chartFleet(t, kubereal.Get(t), name, values)
	a, b := newAgent(t), newAgent(t)
	f.addAgent(t, "node-a", a)
	f.addAgent(t, "node-b", b)
	return r, f, a, b
}

// addAgent makes node's agent pod, at the agent's address, and its
// EndpointSlice, as the EndpointSlice controller writes it.
func (f *fleet) addAgent(t *testing.T, node string, a *testenv.FakeAgent) *corev1.Pod {
	t.Helper()
	return f.Add(t, node, testenv.HostIP(t), a.Port(t))
}

func ptr[T any](v T) *T { return &v }

// installRBAC renders the chart with values into namespace and applies its
// ServiceAccounts, Roles, ClusterRoles and bindings with the admin's
// credentials, and waits until the authorizer grants the dispatcher what
// they say (it reads them from a cache: a moment later); the test's
// cleanup deletes the cluster-scoped ones.
func installRBAC(t *testing.T, cp *kubereal.ControlPlane, namespace string, values map[string]any) *release {
	t.Helper()
	r := &release{cp: cp, namespace: namespace, objects: render(t, namespace, values)}
	rbac := rbacOnly(r.objects)
	apply(t, cp, rbac)
	t.Cleanup(func() { remove(t, cp, rbac) })
	var granted []authorizationv1.ResourceAttributes
	for _, o := range rbac {
		var rules []rbacv1.PolicyRule
		switch o.GetKind() {
		case "Role":
			var role rbacv1.Role
			if err := runtime.DefaultUnstructuredConverter.FromUnstructured(o.Object, &role); err != nil {
				t.Fatal(err)
			}
			rules = role.Rules
		case "ClusterRole":
			var role rbacv1.ClusterRole
			if err := runtime.DefaultUnstructuredConverter.FromUnstructured(o.Object, &role); err != nil {
				t.Fatal(err)
			}
			rules = role.Rules
		default:
			continue
		}
		if !strings.HasPrefix(o.GetName(), r.dispatcherName()) {
			continue
		}
		granted = append(granted, attributes(o.GetNamespace(), rules)...)
	}
	cp.WaitAccess(t, namespace, r.dispatcherName(), true, granted...)
	return r
}

// attributes are the requests that rules grant, in namespace ("" for a
// ClusterRole's), one of each verb on each resource (of its first name,
// when the rule names some).
func attributes(namespace string, rules []rbacv1.PolicyRule) []authorizationv1.ResourceAttributes {
	var out []authorizationv1.ResourceAttributes
	for _, rule := range rules {
		name := ""
		if len(rule.ResourceNames) > 0 {
			name = rule.ResourceNames[0]
		}
		for _, res := range rule.Resources {
			for _, verb := range rule.Verbs {
				out = append(out, authorizationv1.ResourceAttributes{Namespace: namespace, Verb: verb, Group: rule.APIGroups[0], Resource: res, Name: name})
			}
		}
	}
	return out
}

// roleRules are the rules of the chart's Role for the dispatcher as the
// API server has them now.
func (r *release) roleRules(t *testing.T) []rbacv1.PolicyRule {
	t.Helper()
	role, err := r.cp.Admin(t).RbacV1().Roles(r.namespace).Get(t.Context(), r.dispatcherName(), metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return role.Rules
}

// setRoleRules replaces the rules of the chart's Role for the dispatcher,
// as an administrator would while the dispatcher runs; the authorizer
// sees the change a moment later (kubereal.WaitAccess).
func (r *release) setRoleRules(t *testing.T, rules []rbacv1.PolicyRule) {
	t.Helper()
	roles := r.cp.Admin(t).RbacV1().Roles(r.namespace)
	role, err := roles.Get(t.Context(), r.dispatcherName(), metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	role.Rules = rules
	if _, err := roles.Update(t.Context(), role, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// without is rules less those on resource.
func without(rules []rbacv1.PolicyRule, resource string) []rbacv1.PolicyRule {
	return slices.DeleteFunc(slices.Clone(rules), func(p rbacv1.PolicyRule) bool { return slices.Contains(p.Resources, resource) })
}

// dispatcherValues turns on the dispatcher's discovery, and its taints
// when taint is true; no shared Lease unless lease is true.
func dispatcherValues(taint, lease bool) map[string]any {
	replicas := 1
	if lease {
		replicas = 2
	}
	return map[string]any{"dispatcher": map[string]any{
		"replicas":     replicas,
		"discovery":    map[string]any{"enabled": true},
		"sharedLimits": map[string]any{"enabled": lease},
		"escalate":     map[string]any{"taint": taint},
	}}
}

// startDispatcher runs a dispatcher in this process, with Kubernetes
// discovery through the API server as the chart's dispatcher
// ServiceAccount (its token from the TokenRequest API, nothing more), and
// returns its base URL and its kubeconfig. tune, when not nil, changes its
// options.
func startDispatcher(t *testing.T, r *release, tune func(*app.Options)) (string, string) {
	t.Helper()
	kubeconfig := r.cp.Kubeconfig(t, r.cp.ServiceAccountToken(t, r.namespace, r.dispatcherName()))
	// The discovery flags are the chart's Deployment's.
	flags := r.dispatcherFlags(t)
	addrs, systemd, file := []string{testenv.FreeAddr(t)}, false, ""
	o := app.Options{
		Web:  &web.FlagConfig{WebListenAddresses: &addrs, WebSystemdSocket: &systemd, WebConfigFile: &file},
		Auth: intake.AuthConfig{InsecureNone: true}, NodeLabel: "node", UUIDLabel: "uuid",
		StorePath: filepath.Join(t.TempDir(), "d.db"), Logger: testenv.Logger(t),
		Dispatch: app.Dispatch{Timeout: 5 * time.Second, MaxAttempts: 1,
			Kubernetes: app.Kubernetes{Service: flags["dispatch.kubernetes.service"], Namespace: flags["dispatch.kubernetes.namespace"],
				PortName: flags["dispatch.kubernetes.port-name"], Scheme: flags["dispatch.kubernetes.scheme"],
				DaemonSet: flags["dispatch.kubernetes.daemonset"], Lease: flags["dispatch.kubernetes.lease"],
				Kubeconfig: kubeconfig, SyncTimeout: 20 * time.Second}},
	}
	if tune != nil {
		tune(&o)
	}
	base := "http://" + addrs[0]
	testenv.Serve(t, base, func(ctx context.Context) error { return dispatcher.Run(ctx, o, dispatcher.Escalate{}) })
	return base, kubeconfig
}

// dispatcherFlags is the chart's dispatcher container's --name=value
// arguments, by name.
func (r *release) dispatcherFlags(t *testing.T) map[string]string {
	t.Helper()
	d := find(t, r.objects, "Deployment", r.dispatcherName())
	containers, _, _ := unstructured.NestedSlice(d.Object, "spec", "template", "spec", "containers")
	flags := map[string]string{}
	for _, c := range containers {
		args, _, _ := unstructured.NestedStringSlice(c.(map[string]any), "args")
		for _, a := range args {
			if k, v, ok := strings.Cut(strings.TrimPrefix(a, "--"), "="); ok {
				flags[k] = v
			}
		}
	}
	return flags
}

// actionsOf are the dispatcher's actions by node.
func actionsOf(t *testing.T, bases ...string) map[string][]remediate.Action {
	t.Helper()
	out := map[string][]remediate.Action{}
	for _, base := range bases {
		for _, a := range testenv.Actions[remediate.Action](t, base, "") {
			out[a.Node] = append(out[a.Node], a)
		}
	}
	return out
}

// TestChartDispatcherDiscovery: the dispatcher, with the chart's RBAC only
// (its ServiceAccount's token; the chart's Role decided on by the real
// RBAC authorizer), finds the node agents in the EndpointSlices that the
// test writes as the EndpointSlice controller would, for pods of the
// chart's DaemonSet bound to their nodes; it forwards each node's alert to
// that node's agent. A node in no slice is rejected, and neither its
// listener nor one that --dispatch.url-template would reach gets anything;
// an endpoint that is not ready, or has no nodeName, is no agent. Once an
// agent's slice and pod are gone, its node is rejected and its agent never
// contacted again; a slice changed to name a ready agent makes its node
// known: without a restart.
func TestChartDispatcherDiscovery(t *testing.T) {
	r, f, a, b := twoAgents(t, "discovery", dispatcherValues(false, false))
	notReady, nameless, c := newAgent(t), newAgent(t), newAgent(t)
	podN := f.AddPod(t, "node-n", testenv.HostIP(t), notReady.Port(t))
	f.Apply(t, f.Slice(f.SliceName("node-n"), notReady.Port(t), f.Endpoint(podN, ptr(false))))
	noNode := f.Endpoint(f.AddPod(t, "node-l", testenv.HostIP(t), nameless.Port(t)), ptr(true))
	noNode.NodeName = nil
	f.Apply(t, f.Slice(f.SliceName("node-l"), nameless.Port(t), noNode))
	// For a node named 127.0.0.1, the template would reach this listener.
	templated := testenv.NewFakeAgent(t, "127.0.0.1")
	base, _ := startDispatcher(t, r, func(o *app.Options) {
		o.Dispatch.URLTemplate = "http://{{.Node}}:" + strconv.Itoa(int(templated.Port(t)))
	})

	if res := testenv.MustPostAlerts(t, base, "node-a", "node-b", "node-x", "127.0.0.1", "node-n"); res["accepted"] != 2 || res["rejected"] != 3 {
		t.Fatalf("results %v, want node-a and node-b accepted; node-x (in no slice), 127.0.0.1 and node-n (not ready) rejected", res)
	}
	testenv.Eventually(t, 20*time.Second, "node-a's and node-b's agents to get their alerts", func() bool {
		return len(a.Alerts()) == 1 && len(b.Alerts()) == 1
	})
	if a.Alerts()[0] != "node-a" || b.Alerts()[0] != "node-b" {
		t.Errorf("the agents got alerts for %v and %v", a.Alerts(), b.Alerts())
	}
	// A rejected alert makes no action: nothing is ever sent for it.
	if got := actionsOf(t, base); len(got) != 2 || len(got["node-a"]) != 1 || len(got["node-b"]) != 1 {
		t.Errorf("the dispatcher's actions by node: %v, want node-a's and node-b's only", got)
	}
	_, mfs := testenv.Scrape(t, base+"/metrics")
	if v, _ := testenv.Value(mfs, "gpu_orphan_dispatcher_discovered_agents", nil); v != 2 {
		t.Errorf("gpu_orphan_dispatcher_discovered_agents = %v, want 2", v)
	}

	// node-a's pod goes: the EndpointSlice controller deletes its slice.
	f.Remove(t, "node-a")
	testenv.Eventually(t, 20*time.Second, "node-a to be rejected", func() bool {
		return testenv.MustPostAlerts(t, base, "node-a")["rejected"] == 1
	})
	if res := testenv.MustPostAlerts(t, base, "node-a", "node-b"); res["rejected"] != 1 || res["accepted"] != 1 {
		t.Fatalf("results %v, want node-a rejected and node-b accepted", res)
	}
	testenv.Eventually(t, 20*time.Second, "node-b's agent to get its second alert", func() bool { return len(b.Alerts()) == 2 })

	// node-c's agent becomes ready in node-n's slice: MODIFIED.
	podC := f.AddPod(t, "node-c", testenv.HostIP(t), c.Port(t))
	f.Apply(t, f.Slice(f.SliceName("node-n"), c.Port(t), f.Endpoint(podN, ptr(false)), f.Endpoint(podC, ptr(true))))
	testenv.Eventually(t, 20*time.Second, "node-c to be accepted", func() bool {
		return testenv.MustPostAlerts(t, base, "node-c")["accepted"] == 1
	})
	testenv.Eventually(t, 20*time.Second, "node-c's agent to get its alert", func() bool { return len(c.Alerts()) == 1 })
	if got := c.Alerts(); got[0] != "node-c" {
		t.Errorf("node-c's agent got an alert for %v", got)
	}
	if got := a.Alerts(); len(got) != 1 {
		t.Errorf("node-a's agent was contacted after its slice went: %v", got)
	}
	for what, l := range map[string]*testenv.FakeAgent{"the listener that the URL template names": templated,
		"the agent whose endpoint is not ready": notReady, "the agent whose endpoint has no nodeName": nameless} {
		if got := l.Requests(); len(got) != 0 {
			t.Errorf("%s got %v", what, got)
		}
	}
}
