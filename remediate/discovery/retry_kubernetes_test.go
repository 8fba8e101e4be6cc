//go:build kubernetes

package discovery

import (
	"context"
	"maps"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	appsv1 "k8s.io/api/apps/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv/kubereal"
)

// These tests run against a real kube-apiserver (make e2e-kubernetes);
// they stay in the package for what only it can reach (the retry's
// period, whether discovery has stopped).

func TestMain(m *testing.M) { os.Exit(kubereal.Main(m)) }

// TestRetryStopsWithDiscovery: the retry of a check that the API server
// could not answer (get on pods taken from the Role: 403) reads the pod
// again while discovery runs, counted in
// gpu_orphan_dispatcher_discovery_errors_total, and is neither tried nor
// scheduled once discovery's context has ended (it was, every retryCheck,
// for as long as the process lived).
func TestRetryStopsWithDiscovery(t *testing.T) {
	cp := kubereal.Get(t)
	admin := cp.Admin(t)
	ns, err := admin.CoreV1().Namespaces().Create(t.Context(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "discovery-retry-"}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ip := testenv.HostIP(t)
	a, b := testenv.NewFakeAgent(t, ip), testenv.NewFakeAgent(t, ip)
	agents := newAgents(t, cp, ns.Name, a.Port(t))
	agents.Add(t, "retry-gpu-a", ip, a.Port(t))
	podB := agents.AddPod(t, "retry-gpu-b", ip, b.Port(t))

	// The dispatcher's ServiceAccount, with the chart's discovery rules.
	rules := []rbacv1.PolicyRule{
		{APIGroups: []string{"discovery.k8s.io"}, Resources: []string{"endpointslices"}, Verbs: []string{"list", "watch"}},
		{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"get"}},
		{APIGroups: []string{"apps"}, Resources: []string{"daemonsets"}, Verbs: []string{"get"}},
	}
	const sa = "dispatcher"
	if _, err := admin.CoreV1().ServiceAccounts(ns.Name).Create(t.Context(), &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	roles := admin.RbacV1().Roles(ns.Name)
	if _, err := roles.Create(t.Context(), &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Name: sa}, Rules: rules}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.RbacV1().RoleBindings(ns.Name).Create(t.Context(), &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: sa},
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: sa},
		Subjects: []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Name: sa, Namespace: ns.Name}}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	getPods := authorizationv1.ResourceAttributes{Namespace: ns.Name, Verb: "get", Resource: "pods"}
	cp.WaitAccess(t, ns.Name, sa, true, getPods,
		authorizationv1.ResourceAttributes{Namespace: ns.Name, Verb: "list", Group: "discovery.k8s.io", Resource: "endpointslices"},
		authorizationv1.ResourceAttributes{Namespace: ns.Name, Verb: "get", Group: "apps", Resource: "daemonsets"})

	k, err := New(Config{Service: agents.Service.Name, Namespace: ns.Name, PortName: agents.PortName, Scheme: "http",
		Kubeconfig: cp.Kubeconfig(t, cp.ServiceAccountToken(t, ns.Name, sa)), SyncTimeout: 20 * time.Second, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	k.retryAfter = 20 * time.Millisecond
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	if err := k.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if got := k.Agents(); !maps.Equal(got, map[string]string{"retry-gpu-a": a.URL}) {
		t.Fatalf("agents %v, want retry-gpu-a's at %s", got, a.URL)
	}

	// Get on pods goes; gpu-b's slice comes: its pod cannot be read.
	role, err := roles.Get(t.Context(), sa, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	role.Rules = slices.DeleteFunc(slices.Clone(rules), func(r rbacv1.PolicyRule) bool { return slices.Contains(r.Resources, "pods") })
	if _, err := roles.Update(t.Context(), role, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	cp.WaitAccess(t, ns.Name, sa, false, getPods)
	agents.Apply(t, agents.Slice(agents.SliceName("retry-gpu-b"), b.Port(t), agents.Endpoint(podB, ptr.To(true))))
	testenv.Eventually(t, 20*time.Second, "gpu-b's pod to be read again, and again", func() bool { return testutil.ToFloat64(k.podsFailed.counter) >= 3 })
	if got := k.Agents(); !maps.Equal(got, map[string]string{"retry-gpu-a": a.URL}) {
		t.Errorf("while pods are forbidden: %v, want gpu-a only (known before), not gpu-b (its pod unread)", got)
	}

	cancel()
	// Let the informer's shutdown and a timer already due run out.
	testenv.Eventually(t, 10*time.Second, "discovery to stop", func() bool {
		k.rebuildMu.Lock()
		defer k.rebuildMu.Unlock()
		return k.stopped
	})
	time.Sleep(50 * time.Millisecond)
	failed := testutil.ToFloat64(k.podsFailed.counter)
	// Absence has no condition to wait on: 25 retry periods. Each read,
	// refused or cut short by the ended context, would be counted.
	time.Sleep(25 * k.retryAfter)
	if got := testutil.ToFloat64(k.podsFailed.counter); got != failed {
		t.Errorf("%v more reads of the pod were tried after discovery stopped", got-failed)
	}
}

// newAgents makes the agents' ServiceAccount, headless Service and
// DaemonSet in namespace, serving on port, as a chart would (no controller
// runs: the DaemonSet makes no pod by itself).
func newAgents(t *testing.T, cp *kubereal.ControlPlane, namespace string, port int32) *kubereal.Agents {
	t.Helper()
	admin := cp.Admin(t)
	const name, portName = "gpu-orphan-node", "remediator"
	labels := map[string]string{"app.kubernetes.io/name": name}
	// Pod admission wants the pods' ServiceAccount to exist; no
	// controller makes "default" here.
	if _, err := admin.CoreV1().ServiceAccounts(namespace).Create(t.Context(), &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: name},
		AutomountServiceAccountToken: ptr.To(false)}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	svc, err := admin.CoreV1().Services(namespace).Create(t.Context(), &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: corev1.ServiceSpec{ClusterIP: corev1.ClusterIPNone, Selector: labels, Ports: []corev1.ServicePort{{Name: portName, Port: port}}}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ds, err := admin.AppsV1().DaemonSets(namespace).Create(t.Context(), &appsv1.DaemonSet{ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: appsv1.DaemonSetSpec{Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec: corev1.PodSpec{ServiceAccountName: name, Containers: []corev1.Container{{Name: "remediator", Image: "gpu-orphan:test",
					Ports: []corev1.ContainerPort{{Name: portName, ContainerPort: port}}}}}}}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return &kubereal.Agents{Admin: admin, Service: svc, DaemonSet: ds, PortName: portName}
}
