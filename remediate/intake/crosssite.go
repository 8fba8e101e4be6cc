package intake

import (
	"fmt"
	"mime"
	"net"
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
	cop, err := a.crossOriginProtection(externalURL, func(w http.ResponseWriter, r *http.Request) {
		a.warn.Warn("Refused a cross-site request", "remote", sourceOf(r), "method", r.Method, "path", r.URL.Path,
			"origin", r.Header.Get("Origin"), "sec_fetch_site", r.Header.Get("Sec-Fetch-Site"))
		httpError(w, http.StatusForbidden, "cross-site request refused: %s %s from origin %q, which is not this remediator's (%s); "+
			"if browsers reach it under another URL, give that URL as --web.external-url",
			r.Method, r.URL.Path, r.Header.Get("Origin"), r.Host)
	})
	if err != nil {
		return nil, fmt.Errorf("--web.external-url: %w", err)
	}
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

// crossOriginProtection refuses, with deny, a request that is not GET,
// HEAD or OPTIONS from another origin than the request's own Host and
// externalURL's, when set; each refusal counts as a 403.
func (a *Auth) crossOriginProtection(externalURL *url.URL, deny http.HandlerFunc) (*http.CrossOriginProtection, error) {
	cop := http.NewCrossOriginProtection()
	if externalURL != nil && externalURL.Host != "" {
		if err := cop.AddTrustedOrigin(externalURL.Scheme + "://" + externalURL.Host); err != nil {
			return nil, err
		}
	}
	cop.SetDenyHandler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		a.metrics.Requests.WithLabelValues("403").Inc()
		deny(w, r)
	}))
	return cop, nil
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

// hostChecked serves next a request that brings no credential, on a
// remediator without authentication (--auth.insecure-none), only under
// one of its own names: an IP address, localhost, or one of the names it
// is served under (AuthConfig.Hosts: --web.external-url's host and the
// listen addresses'). Through DNS rebinding, another site's script reaches
// the remediator under that site's own name, which it resolved to the
// remediator's address: without authentication, the network position it
// borrows from the browser is all it needs to read the audit log
// (/api/v1/actions, other users' command lines) and reset the breaker.
// Such a request gets 403. Alertmanager sends the Host of its webhook URL:
// an IP address passes; a name (a Service, a host name) must be given as
// --web.external-url, or as the listen address.
func (a *Auth) hostChecked(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if HostAllowed(r.Host, a.hosts) {
			next.ServeHTTP(w, r)
			return
		}
		a.metrics.Requests.WithLabelValues("403").Inc()
		a.warn.Warn("Refused a request without credentials under a foreign Host", "remote", sourceOf(r), "method", r.Method,
			"path", r.URL.Path, "host", r.Host)
		httpError(w, http.StatusForbidden, "Host %q is not a name of this remediator, and the request has no credential "+
			"(--auth.insecure-none serves only its own names, IP addresses and localhost, against DNS rebinding): "+
			"give the URL it is reached under as --web.external-url, or send the bearer token", r.Host)
	})
}

// HostAllowed reports whether host, a request's Host header, names the
// remediator: an IP address (DNS rebinding needs a name), localhost, or
// one of names. Ports are not compared.
func HostAllowed(host string, names []string) bool {
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
