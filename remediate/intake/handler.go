package intake

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"mime"
	"net/http"
	"strconv"
	"time"

	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

// Recorder durably records a notification; the store implements it.
type Recorder interface {
	RecordNotification(ctx context.Context, n store.Notification) ([]store.AlertOutcome, error)
}

// RoomChecker is implemented by a Recorder that can tell, before recording,
// that it is short of room; the store does. While it is, notifications get
// 503 (Alertmanager retries them) rather than eat into the reserve that
// running actions need to record their results.
type RoomChecker interface {
	CheckRoom(ctx context.Context) error
}

// Classifier decides whether an alert is work for this receiver. It
// returns the alert's node and GPU, and why it is ignored when it is not a
// candidate.
type Classifier func(labels map[string]string) (node, gpuUUID, ignoreReason string)

// Rejecter, when set, refuses an alert outright (the dispatcher: a node on
// no allow-list): it is recorded with the result "rejected", never work.
type Rejecter func(labels map[string]string) (reason string)

// Config configures the webhook handler.
type Config struct {
	Recorder Recorder
	Classify Classifier
	Reject   Rejecter
	// MaxBodyBytes bounds a request body; larger bodies get 413.
	MaxBodyBytes int64
	// Wake is called after alerts were accepted or resolved, to start work.
	Wake func()
	// Resolved, if set, is called for each recorded resolved alert that is
	// work for this receiver (the dispatcher passes it on to the node).
	Resolved func(store.Alert)
	Metrics  *remediate.Metrics
	Logger   *slog.Logger
}

// Handler serves POST /api/v1/alerts.
type Handler struct{ cfg Config }

// NewHandler returns the webhook handler.
func NewHandler(cfg Config) *Handler {
	if cfg.MaxBodyBytes <= 0 {
		cfg.MaxBodyBytes = 1 << 20
	}
	if cfg.Wake == nil {
		cfg.Wake = func() {}
	}
	return &Handler{cfg: cfg}
}

// Reply is the body of a successful intake.
type Reply struct {
	Received int                  `json:"received"`
	Results  map[string]int       `json:"results"`
	Alerts   []store.AlertOutcome `json:"alerts"`
}

func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	code, err := h.serve(w, r)
	h.cfg.Metrics.Requests.WithLabelValues(strconv.Itoa(code)).Inc()
	if err != nil {
		h.cfg.Logger.Warn("Rejected webhook request", "code", code, "remote", sourceOf(r), "err", err)
		httpError(w, code, "%v", err)
	}
}

// serve returns the status code, and an error to report when it is not 2xx.
// 4xx are final for Alertmanager; 5xx only when a retry could help.
func (h *Handler) serve(w http.ResponseWriter, r *http.Request) (int, error) {
	mt, _, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if err != nil || mt != "application/json" {
		return http.StatusUnsupportedMediaType, errors.New("Content-Type must be application/json")
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, h.cfg.MaxBodyBytes))
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			return http.StatusRequestEntityTooLarge, errors.New("payload larger than " + strconv.FormatInt(h.cfg.MaxBodyBytes, 10) + " bytes")
		}
		return http.StatusBadRequest, errors.New("reading the body: " + err.Error())
	}
	msg, err := ParseMessage(body)
	if err != nil {
		h.cfg.Metrics.Notifications.WithLabelValues("rejected").Inc()
		return http.StatusBadRequest, err
	}

	if rc, ok := h.cfg.Recorder.(RoomChecker); ok {
		// Other errors are left to RecordNotification, which reports them.
		if err := rc.CheckRoom(r.Context()); errors.Is(err, store.ErrNoRoom) {
			return http.StatusServiceUnavailable, errors.New("could not record the notification durably: " + err.Error())
		}
	}

	n := store.Notification{
		ReceivedAt: time.Now(), Remote: sourceOf(r), Receiver: msg.Receiver,
		GroupKey: msg.GroupKey, Status: msg.Status,
	}
	for _, a := range msg.Alerts {
		node, uuid, ignore := h.cfg.Classify(a.Labels)
		rejected := false
		if h.cfg.Reject != nil {
			if why := h.cfg.Reject(a.Labels); why != "" {
				ignore, rejected = why, true
			}
		}
		n.Alerts = append(n.Alerts, store.Alert{
			Fingerprint: a.Fingerprint, StartsAt: a.StartsAt, EndsAt: a.EndsAt, Status: a.Status,
			Node: node, GPUUUID: uuid, Labels: a.Labels, Candidate: ignore == "", IgnoreReason: ignore,
			Rejected: rejected,
		})
	}
	outcomes, err := h.cfg.Recorder.RecordNotification(r.Context(), n)
	if err != nil {
		// Nothing was recorded: Alertmanager should try again.
		return http.StatusServiceUnavailable, errors.New("could not record the notification durably: " + err.Error())
	}

	reply := Reply{Received: len(outcomes), Results: map[string]int{}, Alerts: outcomes}
	wake := false
	for _, o := range outcomes {
		reply.Results[o.Result]++
		h.cfg.Metrics.Notifications.WithLabelValues(o.Result).Inc()
		wake = wake || o.Result == "accepted" || o.Result == "resolved"
	}
	h.cfg.Logger.Info("Notification recorded", "remote", n.Remote, "receiver", n.Receiver, "alerts", len(outcomes), "results", reply.Results)
	if wake {
		h.cfg.Wake()
	}
	if h.cfg.Resolved != nil {
		for _, a := range n.Alerts {
			if a.Candidate && a.Status == "resolved" {
				h.cfg.Resolved(a)
			}
		}
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusOK)
	if err := json.NewEncoder(w).Encode(reply); err != nil {
		// The alerts are recorded and the status is sent; only the body
		// was lost, most likely with the client.
		h.cfg.Logger.Debug("Writing the webhook reply failed", "remote", sourceOf(r), "err", err)
	}
	return http.StatusOK, nil
}
