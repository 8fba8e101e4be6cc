package stack

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// The daemons' HTTP APIs, as far as the loop reads them. The remediator's
// types follow its JSON (README, "API"), not its Go types.

var httpClient = &http.Client{Timeout: 3 * time.Second}

func get(ctx context.Context, u, token string) ([]byte, int, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return nil, 0, err
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := httpClient.Do(req)
	if err != nil {
		return nil, 0, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return b, resp.StatusCode, err
}

// getJSON GETs u and decodes a 200 answer into v.
func getJSON(ctx context.Context, u, token string, v any) error {
	b, code, err := get(ctx, u, token)
	if err != nil {
		return err
	}
	if code != http.StatusOK {
		return fmt.Errorf("GET %s: %d: %s", u, code, bytes.TrimSpace(b))
	}
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("GET %s: %w: %s", u, err, b)
	}
	return nil
}

// statusOf GETs u and returns the status code, 0 if there was no answer.
func statusOf(ctx context.Context, u, token string) int {
	_, code, err := get(ctx, u, token)
	if err != nil {
		return 0
	}
	return code
}

// Scrape fetches and parses a /metrics page.
func Scrape(ctx context.Context, u string) (map[string]*dto.MetricFamily, error) {
	b, code, err := get(ctx, u, "")
	if err != nil {
		return nil, err
	}
	if code != http.StatusOK {
		return nil, fmt.Errorf("GET %s: %d", u, code)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	return p.TextToMetricFamilies(bytes.NewReader(b))
}

// Sample is one element of an instant vector from Prometheus's query API.
type Sample struct {
	Metric map[string]string `json:"metric"`
	Value  [2]any            `json:"value"`
}

// Float is the sample's value.
func (s Sample) Float() float64 {
	str, _ := s.Value[1].(string)
	f, _ := strconv.ParseFloat(str, 64)
	return f
}

// Query runs an instant query in Prometheus.
func (s *Stack) Query(ctx context.Context, q string) ([]Sample, error) {
	var r struct {
		Status string `json:"status"`
		Data   struct {
			ResultType string   `json:"resultType"`
			Result     []Sample `json:"result"`
		} `json:"data"`
	}
	if err := getJSON(ctx, s.URLs.Prometheus+"/api/v1/query?query="+url.QueryEscape(q), "", &r); err != nil {
		return nil, err
	}
	if r.Status != "success" || r.Data.ResultType != "vector" {
		return nil, fmt.Errorf("query %q: status %s, type %s", q, r.Status, r.Data.ResultType)
	}
	return r.Data.Result, nil
}

// PromAlert is an alert of Prometheus's /api/v1/alerts.
type PromAlert struct {
	Labels   map[string]string `json:"labels"`
	State    string            `json:"state"`
	ActiveAt time.Time         `json:"activeAt"`
	Value    string            `json:"value"`
}

// PromAlerts lists Prometheus's pending and firing alerts.
func (s *Stack) PromAlerts(ctx context.Context) ([]PromAlert, error) {
	var r struct {
		Data struct {
			Alerts []PromAlert `json:"alerts"`
		} `json:"data"`
	}
	err := getJSON(ctx, s.URLs.Prometheus+"/api/v1/alerts", "", &r)
	return r.Data.Alerts, err
}

// Rule is an alerting rule as Prometheus loaded it.
type Rule struct {
	File  string
	Name  string  `json:"name"`
	Query string  `json:"query"`
	For   float64 `json:"duration"` // seconds
}

// Rule returns the alerting rule called name that Prometheus evaluates.
func (s *Stack) Rule(ctx context.Context, name string) (Rule, error) {
	var r struct {
		Data struct {
			Groups []struct {
				File  string `json:"file"`
				Rules []Rule `json:"rules"`
			} `json:"groups"`
		} `json:"data"`
	}
	if err := getJSON(ctx, s.URLs.Prometheus+"/api/v1/rules", "", &r); err != nil {
		return Rule{}, err
	}
	n := 0
	for _, g := range r.Data.Groups {
		for _, rule := range g.Rules {
			n++
			if rule.Name == name {
				rule.File = g.File
				return rule, nil
			}
		}
	}
	return Rule{}, fmt.Errorf("no rule %s in Prometheus (%d rules)", name, n)
}

// AMAlert is an alert of Alertmanager's /api/v2/alerts.
type AMAlert struct {
	Labels      map[string]string `json:"labels"`
	Fingerprint string            `json:"fingerprint"`
	StartsAt    time.Time         `json:"startsAt"`
	Status      struct {
		State string `json:"state"`
	} `json:"status"`
	Receivers []struct {
		Name string `json:"name"`
	} `json:"receivers"`
}

// SentTo reports whether the alert is routed to receiver.
func (a AMAlert) SentTo(receiver string) bool {
	for _, r := range a.Receivers {
		if r.Name == receiver {
			return true
		}
	}
	return false
}

// AMAlerts lists Alertmanager's alerts.
func (s *Stack) AMAlerts(ctx context.Context) ([]AMAlert, error) {
	var r []AMAlert
	err := getJSON(ctx, s.URLs.Alertmanager+"/api/v2/alerts", "", &r)
	return r, err
}

// Action is a remediation as the remediator's API shows it.
type Action struct {
	ID               string     `json:"id"`
	Node             string     `json:"node"`
	GPUUUID          string     `json:"gpu_uuid"`
	GPUIndex         int        `json:"gpu_index"`
	Policy           Text       `json:"policy"`
	State            string     `json:"state"`
	Reason           Text       `json:"reason"`
	Source           string     `json:"source"`
	AlertFingerprint string     `json:"alert_fingerprint"`
	AlertStartsAt    time.Time  `json:"alert_starts_at"`
	FreedBytes       uint64     `json:"freed_bytes"`
	StartedAt        time.Time  `json:"started_at"`
	FinishedAt       *time.Time `json:"finished_at"`
	VerifySeconds    float64    `json:"verify_seconds"`
	Before           *Evidence  `json:"before"`
	After            *Evidence  `json:"after"`
	Targets          []Target   `json:"targets"`
	// DeadOwners are the dead PIDs NVML charged the memory to, named as
	// the remediator saw them alive; set once the action planned.
	DeadOwners []DeadOwner `json:"dead_owners"`
	Leftover   []struct {
		PID    int    `json:"pid"`
		Kind   Text   `json:"kind"`
		Detail string `json:"detail"`
	} `json:"leftover"`
	NextStep Text `json:"next_step"`
	// Events come with one action only (Stack.Action).
	Events []ActionEvent `json:"events"`
}

// Action states.
const (
	StateQueued    = "queued"
	StateRunning   = "running"
	StateSucceeded = "succeeded"
	StateDryRun    = "dry_run"
)

// Evidence is the GPU's memory at one moment of an action.
type Evidence struct {
	At                time.Time `json:"at"`
	UsedBytes         uint64    `json:"used_bytes"`
	UnownedBytes      uint64    `json:"unowned_bytes"`
	UnownedAgeSeconds float64   `json:"unowned_age_seconds"`
	DeadOwnerPIDs     []uint32  `json:"dead_owner_pids"`
	HolderPIDs        []int     `json:"holder_pids"`
}

// DeadOwner is a dead PID that NVML still charged memory to when the
// action planned, and who it was: Known when the remediator saw it alive.
type DeadOwner struct {
	PID       int    `json:"pid"`
	UsedBytes uint64 `json:"used_bytes"`
	Known     bool   `json:"known"`
	Comm      string `json:"comm"`
	User      string `json:"user"`
	SlurmJob  string `json:"slurm_job"`
	PodUID    string `json:"pod_uid"`
}

// Who says in one line who the dead owner was, as the remediator's
// /actions page and `gpu-orphan report` do: "PID 463: python3, user
// alice", or "PID 463: unknown".
func (o DeadOwner) Who() string {
	if !o.Known {
		return fmt.Sprintf("PID %d: unknown", o.PID)
	}
	s := fmt.Sprintf("PID %d: %s, user %s", o.PID, o.Comm, o.User)
	if o.SlurmJob != "" {
		s += ", Slurm job " + o.SlurmJob
	}
	if o.PodUID != "" {
		s += ", pod " + o.PodUID
	}
	return s
}

// Target is a process the action signals.
type Target struct {
	PID        int      `json:"pid"`
	PGID       int      `json:"pgid"`
	Comm       string   `json:"comm"`
	Reason     Text     `json:"reason"`
	WholeGroup bool     `json:"whole_group"`
	Outcome    Text     `json:"outcome"`
	Signals    []string `json:"signals"`
}

// ActionEvent is one step of an action's audit record.
type ActionEvent struct {
	Kind   string          `json:"kind"`
	At     time.Time       `json:"at"`
	Detail json.RawMessage `json:"detail"`
}

// Text is a reason, policy or outcome: a JSON string, or any other JSON
// value kept as its text, so that a richer form does not break the loop.
type Text string

func (t *Text) UnmarshalJSON(b []byte) error {
	var s string
	if json.Unmarshal(b, &s) == nil {
		*t = Text(s)
		return nil
	}
	if string(b) == "null" {
		*t = ""
		return nil
	}
	var buf bytes.Buffer
	if err := json.Compact(&buf, b); err != nil {
		return err
	}
	*t = Text(buf.String())
	return nil
}

// Actions lists the remediator's latest actions, newest first.
func (s *Stack) Actions(ctx context.Context) ([]Action, error) {
	var as []Action
	err := getJSON(ctx, s.URLs.Remediator+"/api/v1/actions?limit=20", s.Token, &as)
	return as, err
}

// Action returns one action with its events.
func (s *Stack) Action(ctx context.Context, id string) (Action, error) {
	var a Action
	err := getJSON(ctx, s.URLs.Remediator+"/api/v1/actions/"+url.PathEscape(id), s.Token, &a)
	return a, err
}

// Status GETs a path of the remediator, with the token or without, and
// returns the status code.
func (s *Stack) Status(ctx context.Context, path string, withToken bool) int {
	tok := ""
	if withToken {
		tok = s.Token
	}
	return statusOf(ctx, s.URLs.Remediator+path, tok)
}

// Series returns the metrics of a family whose labels include want.
func Series(mfs map[string]*dto.MetricFamily, name string, want map[string]string) []*dto.Metric {
	var out []*dto.Metric
	if mf := mfs[name]; mf != nil {
		for _, m := range mf.Metric {
			if hasLabels(m, want) {
				out = append(out, m)
			}
		}
	}
	return out
}

// Value returns the value of the first series of name whose labels
// include want, and whether there is one.
func Value(mfs map[string]*dto.MetricFamily, name string, want map[string]string) (float64, bool) {
	ms := Series(mfs, name, want)
	if len(ms) == 0 {
		return 0, false
	}
	m := ms[0]
	switch {
	case m.Gauge != nil:
		return m.Gauge.GetValue(), true
	case m.Counter != nil:
		return m.Counter.GetValue(), true
	case m.Untyped != nil:
		return m.Untyped.GetValue(), true
	}
	return 0, false
}

// Label returns a series' label value.
func Label(m *dto.Metric, name string) string {
	for _, l := range m.Label {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}

func hasLabels(m *dto.Metric, want map[string]string) bool {
	for k, v := range want {
		if Label(m, k) != v {
			return false
		}
	}
	return true
}
