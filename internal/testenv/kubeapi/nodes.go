package kubeapi

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"mime"
	"net/http"
	"reflect"
	"strconv"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// Nodes are served too: get, and patch of their taints, strictly as the
// dispatcher writes them: Content-Type application/json-patch+json, and a
// body of exactly two operations, a test of /metadata/resourceVersion (a
// stale one is 409 Conflict, as kube-apiserver answers a failed test) and
// an add of /spec/taints, the whole list. Any other patch type, shape or
// path is refused (415, 422), so that a change of the dispatcher's patch
// shows in the tests. Events are created (core/v1, namespace default only,
// as Node events go there), and must name a Node as their involvedObject.

// AddNode adds a node with taints.
func (s *Server) AddNode(name string, taints ...corev1.Taint) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.rv++
	s.nodes[name] = &corev1.Node{TypeMeta: metav1.TypeMeta{Kind: "Node", APIVersion: "v1"},
		ObjectMeta: metav1.ObjectMeta{Name: name, UID: types.UID("uid-node-" + name), ResourceVersion: strconv.FormatInt(s.rv, 10),
			CreationTimestamp: metav1.NewTime(time.Now().Truncate(time.Second))},
		Spec: corev1.NodeSpec{Taints: taints}}
}

// Node returns a copy of the node, or nil.
func (s *Server) Node(name string) *corev1.Node {
	s.mu.Lock()
	defer s.mu.Unlock()
	if n, ok := s.nodes[name]; ok {
		return n.DeepCopy()
	}
	return nil
}

// NodeEvents returns the Events created, in order.
func (s *Server) NodeEvents() []corev1.Event {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]corev1.Event, len(s.nodeEvents))
	for i, e := range s.nodeEvents {
		out[i] = *e.DeepCopy()
	}
	return out
}

// Patches is how many node patches were applied, and how many refused
// (a bad patch, a conflict, or RBAC).
func (s *Server) Patches() (applied, refused int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.patches, s.patchRefusals
}

// ForbidNodes makes every node request answer 403, as without RBAC get
// and patch on nodes, or serve again; ForbidEvents does so for creating
// Events.
func (s *Server) ForbidNodes(on bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.nodesDenied = on
}

// ForbidEvents: see ForbidNodes.
func (s *Server) ForbidEvents(on bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.eventsDenied = on
}

func (s *Server) forbiddenNode(w http.ResponseWriter, verb, name string) {
	writeStatus(w, http.StatusForbidden, "Forbidden", fmt.Sprintf(`nodes %q is forbidden: User "system:serviceaccount:%s:gpu-orphan-dispatcher" cannot %s resource "nodes" in API group "" at the cluster scope`,
		name, s.namespace, verb))
}

func (s *Server) getNode(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	name := r.PathValue("name")
	if s.nodesDenied {
		s.forbiddenNode(w, "get", name)
		return
	}
	n, ok := s.nodes[name]
	if !ok {
		writeStatus(w, http.StatusNotFound, "NotFound", fmt.Sprintf(`nodes %q not found`, name))
		return
	}
	writeJSON(w, n)
}

func (s *Server) patchNode(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("name")
	body, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
	s.mu.Lock()
	defer s.mu.Unlock()
	refuse := func(code int, reason, msg string) {
		s.patchRefusals++
		writeStatus(w, code, reason, msg)
	}
	if s.nodesDenied {
		s.patchRefusals++
		s.forbiddenNode(w, "patch", name)
		return
	}
	if ct, _, _ := mime.ParseMediaType(r.Header.Get("Content-Type")); ct != string(types.JSONPatchType) {
		refuse(http.StatusUnsupportedMediaType, "UnsupportedMediaType", "the test API server takes node patches as application/json-patch+json only, not "+r.Header.Get("Content-Type"))
		return
	}
	if err != nil {
		refuse(http.StatusBadRequest, "BadRequest", err.Error())
		return
	}
	n, ok := s.nodes[name]
	if !ok {
		refuse(http.StatusNotFound, "NotFound", fmt.Sprintf(`nodes %q not found`, name))
		return
	}
	var ops []struct {
		Op    string          `json:"op"`
		Path  string          `json:"path"`
		Value json.RawMessage `json:"value"`
		From  string          `json:"from"`
	}
	if err := json.Unmarshal(body, &ops); err != nil {
		refuse(http.StatusBadRequest, "BadRequest", "a JSON patch: "+err.Error())
		return
	}
	if len(ops) != 2 || ops[0].Op != "test" || ops[0].Path != "/metadata/resourceVersion" || ops[1].Op != "add" || ops[1].Path != "/spec/taints" ||
		ops[0].From != "" || ops[1].From != "" {
		refuse(http.StatusUnprocessableEntity, "Invalid", "the test API server takes exactly [test /metadata/resourceVersion, add /spec/taints], not "+string(body))
		return
	}
	var rv string
	if err := json.Unmarshal(ops[0].Value, &rv); err != nil || rv == "" {
		refuse(http.StatusUnprocessableEntity, "Invalid", "test /metadata/resourceVersion wants a string value")
		return
	}
	if rv != n.ResourceVersion {
		refuse(http.StatusConflict, "Conflict", fmt.Sprintf(`Operation cannot be fulfilled on nodes %q: the object has been modified; please apply your changes to the latest version and try again`, name))
		return
	}
	var taints []corev1.Taint
	dec := json.NewDecoder(bytes.NewReader(ops[1].Value))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&taints); err != nil {
		refuse(http.StatusUnprocessableEntity, "Invalid", "spec.taints: "+err.Error())
		return
	}
	seen := map[string]bool{}
	for _, t := range taints {
		k := t.Key + ":" + string(t.Effect)
		if t.Key == "" || seen[k] || (t.Effect != corev1.TaintEffectNoSchedule && t.Effect != corev1.TaintEffectPreferNoSchedule && t.Effect != corev1.TaintEffectNoExecute) {
			refuse(http.StatusUnprocessableEntity, "Invalid", fmt.Sprintf("spec.taints: a taint must have a key and an effect, and be unique by key and effect: %+v", t))
			return
		}
		seen[k] = true
	}
	if len(taints) == 0 {
		taints = nil
	}
	if reflect.DeepEqual(taints, n.Spec.Taints) {
		writeJSON(w, n)
		return
	}
	s.rv++
	n.Spec.Taints, n.ResourceVersion = taints, strconv.FormatInt(s.rv, 10)
	s.patches++
	writeJSON(w, n)
}

func (s *Server) createEvent(w http.ResponseWriter, r *http.Request) {
	var ev corev1.Event
	err := json.NewDecoder(r.Body).Decode(&ev)
	s.mu.Lock()
	defer s.mu.Unlock()
	ns := r.PathValue("ns")
	if s.eventsDenied {
		writeStatus(w, http.StatusForbidden, "Forbidden", fmt.Sprintf(`events is forbidden: User "system:serviceaccount:%s:gpu-orphan-dispatcher" cannot create resource "events" in API group "" in the namespace "%s"`, s.namespace, ns))
		return
	}
	if err != nil {
		writeStatus(w, http.StatusBadRequest, "BadRequest", "an Event: "+err.Error())
		return
	}
	o := ev.InvolvedObject
	if ns != metav1.NamespaceDefault || ev.Namespace != ns || o.Kind != "Node" || o.APIVersion != "v1" || o.Name == "" || o.Namespace != "" || ev.Reason == "" || ev.Message == "" ||
		(ev.Type != corev1.EventTypeNormal && ev.Type != corev1.EventTypeWarning) {
		writeStatus(w, http.StatusUnprocessableEntity, "Invalid", fmt.Sprintf("the test API server takes Events on a Node in namespace default, with a reason, a message and a type: %+v", ev))
		return
	}
	if n, ok := s.nodes[o.Name]; !ok || n.UID != o.UID {
		writeStatus(w, http.StatusUnprocessableEntity, "Invalid", "involvedObject names no Node of that name and UID: "+o.Name+" "+string(o.UID))
		return
	}
	s.rv++
	if ev.Name == "" {
		ev.Name = ev.GenerateName + strconv.FormatInt(s.rv, 10)
	}
	ev.ResourceVersion, ev.UID = strconv.FormatInt(s.rv, 10), types.UID("uid-event-"+ev.Name)
	ev.TypeMeta = metav1.TypeMeta{Kind: "Event", APIVersion: "v1"}
	s.nodeEvents = append(s.nodeEvents, ev.DeepCopy())
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	_ = json.NewEncoder(w).Encode(ev)
}
