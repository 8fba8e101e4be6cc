package remediate

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the remediator's own instruments, shared by intake, the
// engine and the dispatcher. Names are listed in docs/metrics.md.
type Metrics struct {
	Notifications *prometheus.CounterVec
	Requests      *prometheus.CounterVec
	AuthFailures  prometheus.Counter
	Actions       *prometheus.CounterVec
	// FreedBytes and OrphanedEvents are by the user whose dead owner left
	// the memory (UnknownUser when not known); see CountOrphan.
	FreedBytes     *prometheus.CounterVec
	OrphanedEvents *prometheus.CounterVec
	ActionDuration prometheus.Histogram
	Signals        *prometheus.CounterVec
	Limited        *prometheus.CounterVec
	BreakerOpen    prometheus.Gauge
	QueueDepth     prometheus.Gauge
	StoreUp        prometheus.Gauge
	LastAction     *prometheus.GaugeVec
	// RecordedDescendants is snapshot.Lineage.RecordedDescendants.
	RecordedDescendants prometheus.Gauge
	// Escalations are by the user whose dead owner left the memory and
	// by Action.Escalation; see CountEscalation.
	Escalations *prometheus.CounterVec
}

// NewMetrics creates the instruments and registers them on reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	const ns, sub = "gpu_orphan", "remediator"
	m := &Metrics{
		Notifications: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Subsystem: sub, Name: "notifications_total",
			Help: "Alerts received, by result: accepted, duplicate, ignored, resolved, rejected."}, []string{"result"}),
		Requests: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Subsystem: sub, Name: "requests_total",
			Help: "Webhook requests by HTTP status code."}, []string{"code"}),
		AuthFailures: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Subsystem: sub, Name: "auth_failures_total",
			Help: "Requests with a missing or wrong token."}),
		Actions: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Subsystem: sub, Name: "actions_total",
			Help: "Finished actions by state: dry_run, succeeded, failed, skipped, interrupted."}, []string{"state"}),
		FreedBytes: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Subsystem: sub, Name: "freed_bytes_total",
			Help: "GPU memory verified back after cleanups, by the user whose dead process left it (unknown when the remediator never saw it alive), shared by the memory NVML charged each dead owner."}, []string{"user"}),
		OrphanedEvents: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Subsystem: sub, Name: "orphaned_events_total",
			Help: "Actions that acted on memory left by a dead process of this user (unknown when the remediator never saw it alive): one per action and user."}, []string{"user"}),
		ActionDuration: prometheus.NewHistogram(prometheus.HistogramOpts{Namespace: ns, Subsystem: sub, Name: "action_duration_seconds",
			Help: "Time from the start of an action to its verification.", Buckets: []float64{0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120}}),
		Signals: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Subsystem: sub, Name: "signals_total",
			Help: "Signals sent, through pidfds."}, []string{"signal"}),
		Limited: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Subsystem: sub, Name: "limited_total",
			Help: "Work held back by a limit: cooldown, gpu_busy, node_rate, concurrency, breaker, fleet_rate, or store (the audit store cannot be written)."}, []string{"limit"}),
		BreakerOpen: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Subsystem: sub, Name: "breaker_open",
			Help: "1 while the circuit breaker is open: no acting until POST /api/v1/breaker/reset."}),
		QueueDepth: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Subsystem: sub, Name: "queue_depth",
			Help: "Alerts recorded but not yet acted on."}),
		StoreUp: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Subsystem: sub, Name: "store_up",
			Help: "1 if the audit store accepts writes; 0 if not (the remediator then refuses to act)."}),
		LastAction: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: ns, Subsystem: sub, Name: "last_action_timestamp_seconds",
			Help: "When the last action with that state finished."}, []string{"state"}),
		RecordedDescendants: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Subsystem: sub, Name: "recorded_descendants",
			Help: "Processes seen descending from a GPU's owner, holding its GPU, while the owner lived: once it dies, the proof that they hold its context."}),
		Escalations: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Subsystem: sub, Name: "escalations_total",
			Help: "Cleanups whose targets all exited while the memory stayed held, by the user whose dead process left it (for traced_holder, the tracer's user) and by kind: hidden_holder (no process visible holds it), unproven_holder (holders nothing proves inherited it) or traced_holder (a tracer that is not a target holds the targets in a tracing stop). A human's case; never counted toward the circuit breaker."}, []string{"user", "kind"}),
	}
	for _, r := range []string{"accepted", "duplicate", "ignored", "resolved", "rejected"} {
		m.Notifications.WithLabelValues(r)
	}
	for _, s := range []State{StateDryRun, StateSucceeded, StateFailed, StateSkipped, StateInterrupted} {
		m.Actions.WithLabelValues(string(s))
	}
	for _, s := range []string{"SIGTERM", "SIGKILL"} {
		m.Signals.WithLabelValues(s)
	}
	for _, l := range []string{"cooldown", "gpu_busy", "node_rate", "concurrency", "breaker", "fleet_rate", "store"} {
		m.Limited.WithLabelValues(l)
	}
	reg.MustRegister(m.Notifications, m.Requests, m.AuthFailures, m.Actions, m.FreedBytes, m.OrphanedEvents, m.ActionDuration,
		m.Signals, m.Limited, m.BreakerOpen, m.QueueDepth, m.StoreUp, m.LastAction, m.RecordedDescendants, m.Escalations)
	return m
}

// CountEscalation counts an escalated action (Action.Escalation) once for
// each of its users (Action.EscalationUsers: the tracers' users for
// traced_holder, else its dead owners'), so that the
// users whose jobs leave memory nobody can reclaim stand out, while the
// breaker, which they cannot trip this way, keeps other users' cleanups
// going.
func (m *Metrics) CountEscalation(a Action) {
	for _, u := range a.EscalationUsers() {
		m.Escalations.WithLabelValues(u, a.Escalation).Inc()
	}
}

// UnknownUser is the user label of memory whose dead owner the remediator
// never saw alive, or that no dead owner was charged for.
const UnknownUser = "unknown"

// CountOrphan counts an action that acted (its ladder ran): one orphaned
// event for each user among its dead owners, and, when it succeeded, the
// freed bytes shared among those users by the memory NVML charged each
// (equally when it charged none). An action without dead owners (policy
// orphaned, acting on live orphaned owners) counts under UnknownUser, so
// that freed_bytes_total summed over user is all the memory freed.
func (m *Metrics) CountOrphan(a Action) {
	shares := map[string]float64{}
	var total float64
	for _, o := range a.DeadOwners {
		total += float64(o.UsedBytes)
	}
	for _, o := range a.DeadOwners {
		w := 1 / float64(len(a.DeadOwners))
		if total > 0 {
			w = float64(o.UsedBytes) / total
		}
		shares[o.UserLabel()] += w
	}
	if len(shares) == 0 {
		shares[UnknownUser] = 1
	}
	for user, w := range shares {
		m.OrphanedEvents.WithLabelValues(user).Inc()
		if a.State == StateSucceeded {
			m.FreedBytes.WithLabelValues(user).Add(float64(a.FreedBytes) * w)
		}
	}
}

// UserLabel is the dead owner's user as a metric label: UnknownUser when
// its identity is not known, its UID when the name was not.
func (o DeadOwner) UserLabel() string {
	switch {
	case !o.Known:
		return UnknownUser
	case o.User != "":
		return o.User
	case o.UID != nil:
		return strconv.Itoa(*o.UID)
	}
	return UnknownUser
}
