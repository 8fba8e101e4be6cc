// Package dispatch is the fleet's single webhook target: it forwards each
// alert to the remediator of the node it names, under fleet-wide limits,
// and retries an unreachable node before it records the action as failed.
// Once an agent took an alert, Follow collects the agent's result into the
// dispatcher's record (remediate.Action.Agent, with the agent's evidence,
// targets, freed bytes and dead owners), so that the dispatcher's audit
// store speaks for the whole fleet.
package dispatch

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net/http"
	"net/url"
	"os"
	"strings"
	"sync"
	"text/template"
	"time"

	amtemplate "github.com/prometheus/alertmanager/template"

	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/intake"
	"github.com/gpu-orphan/gpu-orphan/remediate/limits"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

// Config configures the fleet dispatcher.
type Config struct {
	// URLTemplate builds a node agent's base URL from {{.Node}}, e.g.
	// "https://{{.Node}}:10836". It fills only nodes that the targets name
	// with an empty URL: the allow-list vouches for every host contacted.
	URLTemplate string
	// Targets is the allow-list: node names to base URLs, "" for the
	// template's URL. TargetsFile, when set, is read instead, and read again
	// whenever it changes (its modification time or size).
	Targets     map[string]string
	TargetsFile string
	// Discovery is the second allow-list, agents found in the cluster
	// (package discovery). The targets win for the nodes they name: a
	// human's entry is not overridden by what the cluster says.
	Discovery AgentSource
	// Token is the fleet's secret, the agents' token: each request to a
	// node's agent is signed with the key it derives for that node
	// (intake.SignFleetRequest). The token itself is never sent: whoever
	// holds an agent's port learns nothing that works on another node,
	// later, or twice.
	Token  string
	Client *http.Client
	// Fleet holds the fleet's limits and breaker. Shared, when set,
	// keeps the limit's window together with the other dispatcher
	// replicas (package dispatch/lease), so that they never exceed it
	// together; Fleet's breaker still applies.
	Fleet     *limits.Fleet
	Shared    SharedWindow
	NodeLabel string
	// MaxAttempts bounds retries to an unreachable agent before the action
	// is recorded as failed (it is never dropped silently).
	MaxAttempts int
	// FollowInterval is how often Follow asks agents for the results it
	// waits for; FollowFor how long after an alert it keeps asking.
	FollowInterval time.Duration
	FollowFor      time.Duration
	// Labels returns the labels of the alert (fingerprint, startsAt) as
	// received; the store's AlertLabels. Without it, or without a record,
	// the forwarded alert has only the node, the uuid and the alertname.
	Labels func(ctx context.Context, fingerprint string, startsAt time.Time) (map[string]string, error)
	// Taints, when set (--escalate.taint), takes a node whose memory
	// cannot be brought back out of scheduling, and puts it back when its
	// GPU is clean (escalate).
	Taints *Taints
	// AlertAttempts is the store's bound on the actions of one alert
	// (store.RetryPolicy.MaxAttempts): the last attempt ending with the
	// memory held taints the node.
	AlertAttempts int
	Metrics       *remediate.Metrics
	Logger        *slog.Logger
}

// AgentSource gives the agents that a source vouches for: node name to
// base URL, current at each call.
type AgentSource interface {
	Agents() map[string]string
}

// SharedWindow is the fleet limit's window as the dispatcher replicas keep
// it together.
type SharedWindow interface {
	// Allow is limits.Fleet.Allow on the shared window. An error that is
	// not a *limits.Limited means the window could not be read or
	// written: the node is not served.
	Allow(ctx context.Context, node string, knownNodes int) error
}

// Dispatcher forwards each alert to the agent of the node it names.
type Dispatcher struct {
	cfg  Config
	tmpl *template.Template

	mu       sync.Mutex
	attempts map[string]int

	targetsMu    sync.Mutex
	targets      map[string]string
	targetsMtime time.Time
	targetsSize  int64
}

// New validates cfg and returns a Dispatcher.
func New(cfg Config) (*Dispatcher, error) {
	if cfg.TargetsFile == "" && len(cfg.Targets) == 0 && cfg.Discovery == nil {
		return nil, fmt.Errorf("the dispatcher needs an allow-list of its agents: --dispatch.targets-file (node to URL; --dispatch.url-template fills only the nodes it names with an empty URL), Kubernetes discovery (--dispatch.kubernetes.service), or both")
	}
	d := &Dispatcher{cfg: cfg, attempts: map[string]int{}, targets: cfg.Targets}
	if cfg.TargetsFile != "" {
		if err := d.reloadTargets(); err != nil {
			return nil, err
		}
	}
	if cfg.URLTemplate != "" {
		t, err := template.New("url").Option("missingkey=error").Parse(cfg.URLTemplate)
		if err != nil {
			return nil, fmt.Errorf("parsing --dispatch.url-template: %w", err)
		}
		d.tmpl = t
	}
	if d.cfg.MaxAttempts <= 0 {
		d.cfg.MaxAttempts = 8
	}
	client := &http.Client{Timeout: 10 * time.Second}
	if d.cfg.Client != nil {
		c := *d.cfg.Client
		client = &c
	}
	// A redirect would send the signed alert to a host that no
	// allow-list vouches for: the 3xx is the answer, and a failure.
	client.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	d.cfg.Client = client
	if d.cfg.NodeLabel == "" {
		d.cfg.NodeLabel = "node"
	}
	if d.cfg.FollowInterval <= 0 {
		d.cfg.FollowInterval = time.Second
	}
	if d.cfg.FollowFor <= 0 {
		d.cfg.FollowFor = DefaultFollowFor
	}
	if d.cfg.Logger == nil {
		d.cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if d.cfg.AlertAttempts <= 0 {
		d.cfg.AlertAttempts = store.DefaultMaxAttempts
	}
	return d, nil
}

// LoadTargets reads a targets file: a JSON object of node name to URL.
func LoadTargets(path string) (map[string]string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("reading the targets file: %w", err)
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	var m map[string]string
	if err := dec.Decode(&m); err != nil {
		return nil, fmt.Errorf("parsing the targets file %s (want {\"node\": \"https://node:10836\"}): %w", path, err)
	}
	for node, u := range m {
		if u == "" {
			continue // the URL template's, checked when it is used
		}
		if _, err := validURL(u); err != nil {
			return nil, fmt.Errorf("targets file %s, node %q: %w", path, node, err)
		}
	}
	return m, nil
}

// reloadTargets reads the targets file if it changed since it was last
// read. A file that cannot be read or parsed keeps the previous allow-list
// (and is an error at start-up).
func (d *Dispatcher) reloadTargets() error {
	if d.cfg.TargetsFile == "" {
		return nil
	}
	fi, err := os.Stat(d.cfg.TargetsFile)
	if err != nil {
		return fmt.Errorf("reading the targets file: %w", err)
	}
	d.targetsMu.Lock()
	defer d.targetsMu.Unlock()
	if d.targets != nil && fi.ModTime().Equal(d.targetsMtime) && fi.Size() == d.targetsSize {
		return nil
	}
	m, err := LoadTargets(d.cfg.TargetsFile)
	if err != nil {
		return err
	}
	if d.targets != nil {
		d.cfg.Logger.Info("Targets file reloaded", "path", d.cfg.TargetsFile, "nodes", len(m))
	}
	d.targets, d.targetsMtime, d.targetsSize = m, fi.ModTime(), fi.Size()
	return nil
}

// routes is the current allow-list: the targets, re-read when the file
// changed, over the discovered agents. Its size is the fleet's known nodes.
func (d *Dispatcher) routes() map[string]string {
	if err := d.reloadTargets(); err != nil {
		d.cfg.Logger.Error("Reloading the targets file failed; keeping the previous allow-list", "err", err)
	}
	d.targetsMu.Lock()
	targets := d.targets
	d.targetsMu.Unlock()
	if d.cfg.Discovery == nil {
		return targets
	}
	found := d.cfg.Discovery.Agents()
	if len(found) == 0 {
		return targets
	}
	merged := make(map[string]string, len(found)+len(targets))
	maps.Copy(merged, found)
	// The targets file wins for the nodes it names.
	maps.Copy(merged, targets)
	return merged
}

// Known reports whether node is on the allow-list with a usable URL. A
// node that is not is never contacted.
func (d *Dispatcher) Known(node string) bool {
	_, err := d.agentBase(node)
	return err == nil
}

// validNodeName keeps label values that could rewrite a URL (paths,
// queries, credentials, templates) out of the agent's address.
func validNodeName(node string) bool {
	if node == "" || len(node) > 253 {
		return false
	}
	for _, r := range node {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '.' || r == '_') {
			return false
		}
	}
	return true
}

func validURL(s string) (*url.URL, error) {
	u, err := url.Parse(s)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.User != nil {
		return nil, fmt.Errorf("invalid agent URL %q: want http(s)://host:port", s)
	}
	return u, nil
}

// agentURL is the webhook endpoint of node's agent.
func (d *Dispatcher) agentURL(node string) (string, error) {
	base, err := d.agentBase(node)
	if err != nil {
		return "", err
	}
	return base + "/api/v1/alerts", nil
}

// agentBase is the base URL of node's agent, from the allow-list only.
func (d *Dispatcher) agentBase(node string) (string, error) {
	base, ok := d.routes()[node]
	if !ok {
		return "", fmt.Errorf("node %q is on no allow-list (--dispatch.targets-file, Kubernetes discovery)", node)
	}
	if base == "" {
		if d.tmpl == nil || !validNodeName(node) {
			return "", fmt.Errorf("node %q has no URL in the targets file and no --dispatch.url-template can fill it", node)
		}
		var b strings.Builder
		if err := d.tmpl.Execute(&b, struct{ Node string }{node}); err != nil {
			return "", err
		}
		base = b.String()
	}
	u, err := validURL(base)
	if err != nil {
		return "", err
	}
	return strings.TrimSuffix(u.String(), "/"), nil
}

// Execute forwards one firing alert to its node (engine.Executor).
func (d *Dispatcher) Execute(ctx context.Context, a remediate.Action) (remediate.Action, time.Duration) {
	a.Source = "dispatch"
	if _, err := d.agentURL(a.Node); err != nil {
		// Taken off the allow-list since the alert came: never contacted.
		a.State, a.Reason = remediate.StateSkipped, "rejected: "+err.Error()
		return a, 0
	}
	if err := d.allow(ctx, a.Node, len(d.routes())); err != nil {
		if retry, limit, ok := limits.Retry(err); ok {
			d.cfg.Metrics.Limited.WithLabelValues(limit).Inc()
			a.State, a.Reason = remediate.StateQueued, "held back by the "+limit+" limit"
			return a, retry
		}
		// The shared window cannot be read or written: no node is
		// counted, so none is served.
		d.cfg.Logger.Warn("The fleet limit's shared window is unavailable; holding the alert back", "action", a.ID, "node", a.Node, "err", err)
		a.State, a.Reason = remediate.StateQueued, "waiting: "+err.Error()
		return a, 5 * time.Second
	}
	labels, err := d.labels(ctx, a)
	if err != nil {
		a.State, a.Reason = remediate.StateQueued, "retrying: reading the alert's labels: "+err.Error()
		return a, time.Second
	}
	// The allow-list again, as it is now: the URL is that of the node's
	// agent now, and a node taken off the list meanwhile gets nothing.
	target, err := d.agentURL(a.Node)
	if err != nil {
		a.State, a.Reason = remediate.StateSkipped, "rejected: "+err.Error()
		return a, 0
	}
	code, body, err := d.Forward(ctx, a.Node, target, labels, "firing", a.AlertFingerprint, a.AlertStartsAt)
	if err == nil && code/100 == 2 {
		d.forget(a.ID)
		d.cfg.Fleet.Report(a.Node, limits.Succeeded)
		a.State, a.Reason = remediate.StateSucceeded, "forwarded to "+target+": "+strings.TrimSpace(body)
		if a.Agent = agentResult(strings.TrimSuffix(target, "/api/v1/alerts"), a.AlertFingerprint, body); a.Agent == nil {
			d.cfg.Logger.Warn("The agent's reply names no action: its result will not be collected", "action", a.ID, "node", a.Node)
		} else if a.Agent.ActionID == "" {
			// The agent made no action of it (another node, a GPU it
			// does not have, a label it does not read): nothing was done.
			a.State, a.Reason = remediate.StateSkipped, a.Agent.Reason
		}
		return a, 0
	}
	reason := fmt.Sprintf("node agent %s answered %d: %s", target, code, strings.TrimSpace(body))
	if err != nil {
		reason = fmt.Sprintf("node agent %s unreachable: %v", target, err)
	} else if code/100 == 3 {
		reason = fmt.Sprintf("node agent %s answered %d (a redirect, never followed): %s", target, code, strings.TrimSpace(body))
	}
	retryable := err != nil || code/100 == 5
	n := d.attempt(a.ID)
	if retryable && n < d.cfg.MaxAttempts {
		d.cfg.Logger.Warn("Forwarding failed; will retry", "action", a.ID, "node", a.Node, "attempt", n, "err", reason)
		a.State, a.Reason = remediate.StateQueued, "retrying: "+reason
		return a, time.Duration(1<<min(n, 6)) * time.Second
	}
	d.forget(a.ID)
	// Whatever answered (the agent with its store full, or refusing; a
	// user's listener on the agent's port while the agent is down) or
	// did not: that node's trouble, which a user of that node can cause.
	// It is counted against the node, and never toward the fleet's
	// breaker: it never holds the other nodes' alerts back.
	times := d.cfg.Fleet.ReportUnavailable(a.Node)
	what := "refused"
	if retryable {
		what = "unavailable"
	}
	d.cfg.Logger.Error("Forwarding failed for good: the node's agent is "+what, "action", a.ID, "node", a.Node,
		"attempts", n, "unavailable_within_breaker_window", times, "err", reason)
	a.State, a.Reason = remediate.StateFailed, reason
	return a, 0
}

// allow asks the fleet limit for node: the window the replicas share when
// there is one, else this dispatcher's own.
func (d *Dispatcher) allow(ctx context.Context, node string, knownNodes int) error {
	if d.cfg.Shared != nil {
		return d.cfg.Shared.Allow(ctx, node, knownNodes)
	}
	return d.cfg.Fleet.Allow(node, knownNodes)
}

// labels are the alert's labels as the dispatcher received them, so that
// the agent reads its own --alert.*-label names; without a Labels source
// (or a record of them), the node and GPU under the default names.
func (d *Dispatcher) labels(ctx context.Context, a remediate.Action) (map[string]string, error) {
	if d.cfg.Labels != nil {
		l, err := d.cfg.Labels(ctx, a.AlertFingerprint, a.AlertStartsAt)
		if err != nil {
			return nil, err
		}
		if len(l) > 0 {
			return l, nil
		}
	}
	return map[string]string{d.cfg.NodeLabel: a.Node, "uuid": a.GPUUUID, "alertname": "GPUOrphanMemory"}, nil
}

func (d *Dispatcher) attempt(id string) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.attempts[id]++
	return d.attempts[id]
}

func (d *Dispatcher) forget(id string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	delete(d.attempts, id)
}

// ForwardResolved tells a node's agent that an alert resolved, so it can
// cancel queued work. It is best effort: the agent's fresh snapshot is the
// real safeguard. labels are the alert's, as received.
func (d *Dispatcher) ForwardResolved(ctx context.Context, node string, labels map[string]string, fingerprint string, startsAt time.Time) {
	target, err := d.agentURL(node)
	if err != nil {
		return
	}
	if _, _, err := d.Forward(ctx, node, target, labels, "resolved", fingerprint, startsAt); err != nil {
		d.cfg.Logger.Warn("Forwarding a resolved alert failed", "node", node, "err", err)
	}
}

// Forward posts a one-alert webhook payload (version 4) to a node agent,
// with the alert's labels as received, keeping its fingerprint and
// startsAt so the agent stays idempotent across dispatcher retries and
// across dispatcher replicas. The request is signed for node, whose agent
// target is.
func (d *Dispatcher) Forward(ctx context.Context, node, target string, labels map[string]string, status, fingerprint string, startsAt time.Time) (int, string, error) {
	alert := amtemplate.Alert{
		Status:      status,
		Labels:      amtemplate.KV(labels),
		Annotations: amtemplate.KV{},
		StartsAt:    startsAt,
		Fingerprint: fingerprint,
	}
	msg := intake.Message{
		Data: &amtemplate.Data{
			Receiver: "gpu-orphan-dispatcher", Status: status, Alerts: amtemplate.Alerts{alert},
			GroupLabels: amtemplate.KV{}, CommonLabels: alert.Labels, CommonAnnotations: amtemplate.KV{},
		},
		Version: intake.SupportedVersion, GroupKey: "gpu-orphan-dispatcher/" + labels[d.cfg.NodeLabel],
	}
	body, err := json.Marshal(msg)
	if err != nil {
		return 0, "", err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, target, bytes.NewReader(body))
	if err != nil {
		return 0, "", err
	}
	req.Header.Set("Content-Type", "application/json")
	if err := d.sign(req, body, node); err != nil {
		return 0, "", err
	}
	resp, err := d.cfg.Client.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	return resp.StatusCode, string(b), nil
}

// sign signs req, whose body is body, for node's agent with the fleet's
// secret; without a secret (agents that take client certificates, or
// none) it sends no credential.
func (d *Dispatcher) sign(req *http.Request, body []byte, node string) error {
	if d.cfg.Token == "" {
		return nil
	}
	return intake.SignFleetRequest(req, body, d.cfg.Token, node, time.Now())
}
