// Package ui serves /actions: a page for people, with who leaks most (the
// report), the latest actions, the policy, whether it acts, and the
// breaker's state; /actions/{id}, an action's detail (its targets, why
// each was chosen, its events); and the sign-in page that a browser gets
// in place of a 401. Plain html/template, no JavaScript; the pages refresh
// themselves with <meta http-equiv="refresh">.
package ui

import (
	"bytes"
	"crypto/sha256"
	"embed"
	"encoding/base64"
	"fmt"
	"html/template"
	"log/slog"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/prometheus/common/model"

	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/intake"
	"github.com/gpu-orphan/gpu-orphan/remediate/report"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

//go:embed actions.html action.html signin.html style.css
var files embed.FS

// style is the pages' one stylesheet, inline in each.
var style = func() string {
	b, err := files.ReadFile("style.css")
	if err != nil {
		panic(err)
	}
	return string(b)
}()

var pages = template.Must(template.New("").Funcs(template.FuncMap{
	"mib":    func(b uint64) string { return fmt.Sprintf("%d MiB", b>>20) },
	"gibh":   func(v float64) string { return fmt.Sprintf("%.2f", v) },
	"when":   func(t any) string { return when(t) },
	"joined": func(s []string) string { return strings.Join(s, " ") },
	"why":    why,
	// The stylesheet is the project's own, not input.
	"css": func() template.CSS { return template.CSS(style) }, //nolint:gosec
}).ParseFS(files, "*.html"))

func when(t any) string {
	switch t := t.(type) {
	case time.Time:
		return t.UTC().Format("2006-01-02 15:04:05Z")
	case *time.Time:
		if t != nil {
			return t.UTC().Format("2006-01-02 15:04:05Z")
		}
	}
	return "-"
}

// reasons say in words why a process was chosen as a target
// (remediate.Target.Reason).
var reasons = map[remediate.TargetReason]string{
	remediate.ReasonInheritedFromDeadOwner: "it inherited the GPU context of a dead owner",
	remediate.ReasonOrphaned:               "its session leader died and it was reparented (orphaned)",
	"process_group_member":                 "a member of a process group killed whole",
	"device_holder":                        "it holds the GPU (policy all-holders)",
	"inheritor_of_target":                  "it holds the context of an orphaned target (a descendant, or shares its files)",
}

func why(r remediate.TargetReason) string {
	if s, ok := reasons[r]; ok {
		return s
	}
	return string(r)
}

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
	Hosts []string
	// Policy and Act are the node's: what it targets, and whether it
	// signals or only records (a dry run). The dispatcher has neither.
	Policy remediate.Policy
	Act    bool
	// SignedIn reports whether a request came with a session cookie
	// (intake.Auth.SignedIn): the pages then offer to sign out.
	SignedIn func(*http.Request) bool
	Logger   *slog.Logger
	now      func() time.Time
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

// mode is the header of both pages: what the remediator does.
type mode struct {
	Role        string
	Policy      remediate.Policy
	Act         bool
	BreakerOpen bool
	// SignOut: the request came with a session cookie.
	SignOut bool
}

type view struct {
	Role       string
	Mode       mode
	By         report.By
	Since      string
	ByLinks    []link
	SinceLinks []link
	Report     report.Report
	Actions    []actionView
}

type actionView struct {
	remediate.Action
	// Href is the action's detail page, relative to /actions.
	Href       string
	DeadOwners []string
}

type detailView struct {
	remediate.Action
	Mode       mode
	Final      bool
	DeadOwners []string
	Events     []store.Event
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
		if cfg.Hosts != nil && !intake.HostAllowed(r.Host, cfg.Hosts) {
			cfg.Logger.Debug("Refused /actions for a foreign Host", "host", r.Host, "remote", r.RemoteAddr)
			http.Error(w, fmt.Sprintf("Host %q is not a name of this remediator: give its URL as --web.external-url to serve the page under it", r.Host),
				http.StatusForbidden)
			return
		}
		if id, ok := strings.CutPrefix(r.URL.Path, "/actions/"); ok {
			cfg.detail(w, r, id)
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
		v, err := cfg.view(r, by, sinceText, time.Duration(d))
		if err != nil {
			cfg.Logger.Error("Rendering /actions", "err", err)
			http.Error(w, "reading the audit store: "+err.Error(), http.StatusServiceUnavailable)
			return
		}
		cfg.render(w, http.StatusOK, "actions.html", v)
	})
}

// TrailingSlash answers /actions/ with a redirect to /actions, keeping the
// query: the page lives at /actions (its links are relative to it), and
// "/actions/" is what a person or a browser's completion often types.
// The Location is relative ("../actions"), so that it holds behind a proxy
// that serves the remediator under a path. It reveals nothing, so it needs
// no authentication.
func TrailingSlash(w http.ResponseWriter, r *http.Request) {
	target := "../actions"
	if r.URL.RawQuery != "" {
		target += "?" + r.URL.RawQuery
	}
	// Set by hand: http.Redirect would make the relative path absolute.
	w.Header().Set("Location", target)
	w.WriteHeader(http.StatusMovedPermanently)
}

// detail serves /actions/{id}.
func (cfg Config) detail(w http.ResponseWriter, r *http.Request, id string) {
	acts, err := cfg.Store.Actions(r.Context(), store.Filter{ID: id, Limit: 1})
	if err != nil {
		cfg.Logger.Error("Rendering /actions/{id}", "err", err)
		http.Error(w, "reading the audit store: "+err.Error(), http.StatusServiceUnavailable)
		return
	}
	if len(acts) == 0 {
		http.Error(w, fmt.Sprintf("no action %q", id), http.StatusNotFound)
		return
	}
	events, err := cfg.Store.Events(r.Context(), id)
	if err != nil {
		cfg.Logger.Error("Rendering /actions/{id}", "err", err)
		http.Error(w, "reading the audit store: "+err.Error(), http.StatusServiceUnavailable)
		return
	}
	a := acts[0]
	v := detailView{Action: a, Mode: cfg.mode(r), Final: a.State.Final(), DeadOwners: deadOwners(a), Events: events}
	cfg.render(w, http.StatusOK, "action.html", v)
}

func (cfg Config) mode(r *http.Request) mode {
	m := mode{Role: cfg.Role, Policy: cfg.Policy, Act: cfg.Act, SignOut: cfg.SignedIn != nil && cfg.SignedIn(r)}
	if cfg.Breaker != nil {
		m.BreakerOpen = cfg.Breaker.BreakerOpen()
	}
	return m
}

func deadOwners(a remediate.Action) []string {
	var out []string
	for _, o := range a.DeadOwners {
		out = append(out, o.Who())
	}
	return out
}

// render executes a page into a buffer first, so that a failure is a 500,
// not half a page.
func (cfg Config) render(w http.ResponseWriter, code int, name string, v any) {
	var b bytes.Buffer
	if err := pages.ExecuteTemplate(&b, name, v); err != nil {
		cfg.Logger.Error("Rendering a page", "page", name, "err", err)
		http.Error(w, "rendering the page: "+err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(code)
	w.Write(b.Bytes())
}

type signInView struct {
	Code        int
	Problem     string
	TokenSignIn bool
	Next        string
	Lifetime    string
}

// Denied is the page a browser gets in place of a refused /actions: how to
// sign in with the token, or to serve the page openly. It is
// intake.DeniedPage; the form posts to /actions/login (intake.Auth.Login).
func (cfg Config) Denied(w http.ResponseWriter, r *http.Request, code int, problem string, tokenSignIn bool) {
	h := w.Header()
	h.Set("Content-Security-Policy", "default-src 'none'; style-src "+styleHash+"; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
	h.Set("X-Frame-Options", "DENY")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "no-referrer")
	h.Set("Cache-Control", "no-store")
	next := r.URL.Path
	if r.Method == http.MethodPost {
		next = r.PostForm.Get("next")
	}
	if !strings.HasPrefix(next, "/actions") || next == "/actions/login" || next == "/actions/logout" {
		next = "/actions"
	}
	cfg.render(w, code, "signin.html", signInView{Code: code, Problem: problem, TokenSignIn: tokenSignIn, Next: next,
		Lifetime: sessionLifetime})
}

// sessionLifetime is intake.SessionLifetime in words.
const sessionLifetime = "12 hours"

func (cfg Config) view(r *http.Request, by report.By, sinceText string, since time.Duration) (view, error) {
	ctx := r.Context()
	now := cfg.now()
	from := now.Add(-since)
	acts, err := report.Collect(ctx, report.StoreSource{Store: cfg.Store}, from, now.Add(time.Second))
	if err != nil {
		return view{}, err
	}
	v := view{Role: cfg.Role, Mode: cfg.mode(r), By: by, Since: sinceText, Report: report.Build(acts, by, from, now)}
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
		av := actionView{Action: a, Href: "actions/" + url.PathEscape(a.ID), DeadOwners: deadOwners(a)}
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

// styleHash is the CSP hash of the pages' one inline <style> element.
var styleHash = func() string {
	sum := sha256.Sum256([]byte(style))
	return "'sha256-" + base64.StdEncoding.EncodeToString(sum[:]) + "'"
}()

// setSecurityHeaders: the pages load nothing, run no script, submit no
// form but their own sign-out, and may not be framed; only their own
// inline style applies.
func setSecurityHeaders(h http.Header) {
	h.Set("Content-Security-Policy", "default-src 'none'; style-src "+styleHash+"; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
	h.Set("X-Frame-Options", "DENY")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "no-referrer")
}
