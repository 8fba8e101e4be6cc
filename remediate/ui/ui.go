// Package ui serves /actions: a page for people, with who leaks most (the
// report), the latest actions and the breaker's state. Plain html/template,
// no JavaScript: each action links to its JSON in the API.
package ui

import (
	"context"
	"crypto/sha256"
	"embed"
	"encoding/base64"
	"fmt"
	"html/template"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/prometheus/common/model"

	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/report"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

//go:embed actions.html
var files embed.FS

var page = template.Must(template.New("actions.html").Funcs(template.FuncMap{
	"mib":    func(b uint64) string { return fmt.Sprintf("%d MiB", b>>20) },
	"gibh":   func(v float64) string { return fmt.Sprintf("%.2f", v) },
	"when":   func(t time.Time) string { return t.UTC().Format("2006-01-02 15:04:05Z") },
	"joined": func(s []string) string { return strings.Join(s, " ") },
}).ParseFS(files, "actions.html"))

// Breaker says whether the circuit breaker holds work back.
type Breaker interface{ BreakerOpen() bool }

// Config is what the page reads.
type Config struct {
	Store   *store.Store
	Breaker Breaker
	// Role names the remediator's role on the page: node or dispatcher.
	Role string
	// Hosts, when not nil, are the names under which the page is served
	// (from --web.external-url and the listen addresses): a request whose
	// Host is another name gets 403, unless it is an IP address or
	// localhost. A page served without authentication needs it: through
	// DNS rebinding, another site's script reads the page under that
	// site's name.
	Hosts  []string
	Logger *slog.Logger
	now    func() time.Time
}

// Choices of the report's links.
var (
	sinceChoices = []string{"1h", "1d", "7d", "30d"}
	byChoices    = []report.By{report.ByUser, report.BySlurmJob, report.ByComm, report.ByNode}
)

// latest is how many actions the page lists.
const latest = 50

type link struct {
	Label, Href string
	Current     bool
}

type view struct {
	Role        string
	BreakerOpen bool
	By          report.By
	Since       string
	ByLinks     []link
	SinceLinks  []link
	Report      report.Report
	Actions     []actionView
}

type actionView struct {
	remediate.Action
	JSON       string
	DeadOwners []string
	Targets    []string
}

// Handler serves the page.
func Handler(cfg Config) http.Handler {
	if cfg.now == nil {
		cfg.now = time.Now
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		setSecurityHeaders(w.Header())
		if cfg.Hosts != nil && !hostAllowed(r.Host, cfg.Hosts) {
			cfg.Logger.Debug("Refused /actions for a foreign Host", "host", r.Host, "remote", r.RemoteAddr)
			http.Error(w, fmt.Sprintf("Host %q is not a name of this remediator: give its URL as --web.external-url to serve the page under it", r.Host),
				http.StatusForbidden)
			return
		}
		q := r.URL.Query()
		by, err := report.ParseBy(orDefault(q.Get("by"), string(report.ByUser)))
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		sinceText := orDefault(q.Get("since"), "7d")
		d, err := model.ParseDuration(sinceText)
		if err != nil || d <= 0 {
			http.Error(w, fmt.Sprintf("since: %q is not a duration such as 7d or 12h", sinceText), http.StatusBadRequest)
			return
		}
		v, err := cfg.view(r.Context(), by, sinceText, time.Duration(d))
		if err != nil {
			cfg.Logger.Error("Rendering /actions", "err", err)
			http.Error(w, "reading the audit store: "+err.Error(), http.StatusServiceUnavailable)
			return
		}
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		if err := page.Execute(w, v); err != nil {
			cfg.Logger.Error("Rendering /actions", "err", err)
		}
	})
}

func (cfg Config) view(ctx context.Context, by report.By, sinceText string, since time.Duration) (view, error) {
	now := cfg.now()
	from := now.Add(-since)
	acts, err := report.Collect(ctx, report.StoreSource{Store: cfg.Store}, from, now.Add(time.Second))
	if err != nil {
		return view{}, err
	}
	v := view{Role: cfg.Role, By: by, Since: sinceText, Report: report.Build(acts, by, from, now)}
	if cfg.Breaker != nil {
		v.BreakerOpen = cfg.Breaker.BreakerOpen()
	}
	for _, b := range byChoices {
		v.ByLinks = append(v.ByLinks, link{string(b), "?" + url.Values{"by": {string(b)}, "since": {sinceText}}.Encode(), b == by})
	}
	for _, s := range sinceChoices {
		v.SinceLinks = append(v.SinceLinks, link{s, "?" + url.Values{"by": {string(by)}, "since": {s}}.Encode(), s == sinceText})
	}
	recent, err := cfg.Store.Actions(ctx, store.Filter{Limit: latest})
	if err != nil {
		return view{}, err
	}
	for _, a := range recent {
		av := actionView{Action: a, JSON: "api/v1/actions/" + url.PathEscape(a.ID)}
		for _, o := range a.DeadOwners {
			av.DeadOwners = append(av.DeadOwners, o.Who())
		}
		for _, t := range a.Targets {
			av.Targets = append(av.Targets, fmt.Sprintf("%d %s %s → %s", t.PID, t.Comm, strings.Join(t.Signals, ","), orDefault(t.Outcome, "planned")))
		}
		v.Actions = append(v.Actions, av)
	}
	return v, nil
}

func orDefault(s, def string) string {
	if s == "" {
		return def
	}
	return s
}

// styleHash is the CSP hash of the page's one inline <style> element.
var styleHash = func() string {
	b, err := files.ReadFile("actions.html")
	if err != nil {
		panic(err)
	}
	_, rest, ok1 := strings.Cut(string(b), "<style>")
	css, _, ok2 := strings.Cut(rest, "</style>")
	if !ok1 || !ok2 {
		panic("actions.html has no <style> element")
	}
	sum := sha256.Sum256([]byte(css))
	return "'sha256-" + base64.StdEncoding.EncodeToString(sum[:]) + "'"
}()

// setSecurityHeaders: the page loads nothing, runs no script, submits no
// form and may not be framed; only its own inline style applies.
func setSecurityHeaders(h http.Header) {
	h.Set("Content-Security-Policy", "default-src 'none'; style-src "+styleHash+"; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
	h.Set("X-Frame-Options", "DENY")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "no-referrer")
}

// hostAllowed reports whether host, a request's Host header, names the
// remediator: an IP address (DNS rebinding needs a name), localhost, or
// one of names. Ports are not compared.
func hostAllowed(host string, names []string) bool {
	name := host
	if h, _, err := net.SplitHostPort(host); err == nil {
		name = h
	}
	name = strings.TrimSuffix(strings.ToLower(strings.Trim(name, "[]")), ".")
	if name == "" {
		return false
	}
	if net.ParseIP(name) != nil || name == "localhost" || strings.HasSuffix(name, ".localhost") {
		return true
	}
	for _, n := range names {
		if strings.EqualFold(strings.TrimSuffix(n, "."), name) {
			return true
		}
	}
	return false
}
