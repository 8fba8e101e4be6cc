package intake

import (
	"fmt"
	"mime"
	"net/http"
	"net/url"
	"strings"
)

// RefuseCrossSite returns a middleware for the state-changing endpoints
// (the webhook, the breaker reset) that refuses what a web page on another
// site can make a browser send. A browser attaches its client certificate
// (and, with --auth.insecure-none, it has the network position) to a form
// that another site submits, so authentication alone does not stop it.
//
//   - A request that is not GET, HEAD or OPTIONS from another origin, as the
//     browser says in Sec-Fetch-Site or Origin, gets 403. The request's
//     own Host is its origin, and so is externalURL's when set: the URL
//     browsers use to reach the remediator through a proxy.
//   - Such a request needs Content-Type: application/json (what
//     Alertmanager sends) or an Authorization: Bearer header, else 415. A
//     form can send neither, nor can a page's script to another origin
//     without a CORS preflight, which the remediator never grants.
//
// It runs after authentication (an unauthenticated request gets 401
// whatever it sends); refusals are logged as rejected requests are,
// throttled.
func (a *Auth) RefuseCrossSite(externalURL *url.URL) (func(http.Handler) http.Handler, error) {
	cop := http.NewCrossOriginProtection()
	if externalURL != nil && externalURL.Host != "" {
		if err := cop.AddTrustedOrigin(externalURL.Scheme + "://" + externalURL.Host); err != nil {
			return nil, fmt.Errorf("--web.external-url: %w", err)
		}
	}
	cop.SetDenyHandler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		a.metrics.Requests.WithLabelValues("403").Inc()
		a.warn.Warn("Refused a cross-site request", "remote", sourceOf(r), "method", r.Method, "path", r.URL.Path,
			"origin", r.Header.Get("Origin"), "sec_fetch_site", r.Header.Get("Sec-Fetch-Site"))
		httpError(w, http.StatusForbidden, "cross-site request refused: %s %s from origin %q, which is not this remediator's (%s); "+
			"if browsers reach it under another URL, give that URL as --web.external-url",
			r.Method, r.URL.Path, r.Header.Get("Origin"), r.Host)
	}))
	return func(next http.Handler) http.Handler {
		return cop.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if !safeMethod(r.Method) && !jsonOrBearer(r) {
				a.metrics.Requests.WithLabelValues("415").Inc()
				a.warn.Warn("Refused a request a browser form could send", "remote", sourceOf(r), "method", r.Method, "path", r.URL.Path,
					"content_type", r.Header.Get("Content-Type"))
				httpError(w, http.StatusUnsupportedMediaType, "%s %s needs Content-Type: application/json or an Authorization: Bearer header "+
					"(got Content-Type %q): a browser form can send neither, so requests from other sites are refused", r.Method, r.URL.Path, r.Header.Get("Content-Type"))
				return
			}
			next.ServeHTTP(w, r)
		}))
	}, nil
}

func safeMethod(m string) bool {
	return m == http.MethodGet || m == http.MethodHead || m == http.MethodOptions
}

// jsonOrBearer reports whether r carries what no form can: a JSON content
// type, or a bearer token (browsers attach Basic credentials on their own,
// never a Bearer token).
func jsonOrBearer(r *http.Request) bool {
	if mt, _, err := mime.ParseMediaType(r.Header.Get("Content-Type")); err == nil && mt == "application/json" {
		return true
	}
	scheme, _, ok := strings.Cut(r.Header.Get("Authorization"), " ")
	return ok && strings.EqualFold(scheme, "Bearer")
}
