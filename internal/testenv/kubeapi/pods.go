package kubeapi

import (
	"net/http"
	"sync"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
)

// Pods and DaemonSets of the namespace are served too, get only, for the
// dispatcher's check that an endpoint is a pod of the agents' DaemonSet
// on its node. ForbidPods answers 403 to both, as without RBAC.

// podStore holds the pods and DaemonSets; its own lock, so that the
// slices' code is left alone.
type podStore struct {
	mu         sync.Mutex
	pods       map[string]*corev1.Pod
	daemonSets map[string]*appsv1.DaemonSet
	denied     bool
	gets       int
}

func (s *Server) servePods(mux *http.ServeMux) {
	s.objects.pods, s.objects.daemonSets = map[string]*corev1.Pod{}, map[string]*appsv1.DaemonSet{}
	mux.HandleFunc("GET /api/v1/namespaces/{ns}/pods/{name}", func(w http.ResponseWriter, r *http.Request) {
		s.getObject(w, r, "pods", func(name string) any {
			if p, ok := s.objects.pods[name]; ok {
				return p.DeepCopy()
			}
			return nil
		})
	})
	mux.HandleFunc("GET /apis/apps/v1/namespaces/{ns}/daemonsets/{name}", func(w http.ResponseWriter, r *http.Request) {
		s.getObject(w, r, "daemonsets", func(name string) any {
			if d, ok := s.objects.daemonSets[name]; ok {
				return d.DeepCopy()
			}
			return nil
		})
	})
}

func (s *Server) getObject(w http.ResponseWriter, r *http.Request, resource string, get func(name string) any) {
	o := &s.objects
	o.mu.Lock()
	defer o.mu.Unlock()
	o.gets++
	ns, name := r.PathValue("ns"), r.PathValue("name")
	switch obj := get(name); {
	case o.denied:
		writeStatus(w, http.StatusForbidden, "Forbidden", resource+" \""+name+"\" is forbidden: the test API server denies get")
	case ns != s.namespace || obj == nil:
		writeStatus(w, http.StatusNotFound, "NotFound", resource+" \""+name+"\" not found")
	default:
		writeJSON(w, obj)
	}
}

// AddDaemonSet adds a DaemonSet and returns it.
func (s *Server) AddDaemonSet(name string) *appsv1.DaemonSet {
	o := &s.objects
	o.mu.Lock()
	defer o.mu.Unlock()
	d := &appsv1.DaemonSet{TypeMeta: metav1.TypeMeta{Kind: "DaemonSet", APIVersion: "apps/v1"},
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: s.namespace, UID: types.UID("uid-daemonset-" + name), ResourceVersion: "1",
			CreationTimestamp: metav1.NewTime(time.Now().Truncate(time.Second))}}
	o.daemonSets[name] = d
	return d.DeepCopy()
}

// AddPod adds a pod, or replaces the one of its name; a pod without a UID
// gets one.
func (s *Server) AddPod(p *corev1.Pod) {
	o := &s.objects
	o.mu.Lock()
	defer o.mu.Unlock()
	p = p.DeepCopy()
	p.Namespace = s.namespace
	if p.UID == "" {
		p.UID = types.UID("uid-pod-" + p.Name)
	}
	o.pods[p.Name] = p
}

// DeletePod removes a pod.
func (s *Server) DeletePod(name string) {
	o := &s.objects
	o.mu.Lock()
	defer o.mu.Unlock()
	delete(o.pods, name)
}

// ForbidPods makes every pod and DaemonSet request answer 403, or serve
// again.
func (s *Server) ForbidPods(on bool) {
	s.objects.mu.Lock()
	defer s.objects.mu.Unlock()
	s.objects.denied = on
}

// PodGets is how many pod and DaemonSet GETs the server answered.
func (s *Server) PodGets() int {
	s.objects.mu.Lock()
	defer s.objects.mu.Unlock()
	return s.objects.gets
}

// AgentPod builds a pod of DaemonSet ds (as its controller makes one) on
// node, at ip (its host's network, as the agents run), serving on port
// under portName.
func AgentPod(name string, ds *appsv1.DaemonSet, node, ip, portName string, port int32) *corev1.Pod {
	return &corev1.Pod{TypeMeta: metav1.TypeMeta{Kind: "Pod", APIVersion: "v1"},
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"app.kubernetes.io/name": ds.Name},
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "DaemonSet", Name: ds.Name, UID: ds.UID,
				Controller: ptr.To(true), BlockOwnerDeletion: ptr.To(true)}}},
		Spec: corev1.PodSpec{NodeName: node, HostNetwork: true, Containers: []corev1.Container{{Name: "remediator",
			Ports: []corev1.ContainerPort{{Name: portName, ContainerPort: port, Protocol: corev1.ProtocolTCP}}}}},
		Status: corev1.PodStatus{Phase: corev1.PodRunning, HostIP: ip, PodIP: ip, PodIPs: []corev1.PodIP{{IP: ip}}},
	}
}
