// Package api serves the remediator's HTTP surface: the webhook, the audit
// log, the breaker reset, health and metrics.
package api

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"math"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"github.com/gorilla/mux"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/common/version"
	"github.com/prometheus/exporter-toolkit/web"

	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/intake"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

// Breaker is the circuit breaker a human resets.
type Breaker interface {
	Reset()
	BreakerOpen() bool
}

// Status is what GET /api/v1/status reports.
type Status struct {
	Role        string           `json:"role"`
	Node        string           `json:"node,omitempty"`
	Act         bool             `json:"act"`
	Policy      remediate.Policy `json:"policy,omitempty"`
	BreakerOpen bool             `json:"breaker_open"`
	StoreError  string           `json:"store_error,omitempty"`
	QueueDepth  int              `json:"queue_depth"`
}

// Config wires the API.
type Config struct {
	Webhook  http.Handler
	Auth     *intake.Auth
	Store    *store.Store
	Breaker  Breaker
	Registry *prometheus.Registry
	// Ready reports whether the remediator can take work now.
	Ready  func() error
	Status func(ctx context.Context) Status
	// ExternalURL is the URL browsers use to reach the remediator
	// (--web.external-url), if another than the request's own: an origin
	// that may send state-changing requests.
	ExternalURL *url.URL
	Logger      *slog.Logger
}

// NewRouter returns the remediator's router.
func NewRouter(cfg Config) (http.Handler, error) {
	r := mux.NewRouter()
	authed := r.PathPrefix("/api/v1").Subrouter()
	// Authenticated requests from another site are refused too: a
	// browser attaches a client certificate to a form another site submits.
	sameSite, err := cfg.Auth.RefuseCrossSite(cfg.ExternalURL)
	if err != nil {
		return nil, err
	}
	authed.Use(cfg.Auth.Wrap, sameSite)
	authed.Handle("/alerts", cfg.Webhook).Methods(http.MethodPost)
	authed.HandleFunc("/actions", cfg.listActions).Methods(http.MethodGet)
	authed.HandleFunc("/actions/{id}", cfg.getAction).Methods(http.MethodGet)
	authed.HandleFunc("/breaker/reset", cfg.resetBreaker).Methods(http.MethodPost)
	authed.HandleFunc("/status", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, cfg.Status(r.Context()))
	}).Methods(http.MethodGet)

	r.Handle("/metrics", promhttp.HandlerFor(cfg.Registry, promhttp.HandlerOpts{
		ErrorLog: slog.NewLogLogger(cfg.Logger.Handler(), slog.LevelError), MaxRequestsInFlight: 10, Registry: cfg.Registry,
	}))
	r.HandleFunc("/-/healthy", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "Healthy") })
	r.HandleFunc("/-/ready", func(w http.ResponseWriter, _ *http.Request) {
		if err := cfg.Ready(); err != nil {
			http.Error(w, "Not ready: "+err.Error(), http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "Ready")
	})
	landing, err := web.NewLandingPage(web.LandingConfig{
		Name:        "GPU Orphan Remediator",
		Description: "Takes Alertmanager's alerts and cleans up the processes that hold orphaned GPU memory, verified and rate-limited.",
		Version:     version.Info(),
		// pprof is not served.
		Profiling: "false",
		Links: []web.LandingLinks{
			{Address: "/actions", Text: "Actions", Description: "the page for people: who leaks most, the latest actions, the breaker (sign in with the webhook token, unless --web.ui.open)"},
			{Address: "/metrics", Text: "Metrics"},
			{Address: "/api/v1/actions", Text: "Actions, JSON (authenticated)"},
			{Address: "/api/v1/status", Text: "Status (authenticated)"},
			{Address: "/-/healthy", Text: "Health"},
			{Address: "/-/ready", Text: "Readiness"},
		},
	})
	if err != nil {
		return nil, err
	}
	r.Handle("/", landing)
	return r, nil
}

func (cfg Config) listActions(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	f := store.Filter{Node: q.Get("node"), GPU: q.Get("gpu"), State: remediate.State(q.Get("state")),
		User: q.Get("user"), SlurmJob: q.Get("slurm_job")}
	var err error
	if f.Since, err = parseTime(q.Get("since")); err != nil {
		writeError(w, http.StatusBadRequest, "since: %v", err)
		return
	}
	if f.Until, err = parseTime(q.Get("until")); err != nil {
		writeError(w, http.StatusBadRequest, "until: %v", err)
		return
	}
	if s := q.Get("limit"); s != "" {
		if f.Limit, err = strconv.Atoi(s); err != nil || f.Limit < 1 || f.Limit > 1000 {
			writeError(w, http.StatusBadRequest, "limit must be a number from 1 to 1000")
			return
		}
	}
	actions, err := cfg.Store.Actions(r.Context(), f)
	if err != nil {
		writeError(w, http.StatusInternalServerError, "reading the audit store: %v", err)
		return
	}
	if actions == nil {
		actions = []remediate.Action{}
	}
	writeJSON(w, http.StatusOK, actions)
}

// actionWithEvents is one action and its timeline.
type actionWithEvents struct {
	remediate.Action
	Events []store.Event `json:"events"`
}

func (cfg Config) getAction(w http.ResponseWriter, r *http.Request) {
	id := mux.Vars(r)["id"]
	actions, err := cfg.Store.Actions(r.Context(), store.Filter{ID: id, Limit: 1})
	if err != nil {
		writeError(w, http.StatusInternalServerError, "reading the audit store: %v", err)
		return
	}
	if len(actions) == 0 {
		writeError(w, http.StatusNotFound, "no action %q", id)
		return
	}
	events, err := cfg.Store.Events(r.Context(), id)
	if err != nil {
		writeError(w, http.StatusInternalServerError, "reading the audit store: %v", err)
		return
	}
	writeJSON(w, http.StatusOK, actionWithEvents{Action: actions[0], Events: events})
}

func (cfg Config) resetBreaker(w http.ResponseWriter, r *http.Request) {
	was := cfg.Breaker.BreakerOpen()
	cfg.Breaker.Reset()
	cfg.Logger.Warn("Circuit breaker reset by request", "remote", r.RemoteAddr, "was_open", was)
	writeJSON(w, http.StatusOK, map[string]bool{"was_open": was, "open": cfg.Breaker.BreakerOpen()})
}

// The times a query may name: 1970 through 9999, in UTC. Nothing in the
// audit log predates the Unix epoch, and the store keeps times as text
// with four-digit years, which a later time would not sort against.
var (
	minQueryTime = time.Unix(0, 0).UTC()
	maxQueryTime = time.Date(9999, 12, 31, 23, 59, 59, 999999999, time.UTC)
)

// parseTime accepts RFC 3339 or Unix seconds (a decimal number, fractions
// allowed), from 1970 through 9999. The empty string is the zero time: no
// bound.
func parseTime(s string) (time.Time, error) {
	if s == "" {
		return time.Time{}, nil
	}
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		if t.Before(minQueryTime) || t.After(maxQueryTime) {
			return time.Time{}, fmt.Errorf("%q is not between 1970 and 9999 (UTC)", s)
		}
		return t, nil
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil {
		return time.Time{}, fmt.Errorf("%q is neither RFC 3339 nor Unix seconds", s)
	}
	maxSec := maxQueryTime.Unix()
	if math.IsNaN(f) || math.IsInf(f, 0) || f < 0 || f >= float64(maxSec+1) {
		return time.Time{}, fmt.Errorf("%q is not a finite Unix time between 1970 and 9999 (0 <= seconds < %d)", s, maxSec+1)
	}
	// Seconds and nanoseconds apart: nanoseconds since 1970 overflow int64
	// in 2262. Truncating the fraction keeps the time within the bound.
	sec, frac := math.Modf(f)
	return time.Unix(int64(sec), int64(frac*1e9)), nil
}

// writeJSON replies v as indented JSON. It encodes before it writes the
// status, so that a value that cannot be encoded is a 500, not a 200 with
// half a body.
func writeJSON(w http.ResponseWriter, code int, v any) {
	body, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		http.Error(w, "encoding the reply: "+err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	w.Write(append(body, '\n'))
}

func writeError(w http.ResponseWriter, code int, format string, args ...any) {
	writeJSON(w, code, map[string]string{"error": fmt.Sprintf(format, args...)})
}
