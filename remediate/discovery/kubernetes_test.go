package discovery

import (
	"log/slog"
	"maps"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
)

const (
	ns      = "gpu-orphan"
	service = "gpu-orphan-node"
)

var (
	ready    = ptr.To(true)
	notReady = ptr.To(false)
)

// slice is an EndpointSlice of service in namespace ns with one port, and
// endpoints, as the EndpointSlice controller makes it: labelled managed-by
// the controller, and owned by the Service.
func slice(name, service, portName string, port int32, endpoints ...discoveryv1.Endpoint) *discoveryv1.EndpointSlice {
	return &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns,
			Labels: map[string]string{discoveryv1.LabelServiceName: service, discoveryv1.LabelManagedBy: ControllerName},
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "v1", Kind: "Service", Name: service, UID: types.UID("uid-service-" + service),
				Controller: ptr.To(true), BlockOwnerDeletion: ptr.To(true)}}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Endpoints:   endpoints,
		Ports:       []discoveryv1.EndpointPort{{Name: ptr.To(portName), Port: ptr.To(port), Protocol: ptr.To(corev1.ProtocolTCP)}},
	}
}

// endpoint is an endpoint on node (none if empty) at address, pointing at
// a Pod of namespace ns; ready nil leaves the condition unset, which the
// API reads as ready.
func endpoint(node, address string, ready *bool) discoveryv1.Endpoint {
	e := discoveryv1.Endpoint{Addresses: []string{address}, Conditions: discoveryv1.EndpointConditions{Ready: ready},
		TargetRef: &corev1.ObjectReference{Kind: "Pod", Namespace: ns, Name: "agent-" + address}}
	if node != "" {
		e.NodeName = ptr.To(node)
		e.TargetRef.Name = "agent-" + node
	}
	return e
}

// TestPickAgents: which endpoint is a node's agent, and at which URL.
func TestPickAgents(t *testing.T) {
	ep := endpoint
	ipv6 := slice("v6", service, "remediator", 10836, ep("gpu-v6", "fd00::5", ready))
	ipv6.AddressType = discoveryv1.AddressTypeIPv6
	// Slices and endpoints that name no agent (issue 16): only the
	// EndpointSlice controller's slices of the Service, and endpoints that
	// point at a Pod of the slice's namespace.
	handMade := slice("hand-made", service, "remediator", 10836, ep("gpu-a", "10.0.0.66", ready))
	delete(handMade.Labels, discoveryv1.LabelManagedBy)
	mirrored := slice("mirrored", service, "remediator", 10836, ep("gpu-a", "10.0.0.66", ready))
	mirrored.Labels[discoveryv1.LabelManagedBy] = "endpointslicemirroring-controller.k8s.io"
	otherOwner := slice("other-owner", service, "remediator", 10836, ep("gpu-a", "10.0.0.66", ready))
	otherOwner.OwnerReferences[0].Name = "some-other-service"
	noOwner := slice("no-owner", service, "remediator", 10836, ep("gpu-a", "10.0.0.66", ready))
	noOwner.OwnerReferences = nil
	notController := slice("not-controller", service, "remediator", 10836, ep("gpu-a", "10.0.0.66", ready))
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
		{"ready, and unset readiness (ready in the API)", []*discoveryv1.EndpointSlice{slice("s", service, "remediator", 10836,
			ep("gpu-a", "10.0.0.5", ready), ep("gpu-b", "10.0.0.6", nil))}, "http",
			map[string]string{"gpu-a": "http://10.0.0.5:10836", "gpu-b": "http://10.0.0.6:10836"}},
		{"not ready", []*discoveryv1.EndpointSlice{slice("s", service, "remediator", 10836,
			ep("gpu-a", "10.0.0.5", notReady))}, "http", map[string]string{}},
		{"no nodeName", []*discoveryv1.EndpointSlice{slice("s", service, "remediator", 10836,
			ep("", "10.0.0.5", ready))}, "http", map[string]string{}},
		{"another port's name", []*discoveryv1.EndpointSlice{slice("s", service, "metrics", 10835,
			ep("gpu-a", "10.0.0.5", ready))}, "http", map[string]string{}},
		{"IPv6 in brackets, https", []*discoveryv1.EndpointSlice{ipv6}, "https", map[string]string{"gpu-v6": "https://[fd00::5]:10836"}},
		{"several ready: the lowest address, numerically, across slices", []*discoveryv1.EndpointSlice{
			slice("s1", service, "remediator", 10836, ep("gpu-a", "10.0.0.10", ready), ep("gpu-a", "10.0.0.200", notReady)),
			slice("s2", service, "remediator", 10837, ep("gpu-a", "10.0.0.9", ready)),
		}, "http", map[string]string{"gpu-a": "http://10.0.0.9:10837"}},
		{"slices the controller did not make for the Service", []*discoveryv1.EndpointSlice{handMade, mirrored, otherOwner, noOwner, notController,
			slice("s", service, "remediator", 10836, ep("gpu-b", "10.0.0.70", ready))}, "http",
			map[string]string{"gpu-b": "http://10.0.0.70:10836"}},
		{"endpoints that point at no Pod of the namespace, though lower", []*discoveryv1.EndpointSlice{slice("s", service, "remediator", 10836,
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
