package intake

import (
	"crypto/sha256"
	"crypto/subtle"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"golang.org/x/time/rate"

	"github.com/gpu-orphan/gpu-orphan/remediate"
)

// Auth checks callers: a bearer token compared in constant time, or a
// client certificate verified by the TLS layer (--web.config.file).
// Repeated failures from one source are rate-limited; a correct credential
// is admitted from any source.
type Auth struct {
	tokenSum [32]byte
	hasToken bool
	// sessionKey signs the pages' session cookies (session.go), for
	// scope, this remediator; secureURL: the external URL is https.
	sessionKey []byte
	scope      []byte
	secureURL  bool
	// revoked holds the sessions that a logout revoked, until they
	// expire; sessions issued before sessionsNotBefore (Unix seconds)
	// are revoked too. Under mu.
	revoked           map[string]time.Time
	sessionsNotBefore int64
	insecure          bool
	// hosts are the names, besides IP addresses and localhost, under
	// which a request without a credential is served with insecure
	// (crosssite.go, hostChecked).
	hosts []string
	// fleet checks the dispatcher's signed requests (fleetsig.go).
	fleet *fleetVerifier

	failRate  rate.Limit
	failBurst int
	mu        sync.Mutex
	// failures holds a budget per source, at most maxSources of them;
	// sources beyond share overflow.
	failures   map[string]*rate.Limiter
	maxSources int
	overflow   *rate.Limiter
	lastSweep  time.Time

	metrics *remediate.Metrics
	logger  *slog.Logger
	// warn logs rejected requests, a few per interval and then a count.
	warn *throttledLog
}

// AuthConfig configures Auth.
type AuthConfig struct {
	// TokenFile holds the bearer token. Empty means none.
	TokenFile string
	// InsecureNone allows requests with no authentication at all.
	InsecureNone bool
	// FailuresPerMinute and FailureBurst bound wrong tokens per source.
	FailuresPerMinute float64
	FailureBurst      int
	// MaxSources bounds the sources whose failures are counted one by
	// one (default DefaultMaxSources); the failures of sources beyond
	// share one budget, so that a scan from many addresses cannot grow
	// the table.
	MaxSources int
	// FleetNode is this node agent's name: requests that the dispatcher
	// signed for it with the token's per-node key are admitted
	// (fleetsig.go). Empty admits none.
	FleetNode string
	// Session is the remediator that the pages' session cookies are
	// bound to (session.go).
	Session SessionScope
	// Hosts are the names under which the remediator is served (the
	// host of --web.external-url and of the listen addresses): with
	// InsecureNone, a request that brings no credential is served only
	// under one of them, an IP address or localhost (DNS rebinding).
	Hosts []string
}

// DefaultMaxSources is AuthConfig.MaxSources's default: a few hundred
// kilobytes of failure budgets.
const DefaultMaxSources = 4096

// The warnings about rejected requests: at most warnBurst lines per
// warnInterval, then one line with the count of the others.
const (
	warnInterval = time.Minute
	warnBurst    = 10
)

// sweepEvery is how often budgets that are full again are forgotten; a
// full table is swept at most once a second.
const sweepEvery = time.Minute

// NewAuth reads the token file. Without a token, callers must present a
// verified client certificate, unless InsecureNone is set.
func NewAuth(cfg AuthConfig, m *remediate.Metrics, logger *slog.Logger) (*Auth, error) {
	a := &Auth{insecure: cfg.InsecureNone, failures: map[string]*rate.Limiter{}, maxSources: cfg.MaxSources, metrics: m, logger: logger,
		warn: newThrottledLog(logger, warnInterval, warnBurst), hosts: cfg.Hosts,
		scope: cfg.Session.encode(), revoked: map[string]time.Time{}}
	a.secureURL = cfg.Session.ExternalURL != nil && cfg.Session.ExternalURL.Scheme == "https"
	a.failRate = rate.Limit(cfg.FailuresPerMinute / 60)
	a.failBurst = cfg.FailureBurst
	if a.failBurst <= 0 {
		a.failBurst = 5
	}
	if cfg.FailuresPerMinute <= 0 {
		a.failRate = rate.Limit(10.0 / 60)
	}
	if a.maxSources <= 0 {
		a.maxSources = DefaultMaxSources
	}
	a.overflow = rate.NewLimiter(a.failRate, a.failBurst)
	if cfg.TokenFile != "" {
		tok, err := ReadTokenFile("--auth.token-file", cfg.TokenFile)
		if err != nil {
			return nil, err
		}
		a.tokenSum, a.hasToken = sha256.Sum256([]byte(tok)), true
		a.sessionKey = sessionKey(a.tokenSum)
		if cfg.FleetNode != "" {
			a.fleet = newFleetVerifier(tok, cfg.FleetNode, a.warn)
		}
	}
	return a, nil
}

// Wrap admits authenticated requests to next: the API's. The session
// cookie of the pages' sign-in form (session.go) is never accepted here.
// With --auth.insecure-none, a request without a credential is admitted
// under the Host check (hostChecked), which a DNS rebinding fails.
//
// A correct credential, a verified client certificate or the right bearer
// token, is always admitted, whatever the source did before: many callers
// can share one source address (all of Kubernetes behind one SNAT address,
// or Alertmanager behind the NAT a token guesser also uses), and
// Alertmanager does not retry a 429, so refusing a correct token would lose
// its notification for good. Only failures are limited: a missing or wrong
// token gets 401 and spends one of the source's failure budget; once the
// budget is spent, the source's failures get 429 instead, until it refills.
// The token is checked in constant time before the budget is looked at, so
// a correct guess from a blocked source is admitted like any other; the
// budget bounds how fast a source can guess, not whether a guess can win.
func (a *Auth) Wrap(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if a.admitted(r) {
			next.ServeHTTP(w, r)
			return
		}
		if a.insecure {
			a.hostChecked(next).ServeHTTP(w, r)
			return
		}
		source := sourceOf(r)
		if a.blocked(source) {
			a.metrics.Requests.WithLabelValues("429").Inc()
			httpError(w, http.StatusTooManyRequests, "too many failed authentication attempts from %s; try again later", source)
			return
		}
		a.metrics.AuthFailures.Inc()
		a.metrics.Requests.WithLabelValues("401").Inc()
		a.recordFailure(source)
		a.warn.Warn("Rejected unauthenticated request", "remote", source, "path", r.URL.Path)
		w.Header().Set("WWW-Authenticate", `Bearer realm="gpu-orphan-remediator"`)
		httpError(w, http.StatusUnauthorized, "missing or wrong bearer token")
	})
}

// admitted reports whether r brings a credential: a verified client
// certificate, the bearer token, or the dispatcher's signature. (The
// pages' session cookie is WrapPage's; --auth.insecure-none's requests
// without any are hostChecked's.)
func (a *Auth) admitted(r *http.Request) bool {
	return a.clientCertOK(r) || a.tokenOK(r) || a.fleet.ok(r)
}

func (a *Auth) clientCertOK(r *http.Request) bool {
	return r.TLS != nil && len(r.TLS.VerifiedChains) > 0
}

func (a *Auth) tokenOK(r *http.Request) bool {
	if !a.hasToken {
		return false
	}
	// The scheme is case-insensitive (RFC 9110, section 11.1), and
	// Alertmanager sends whatever its http_config's authorization.type says.
	scheme, tok, ok := strings.Cut(r.Header.Get("Authorization"), " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return false
	}
	return a.tokenMatches(tok)
}

// tokenMatches reports whether tok, trimmed, is the token: the bearer
// token's check and the sign-in form's. Hashing first makes the
// comparison constant-time in the length too.
func (a *Auth) tokenMatches(tok string) bool {
	sum := sha256.Sum256([]byte(strings.TrimSpace(tok)))
	return subtle.ConstantTimeCompare(sum[:], a.tokenSum[:]) == 1
}

// blocked reports whether source has used up its failure budget, without
// spending any of it. A source without a budget of its own, while the
// table is full, has the shared one.
func (a *Auth) blocked(source string) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	if l, ok := a.failures[budgetKey(source)]; ok {
		return l.Tokens() < 1
	}
	return len(a.failures) >= a.maxSources && a.overflow.Tokens() < 1
}

func (a *Auth) recordFailure(source string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	now := time.Now()
	key := budgetKey(source)
	l, ok := a.failures[key]
	if !ok && (now.Sub(a.lastSweep) > sweepEvery || len(a.failures) >= a.maxSources && now.Sub(a.lastSweep) > time.Second) {
		// Forget sources whose budget is full again.
		for k, l := range a.failures {
			if l.TokensAt(now) >= float64(a.failBurst) {
				delete(a.failures, k)
			}
		}
		a.lastSweep = now
	}
	switch {
	case ok:
	case len(a.failures) < a.maxSources:
		l = rate.NewLimiter(a.failRate, a.failBurst)
		a.failures[key] = l
	default:
		// Every source counted is still failing: the others share one
		// budget. It blocks their wrong tokens sooner, never a correct
		// credential.
		l = a.overflow
	}
	l.AllowN(now, 1)
}

// budgetKey is the failure budget's key of a source: the address, but an
// IPv6 address's /64, which one host usually has whole.
func budgetKey(source string) string {
	ip := net.ParseIP(source)
	if ip == nil || ip.To4() != nil {
		return source
	}
	return ip.Mask(net.CIDRMask(64, 128)).String() + "/64"
}

func sourceOf(r *http.Request) string {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		return r.RemoteAddr
	}
	return host
}

// httpError writes a plain-text error that says what was wrong.
func httpError(w http.ResponseWriter, code int, format string, args ...any) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(code)
	fmt.Fprintf(w, format+"\n", args...)
}
