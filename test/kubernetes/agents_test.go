//go:build kubernetes

package kubernetes

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/exporter-toolkit/web"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	nodev1 "k8s.io/api/node/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/kubernetes"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv/kubereal"
	"github.com/gpu-orphan/gpu-orphan/remediate/app"
	"github.com/gpu-orphan/gpu-orphan/remediate/app/dispatcher"
	"github.com/gpu-orphan/gpu-orphan/remediate/discovery"
	"github.com/gpu-orphan/gpu-orphan/remediate/intake"
)

// agent is a real HTTP listener standing for one node's agent: it records
// the node label of each webhook it gets, and accepts it.
type agent struct {
	*httptest.Server
	mu    sync.Mutex
	nodes []string
}

func newAgent(t *testing.T) *agent {
	t.Helper()
	a := &agent{}
	l, err := net.Listen("tcp", net.JoinHostPort(hostIP(t), "0"))
	if err != nil {
		t.Fatal(err)
	}
	a.Server = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var msg intake.Message
		if err := json.NewDecoder(r.Body).Decode(&msg); err != nil || len(msg.Alerts) != 1 {
			http.Error(w, "bad webhook", http.StatusBadRequest)
			return
		}
		a.mu.Lock()
		a.nodes = append(a.nodes, msg.Alerts[0].Labels["node"])
		a.mu.Unlock()
		_, _ = w.Write([]byte(`{"received":1}`))
	}))
	a.Listener.Close()
	a.Listener = l
	a.Start()
	t.Cleanup(a.Close)
	return a
}

// hostIP is an IPv4 address of this machine outside the loopback range:
// kube-apiserver refuses a loopback address in an EndpointSlice (the fake
// API server took 127.0.0.1), so the agents listen on this one.
func hostIP(t *testing.T) string {
	t.Helper()
	ifs, err := net.Interfaces()
	if err != nil {
		t.Fatal(err)
	}
	for _, i := range ifs {
		if i.Flags&net.FlagUp == 0 || i.Flags&net.FlagLoopback != 0 {
			continue
		}
		addrs, _ := i.Addrs()
		for _, a := range addrs {
			if n, ok := a.(*net.IPNet); ok && n.IP.To4() != nil && n.IP.IsGlobalUnicast() {
				return n.IP.String()
			}
		}
	}
	t.Skip("this machine has no IPv4 address outside the loopback range for the agents to listen on (an EndpointSlice may not name 127.0.0.1)")
	return ""
}

func (a *agent) received() []string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]string(nil), a.nodes...)
}

func (a *agent) port() int32 {
	_, p, _ := net.SplitHostPort(a.Listener.Addr().String())
	n, _ := strconv.Atoi(p)
	return int32(n)
}

// fleet is what kube-controller-manager and the kubelets would have made
// for the chart's node agents: the DaemonSet's pods, each bound to its
// node with its IP, and the EndpointSlices of the agents' Service, one per
// node (each agent listener has a port of its own).
type fleet struct {
	cp        *kubereal.ControlPlane
	admin     kubernetes.Interface
	namespace string
	service   *corev1.Service
	ds        *appsv1.DaemonSet
}

// newFleet creates the chart's agents' Service and node DaemonSet (no
// controller runs: the DaemonSet makes no pod by itself).
func newFleet(t *testing.T, cp *kubereal.ControlPlane, r *release) *fleet {
	t.Helper()
	admin := cp.Admin(t)
	apply(t, cp, []*unstructured.Unstructured{find(t, r.objects, "Service", r.agentsService()), find(t, r.objects, "DaemonSet", "go-gpu-orphan-node")})
	f := &fleet{cp: cp, admin: admin, namespace: r.namespace}
	var err error
	if f.service, err = admin.CoreV1().Services(r.namespace).Get(t.Context(), r.agentsService(), metav1.GetOptions{}); err != nil {
		t.Fatal(err)
	}
	if f.ds, err = admin.AppsV1().DaemonSets(r.namespace).Get(t.Context(), "go-gpu-orphan-node", metav1.GetOptions{}); err != nil {
		t.Fatal(err)
	}
	// The chart's DaemonSet runs with runtimeClassName nvidia (the GPU
	// operator's): without that RuntimeClass, the API server's admission
	// refuses its pods (the fake took any).
	if rc := f.ds.Spec.Template.Spec.RuntimeClassName; rc != nil {
		_, err := admin.NodeV1().RuntimeClasses().Create(t.Context(), &nodev1.RuntimeClass{ObjectMeta: metav1.ObjectMeta{Name: *rc}, Handler: *rc}, metav1.CreateOptions{})
		if err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatal(err)
		}
	}
	return f
}

// twoAgents is a namespace of the test's own, named name, with the
// chart's RBAC for values, its agents' Service and DaemonSet, and the
// agents of node-a and node-b.
func twoAgents(t *testing.T, name string, values map[string]any) (*release, *fleet, *agent, *agent) {
	t.Helper()
	cp := kubereal.Get(t)
	r := installRBAC(t, cp, newNamespace(t, cp, name), values)
	f := newFleet(t, cp, r)
	a, b := newAgent(t), newAgent(t)
	f.addAgent(t, "node-a", a)
	f.addAgent(t, "node-b", b)
	return r, f, a, b
}

// addAgent makes node's agent pod (owned by the DaemonSet, on node, with
// the listener's address as its IP) and its EndpointSlice, as the
// EndpointSlice controller writes it.
func (f *fleet) addAgent(t *testing.T, node string, a *agent) {
	t.Helper()
	ctx := t.Context()
	if _, err := f.admin.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{}); err != nil {
		if _, err := f.admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: node}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	tmpl := f.ds.Spec.Template
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: f.ds.Name + "-" + node, Namespace: f.namespace, Labels: tmpl.Labels,
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "DaemonSet", Name: f.ds.Name, UID: f.ds.UID,
				Controller: ptr(true), BlockOwnerDeletion: ptr(true)}}},
		Spec: *tmpl.Spec.DeepCopy(),
	}
	pod.Spec.NodeName = node
	// The agent serves on its listener's port: the pod declares it, as
	// the EndpointSlice controller takes the slice's port from the pod.
	for i := range pod.Spec.Containers {
		for j, p := range pod.Spec.Containers[i].Ports {
			if p.Name == "remediator" {
				pod.Spec.Containers[i].Ports[j].ContainerPort = a.port()
				if p.HostPort != 0 {
					pod.Spec.Containers[i].Ports[j].HostPort = a.port()
				}
			}
		}
	}
	created, err := f.admin.CoreV1().Pods(f.namespace).Create(ctx, pod, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("creating the agent pod of %s: %v", node, err)
	}
	created.Status.Phase = corev1.PodRunning
	ip := hostIP(t)
	created.Status.PodIP, created.Status.PodIPs = ip, []corev1.PodIP{{IP: ip}}
	created.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}
	if created, err = f.admin.CoreV1().Pods(f.namespace).UpdateStatus(ctx, created, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("the agent pod's status: %v", err)
	}
	slice := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Name: f.service.Name + "-" + node, Namespace: f.namespace,
			Labels: map[string]string{discoveryv1.LabelServiceName: f.service.Name, discoveryv1.LabelManagedBy: discovery.ControllerName},
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "v1", Kind: "Service", Name: f.service.Name, UID: f.service.UID,
				Controller: ptr(true), BlockOwnerDeletion: ptr(true)}}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Endpoints: []discoveryv1.Endpoint{{Addresses: []string{ip}, NodeName: ptr(node),
			Conditions: discoveryv1.EndpointConditions{Ready: ptr(true), Serving: ptr(true), Terminating: ptr(false)},
			TargetRef:  &corev1.ObjectReference{Kind: "Pod", Namespace: f.namespace, Name: created.Name, UID: created.UID}}},
		Ports: []discoveryv1.EndpointPort{{Name: ptr("remediator"), Port: ptr(a.port()), Protocol: ptr(corev1.ProtocolTCP)}},
	}
	if _, err := f.admin.DiscoveryV1().EndpointSlices(f.namespace).Create(ctx, slice, metav1.CreateOptions{}); err != nil {
		t.Fatalf("the API server refused node %s's EndpointSlice: %v", node, err)
	}
}

// removeAgent deletes node's EndpointSlice and pod, as when the pod goes.
func (f *fleet) removeAgent(t *testing.T, node string) {
	t.Helper()
	if err := f.admin.DiscoveryV1().EndpointSlices(f.namespace).Delete(t.Context(), f.service.Name+"-"+node, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := f.admin.CoreV1().Pods(f.namespace).Delete(t.Context(), f.ds.Name+"-"+node, metav1.DeleteOptions{GracePeriodSeconds: ptr(int64(0))}); err != nil {
		t.Fatal(err)
	}
}

func ptr[T any](v T) *T { return &v }

// installRBAC renders the chart with values into namespace and applies its
// ServiceAccounts, Roles, ClusterRoles and bindings with the admin's
// credentials; the test's cleanup deletes the cluster-scoped ones.
func installRBAC(t *testing.T, cp *kubereal.ControlPlane, namespace string, values map[string]any) *release {
	t.Helper()
	r := &release{cp: cp, namespace: namespace, objects: render(t, namespace, values)}
	rbac := rbacOnly(r.objects)
	apply(t, cp, rbac)
	t.Cleanup(func() { remove(t, cp, rbac) })
	return r
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
// returns its base URL and its kubeconfig.
func startDispatcher(t *testing.T, r *release, tune func(*app.Options)) (string, string) {
	t.Helper()
	kubeconfig := r.cp.Kubeconfig(t, r.cp.ServiceAccountToken(t, r.namespace, r.dispatcherName()))
	// The discovery flags are the chart's Deployment's.
	flags := r.dispatcherFlags(t)
	addrs, systemd, file := []string{testenv.FreeAddr(t)}, false, ""
	o := app.Options{
		Web:  &web.FlagConfig{WebListenAddresses: &addrs, WebSystemdSocket: &systemd, WebConfigFile: &file},
		Auth: intake.AuthConfig{InsecureNone: true}, NodeLabel: "node", UUIDLabel: "uuid",
		StorePath: filepath.Join(t.TempDir(), "d.db"), Logger: testLogger(t),
		Dispatch: app.Dispatch{Timeout: 5 * time.Second, MaxAttempts: 1,
			Kubernetes: app.Kubernetes{Service: flags["dispatch.kubernetes.service"], Namespace: flags["dispatch.kubernetes.namespace"],
				PortName: flags["dispatch.kubernetes.port-name"], Scheme: flags["dispatch.kubernetes.scheme"],
				DaemonSet: flags["dispatch.kubernetes.daemonset"], Lease: flags["dispatch.kubernetes.lease"],
				Kubeconfig: kubeconfig, SyncTimeout: 20 * time.Second}},
	}
	esc := dispatcher.Escalate{}
	if tune != nil {
		tune(&o)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- dispatcher.Run(ctx, o, esc) }()
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
	base := "http://" + addrs[0]
	testenv.Eventually(t, 30*time.Second, "the dispatcher to serve", func() bool {
		select {
		case err := <-done:
			t.Fatalf("the dispatcher stopped: %v", err)
		default:
		}
		return healthy(base)
	})
	return base, kubeconfig
}

// healthy reports whether the dispatcher at base answers /-/healthy.
func healthy(base string) bool {
	resp, err := http.Get(base + "/-/healthy")
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
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

func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(b []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(b)))
	return len(b), nil
}

var (
	alertMu  sync.Mutex
	alertSeq int
)

// postAlertsNoFatal is postAlerts for another goroutine: nil on error.
func postAlertsNoFatal(base string, nodes ...string) map[string]int {
	res, err := post(base, nodes...)
	if err != nil {
		return nil
	}
	return res
}

// postAlerts posts one webhook with a firing alert per node to the
// dispatcher at base, and returns the counts by result.
func postAlerts(t *testing.T, base string, nodes ...string) map[string]int {
	t.Helper()
	res, err := post(base, nodes...)
	if err != nil {
		t.Fatal(err)
	}
	return res
}

func post(base string, nodes ...string) (map[string]int, error) {
	var alerts []map[string]any
	alertMu.Lock()
	for _, node := range nodes {
		alertSeq++
		alerts = append(alerts, map[string]any{
			"status": "firing", "labels": map[string]string{"alertname": "GPUOrphanMemory", "node": node, "uuid": "GPU-" + strconv.Itoa(alertSeq)},
			"annotations": map[string]string{}, "startsAt": time.Now().Add(-time.Minute).Format(time.RFC3339Nano),
			"endsAt": "0001-01-01T00:00:00Z", "generatorURL": "http://prometheus", "fingerprint": fmt.Sprintf("%016x", alertSeq),
		})
	}
	alertMu.Unlock()
	body, _ := json.Marshal(map[string]any{"version": "4", "groupKey": "{}:{}", "truncatedAlerts": 0, "status": "firing", "receiver": "gpu-orphan",
		"groupLabels": map[string]string{}, "commonLabels": map[string]string{}, "commonAnnotations": map[string]string{},
		"externalURL": "http://alertmanager", "alerts": alerts})
	resp, err := http.Post(base+"/api/v1/alerts", "application/json", bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var reply struct {
		Results map[string]int `json:"results"`
	}
	if resp.StatusCode != http.StatusOK || json.Unmarshal(b, &reply) != nil {
		return nil, fmt.Errorf("webhook: %d %s", resp.StatusCode, b)
	}
	return reply.Results, nil
}

// TestChartDispatcherDiscovery: the dispatcher, with the chart's RBAC only
// (its ServiceAccount's token; the chart's Role decided on by the real
// RBAC authorizer), finds the node agents in the EndpointSlices that the
// test writes as the EndpointSlice controller would, for pods of the
// chart's DaemonSet bound to their nodes; it forwards each node's alert to
// that node's agent; a node in no slice is rejected; once an agent's slice
// and pod are gone, its node is rejected and its agent never contacted
// again, without a restart.
func TestChartDispatcherDiscovery(t *testing.T) {
	r, f, a, b := twoAgents(t, "discovery", dispatcherValues(false, false))
	base, _ := startDispatcher(t, r, nil)

	if res := postAlerts(t, base, "node-a", "node-b", "node-x"); res["accepted"] != 2 || res["rejected"] != 1 {
		t.Fatalf("results %v, want node-a and node-b accepted, node-x (in no slice) rejected", res)
	}
	testenv.Eventually(t, 20*time.Second, "node-a's and node-b's agents to get their alerts", func() bool {
		return len(a.received()) == 1 && len(b.received()) == 1
	})
	if a.received()[0] != "node-a" || b.received()[0] != "node-b" {
		t.Errorf("the agents got alerts for %v and %v", a.received(), b.received())
	}
	_, mfs := testenv.Scrape(t, base+"/metrics")
	if v, _ := testenv.Value(mfs, "gpu_orphan_dispatcher_discovered_agents", nil); v != 2 {
		t.Errorf("gpu_orphan_dispatcher_discovered_agents = %v, want 2", v)
	}

	// node-a's pod goes: the EndpointSlice controller deletes its slice.
	f.removeAgent(t, "node-a")
	testenv.Eventually(t, 20*time.Second, "node-a to be rejected", func() bool {
		return postAlerts(t, base, "node-a")["rejected"] == 1
	})
	if res := postAlerts(t, base, "node-a", "node-b"); res["rejected"] != 1 || res["accepted"] != 1 {
		t.Fatalf("results %v, want node-a rejected and node-b accepted", res)
	}
	testenv.Eventually(t, 20*time.Second, "node-b's agent to get its second alert", func() bool { return len(b.received()) == 2 })
	if got := a.received(); len(got) != 1 {
		t.Errorf("node-a's agent was contacted after its slice went: %v", got)
	}
}
