// Package discovery finds the dispatcher's node agents in Kubernetes: the
// EndpointSlices of the agents' Service (the DaemonSet's), watched through
// the API server, give each node's agent by the endpoint's nodeName. It is
// the dispatcher's second allow-list, beside its targets file: a node no
// ready endpoint names is not known, and never contacted.
//
// Only slices that the EndpointSlice controller made for the Service are
// read (its managed-by label, and the Service as their controlling owner),
// and only endpoints that point at a Pod of the Service's namespace: a
// slice that someone wrote by hand, or mirrored from an Endpoints object,
// names no agent. Labels and owner references can be copied by whoever
// may write EndpointSlices, so each endpoint is also checked against the
// pod it names (issue 24): the pod exists (with the targetRef's UID, when
// it has one), its controller is the agents' DaemonSet (by name and UID),
// it runs on the endpoint's node, at the endpoint's address, and serves
// the endpoint's port. That needs RBAC get on pods and on the DaemonSet.
//
// A read that fails at run time (a lost permission, an API server away)
// is counted by resource, logged at once and then at most once a minute
// while it goes on, and its recovery logged: the informer retries within
// a second at first, which would flood the log. Meanwhile the agents found
// before stay known, no new one is found, and an endpoint whose pod cannot
// be read is no agent until it can.
package discovery

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
)

// ServiceAccountNamespaceFile holds the pod's own namespace, mounted with
// its service account token.
const ServiceAccountNamespaceFile = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"

// ControllerName is the managed-by label's value on the slices that the
// EndpointSlice controller (kube-controller-manager) makes for a Service
// with a selector.
const ControllerName = "endpointslice-controller.k8s.io"

// Config configures the discovery of node agents.
type Config struct {
	// Service is the node agents' Service; its EndpointSlices carry the
	// label kubernetes.io/service-name=Service.
	Service string
	// Namespace is the Service's; empty means the pod's own, read from
	// NamespaceFile (ServiceAccountNamespaceFile when empty).
	Namespace     string
	NamespaceFile string
	// PortName is the EndpointSlice port that the agents serve on, and
	// Scheme (http or https) how they serve it.
	PortName string
	Scheme   string
	// Kubeconfig is a kubeconfig file, for running outside a cluster;
	// empty means the in-cluster configuration.
	Kubeconfig string
	// DaemonSet is the agents' DaemonSet in Namespace: an endpoint is an
	// agent only if it names a pod that this DaemonSet controls, on the
	// endpoint's node, at its address and port. Empty means Service's
	// name (the chart names both alike).
	DaemonSet string
	// SyncTimeout bounds the wait for the first list at Start.
	SyncTimeout time.Duration
	// Registerer gets the gauge of discovered agents and the counter of
	// failed reads; nil registers none.
	Registerer prometheus.Registerer
	Logger     *slog.Logger
}

// Kubernetes is the set of agents that the Service's EndpointSlices name,
// kept current by an informer (list, then watch). It is safe for
// concurrent use.
type Kubernetes struct {
	cfg        Config
	restConfig *rest.Config
	discovered prometheus.Gauge
	// failures of the reads of EndpointSlices, pods and the DaemonSet.
	slicesFailed, podsFailed, daemonSetFailed *failureLog

	// agents is node → agent, replaced whole on every change.
	agents atomic.Pointer[map[string]agent]
	// rebuildMu orders rebuilds: one from the informer's handler, one
	// after the first sync.
	rebuildMu sync.Mutex
	// warned is what the last rebuild ignored, and logged; under rebuildMu.
	warned map[string]bool
	// client reads the pods and the DaemonSet; set by Start.
	client kubernetes.Interface
	// checked holds each endpoint's check against its pod, by the
	// endpoint as its slice's version states it: "" for an agent, else
	// why not. Under rebuildMu; what the last rebuild did not see goes.
	checked map[string]string
	// podErr is the last error reading a pod or the DaemonSet that was
	// not a 404: a Forbidden one ends Start.
	podErr atomic.Pointer[error]
	// list is the informer's slices, for the rebuild that retries the
	// checks the API server could not answer (retry, under rebuildMu).
	list  func() []any
	retry *time.Timer
	// retryAfter is retryCheck but in tests.
	retryAfter time.Duration
	// stopped is set, under rebuildMu, when the discovery's context ends:
	// no retry is scheduled after it.
	stopped bool
	// runCtx is the discovery's: the pod reads end with it.
	runCtx context.Context
}

// retryCheck is how soon the endpoints whose pods could not be read are
// checked again.
const retryCheck = 5 * time.Second

// agent is the agent that discovery picked for one node.
type agent struct {
	url string
	// ready is how many ready endpoints the node had; more than one
	// during a rolling update.
	ready int
}

// New checks cfg and reads the client configuration; it does not contact
// the API server (Start does).
func New(cfg Config) (*Kubernetes, error) {
	if cfg.Service == "" {
		return nil, errors.New("kubernetes discovery needs the node agents' Service (--dispatch.kubernetes.service)")
	}
	if cfg.Scheme != "http" && cfg.Scheme != "https" {
		return nil, fmt.Errorf("--dispatch.kubernetes.scheme %q: want http or https", cfg.Scheme)
	}
	if cfg.PortName == "" {
		return nil, errors.New("--dispatch.kubernetes.port-name is empty: name the EndpointSlice port of the agents")
	}
	if cfg.SyncTimeout <= 0 {
		cfg.SyncTimeout = 30 * time.Second
	}
	if cfg.DaemonSet == "" {
		cfg.DaemonSet = cfg.Service
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.NamespaceFile == "" {
		cfg.NamespaceFile = ServiceAccountNamespaceFile
	}
	ns, err := namespace(cfg.Namespace, cfg.NamespaceFile)
	if err != nil {
		return nil, err
	}
	cfg.Namespace = ns
	rc, err := ClientConfig(cfg.Kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("kubernetes discovery: %w", err)
	}
	k := &Kubernetes{cfg: cfg, restConfig: rc, retryAfter: retryCheck, runCtx: context.Background()}
	k.agents.Store(&map[string]agent{})
	k.discovered = prometheus.NewGauge(prometheus.GaugeOpts{Namespace: "gpu_orphan", Subsystem: "dispatcher", Name: "discovered_agents",
		Help: "Nodes whose agent the dispatcher found ready in the agents' EndpointSlices (Kubernetes discovery)."})
	failed := prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "gpu_orphan", Subsystem: "dispatcher", Name: "discovery_errors_total",
		Help: "Failed reads of Kubernetes discovery, by resource: a list or watch of the agents' EndpointSlices, a get of a pod or of the agents' DaemonSet."},
		[]string{"resource"})
	k.slicesFailed = &failureLog{counter: failed.WithLabelValues("endpointslices"), logger: cfg.Logger,
		what: "listing and watching the agents' EndpointSlices", rbac: "RBAC verbs list and watch on endpointslices (API group discovery.k8s.io)"}
	k.podsFailed = &failureLog{counter: failed.WithLabelValues("pods"), logger: cfg.Logger,
		what: "reading the pods that the agents' endpoints name", rbac: "RBAC verb get on pods"}
	k.daemonSetFailed = &failureLog{counter: failed.WithLabelValues("daemonsets"), logger: cfg.Logger,
		what: "reading the agents' DaemonSet", rbac: "RBAC verb get on daemonsets (API group apps)"}
	for _, f := range []*failureLog{k.slicesFailed, k.podsFailed, k.daemonSetFailed} {
		f.namespace = cfg.Namespace
	}
	if cfg.Registerer != nil {
		for _, c := range []prometheus.Collector{k.discovered, failed} {
			if err := cfg.Registerer.Register(c); err != nil {
				return nil, err
			}
		}
	}
	return k, nil
}

// ClientConfig is the API server's configuration: from kubeconfig, a
// file, or else the pod's own (in-cluster).
func ClientConfig(kubeconfig string) (*rest.Config, error) {
	var (
		rc  *rest.Config
		err error
	)
	if kubeconfig != "" {
		rc, err = clientcmd.BuildConfigFromFlags("", kubeconfig)
	} else {
		rc, err = rest.InClusterConfig()
	}
	if err != nil {
		return nil, fmt.Errorf("the API server's configuration (in-cluster, or --dispatch.kubernetes.kubeconfig): %w", err)
	}
	rc.UserAgent = "gpu-orphan-remediator (dispatcher)"
	return rc, nil
}

// Namespace is flag, when set, or else the pod's own namespace, read
// from file (ServiceAccountNamespaceFile when empty).
func Namespace(flag, file string) (string, error) {
	if file == "" {
		file = ServiceAccountNamespaceFile
	}
	return namespace(flag, file)
}

// namespace is the flag's value, or else the pod's own namespace.
func namespace(flag, file string) (string, error) {
	if flag != "" {
		return flag, nil
	}
	b, err := os.ReadFile(file)
	if err != nil {
		return "", fmt.Errorf("kubernetes discovery: no --dispatch.kubernetes.namespace, and the pod's own namespace cannot be read: %w", err)
	}
	ns := strings.TrimSpace(string(b))
	if ns == "" {
		return "", fmt.Errorf("kubernetes discovery: no --dispatch.kubernetes.namespace, and %s is empty", file)
	}
	return ns, nil
}

// Agents returns the discovered agents' base URLs by node name.
func (k *Kubernetes) Agents() map[string]string {
	cur := *k.agents.Load()
	urls := make(map[string]string, len(cur))
	for node, a := range cur {
		urls[node] = a.url
	}
	return urls
}

// Start lists the Service's EndpointSlices and watches them until ctx
// ends. It returns once the first list is in, so that no node is taken
// for unknown only because the cache is still empty; it fails if the list
// is forbidden, or does not succeed within SyncTimeout.
func (k *Kubernetes) Start(ctx context.Context) (err error) {
	client, err := kubernetes.NewForConfig(k.restConfig)
	if err != nil {
		return fmt.Errorf("kubernetes discovery: %w", err)
	}
	// The pods are read one by one (RBAC get, no list): at the first sync,
	// one per node.
	rc := rest.CopyConfig(k.restConfig)
	rc.QPS, rc.Burst = 100, 200
	if k.client, err = kubernetes.NewForConfig(rc); err != nil {
		return fmt.Errorf("kubernetes discovery: %w", err)
	}
	selector := discoveryv1.LabelServiceName + "=" + k.cfg.Service
	factory := informers.NewSharedInformerFactoryWithOptions(client, 0, informers.WithNamespace(k.cfg.Namespace))
	informer := factory.InformerFor(&discoveryv1.EndpointSlice{}, func(client kubernetes.Interface, _ time.Duration) cache.SharedIndexInformer {
		return k.sliceInformer(client, selector)
	})

	var lastErr atomic.Pointer[error]
	// A refusal will not go away by waiting: it ends the start at once.
	refused := make(chan error, 1)
	if err := informer.SetWatchErrorHandlerWithContext(func(_ context.Context, _ *cache.Reflector, err error) {
		lastErr.Store(&err)
		if apierrors.IsForbidden(err) || apierrors.IsUnauthorized(err) {
			select {
			case refused <- err:
			default:
			}
		}
		if errors.Is(err, io.EOF) || apierrors.IsResourceExpired(err) || apierrors.IsGone(err) {
			// A watch that ended, or a list at a resourceVersion too old:
			// the informer lists again, nothing failed.
			k.cfg.Logger.Info("The watch of the agents' EndpointSlices ended; listing them again", "namespace", k.cfg.Namespace, "err", err)
			return
		}
		// The informer backs off and retries; the agents found so far
		// stay known meanwhile.
		k.slicesFailed.fail(err, "selector", selector)
	}); err != nil {
		return fmt.Errorf("kubernetes discovery: %w", err)
	}
	// Every change recomputes the agents from all the slices: a node's
	// endpoints may be spread over several.
	k.list = informer.GetStore().List
	changed := func(any) { k.rebuild(informer.GetStore().List()) }
	handler, err := informer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: changed, UpdateFunc: func(_, o any) { changed(o) }, DeleteFunc: changed,
	})
	if err != nil {
		return fmt.Errorf("kubernetes discovery: %w", err)
	}

	// The informer runs until ctx ends, or until a failed start stops it.
	runCtx, stop := context.WithCancel(ctx)
	defer func() {
		if err != nil {
			stop()
		}
	}()
	k.runCtx = runCtx
	factory.Start(runCtx.Done())
	go func() {
		<-runCtx.Done()
		k.stop()
		factory.Shutdown()
	}()
	synced := make(chan struct{})
	go func() {
		if cache.WaitForCacheSync(runCtx.Done(), handler.HasSynced) {
			close(synced)
		}
	}()
	timeout := time.NewTimer(k.cfg.SyncTimeout)
	defer timeout.Stop()
	where := fmt.Sprintf("the EndpointSlices of Service %s/%s (label %s)", k.cfg.Namespace, k.cfg.Service, selector)
	select {
	case <-synced:
	case err := <-refused:
		if apierrors.IsUnauthorized(err) {
			return fmt.Errorf("kubernetes discovery: the API server refused the dispatcher's credentials listing %s: %w", where, err)
		}
		return fmt.Errorf("kubernetes discovery: listing %s is forbidden: the dispatcher's service account needs RBAC verbs list and watch on endpointslices (API group discovery.k8s.io) in namespace %s: %w",
			where, k.cfg.Namespace, err)
	case <-timeout.C:
		why := "no answer"
		if p := lastErr.Load(); p != nil {
			why = (*p).Error()
		} else if err := probe(ctx, client, k.cfg.Namespace, selector); err != nil {
			// The informer retries some failures (a refused connection)
			// without reporting them: one list of our own says why.
			why = err.Error()
		}
		return fmt.Errorf("kubernetes discovery: could not list %s within --dispatch.kubernetes.sync-timeout=%s: %s", where, k.cfg.SyncTimeout, why)
	case <-ctx.Done():
		return ctx.Err()
	}
	// The handler has seen every listed slice; this rebuild also covers an
	// empty list, which calls no handler.
	k.rebuild(informer.GetStore().List())
	if p := k.podErr.Load(); p != nil && (apierrors.IsForbidden(*p) || apierrors.IsUnauthorized(*p)) {
		return fmt.Errorf("kubernetes discovery: reading the pods that the agents' endpoints name is forbidden: the dispatcher's service account needs RBAC verb get on pods and on daemonsets (API group apps) in namespace %s: %w",
			k.cfg.Namespace, *p)
	}
	k.cfg.Logger.Info("Kubernetes discovery synced", "namespace", k.cfg.Namespace, "service", k.cfg.Service, "agents", len(*k.agents.Load()))
	return nil
}

// sliceInformer is the informer of the Service's slices: the one of
// client-go's factory, but that the lists and watches tell failureLog
// when they work again, and that a watch that expires is logged.
func (k *Kubernetes) sliceInformer(client kubernetes.Interface, selector string) cache.SharedIndexInformer {
	api := client.DiscoveryV1().EndpointSlices(k.cfg.Namespace)
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			o.LabelSelector = selector
			l, err := api.List(ctx, o)
			if err == nil {
				k.slicesFailed.ok()
			}
			return l, err
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			o.LabelSelector = selector
			w, err := api.Watch(ctx, o)
			if err != nil {
				return nil, err
			}
			k.slicesFailed.ok()
			return newExpiryWatch(w, func(err error) {
				// client-go lists again, and says so only at klog's -v=4.
				k.cfg.Logger.Info("The API server ended the watch of the agents' EndpointSlices: its resourceVersion is too old (410 Gone); listing them again",
					"namespace", k.cfg.Namespace, "resource_version", o.ResourceVersion, "err", err)
			}), nil
		},
	}
	return cache.NewSharedIndexInformerWithOptions(cache.ToListWatcherWithWatchListSemantics(lw, client), &discoveryv1.EndpointSlice{},
		cache.SharedIndexInformerOptions{Indexers: cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc}})
}

// expiryWatch passes a watch's events on, and calls expired with the
// error event that ends it because its resourceVersion is too old.
type expiryWatch struct {
	watch.Interface
	events chan watch.Event
	done   chan struct{}
	once   sync.Once
}

func newExpiryWatch(w watch.Interface, expired func(error)) watch.Interface {
	ew := &expiryWatch{Interface: w, events: make(chan watch.Event), done: make(chan struct{})}
	go func() {
		defer close(ew.events)
		for e := range w.ResultChan() {
			if e.Type == watch.Error {
				if err := apierrors.FromObject(e.Object); apierrors.IsResourceExpired(err) || apierrors.IsGone(err) {
					expired(err)
				}
			}
			select {
			case ew.events <- e:
			case <-ew.done:
				// The reader stopped: no send may block this goroutine.
				return
			}
		}
	}()
	return ew
}

func (ew *expiryWatch) ResultChan() <-chan watch.Event { return ew.events }

func (ew *expiryWatch) Stop() {
	ew.once.Do(func() { close(ew.done) })
	ew.Interface.Stop()
}

// stop ends the retries: the discovery's context has ended.
func (k *Kubernetes) stop() {
	k.rebuildMu.Lock()
	defer k.rebuildMu.Unlock()
	k.stopped = true
	if k.retry != nil {
		k.retry.Stop()
		k.retry = nil
	}
}

// failureLog counts and logs the failures of one kind of read: the first
// at once, then at most a line a minute while they go on (at once when
// the reason changes: an API server away, then a 403), and the first
// success after them.
type failureLog struct {
	counter prometheus.Counter
	logger  *slog.Logger
	// what failed, and the permission that it needs, for the log.
	what, rbac, namespace string

	mu sync.Mutex
	// since is the first failure of those going on, zero when none;
	// logged the last line, and reason its error's; failures counts them.
	since, logged time.Time
	reason        metav1.StatusReason
	failures      int
}

// failureLogEvery is how often failures that go on are logged.
const failureLogEvery = time.Minute

func (f *failureLog) fail(err error, args ...any) {
	f.counter.Inc()
	f.mu.Lock()
	defer f.mu.Unlock()
	now, reason := time.Now(), apierrors.ReasonForError(err)
	f.failures++
	if f.since.IsZero() {
		f.since = now
	} else if now.Sub(f.logged) < failureLogEvery && reason == f.reason {
		return
	}
	f.logged, f.reason = now, reason
	args = append(args, "namespace", f.namespace, "failures", f.failures, "failing_for", now.Sub(f.since).Round(time.Second).String(), "err", err)
	if apierrors.IsForbidden(err) || apierrors.IsUnauthorized(err) {
		f.logger.Error("Kubernetes discovery: "+f.what+" is refused: the dispatcher's service account needs "+f.rbac+
			"; the agents found before stay known, and no other is found until it works again", args...)
		return
	}
	f.logger.Warn("Kubernetes discovery: "+f.what+" failed; retrying, the agents found before stay known", args...)
}

func (f *failureLog) ok() {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.since.IsZero() {
		return
	}
	f.logger.Info("Kubernetes discovery: "+f.what+" works again", "namespace", f.namespace, "failures", f.failures,
		"failed_for", time.Since(f.since).Round(time.Second).String())
	f.since, f.failures = time.Time{}, 0
}

// probe lists the slices once, for the error.
func probe(ctx context.Context, client kubernetes.Interface, namespace, selector string) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	_, err := client.DiscoveryV1().EndpointSlices(namespace).List(ctx, metav1.ListOptions{LabelSelector: selector, Limit: 1})
	return err
}

// rebuild recomputes the agents from every slice in the informer's store,
// and logs what changed.
func (k *Kubernetes) rebuild(objs []any) {
	k.rebuildMu.Lock()
	defer k.rebuildMu.Unlock()
	eps := make([]*discoveryv1.EndpointSlice, 0, len(objs))
	for _, o := range objs {
		if s, ok := o.(*discoveryv1.EndpointSlice); ok {
			eps = append(eps, s)
		}
	}
	// What is ignored is logged once per version of its slice, not on
	// every change of another.
	warned := map[string]bool{}
	checked, retry := map[string]string{}, false
	var ds *appsv1.DaemonSet // read once per rebuild, when an endpoint needs it
	next := pickAgents(eps, k.cfg.Service, k.cfg.PortName, k.cfg.Scheme, k.cfg.Logger, func(s *discoveryv1.EndpointSlice, msg string, args ...any) {
		key := s.Namespace + "/" + s.Name + "@" + s.ResourceVersion + ": " + fmt.Sprint(args...)
		warned[key] = true
		if !k.warned[key] {
			k.cfg.Logger.Warn(msg, args...)
		}
	}, func(s *discoveryv1.EndpointSlice, e discoveryv1.Endpoint, port int32) string {
		key := fmt.Sprintf("%s/%s@%s %s %s %s %s:%d", s.Namespace, s.Name, s.ResourceVersion, e.TargetRef.Name, e.TargetRef.UID, *e.NodeName, e.Addresses[0], port)
		why, ok := k.checked[key]
		if !ok {
			var transient bool
			if why, transient = k.checkPod(&ds, e, port); transient {
				// Not remembered: checked again at the next rebuild,
				// which comes soon.
				retry = true
				return why
			}
		}
		checked[key] = why
		return why
	})
	k.warned, k.checked = warned, checked
	if retry && k.list != nil && k.retry == nil && !k.stopped {
		k.retry = time.AfterFunc(k.retryAfter, func() {
			k.rebuildMu.Lock()
			k.retry = nil
			stopped := k.stopped
			k.rebuildMu.Unlock()
			if !stopped {
				k.rebuild(k.list())
			}
		})
	}
	prev := *k.agents.Load()
	var added, removed, changed []string
	for node, a := range next {
		switch p, ok := prev[node]; {
		case !ok:
			added = append(added, node)
		case p.url != a.url:
			changed = append(changed, node)
		default:
			continue
		}
		if a.ready > 1 {
			k.cfg.Logger.Info("Several ready agents on one node (a rolling update?); using the lowest address", "node", node, "url", a.url, "ready", a.ready)
		}
	}
	for node := range prev {
		if _, ok := next[node]; !ok {
			removed = append(removed, node)
		}
	}
	k.agents.Store(&next)
	k.discovered.Set(float64(len(next)))
	if len(added)+len(removed)+len(changed) > 0 {
		slices.Sort(added)
		slices.Sort(removed)
		slices.Sort(changed)
		k.cfg.Logger.Info("Discovered agents changed", "agents", len(next), "added", added, "removed", removed, "moved", changed)
	}
}

// checkPod says why endpoint e, at port, is not an agent, or "" when it
// is: the pod that its targetRef names exists (with the targetRef's UID
// when it has one), is controlled by the agents' DaemonSet, runs on the
// endpoint's node, has the endpoint's address and serves port. *ds is the
// DaemonSet, read at the first call that needs it. transient is true when
// the API server could not say (an error other than 404).
func (k *Kubernetes) checkPod(ds **appsv1.DaemonSet, e discoveryv1.Endpoint, port int32) (why string, transient bool) {
	ctx, cancel := context.WithTimeout(k.runCtx, 10*time.Second)
	defer cancel()
	failed := func(log *failureLog, what string, err error) (string, bool) {
		if !apierrors.IsNotFound(err) {
			k.podErr.Store(&err)
			log.fail(err, "read", what)
			return what + ": " + err.Error(), true
		}
		log.ok()
		return what + ": " + err.Error(), false
	}
	ref := e.TargetRef
	pod, err := k.client.CoreV1().Pods(ref.Namespace).Get(ctx, ref.Name, metav1.GetOptions{})
	if err != nil {
		return failed(k.podsFailed, "reading pod "+ref.Namespace+"/"+ref.Name, err)
	}
	k.podsFailed.ok()
	if ref.UID != "" && pod.UID != ref.UID {
		return fmt.Sprintf("pod %s is another pod of that name (UID %s, the endpoint names %s)", pod.Name, pod.UID, ref.UID), false
	}
	owner := metav1.GetControllerOf(pod)
	if owner == nil || owner.Kind != "DaemonSet" || owner.APIVersion != "apps/v1" || owner.Name != k.cfg.DaemonSet {
		return fmt.Sprintf("pod %s is not a pod of DaemonSet %s", pod.Name, k.cfg.DaemonSet), false
	}
	if *ds == nil {
		d, err := k.client.AppsV1().DaemonSets(k.cfg.Namespace).Get(ctx, k.cfg.DaemonSet, metav1.GetOptions{})
		if err != nil {
			return failed(k.daemonSetFailed, "reading DaemonSet "+k.cfg.Namespace+"/"+k.cfg.DaemonSet, err)
		}
		k.daemonSetFailed.ok()
		*ds = d
	}
	if owner.UID != (*ds).UID {
		return fmt.Sprintf("pod %s names DaemonSet %s with UID %s, not the DaemonSet's %s", pod.Name, k.cfg.DaemonSet, owner.UID, (*ds).UID), false
	}
	if pod.Spec.NodeName != *e.NodeName {
		return fmt.Sprintf("pod %s runs on node %q, not on %q", pod.Name, pod.Spec.NodeName, *e.NodeName), false
	}
	addr := e.Addresses[0]
	ips := []string{pod.Status.PodIP}
	for _, ip := range pod.Status.PodIPs {
		ips = append(ips, ip.IP)
	}
	if !slices.Contains(ips, addr) {
		return fmt.Sprintf("pod %s has no address %s (it has %s)", pod.Name, addr, strings.Join(slices.Compact(slices.Sorted(slices.Values(ips))), ", ")), false
	}
	for _, c := range pod.Spec.Containers {
		for _, p := range c.Ports {
			if p.ContainerPort == port {
				return "", false
			}
		}
	}
	return fmt.Sprintf("pod %s serves no port %d", pod.Name, port), false
}

// pickAgents picks each node's agent from the slices: an endpoint that is
// ready (or whose readiness is unknown, which the API says to take as
// ready) on a node, pointing at a Pod, at the port named portName, in a
// slice that the EndpointSlice controller made for service, and that
// verify (when not nil) finds to be an agent's. A node with several ready
// endpoints gets the lowest address, so that every dispatcher replica
// picks the same one.
// What it ignores it passes to ignore, with the slice, a message and
// attributes for the log.
func pickAgents(eps []*discoveryv1.EndpointSlice, service, portName, scheme string, logger *slog.Logger,
	ignore func(s *discoveryv1.EndpointSlice, msg string, args ...any),
	verify func(s *discoveryv1.EndpointSlice, e discoveryv1.Endpoint, port int32) string) map[string]agent {
	if ignore == nil {
		ignore = func(*discoveryv1.EndpointSlice, string, ...any) {}
	}
	candidates := map[string][]string{} // node → addresses
	ports := map[string]map[string]int32{}
	for _, s := range eps {
		if why := foreign(s, service); why != "" {
			ignore(s, "Ignoring an EndpointSlice that the EndpointSlice controller did not make for the agents' Service: it names no agent",
				"slice", s.Namespace+"/"+s.Name, "why", why)
			continue
		}
		port, ok := slicePort(s, portName)
		if !ok {
			logger.Debug("EndpointSlice has no port of the agents'", "slice", s.Name, "port_name", portName)
			continue
		}
		for _, e := range s.Endpoints {
			if e.Conditions.Ready != nil && !*e.Conditions.Ready {
				continue
			}
			if len(e.Addresses) == 0 {
				continue
			}
			if e.NodeName == nil || *e.NodeName == "" {
				// Without a node it speaks for no alert's node.
				logger.Debug("Ignoring an endpoint without nodeName", "slice", s.Name, "address", e.Addresses[0])
				continue
			}
			if r := e.TargetRef; r == nil || r.Kind != "Pod" || r.Name == "" || r.Namespace != s.Namespace {
				ignore(s, "Ignoring an endpoint that points at no Pod of the agents' namespace", "slice", s.Namespace+"/"+s.Name,
					"node", *e.NodeName, "address", e.Addresses[0], "target", targetString(r))
				continue
			}
			if verify != nil {
				if why := verify(s, e, port); why != "" {
					ignore(s, "Ignoring an endpoint that is not a pod of the agents' DaemonSet on its node", "slice", s.Namespace+"/"+s.Name,
						"node", *e.NodeName, "address", e.Addresses[0], "target", targetString(e.TargetRef), "why", why)
					continue
				}
			}
			node, addr := *e.NodeName, e.Addresses[0]
			if !slices.Contains(candidates[node], addr) {
				candidates[node] = append(candidates[node], addr)
			}
			if ports[node] == nil {
				ports[node] = map[string]int32{}
			}
			ports[node][addr] = port
		}
	}
	out := make(map[string]agent, len(candidates))
	for node, addrs := range candidates {
		slices.SortFunc(addrs, compareAddress)
		addr := addrs[0]
		out[node] = agent{url: scheme + "://" + net.JoinHostPort(addr, strconv.Itoa(int(ports[node][addr]))), ready: len(addrs)}
	}
	return out
}

// foreign says why a slice is not one that the EndpointSlice controller
// made for service, or "" when it is: the controller's managed-by label,
// and the Service as the slice's controlling owner.
func foreign(s *discoveryv1.EndpointSlice, service string) string {
	if by := s.Labels[discoveryv1.LabelManagedBy]; by != ControllerName {
		return fmt.Sprintf("label %s is %q, not %q", discoveryv1.LabelManagedBy, by, ControllerName)
	}
	owner := metav1.GetControllerOf(s)
	if owner == nil || owner.Kind != "Service" || owner.Name != service || owner.APIVersion != "v1" {
		return "its controlling owner is not Service " + service
	}
	return ""
}

func targetString(r *corev1.ObjectReference) string {
	if r == nil {
		return "none"
	}
	return r.Kind + " " + r.Namespace + "/" + r.Name
}

// slicePort is the number of the slice's port named name.
func slicePort(s *discoveryv1.EndpointSlice, name string) (int32, bool) {
	for _, p := range s.Ports {
		if p.Name != nil && *p.Name == name && p.Port != nil && *p.Port > 0 {
			return *p.Port, true
		}
	}
	return 0, false
}

// compareAddress orders IP addresses numerically, before host names.
func compareAddress(a, b string) int {
	ia, errA := netip.ParseAddr(a)
	ib, errB := netip.ParseAddr(b)
	switch {
	case errA == nil && errB == nil:
		return ia.Compare(ib)
	case errA == nil:
		return -1
	case errB == nil:
		return 1
	}
	return cmp.Compare(a, b)
}
