package intake

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"
)

// A browser cannot send a bearer token, so a person signs in to the pages
// (/actions) once with the token through a form, and gets a session
// cookie instead:
//
//   - The cookie holds an expiry, a random session ID and an HMAC of both
//     and of the remediator that issued it (SessionScope: its role, node
//     name, listen addresses and external URL), under a key derived from
//     the token, never the token. It is checked without state, so that
//     it holds across restarts and across a dispatcher's replicas (which
//     share a scope), and it dies with the token when the token changes.
//     Another remediator with the same token (every node agent of a
//     fleet) refuses it: its scope is not the one signed.
//   - It opens the pages only: a GET or HEAD of /actions or /actions/...
//     The API (/api/v1/...) never accepts it, nor does any request that
//     changes state: a cookie that leaks (cookies do not separate ports,
//     so a browser sends it to a user's server on another port of the
//     same host) reads the pages of one remediator, for the rest of its
//     12 hours at most, and nothing else.
//   - It is HttpOnly and SameSite=Strict (a browser does not send it with
//     a request another site starts). Over plain HTTP it is
//     gpu_orphan_session with Path=/actions, so that a browser keeps it
//     from the host's other paths (on every port). Served over TLS (the
//     request came over TLS, or --web.external-url is https: a proxy
//     terminates TLS) it is __Host-gpu_orphan_session, Secure: a browser
//     sends it over TLS only, and takes it only from a secure origin of
//     this very host, with no Domain and with Path=/, which the __Host-
//     prefix requires. We chose the prefix over the path there: a page
//     over plain HTTP on the same host can neither read nor overwrite a
//     __Host- cookie, and the /actions-only rule is the server's anyway
//     (sessionOK), over HTTP as over TLS.
//   - POST /actions/logout (same-origin, as the sign-in) clears the
//     cookie and revokes its session ID in this process, until the
//     cookie would have expired. A restart, or another dispatcher
//     replica, does not know of the revocation: the cookie is gone from
//     the browser, and a copy taken earlier lasts until its expiry there.

// SessionCookie is the name of the cookie that Login sets over plain HTTP;
// SecureSessionCookie its name when the pages are served over TLS.
const (
	SessionCookie       = "gpu_orphan_session"
	SecureSessionCookie = "__Host-" + SessionCookie
)

// SessionLifetime is how long a sign-in lasts.
const SessionLifetime = 12 * time.Hour

// maxLoginBody bounds the sign-in form.
const maxLoginBody = 4 << 10

// maxRevoked bounds the sessions that logouts revoked and that have not
// expired yet. Past it, every session issued so far is revoked at once.
const maxRevoked = 4096

// pagesPath is the path of the pages, the only one the cookie opens.
const pagesPath = "/actions"

// SessionScope is what a session cookie is bound to: the remediator that
// issued it. A cookie made under another scope is refused.
type SessionScope struct {
	// Role is node or dispatcher; Node this node's name (--node.name).
	Role, Node string
	// Listeners are the listen addresses (--web.listen-address).
	Listeners []string
	// ExternalURL is --web.external-url, if any; an https one also makes
	// the cookie Secure and __Host-.
	ExternalURL *url.URL
}

// encode is the scope as signed: JSON, so that no two scopes sign alike.
func (s SessionScope) encode() []byte {
	ext := ""
	if s.ExternalURL != nil {
		ext = s.ExternalURL.String()
	}
	listeners := slices.Clone(s.Listeners)
	slices.Sort(listeners)
	b, _ := json.Marshal(struct {
		Role, Node, ExternalURL string
		Listeners               []string
	}{s.Role, s.Node, ext, listeners})
	return b
}

// DeniedPage writes the body of a refusal of a page to a browser, with
// code as its status: a sign-in page. problem says what went wrong;
// tokenSignIn whether the sign-in form can be used (a token is set).
type DeniedPage func(w http.ResponseWriter, r *http.Request, code int, problem string, tokenSignIn bool)

func sessionKey(tokenSum [32]byte) []byte {
	return deriveKey(tokenSum[:], "gpu-orphan session key v2")
}

// newSession is a fresh cookie value for a session that ends at expires.
func (a *Auth) newSession(expires time.Time) string {
	id := make([]byte, 16)
	rand.Read(id)
	return a.session(expires, base64.RawURLEncoding.EncodeToString(id))
}

// session is the cookie's value for session id, ending at expires:
// EXPIRY.ID.MAC, the MAC over the version, the scope, the expiry and id.
func (a *Auth) session(expires time.Time, id string) string {
	exp := strconv.FormatInt(expires.Unix(), 10)
	return exp + "." + id + "." + base64.RawURLEncoding.EncodeToString(a.sessionMAC(exp, id))
}

func (a *Auth) sessionMAC(exp, id string) []byte {
	m := hmac.New(sha256.New, a.sessionKey)
	m.Write([]byte("gpu-orphan session v2\x00"))
	m.Write(a.scope)
	m.Write([]byte("\x00" + exp + "\x00" + id))
	return m.Sum(nil)
}

// secureSession reports whether r is served over TLS, as the browser sees
// it: the cookie is then Secure and __Host-.
func (a *Auth) secureSession(r *http.Request) bool {
	return r.TLS != nil || a.secureURL
}

// sessionCookieName is the name of the cookie for r.
func (a *Auth) sessionCookieName(r *http.Request) string {
	if a.secureSession(r) {
		return SecureSessionCookie
	}
	return SessionCookie
}

// onPages reports whether path is one of the pages' (/actions,
// /actions/...), the only paths a session opens.
func onPages(path string) bool {
	return path == pagesPath || strings.HasPrefix(path, pagesPath+"/")
}

// sessionOK reports whether r is a GET or HEAD of the pages that carries
// a session cookie of ours, issued under this remediator's scope, not
// expired and not revoked.
func (a *Auth) sessionOK(r *http.Request) bool {
	if r.Method != http.MethodGet && r.Method != http.MethodHead || !onPages(r.URL.Path) {
		return false
	}
	return a.SignedIn(r)
}

// validSession returns the ID and the expiry (Unix seconds) of r's
// session cookie, if the cookie is ours, under this scope, not expired
// and not revoked; whatever the request's method and path.
func (a *Auth) validSession(r *http.Request) (id string, exp int64, ok bool) {
	if !a.hasToken {
		return "", 0, false
	}
	c, err := r.Cookie(a.sessionCookieName(r))
	if err != nil {
		return "", 0, false
	}
	parts := strings.Split(c.Value, ".")
	if len(parts) != 3 || parts[1] == "" {
		return "", 0, false
	}
	id = parts[1]
	exp, err = strconv.ParseInt(parts[0], 10, 64)
	if err != nil || time.Now().Unix() >= exp {
		return "", 0, false
	}
	mac, err := base64.RawURLEncoding.DecodeString(parts[2])
	if err != nil || !hmac.Equal(mac, a.sessionMAC(parts[0], id)) || a.revokedSession(id, exp) {
		return "", 0, false
	}
	return id, exp, true
}

// revokedSession reports whether a logout revoked session id, which
// expires at Unix time exp.
func (a *Auth) revokedSession(id string, exp int64) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	if exp-int64(SessionLifetime/time.Second) < a.sessionsNotBefore {
		return true
	}
	_, ok := a.revoked[id]
	return ok
}

// revoke revokes session id, which expires at exp, in this process.
func (a *Auth) revoke(id string, exp time.Time) {
	a.mu.Lock()
	defer a.mu.Unlock()
	now := time.Now()
	if len(a.revoked) >= maxRevoked {
		for k, e := range a.revoked {
			if !now.Before(e) {
				delete(a.revoked, k)
			}
		}
	}
	if len(a.revoked) >= maxRevoked {
		// Every session issued up to now is revoked: a person signs in
		// again, and the table starts afresh.
		a.sessionsNotBefore = now.Unix() + 1
		clear(a.revoked)
		return
	}
	a.revoked[id] = exp
}

// WrapPage is Wrap for the pages a person opens in a browser: it also
// admits a GET or HEAD with the session cookie that Login sets, and
// answers a refused request with denied's page (a sign-in form) and 401.
// A wrong bearer token spends the source's failure budget as in Wrap (and
// gets 429 once it is spent); a browser that brings no credential does
// not. With --auth.insecure-none, a request without a credential is
// admitted under the Host check only (hostChecked).
func (a *Auth) WrapPage(next http.Handler, denied DeniedPage) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if a.admitted(r) || a.sessionOK(r) {
			next.ServeHTTP(w, r)
			return
		}
		if a.insecure {
			a.hostChecked(next).ServeHTTP(w, r)
			return
		}
		problem := ""
		if r.Header.Get("Authorization") != "" {
			// A wrong credential is a guess: it spends the budget as
			// Wrap's do. A browser that comes without one is not.
			source := sourceOf(r)
			if a.blocked(source) {
				a.metrics.Requests.WithLabelValues("429").Inc()
				denied(w, r, http.StatusTooManyRequests, "Too many failed sign-ins from "+source+": try again later.", a.hasToken)
				return
			}
			a.metrics.AuthFailures.Inc()
			a.recordFailure(source)
			a.warn.Warn("Rejected unauthenticated request", "remote", source, "path", r.URL.Path)
			problem = "Wrong credentials."
		}
		a.metrics.Requests.WithLabelValues("401").Inc()
		w.Header().Set("WWW-Authenticate", `Bearer realm="gpu-orphan-remediator"`)
		denied(w, r, http.StatusUnauthorized, problem, a.hasToken)
	})
}

// sameOrigin is the cross-origin protection of the sign-in and sign-out
// forms: a form of the page's own origin, or of externalURL's.
func (a *Auth) sameOrigin(externalURL *url.URL, what string, denied DeniedPage) (*http.CrossOriginProtection, error) {
	return a.crossOriginProtection(externalURL, func(w http.ResponseWriter, r *http.Request) {
		a.warn.Warn("Refused a cross-site "+what, "remote", sourceOf(r), "origin", r.Header.Get("Origin"))
		denied(w, r, http.StatusForbidden, "A "+what+" from another site is refused. If browsers reach the remediator under another URL, give it as --web.external-url.", a.hasToken)
	})
}

// Login handles the sign-in form (POST, field token): the right token
// gets the session cookie and a redirect to the page the form names in
// its field next (an /actions path, else /actions); a wrong one gets
// denied's page again with 401 and no cookie. Failures spend the source's
// budget as Wrap's do. Cross-site posts get 403: a sign-in form is
// same-origin. externalURL is the other origin browsers use, if any.
func (a *Auth) Login(externalURL *url.URL, denied DeniedPage) (http.Handler, error) {
	cop, err := a.sameOrigin(externalURL, "sign-in", denied)
	if err != nil {
		return nil, err
	}
	return cop.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !a.hasToken {
			denied(w, r, http.StatusBadRequest, "This remediator has no token (--auth.token-file) to sign in with.", false)
			return
		}
		r.Body = http.MaxBytesReader(w, r.Body, maxLoginBody)
		if err := r.ParseForm(); err != nil {
			denied(w, r, http.StatusBadRequest, "The sign-in form could not be read.", true)
			return
		}
		if !a.tokenMatches(r.PostForm.Get("token")) {
			source := sourceOf(r)
			if a.blocked(source) {
				a.metrics.Requests.WithLabelValues("429").Inc()
				denied(w, r, http.StatusTooManyRequests, "Too many failed sign-ins from "+source+": try again later.", true)
				return
			}
			a.metrics.AuthFailures.Inc()
			a.metrics.Requests.WithLabelValues("401").Inc()
			a.recordFailure(source)
			a.warn.Warn("Rejected a sign-in with a wrong token", "remote", source)
			denied(w, r, http.StatusUnauthorized, "Wrong token.", true)
			return
		}
		expires := time.Now().Add(SessionLifetime)
		c := a.sessionCookie(r)
		c.Value, c.Expires, c.MaxAge = a.newSession(expires), expires, int(SessionLifetime/time.Second)
		http.SetCookie(w, c)
		a.logger.Info("Signed in to the pages", "remote", sourceOf(r))
		next := r.PostForm.Get("next")
		if !onPages(next) || strings.ContainsAny(next, "\\\r\n") {
			next = pagesPath
		}
		http.Redirect(w, r, next, http.StatusSeeOther)
	})), nil
}

// sessionCookie is the session cookie for r but its value and lifetime.
func (a *Auth) sessionCookie(r *http.Request) *http.Cookie {
	if a.secureSession(r) {
		// __Host- requires Secure, Path=/ and no Domain; sessionOK keeps
		// the cookie to the pages.
		return &http.Cookie{Name: SecureSessionCookie, Path: "/", Secure: true, HttpOnly: true, SameSite: http.SameSiteStrictMode}
	}
	return &http.Cookie{Name: SessionCookie, Path: pagesPath, HttpOnly: true, SameSite: http.SameSiteStrictMode}
}

// Logout handles the sign-out form (POST /actions/logout): it revokes the
// session the request's cookie names, if it is valid, clears the cookie
// and redirects to /actions (the sign-in page, now). Cross-site posts get
// 403, as Login's.
func (a *Auth) Logout(externalURL *url.URL, denied DeniedPage) (http.Handler, error) {
	cop, err := a.sameOrigin(externalURL, "sign-out", denied)
	if err != nil {
		return nil, err
	}
	return cop.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if id, exp, ok := a.validSession(r); ok {
			a.revoke(id, time.Unix(exp, 0))
			a.logger.Info("Signed out of the pages", "remote", sourceOf(r))
		}
		c := a.sessionCookie(r)
		c.MaxAge = -1
		http.SetCookie(w, c)
		w.Header().Set("Cache-Control", "no-store")
		http.Redirect(w, r, pagesPath, http.StatusSeeOther)
	})), nil
}

// SignedIn reports whether r brings a session cookie that holds: the
// pages offer it a sign-out button.
func (a *Auth) SignedIn(r *http.Request) bool {
	_, _, ok := a.validSession(r)
	return ok
}
