package intake

import (
	"crypto/hmac"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// A browser cannot send a bearer token, so a person signs in to the pages
// (/actions) once with the token through a form, and gets a session
// cookie instead:
//
//   - The cookie holds an expiry and an HMAC of it under a key derived
//     from the token, never the token: it is checked without state, so
//     that it holds across restarts and across a dispatcher's replicas,
//     and it dies with the token when the token changes.
//   - It is HttpOnly, SameSite=Strict (a browser does not send it with a
//     request another site starts), Path=/, and Secure when the page is
//     served over TLS.
//   - It is accepted for GET and HEAD only: the pages and the API's reads.
//     The webhook and the breaker reset (POST) still need the token or a
//     client certificate, so a cookie never changes state.

// SessionCookie is the name of the cookie that Login sets.
const SessionCookie = "gpu_orphan_session"

// SessionLifetime is how long a sign-in lasts.
const SessionLifetime = 12 * time.Hour

// maxLoginBody bounds the sign-in form.
const maxLoginBody = 4 << 10

// DeniedPage writes the body of a refusal of a page to a browser, with
// code as its status: a sign-in page. problem says what went wrong;
// tokenSignIn whether the sign-in form can be used (a token is set).
type DeniedPage func(w http.ResponseWriter, r *http.Request, code int, problem string, tokenSignIn bool)

func sessionKey(tokenSum [32]byte) []byte {
	m := hmac.New(sha256.New, tokenSum[:])
	m.Write([]byte("gpu-orphan session key v1"))
	return m.Sum(nil)
}

// session is the cookie's value for a session that ends at expires.
func (a *Auth) session(expires time.Time) string {
	exp := strconv.FormatInt(expires.Unix(), 10)
	m := hmac.New(sha256.New, a.sessionKey)
	m.Write([]byte(exp))
	return exp + "." + base64.RawURLEncoding.EncodeToString(m.Sum(nil))
}

// sessionOK reports whether r carries a session cookie that is ours and
// has not expired. Only GET and HEAD use it.
func (a *Auth) sessionOK(r *http.Request) bool {
	if !a.hasToken || (r.Method != http.MethodGet && r.Method != http.MethodHead) {
		return false
	}
	c, err := r.Cookie(SessionCookie)
	if err != nil {
		return false
	}
	exp, _, ok := strings.Cut(c.Value, ".")
	if !ok {
		return false
	}
	sec, err := strconv.ParseInt(exp, 10, 64)
	if err != nil || time.Now().Unix() >= sec {
		return false
	}
	want := a.session(time.Unix(sec, 0))
	return subtle.ConstantTimeCompare([]byte(c.Value), []byte(want)) == 1
}

// WrapPage is Wrap for the pages a person opens in a browser: it also
// admits a GET or HEAD with the session cookie that Login sets, and
// answers a refused request with denied's page (a sign-in form) and 401.
// A wrong bearer token spends the source's failure budget as in Wrap (and
// gets 429 once it is spent); a browser that brings no credential does
// not.
func (a *Auth) WrapPage(next http.Handler, denied DeniedPage) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if a.admitted(r) {
			next.ServeHTTP(w, r)
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

// Login handles the sign-in form (POST, field token): the right token
// gets the session cookie and a redirect to the page the form names in
// its field next (an /actions path, else /actions); a wrong one gets
// denied's page again with 401 and no cookie. Failures spend the source's
// budget as Wrap's do. Cross-site posts get 403: a sign-in form is
// same-origin. externalURL is the other origin browsers use, if any.
func (a *Auth) Login(externalURL *url.URL, denied DeniedPage) (http.Handler, error) {
	cop := http.NewCrossOriginProtection()
	secureURL := false
	if externalURL != nil && externalURL.Host != "" {
		if err := cop.AddTrustedOrigin(externalURL.Scheme + "://" + externalURL.Host); err != nil {
			return nil, err
		}
		secureURL = externalURL.Scheme == "https"
	}
	cop.SetDenyHandler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		a.metrics.Requests.WithLabelValues("403").Inc()
		a.warn.Warn("Refused a cross-site sign-in", "remote", sourceOf(r), "origin", r.Header.Get("Origin"))
		denied(w, r, http.StatusForbidden, "A sign-in from another site is refused. If browsers reach the remediator under another URL, give it as --web.external-url.", a.hasToken)
	}))
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
		sum := sha256.Sum256([]byte(strings.TrimSpace(r.PostForm.Get("token"))))
		if subtle.ConstantTimeCompare(sum[:], a.tokenSum[:]) != 1 {
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
		http.SetCookie(w, &http.Cookie{
			Name: SessionCookie, Value: a.session(expires), Path: "/", Expires: expires, MaxAge: int(SessionLifetime / time.Second),
			HttpOnly: true, SameSite: http.SameSiteStrictMode, Secure: r.TLS != nil || secureURL,
		})
		a.logger.Info("Signed in to the pages", "remote", sourceOf(r))
		next := r.PostForm.Get("next")
		if !strings.HasPrefix(next, "/actions") || strings.ContainsAny(next, "\\\r\n") {
			next = "/actions"
		}
		http.Redirect(w, r, next, http.StatusSeeOther)
	})), nil
}
