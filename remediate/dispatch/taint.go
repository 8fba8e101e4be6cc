package dispatch

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

// TaintKey is the key of the taint that takes a node whose GPU memory
// gpu-orphan cannot bring back out of scheduling; its value is the GPU's
// UUID, its effect NoSchedule.
const TaintKey = "gpu-orphan.io/unreclaimable-memory"

// EventNamespace is where the Events on a Node go: the namespace in which
// the kubelet and the node controller post theirs (a Node has none), so
// that `kubectl describe node` and `kubectl get events -n default` show
// them beside the kubelet's.
const EventNamespace = metav1.NamespaceDefault

// TaintConfig configures Taints.
type TaintConfig struct {
	// RESTConfig reaches the API server (discovery.ClientConfig).
	RESTConfig *rest.Config
	// MaxFraction bounds the known nodes that carry TaintKey at once,
	// rounded down but at least 1 (--dispatch.max-fraction).
	MaxFraction float64
	// Identity names this dispatcher in the Events (reportingInstance).
	Identity string
	Timeout  time.Duration
}

// Taints takes nodes out of scheduling and puts them back: a NoSchedule
// taint (TaintKey=<GPU UUID>) written with a JSON patch that tests the
// Node's resourceVersion, and an Event on the Node saying why. It needs
// RBAC get and patch on nodes and create on events in EventNamespace.
type Taints struct {
	cfg    TaintConfig
	client kubernetes.Interface
	// mu serialises the decisions, so that this dispatcher's count of
	// tainted nodes is never stale by its own writes.
	mu sync.Mutex
}

// NewTaints returns Taints through cfg.RESTConfig.
func NewTaints(cfg TaintConfig) (*Taints, error) {
	if cfg.Timeout <= 0 {
		cfg.Timeout = 10 * time.Second
	}
	if cfg.Identity == "" {
		cfg.Identity = "gpu-orphan-dispatcher"
	}
	rc := rest.CopyConfig(cfg.RESTConfig)
	// JSON, as the Lease's client (package lease) speaks.
	rc.ContentType, rc.AcceptContentTypes = "application/json", "application/json"
	// Counting the tainted nodes reads every known node (RBAC get, no
	// list): client-go's default of 5 a second would make it slow.
	rc.QPS, rc.Burst = 50, 100
	client, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("a Kubernetes client for the nodes' taints: %w", err)
	}
	return &Taints{cfg: cfg, client: client}, nil
}

// Taint outcomes.
const (
	TaintAdded   = "tainted"
	TaintAlready = "already tainted"
	TaintRemoved = "untainted"
	TaintAbsent  = "not tainted"
)

// ErrTaintBound is the refusal of a taint that would put more of the known
// nodes out of scheduling than MaxFraction allows.
var ErrTaintBound = errors.New("the fleet bound on tainted nodes")

// patchOp is one operation of a JSON patch (RFC 6902).
type patchOp struct {
	Op    string `json:"op"`
	Path  string `json:"path"`
	Value any    `json:"value"`
}

// Taint adds TaintKey=gpu:NoSchedule to node unless it carries TaintKey
// already (a taint is unique by key and effect: a second GPU of a tainted
// node leaves the first one's taint), or unless the known nodes that
// carry it would exceed the bound (ErrTaintBound). event is the Event
// posted, or the error posting it.
func (t *Taints) Taint(ctx context.Context, node, gpu, reason string, known []string) (result string, eventErr error, err error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	ctx, cancel := context.WithTimeout(ctx, t.cfg.Timeout)
	defer cancel()
	for attempt := 1; ; attempt++ {
		result, eventErr, err = t.taint(ctx, node, gpu, reason, known)
		if !stale(err) || attempt == patchAttempts {
			return result, eventErr, err
		}
	}
}

// patchAttempts bounds the reads and patches of one decision when other
// writers (the kubelet, the node controller, a label controller) keep
// changing the Node in between.
const patchAttempts = 10

// errStale is the refusal of a patch whose test of the resourceVersion
// failed: the Node changed since it was read, and the decision is made
// again on a fresh read.
var errStale = errors.New("the node changed since it was read")

// stale reports whether err is errStale, or a 409 Conflict.
func stale(err error) bool {
	return errors.Is(err, errStale) || apierrors.IsConflict(err)
}

// taint is one read, decision and patch of Taint.
func (t *Taints) taint(ctx context.Context, node, gpu, reason string, known []string) (result string, eventErr error, err error) {
	n, err := t.client.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
	if err != nil {
		return "", nil, fmt.Errorf("reading node %s: %w", node, err)
	}
	for _, tt := range n.Spec.Taints {
		if tt.Key == TaintKey && tt.Effect == corev1.TaintEffectNoSchedule {
			if tt.Value != gpu {
				return TaintAlready + " (for GPU " + tt.Value + ")", nil, nil
			}
			return TaintAlready, nil, nil
		}
	}
	tainted, err := t.count(ctx, known, node)
	if err != nil {
		return "", nil, err
	}
	limit := max(1, int(math.Floor(t.cfg.MaxFraction*float64(len(known)))))
	if tainted+1 > limit {
		return "", nil, fmt.Errorf("%w: %d of the %d known nodes carry %s already, at most %d may (--dispatch.max-fraction %g)",
			ErrTaintBound, tainted, len(known), TaintKey, limit, t.cfg.MaxFraction)
	}
	taints := append(append([]corev1.Taint{}, n.Spec.Taints...), corev1.Taint{Key: TaintKey, Value: gpu, Effect: corev1.TaintEffectNoSchedule,
		TimeAdded: &metav1.Time{Time: time.Now().UTC().Truncate(time.Second)}})
	if err := t.patch(ctx, n, taints); err != nil {
		return "", nil, err
	}
	return TaintAdded, t.event(ctx, n, corev1.EventTypeWarning, "GPUOrphanTainted",
		fmt.Sprintf("gpu-orphan took the node out of scheduling (taint %s=%s:NoSchedule): %s", TaintKey, gpu, reason)), nil
}

// Untaint removes TaintKey from node when its value is gpu.
func (t *Taints) Untaint(ctx context.Context, node, gpu, reason string) (result string, eventErr error, err error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	ctx, cancel := context.WithTimeout(ctx, t.cfg.Timeout)
	defer cancel()
	for attempt := 1; ; attempt++ {
		result, eventErr, err = t.untaint(ctx, node, gpu, reason)
		if !stale(err) || attempt == patchAttempts {
			return result, eventErr, err
		}
	}
}

// untaint is one read and patch of Untaint.
func (t *Taints) untaint(ctx context.Context, node, gpu, reason string) (result string, eventErr error, err error) {
	n, err := t.client.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
	if err != nil {
		return "", nil, fmt.Errorf("reading node %s: %w", node, err)
	}
	taints := []corev1.Taint{}
	for _, tt := range n.Spec.Taints {
		if tt.Key == TaintKey && tt.Value == gpu {
			continue
		}
		taints = append(taints, tt)
	}
	if len(taints) == len(n.Spec.Taints) {
		return TaintAbsent, nil, nil
	}
	if err := t.patch(ctx, n, taints); err != nil {
		return "", nil, err
	}
	return TaintRemoved, t.event(ctx, n, corev1.EventTypeNormal, "GPUOrphanUntainted",
		fmt.Sprintf("gpu-orphan put the node back into scheduling (taint %s=%s:NoSchedule removed): %s", TaintKey, gpu, reason)), nil
}

// count is how many of the known nodes other than self carry TaintKey. A
// node that is not there (404) carries none; any other error refuses.
func (t *Taints) count(ctx context.Context, known []string, self string) (int, error) {
	c := 0
	for _, name := range known {
		if name == self {
			continue
		}
		n, err := t.client.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			continue
		}
		if err != nil {
			return 0, fmt.Errorf("counting the tainted nodes: reading node %s: %w", name, err)
		}
		for _, tt := range n.Spec.Taints {
			if tt.Key == TaintKey {
				c++
				break
			}
		}
	}
	return c, nil
}

// patch replaces the node's taints with a JSON patch that first tests the
// resourceVersion it read: a node changed meanwhile (another replica, the
// kubelet) is a 409 Conflict, and nothing is written.
func (t *Taints) patch(ctx context.Context, n *corev1.Node, taints []corev1.Taint) error {
	body, err := json.Marshal([]patchOp{
		{Op: "test", Path: "/metadata/resourceVersion", Value: n.ResourceVersion},
		{Op: "add", Path: "/spec/taints", Value: taints},
	})
	if err != nil {
		return err
	}
	if _, err := t.client.CoreV1().Nodes().Patch(ctx, n.Name, types.JSONPatchType, body, metav1.PatchOptions{FieldManager: "gpu-orphan-dispatcher"}); err != nil {
		// kube-apiserver answers a failed test with 422 Invalid and no
		// detail of the operation (measured with v1.37.2,
		// TestTaintWhileNodeUpdated in test/kubernetes; not 409): a fresh
		// read tells a stale resourceVersion from a patch it refused.
		if apierrors.IsInvalid(err) {
			if cur, gerr := t.client.CoreV1().Nodes().Get(ctx, n.Name, metav1.GetOptions{}); gerr == nil && cur.ResourceVersion != n.ResourceVersion {
				return fmt.Errorf("patching the taints of node %s: %w (resourceVersion %s, now %s): %w", n.Name, errStale, n.ResourceVersion, cur.ResourceVersion, err)
			}
		}
		return fmt.Errorf("patching the taints of node %s: %w", n.Name, err)
	}
	return nil
}

// event posts an Event on the Node.
func (t *Taints) event(ctx context.Context, n *corev1.Node, typ, reason, message string) error {
	now := metav1.NewTime(time.Now().UTC().Truncate(time.Second))
	ev := &corev1.Event{
		ObjectMeta: metav1.ObjectMeta{GenerateName: n.Name + ".gpu-orphan.", Namespace: EventNamespace},
		InvolvedObject: corev1.ObjectReference{Kind: "Node", APIVersion: "v1", Name: n.Name, UID: n.UID,
			// As the kubelet refers to its Node.
			Namespace: ""},
		Reason: reason, Message: message, Type: typ,
		Source:         corev1.EventSource{Component: "gpu-orphan-dispatcher"},
		FirstTimestamp: now, LastTimestamp: now, Count: 1,
		ReportingController: "gpu-orphan.io/dispatcher", ReportingInstance: t.cfg.Identity,
	}
	if _, err := t.client.CoreV1().Events(EventNamespace).Create(ctx, ev, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("posting the Event on node %s: %w", n.Name, err)
	}
	return nil
}

// escalate takes a's node out of scheduling, or puts it back, once its
// agent finished: a failed cleanup that escalated (the memory is held by
// nothing it can see or prove), or the alert's last attempt ending with
// the memory held, taints; a cleanup that brought the memory back
// untaints. Each decision is an event of a.
func (d *Dispatcher) escalate(ctx context.Context, st ResultStore, a remediate.Action) {
	if d.cfg.Taints == nil || a.Agent == nil || a.DryRun {
		return
	}
	g := a.Agent
	switch {
	case g.State == remediate.StateFailed && a.Escalation != "":
		d.taint(ctx, st, a, "the cleanup ended "+string(g.State)+" with escalation "+a.Escalation+leftovers(a)+": "+g.Reason)
	case a.MemoryHeld() && a.Attempt >= d.cfg.AlertAttempts:
		d.taint(ctx, st, a, fmt.Sprintf("attempt %d of at most %d ended %s with the memory still held%s: %s", a.Attempt, d.cfg.AlertAttempts, g.State, leftovers(a), g.Reason))
	case g.State == remediate.StateSucceeded && !a.MemoryHeld():
		d.untaint(ctx, st, a.ID, a.Node, a.GPUUUID, "a cleanup brought the memory back (agent action "+g.ActionID+")")
	}
}

func leftovers(a remediate.Action) string {
	var kinds []string
	for _, l := range a.Leftover {
		k := l.Kind
		if l.PID != 0 {
			k += fmt.Sprintf(" PID %d", l.PID)
		}
		kinds = append(kinds, k)
	}
	if len(kinds) == 0 {
		return ""
	}
	return " (left over: " + strings.Join(kinds, "; ") + ")"
}

func (d *Dispatcher) taint(ctx context.Context, st ResultStore, a remediate.Action, reason string) {
	known := make([]string, 0)
	for n := range d.routes() {
		known = append(known, n)
	}
	detail := map[string]any{"node": a.Node, "gpu": a.GPUUUID, "reason": reason, "taint": TaintKey + "=" + a.GPUUUID + ":NoSchedule"}
	result, evErr, err := d.cfg.Taints.Taint(ctx, a.Node, a.GPUUUID, reason, known)
	kind := "taint"
	switch {
	case errors.Is(err, ErrTaintBound):
		kind, detail["refused"] = "taint_refused", err.Error()
		d.cfg.Logger.Warn("Not tainting the node: the fleet bound on tainted nodes is reached", "action", a.ID, "node", a.Node, "gpu", a.GPUUUID, "err", err)
	case err != nil:
		kind, detail["error"] = "taint_failed", err.Error()
		d.cfg.Logger.Error("Tainting the node failed", "action", a.ID, "node", a.Node, "gpu", a.GPUUUID, "err", err)
	default:
		detail["result"] = result
		d.cfg.Logger.Warn("Node taken out of scheduling", "action", a.ID, "node", a.Node, "gpu", a.GPUUUID, "result", result, "reason", reason)
	}
	d.recordEvent(ctx, st, a.ID, kind, detail, evErr)
}

func (d *Dispatcher) untaint(ctx context.Context, st ResultStore, actionID, node, gpu, reason string) {
	detail := map[string]any{"node": node, "gpu": gpu, "reason": reason}
	result, evErr, err := d.cfg.Taints.Untaint(ctx, node, gpu, reason)
	if err != nil {
		detail["error"] = err.Error()
		d.cfg.Logger.Error("Removing the node's taint failed", "action", actionID, "node", node, "gpu", gpu, "err", err)
		d.recordEvent(ctx, st, actionID, "untaint_failed", detail, nil)
		return
	}
	if result == TaintAbsent {
		return // nothing was done, nothing to record
	}
	detail["result"] = result
	d.cfg.Logger.Info("Node put back into scheduling", "action", actionID, "node", node, "gpu", gpu, "reason", reason)
	d.recordEvent(ctx, st, actionID, "untaint", detail, evErr)
}

func (d *Dispatcher) recordEvent(ctx context.Context, st ResultStore, actionID, kind string, detail map[string]any, evErr error) {
	if evErr != nil {
		detail["event_error"] = evErr.Error()
		d.cfg.Logger.Error("Posting the Event on the node failed", "action", actionID, "err", evErr)
	}
	if actionID == "" {
		return
	}
	if err := st.AddEvent(ctx, actionID, kind, detail); err != nil {
		d.cfg.Logger.Error("Recording a taint decision failed", "action", actionID, "kind", kind, "err", err)
	}
}

// AlertResolved puts node back into scheduling when gpu's taint is there:
// its alert resolved, the memory is back. The decision is an event of the
// latest action of that node and GPU.
func (d *Dispatcher) AlertResolved(ctx context.Context, st ResultStore, node, gpu string) {
	if d.cfg.Taints == nil || node == "" || gpu == "" {
		return
	}
	id := ""
	if acts, err := st.Actions(ctx, store.Filter{Node: node, GPU: gpu, Limit: 1}); err == nil && len(acts) > 0 {
		id = acts[0].ID
	}
	d.untaint(ctx, st, id, node, gpu, "the alert resolved")
}
