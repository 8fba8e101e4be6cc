package kubereal

import (
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

// Agents writes what kube-controller-manager and the kubelets would, none
// of which runs here, for a DaemonSet of node agents behind a Service:
// each agent's pod, made from the DaemonSet's template, bound to its node,
// running at its IP; and the Service's EndpointSlices that name the pods,
// as the EndpointSlice controller writes them (its managed-by label, the
// Service as controlling owner).
type Agents struct {
	Admin     kubernetes.Interface
	Service   *corev1.Service
	DaemonSet *appsv1.DaemonSet
	// PortName names the agents' port: the pods' container port and the
	// slices' port.
	PortName string
}

// endpointSliceController is the managed-by label's value on the slices
// of the EndpointSlice controller (discovery.ControllerName, which this
// package may not import).
const endpointSliceController = "endpointslice-controller.k8s.io"

// PodName is the name of node's agent pod.
func (a *Agents) PodName(node string) string { return a.DaemonSet.Name + "-" + node }

// AddPod creates node's agent pod (and the Node, when missing): the
// DaemonSet's template, owned by the DaemonSet, on node, running and
// ready at ip, its container port PortName set to port.
func (a *Agents) AddPod(t testing.TB, node, ip string, port int32) *corev1.Pod {
	t.Helper()
	ctx := t.Context()
	if _, err := a.Admin.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{}); apierrors.IsNotFound(err) {
		_, err = a.Admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: node}}, metav1.CreateOptions{})
		if err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatal(err)
		}
	} else if err != nil {
		t.Fatal(err)
	}
	tmpl := a.DaemonSet.Spec.Template
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: a.PodName(node), Namespace: a.DaemonSet.Namespace, Labels: tmpl.Labels,
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "DaemonSet", Name: a.DaemonSet.Name, UID: a.DaemonSet.UID,
				Controller: ptr.To(true), BlockOwnerDeletion: ptr.To(true)}}},
		Spec: *tmpl.Spec.DeepCopy(),
	}
	pod.Spec.NodeName = node
	// The EndpointSlice controller takes the slice's port from the pod's.
	for i := range pod.Spec.Containers {
		for j, p := range pod.Spec.Containers[i].Ports {
			if p.Name == a.PortName {
				pod.Spec.Containers[i].Ports[j].ContainerPort = port
				if p.HostPort != 0 {
					pod.Spec.Containers[i].Ports[j].HostPort = port
				}
			}
		}
	}
	created, err := a.Admin.CoreV1().Pods(pod.Namespace).Create(ctx, pod, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("creating the agent pod of %s: %v", node, err)
	}
	created.Status.Phase = corev1.PodRunning
	created.Status.PodIP, created.Status.PodIPs = ip, []corev1.PodIP{{IP: ip}}
	created.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}
	if created, err = a.Admin.CoreV1().Pods(pod.Namespace).UpdateStatus(ctx, created, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("the agent pod's status: %v", err)
	}
	return created
}

// DeletePod deletes node's agent pod, as its kubelet would once it
// stopped, and waits until it is gone (its name free for a new pod).
func (a *Agents) DeletePod(t testing.TB, node string) {
	t.Helper()
	pods := a.Admin.CoreV1().Pods(a.DaemonSet.Namespace)
	if err := pods.Delete(t.Context(), a.PodName(node), metav1.DeleteOptions{GracePeriodSeconds: ptr.To(int64(0))}); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 10*time.Second, "pod "+a.PodName(node)+" to be gone", func() bool {
		_, err := pods.Get(t.Context(), a.PodName(node), metav1.GetOptions{})
		return apierrors.IsNotFound(err)
	})
}

// Endpoint is pod's endpoint, at its IP, as the EndpointSlice controller
// writes it; ready nil leaves the condition unset, which the API reads as
// ready.
func (a *Agents) Endpoint(pod *corev1.Pod, ready *bool) discoveryv1.Endpoint {
	return discoveryv1.Endpoint{Addresses: []string{pod.Status.PodIP}, NodeName: ptr.To(pod.Spec.NodeName),
		Conditions: discoveryv1.EndpointConditions{Ready: ready, Serving: ready},
		TargetRef:  &corev1.ObjectReference{Kind: "Pod", Namespace: pod.Namespace, Name: pod.Name, UID: pod.UID}}
}

// Slice is the Service's EndpointSlice name, with port and endpoints, as
// the EndpointSlice controller makes it; not created.
func (a *Agents) Slice(name string, port int32, endpoints ...discoveryv1.Endpoint) *discoveryv1.EndpointSlice {
	return &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: a.Service.Namespace,
			Labels: map[string]string{discoveryv1.LabelServiceName: a.Service.Name, discoveryv1.LabelManagedBy: endpointSliceController},
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "v1", Kind: "Service", Name: a.Service.Name, UID: a.Service.UID,
				Controller: ptr.To(true), BlockOwnerDeletion: ptr.To(true)}}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Endpoints:   append([]discoveryv1.Endpoint{}, endpoints...),
		Ports:       []discoveryv1.EndpointPort{{Name: ptr.To(a.PortName), Port: ptr.To(port), Protocol: ptr.To(corev1.ProtocolTCP)}},
	}
}

// Apply creates the slice, or replaces the one of its name (a watch sees
// ADDED, or MODIFIED).
func (a *Agents) Apply(t testing.TB, slice *discoveryv1.EndpointSlice) {
	t.Helper()
	slices := a.Admin.DiscoveryV1().EndpointSlices(slice.Namespace)
	old, err := slices.Get(t.Context(), slice.Name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		_, err = slices.Create(t.Context(), slice, metav1.CreateOptions{})
	case err == nil:
		slice = slice.DeepCopy()
		slice.ResourceVersion = old.ResourceVersion
		_, err = slices.Update(t.Context(), slice, metav1.UpdateOptions{})
	}
	if err != nil {
		t.Fatalf("the API server refused EndpointSlice %s: %v", slice.Name, err)
	}
}

// DeleteSlice deletes the slice name: a watch sees DELETED.
func (a *Agents) DeleteSlice(t testing.TB, name string) {
	t.Helper()
	if err := a.Admin.DiscoveryV1().EndpointSlices(a.Service.Namespace).Delete(t.Context(), name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
}

// SliceName is the name of node's slice, as Add names it.
func (a *Agents) SliceName(node string) string { return a.Service.Name + "-" + node }

// Add makes node's agent, ready at ip:port: its pod, and a slice of its
// own (a slice's ports are the whole slice's, and each of the tests'
// agents listens on a port of its own).
func (a *Agents) Add(t testing.TB, node, ip string, port int32) *corev1.Pod {
	t.Helper()
	pod := a.AddPod(t, node, ip, port)
	a.Apply(t, a.Slice(a.SliceName(node), port, a.Endpoint(pod, ptr.To(true))))
	return pod
}

// Remove deletes node's slice and pod, as when the pod goes.
func (a *Agents) Remove(t testing.TB, node string) {
	t.Helper()
	a.DeleteSlice(t, a.SliceName(node))
	a.DeletePod(t, node)
}
