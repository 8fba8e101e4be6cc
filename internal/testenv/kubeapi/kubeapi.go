// Package kubeapi is a small Kubernetes API server for tests, over real
// HTTP: it serves discovery.k8s.io/v1 EndpointSlices of one namespace as
// kube-apiserver does for an informer (LIST with a label selector and a
// resourceVersion; WATCH as a chunked stream of JSON events, from a
// resourceVersion; and, when WatchList is on, the streaming list that
// client-go asks for first: initial ADDED events ending in a bookmark). A
// test changes the slices while watches are open, and can take the RBAC
// permission away (403 with a Status, as the API server answers).
//
// It also serves coordination.k8s.io/v1 Leases of that namespace: get,
// create (409 AlreadyExists when it exists) and update, which is refused
// with 409 Conflict unless it carries the Lease's current
// resourceVersion, the compare-and-swap that leader election and shared
// state build on.
//
// And Nodes (get, and a strict JSON patch of their taints) and Events on
// them, for the dispatcher's taints (nodes.go).
package kubeapi

import (
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
)

// Server is the test API server.
type Server struct {
	URL       string
	namespace string

	mu     sync.Mutex
	rv     int64
	slices map[string]*discoveryv1.EndpointSlice
	events []event
	// changed is closed, and replaced, on every change: it wakes watches.
	changed   chan struct{}
	forbidden bool
	watchList bool
	delay     time.Duration
	lists     int
	watches   int

	leases         map[string]*coordinationv1.Lease
	leasesDenied   bool
	leaseWrites    int
	leaseConflicts int

	nodes         map[string]*corev1.Node
	nodeEvents    []*corev1.Event
	nodesDenied   bool
	eventsDenied  bool
	patches       int
	patchRefusals int

	// objects are the pods and DaemonSets (pods.go).
	objects podStore
}

type event struct {
	rv    int64
	typ   string
	slice *discoveryv1.EndpointSlice
}

// Option changes a Server.
type Option func(*Server)

// WatchList makes the server answer client-go's streaming list
// (sendInitialEvents=true), as kube-apiserver does with its WatchList
// feature on; without it, such a request is refused with 422 as by an API
// server without the feature, and the client falls back to LIST.
func WatchList(on bool) Option { return func(s *Server) { s.watchList = on } }

// Delay makes every LIST, and a streaming list's first events, wait d: a
// slow API server, or a large list.
func Delay(d time.Duration) Option { return func(s *Server) { s.delay = d } }

// Start starts a server for namespace, closed at the test's cleanup.
func Start(t testing.TB, namespace string, opts ...Option) *Server {
	t.Helper()
	s := &Server{namespace: namespace, slices: map[string]*discoveryv1.EndpointSlice{}, changed: make(chan struct{}), rv: 100,
		leases: map[string]*coordinationv1.Lease{}, nodes: map[string]*corev1.Node{}}
	for _, o := range opts {
		o(s)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", s.serveSlices)
	mux.HandleFunc("GET /apis/coordination.k8s.io/v1/namespaces/{ns}/leases/{name}", s.getLease)
	mux.HandleFunc("POST /apis/coordination.k8s.io/v1/namespaces/{ns}/leases", s.createLease)
	mux.HandleFunc("PUT /apis/coordination.k8s.io/v1/namespaces/{ns}/leases/{name}", s.updateLease)
	mux.HandleFunc("GET /api/v1/nodes/{name}", s.getNode)
	mux.HandleFunc("PATCH /api/v1/nodes/{name}", s.patchNode)
	mux.HandleFunc("POST /api/v1/namespaces/{ns}/events", s.createEvent)
	s.servePods(mux)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeStatus(w, http.StatusNotFound, "NotFound", "the test API server does not serve "+r.URL.Path)
	})
	srv := httptest.NewServer(mux)
	s.URL = srv.URL
	t.Cleanup(func() {
		// Open watches end when the client goes; wake them to notice.
		s.mu.Lock()
		close(s.changed)
		s.changed = make(chan struct{})
		s.mu.Unlock()
		srv.CloseClientConnections()
		srv.Close()
	})
	return s
}

// Kubeconfig writes a kubeconfig file that points at the server and
// returns its path.
func (s *Server) Kubeconfig(t testing.TB) string {
	t.Helper()
	cfg := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: test
  cluster:
    server: %s
users:
- name: test
  user:
    token: test-token
contexts:
- name: test
  context:
    cluster: test
    user: test
    namespace: %s
current-context: test
`, s.URL, s.namespace)
	p := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(p, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// Forbid makes every request answer 403, as without RBAC for the
// EndpointSlices, or serve again.
func (s *Server) Forbid(on bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.forbidden = on
}

// Requests is how many LIST and WATCH requests the server answered.
func (s *Server) Requests() (lists, watches int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.lists, s.watches
}

// Apply creates the slice or replaces the one of its name: an ADDED or a
// MODIFIED event.
func (s *Server) Apply(slice *discoveryv1.EndpointSlice) {
	s.mu.Lock()
	defer s.mu.Unlock()
	slice = slice.DeepCopy()
	for i, e := range slice.Endpoints {
		// As the controller does: the pod's namespace is the slice's.
		if e.TargetRef != nil && e.TargetRef.Namespace == "" && slice.Namespace == "" {
			slice.Endpoints[i].TargetRef.Namespace = s.namespace
		}
	}
	slice.Namespace = s.namespace
	typ := "MODIFIED"
	if old, ok := s.slices[slice.Name]; ok {
		slice.UID, slice.CreationTimestamp = old.UID, old.CreationTimestamp
	} else {
		typ = "ADDED"
		slice.UID = types.UID("uid-" + slice.Name)
		slice.CreationTimestamp = metav1.NewTime(time.Now().Truncate(time.Second))
	}
	s.changeLocked(typ, slice)
}

// Delete removes the slice: a DELETED event.
func (s *Server) Delete(name string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	old, ok := s.slices[name]
	if !ok {
		return
	}
	s.changeLocked("DELETED", old.DeepCopy())
}

func (s *Server) changeLocked(typ string, slice *discoveryv1.EndpointSlice) {
	s.rv++
	slice.ResourceVersion = strconv.FormatInt(s.rv, 10)
	if typ == "DELETED" {
		delete(s.slices, slice.Name)
	} else {
		s.slices[slice.Name] = slice
	}
	s.events = append(s.events, event{rv: s.rv, typ: typ, slice: slice.DeepCopy()})
	close(s.changed)
	s.changed = make(chan struct{})
}

// Slice builds an EndpointSlice of service with one port, and endpoints,
// as the EndpointSlice controller makes it: labelled managed-by the
// controller, and owned by the Service.
func Slice(name, service, portName string, port int32, endpoints ...discoveryv1.Endpoint) *discoveryv1.EndpointSlice {
	return &discoveryv1.EndpointSlice{
		TypeMeta: metav1.TypeMeta{Kind: "EndpointSlice", APIVersion: "discovery.k8s.io/v1"},
		ObjectMeta: metav1.ObjectMeta{Name: name,
			Labels: map[string]string{discoveryv1.LabelServiceName: service, discoveryv1.LabelManagedBy: "endpointslice-controller.k8s.io"},
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "v1", Kind: "Service", Name: service, UID: types.UID("uid-service-" + service),
				Controller: ptr.To(true), BlockOwnerDeletion: ptr.To(true)}}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Endpoints:   endpoints,
		Ports:       []discoveryv1.EndpointPort{{Name: ptr.To(portName), Port: ptr.To(port), Protocol: ptr.To(corev1.ProtocolTCP)}},
	}
}

// Endpoint builds an endpoint on node (none if empty) at address, pointing
// at a Pod (the slice's namespace once applied); ready nil leaves the
// condition unset, which the API reads as ready.
func Endpoint(node, address string, ready *bool) discoveryv1.Endpoint {
	e := discoveryv1.Endpoint{Addresses: []string{address}, Conditions: discoveryv1.EndpointConditions{Ready: ready},
		TargetRef: &corev1.ObjectReference{Kind: "Pod", Name: "agent-" + address}}
	if node != "" {
		e.NodeName = ptr.To(node)
		e.TargetRef.Name = "agent-" + node
	}
	return e
}

func (s *Server) serveSlices(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	watching := q.Get("watch") == "true" || q.Get("watch") == "1"
	s.mu.Lock()
	if watching {
		s.watches++
	} else {
		s.lists++
	}
	forbidden := s.forbidden
	s.mu.Unlock()
	verb := "list"
	if watching {
		verb = "watch"
	}
	if forbidden {
		writeStatus(w, http.StatusForbidden, "Forbidden", fmt.Sprintf(`endpointslices.discovery.k8s.io is forbidden: User "system:serviceaccount:%s:gpu-orphan-dispatcher" cannot %s resource "endpointslices" in API group "discovery.k8s.io" in the namespace "%s"`,
			s.namespace, verb, r.PathValue("ns")))
		return
	}
	selector, err := labels.Parse(q.Get("labelSelector"))
	if err != nil {
		writeStatus(w, http.StatusBadRequest, "BadRequest", "labelSelector: "+err.Error())
		return
	}
	if r.PathValue("ns") != s.namespace {
		// Another namespace holds none of the slices.
		selector = labels.Nothing()
	}
	if !watching || q.Get("sendInitialEvents") == "true" && s.watchList {
		select {
		case <-time.After(s.delay):
		case <-r.Context().Done():
			return
		}
	}
	if !watching {
		s.list(w, selector)
		return
	}
	if q.Get("sendInitialEvents") == "true" && !s.watchList {
		writeStatus(w, http.StatusUnprocessableEntity, "Invalid", "ListOptions.meta.k8s.io \"\" is invalid: sendInitialEvents: Forbidden: sendInitialEvents is forbidden for watch unless the WatchList feature gate is enabled")
		return
	}
	s.watch(w, r, selector, q.Get("sendInitialEvents") == "true", q.Get("resourceVersion"))
}

func (s *Server) list(w http.ResponseWriter, selector labels.Selector) {
	s.mu.Lock()
	list := discoveryv1.EndpointSliceList{TypeMeta: metav1.TypeMeta{Kind: "EndpointSliceList", APIVersion: "discovery.k8s.io/v1"},
		ListMeta: metav1.ListMeta{ResourceVersion: strconv.FormatInt(s.rv, 10)}}
	for _, name := range slices.Sorted(maps.Keys(s.slices)) {
		if sl := s.slices[name]; selector.Matches(labels.Set(sl.Labels)) {
			list.Items = append(list.Items, *sl.DeepCopy())
		}
	}
	s.mu.Unlock()
	writeJSON(w, list)
}

// watch streams the events after resourceVersion (or, for a streaming
// list, the current slices and a bookmark first) until the client goes or
// the watch's timeoutSeconds pass.
func (s *Server) watch(w http.ResponseWriter, r *http.Request, selector labels.Selector, initial bool, from string) {
	flusher, ok := w.(http.Flusher)
	if !ok {
		writeStatus(w, http.StatusInternalServerError, "InternalError", "streaming unsupported")
		return
	}
	timeout := 10 * time.Minute
	if secs, err := strconv.Atoi(r.URL.Query().Get("timeoutSeconds")); err == nil && secs > 0 {
		timeout = time.Duration(secs) * time.Second
	}
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Transfer-Encoding", "chunked")
	w.WriteHeader(http.StatusOK)
	flusher.Flush()
	enc := json.NewEncoder(w)

	s.mu.Lock()
	last, _ := strconv.ParseInt(from, 10, 64)
	if initial || from == "" || from == "0" {
		last = s.rv
	}
	if initial {
		for _, name := range slices.Sorted(maps.Keys(s.slices)) {
			if sl := s.slices[name]; selector.Matches(labels.Set(sl.Labels)) {
				_ = enc.Encode(watchEvent{Type: "ADDED", Object: sl})
			}
		}
		bookmark := &discoveryv1.EndpointSlice{TypeMeta: metav1.TypeMeta{Kind: "EndpointSlice", APIVersion: "discovery.k8s.io/v1"},
			ObjectMeta: metav1.ObjectMeta{ResourceVersion: strconv.FormatInt(s.rv, 10),
				Annotations: map[string]string{metav1.InitialEventsAnnotationKey: "true"}}}
		_ = enc.Encode(watchEvent{Type: "BOOKMARK", Object: bookmark})
	}
	s.mu.Unlock()
	flusher.Flush()
	for {
		s.mu.Lock()
		var pending []event
		for _, e := range s.events {
			if e.rv > last && selector.Matches(labels.Set(e.slice.Labels)) {
				pending = append(pending, e)
			}
		}
		if len(s.events) > 0 {
			last = max(last, s.events[len(s.events)-1].rv)
		}
		changed := s.changed
		s.mu.Unlock()
		for _, e := range pending {
			if err := enc.Encode(watchEvent{Type: e.typ, Object: e.slice}); err != nil {
				return
			}
		}
		flusher.Flush()
		select {
		case <-changed:
		case <-r.Context().Done():
			return
		case <-deadline.C:
			return
		}
	}
}

// ForbidLeases makes every Lease request answer 403, as without RBAC for
// leases, or serve again.
func (s *Server) ForbidLeases(on bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.leasesDenied = on
}

// Lease returns a copy of the Lease called name, or nil.
func (s *Server) Lease(name string) *coordinationv1.Lease {
	s.mu.Lock()
	defer s.mu.Unlock()
	if l, ok := s.leases[name]; ok {
		return l.DeepCopy()
	}
	return nil
}

// LeaseWrites is how many creates and updates of Leases succeeded, and
// how many were refused as conflicts (a stale resourceVersion, or a
// create of one that exists).
func (s *Server) LeaseWrites() (writes, conflicts int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.leaseWrites, s.leaseConflicts
}

// leaseAccess answers 403 or 404 as the API server would, and reports
// whether the request may go on; s.mu is held.
func (s *Server) leaseAccessLocked(w http.ResponseWriter, r *http.Request, verb string) bool {
	if s.leasesDenied {
		writeStatus(w, http.StatusForbidden, "Forbidden", fmt.Sprintf(`leases.coordination.k8s.io is forbidden: User "system:serviceaccount:%s:gpu-orphan-dispatcher" cannot %s resource "leases" in API group "coordination.k8s.io" in the namespace "%s"`,
			s.namespace, verb, r.PathValue("ns")))
		return false
	}
	if r.PathValue("ns") != s.namespace {
		writeStatus(w, http.StatusNotFound, "NotFound", "the test API server serves leases of namespace "+s.namespace+" only")
		return false
	}
	return true
}

func (s *Server) getLease(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.leaseAccessLocked(w, r, "get") {
		return
	}
	l, ok := s.leases[r.PathValue("name")]
	if !ok {
		writeStatus(w, http.StatusNotFound, "NotFound", fmt.Sprintf(`leases.coordination.k8s.io %q not found`, r.PathValue("name")))
		return
	}
	writeJSON(w, l)
}

// readLease decodes a Lease from the request body.
func readLease(w http.ResponseWriter, r *http.Request) (*coordinationv1.Lease, bool) {
	var l coordinationv1.Lease
	if err := json.NewDecoder(r.Body).Decode(&l); err != nil || l.Name == "" {
		writeStatus(w, http.StatusBadRequest, "BadRequest", fmt.Sprintf("a Lease with a name: %v", err))
		return nil, false
	}
	return &l, true
}

func (s *Server) createLease(w http.ResponseWriter, r *http.Request) {
	l, ok := readLease(w, r)
	if !ok {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.leaseAccessLocked(w, r, "create") {
		return
	}
	if _, exists := s.leases[l.Name]; exists {
		s.leaseConflicts++
		writeStatus(w, http.StatusConflict, "AlreadyExists", fmt.Sprintf(`leases.coordination.k8s.io %q already exists`, l.Name))
		return
	}
	s.rv++
	l.Namespace, l.ResourceVersion = s.namespace, strconv.FormatInt(s.rv, 10)
	l.UID = types.UID("uid-lease-" + l.Name)
	l.CreationTimestamp = metav1.NewTime(time.Now().Truncate(time.Second))
	l.TypeMeta = metav1.TypeMeta{Kind: "Lease", APIVersion: "coordination.k8s.io/v1"}
	s.leases[l.Name] = l.DeepCopy()
	s.leaseWrites++
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	_ = json.NewEncoder(w).Encode(l)
}

func (s *Server) updateLease(w http.ResponseWriter, r *http.Request) {
	l, ok := readLease(w, r)
	if !ok {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.leaseAccessLocked(w, r, "update") {
		return
	}
	old, exists := s.leases[r.PathValue("name")]
	if !exists || l.Name != r.PathValue("name") {
		writeStatus(w, http.StatusNotFound, "NotFound", fmt.Sprintf(`leases.coordination.k8s.io %q not found`, r.PathValue("name")))
		return
	}
	if l.ResourceVersion != "" && l.ResourceVersion != old.ResourceVersion {
		s.leaseConflicts++
		writeStatus(w, http.StatusConflict, "Conflict", fmt.Sprintf(`Operation cannot be fulfilled on leases.coordination.k8s.io %q: the object has been modified; please apply your changes to the latest version and try again`, l.Name))
		return
	}
	s.rv++
	l.Namespace, l.ResourceVersion, l.UID, l.CreationTimestamp = s.namespace, strconv.FormatInt(s.rv, 10), old.UID, old.CreationTimestamp
	l.TypeMeta = metav1.TypeMeta{Kind: "Lease", APIVersion: "coordination.k8s.io/v1"}
	s.leases[l.Name] = l.DeepCopy()
	s.leaseWrites++
	writeJSON(w, l)
}

type watchEvent struct {
	Type   string `json:"type"`
	Object any    `json:"object"`
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(v)
}

// writeStatus answers with a metav1.Status, as the API server does.
func writeStatus(w http.ResponseWriter, code int, reason, message string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(metav1.Status{TypeMeta: metav1.TypeMeta{Kind: "Status", APIVersion: "v1"},
		Status: metav1.StatusFailure, Message: message, Reason: metav1.StatusReason(reason), Code: int32(code)})
}
