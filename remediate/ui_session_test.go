package remediate_test

// Issue 24, items 5 and 6: the pages' session cookie is the pages' only,
// and the remediator's that issued it; it can be signed out; and a
// remediator without authentication answers only its own names.

import (
	"bytes"
	"crypto/x509"
	"fmt"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

// sessionCookieOf is the session cookie that a sign-in answer sets.
func sessionCookieOf(t *testing.T, resp *http.Response, name string) *http.Cookie {
	t.Helper()
	for _, c := range resp.Cookies() {
		if c.Name == name {
			return c
		}
	}
	t.Fatalf("no cookie %s in the sign-in's answer %d: %v", name, resp.StatusCode, resp.Header["Set-Cookie"])
	return nil
}

// replay sends a request with cookie c only, as a server that stole it
// does: by hand, whatever the cookie's Path or Secure say.
func replay(t *testing.T, client *http.Client, method, u string, c *http.Cookie) (*http.Response, string) {
	t.Helper()
	req, _ := http.NewRequest(method, u, nil)
	req.AddCookie(&http.Cookie{Name: c.Name, Value: c.Value})
	return fetch(t, client, req)
}

// TestSessionCookieScope: over plain HTTP the sign-in's cookie is
// gpu_orphan_session with Path=/actions (a browser keeps it from the
// host's other paths), HttpOnly, SameSite=Strict; it opens node-a's pages,
// and nothing else: replayed to node-a's API (a user's server on another
// port received it from the browser: cookies do not separate ports) it
// gets 401; node-b, with the same token, refuses it, and so does a second
// remediator of node-a on another listener. The old cookie had Path=/,
// read the API's GETs, and opened every remediator with the token.
func TestSessionCookieScope(t *testing.T) {
	skipShort(t)
	t.Parallel()
	baseA, _ := startAgent(t, testenv.SimNode(t, 1), filepath.Join(t.TempDir(), "a.db"), "--node.name=node-a")
	baseB, _ := startAgent(t, testenv.SimNode(t, 1), filepath.Join(t.TempDir(), "b.db"), "--node.name=node-b")
	baseA2, _ := startAgent(t, testenv.SimNode(t, 1), filepath.Join(t.TempDir(), "a2.db"), "--node.name=node-a")

	resp, body := signIn(t, browser(t), baseA, token)
	if resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("sign-in on node-a: %d\n%s", resp.StatusCode, body)
	}
	c := sessionCookieOf(t, resp, "gpu_orphan_session")
	if c.Path != "/actions" || c.Secure || !c.HttpOnly || c.SameSite != http.SameSiteStrictMode || c.MaxAge <= 0 {
		t.Errorf("node-a's cookie over HTTP: %s; want Path=/actions, HttpOnly, SameSite=Strict, not Secure", c)
	}
	resp, body = replay(t, http.DefaultClient, http.MethodGet, baseA+"/actions", c)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("node-a's /actions with its cookie: %d, want 200\n%s", resp.StatusCode, body)
	}
	if !strings.Contains(body, `id="sign-out"`) {
		t.Errorf("node-a's /actions, signed in, has no sign-out button")
	}
	for _, p := range []string{"/api/v1/actions", "/api/v1/status", "/api/v1/actions/x"} {
		if resp, body := replay(t, http.DefaultClient, http.MethodGet, baseA+p, c); resp.StatusCode != http.StatusUnauthorized {
			t.Errorf("GET %s on node-a with its cookie: %d, want 401: %s", p, resp.StatusCode, body)
		}
	}
	for name, base := range map[string]string{"node-b (same token)": baseB, "node-a's second remediator (another listener)": baseA2} {
		if resp, body := replay(t, http.DefaultClient, http.MethodGet, base+"/actions", c); resp.StatusCode != http.StatusUnauthorized {
			t.Errorf("%s: /actions with node-a's cookie: %d, want 401\n%s", name, resp.StatusCode, body)
		}
	}
}

// TestSessionCookieTLS: served over TLS, the cookie is
// __Host-gpu_orphan_session, Secure, Path=/ (the prefix requires it), and
// the server keeps it to the pages: replayed to the API, which a browser
// now sends it to, it gets 401; a cookie of the plain-HTTP name is not
// looked at.
func TestSessionCookieTLS(t *testing.T) {
	skipShort(t)
	t.Parallel()
	dir := t.TempDir()
	ca := newCA(t, "gpu-orphan test CA")
	srvCert, srvKey := ca.issue(t, "remediator", x509.ExtKeyUsageServerAuth, net.ParseIP("127.0.0.1"))
	webConfig := writeFile(t, dir, "web.yml", fmt.Appendf(nil, "tls_server_config:\n  cert_file: %s\n  key_file: %s\n",
		writeFile(t, dir, "server.crt", srvCert), writeFile(t, dir, "server.key", srvKey)))
	addr := testenv.FreeAddr(t)
	testenv.Daemon(t, testenv.Bin(t, "gpu-orphan-remediator"), "--backend=sim", "--sim.root="+testenv.SimNode(t, 1),
		"--store.path="+filepath.Join(dir, "r.db"), "--auth.token-file="+tokenFile(t), "--web.config.file="+webConfig,
		"--node.name=node-a", "--web.listen-address="+addr, "--collector.interval=200ms", "--log.level=debug")
	base := "https://" + addr
	client := tlsClient(t, ca, nil, nil)
	waitReady(t, client, base)
	client.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }

	resp, body := signIn(t, client, base, token)
	if resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("sign-in over TLS: %d\n%s", resp.StatusCode, body)
	}
	c := sessionCookieOf(t, resp, "__Host-gpu_orphan_session")
	if c.Path != "/" || !c.Secure || !c.HttpOnly || c.SameSite != http.SameSiteStrictMode || c.Domain != "" {
		t.Errorf("the cookie over TLS: %s; want __Host-, Secure, Path=/, no Domain, HttpOnly, SameSite=Strict", c)
	}
	if resp, body := replay(t, client, http.MethodGet, base+"/actions", c); resp.StatusCode != http.StatusOK {
		t.Fatalf("/actions with the cookie over TLS: %d\n%s", resp.StatusCode, body)
	}
	if resp, body := replay(t, client, http.MethodGet, base+"/api/v1/actions", c); resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("GET /api/v1/actions with the __Host- cookie: %d, want 401: %s", resp.StatusCode, body)
	}
	plain := &http.Cookie{Name: "gpu_orphan_session", Value: c.Value}
	if resp, _ := replay(t, client, http.MethodGet, base+"/actions", plain); resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("/actions over TLS with the plain-HTTP cookie's name: %d, want 401", resp.StatusCode)
	}
}

// TestSessionLogout: POST /actions/logout, from the page's own origin,
// clears the cookie and revokes it: replayed afterwards, it opens nothing.
// From another site, the sign-out is refused and the session lives.
func TestSessionLogout(t *testing.T) {
	skipShort(t)
	t.Parallel()
	base, _ := startAgent(t, testenv.SimNode(t, 1), filepath.Join(t.TempDir(), "r.db"))
	c := browser(t)
	resp, _ := signIn(t, c, base, token)
	cookie := sessionCookieOf(t, resp, "gpu_orphan_session")

	logout := func(origin, site string) *http.Response {
		req, _ := http.NewRequest(http.MethodPost, base+"/actions/logout", strings.NewReader(""))
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		req.Header.Set("Origin", origin)
		req.Header.Set("Sec-Fetch-Site", site)
		resp, _ := fetch(t, c, req)
		return resp
	}
	if resp := logout("http://evil.example", "cross-site"); resp.StatusCode != http.StatusForbidden {
		t.Errorf("a cross-site sign-out: %d, want 403", resp.StatusCode)
	}
	if resp, _ := get(t, c, base+"/actions"); resp.StatusCode != http.StatusOK {
		t.Fatalf("/actions after a refused cross-site sign-out: %d, want 200", resp.StatusCode)
	}

	resp = logout(base, "same-origin")
	if resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/actions" {
		t.Errorf("sign-out: %d to %q, want 303 to /actions", resp.StatusCode, resp.Header.Get("Location"))
	}
	cleared := sessionCookieOf(t, resp, "gpu_orphan_session")
	if cleared.MaxAge >= 0 || cleared.Value != "" || cleared.Path != "/actions" {
		t.Errorf("sign-out's cookie %s: want it cleared (empty, Max-Age<0) at Path=/actions", cleared)
	}
	if resp, body := get(t, c, base+"/actions"); resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("/actions after signing out: %d, want 401\n%s", resp.StatusCode, body)
	}
	if resp, body := replay(t, http.DefaultClient, http.MethodGet, base+"/actions", cookie); resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("/actions with a copy of the signed-out cookie: %d, want 401\n%s", resp.StatusCode, body)
	}
}

// TestInsecureNoneRebinding: with --auth.insecure-none and no token, a
// request under a foreign Host (another site's name resolved to the
// remediator: DNS rebinding) gets 403 on GET /api/v1/actions, POST
// /api/v1/breaker/reset, the webhook and the pages (the old remediator
// served them all: 200, and the breaker reset), while IP addresses,
// localhost and the host of --web.external-url (a Service name that
// Alertmanager's webhook URL uses) are served.
func TestInsecureNoneRebinding(t *testing.T) {
	skipShort(t)
	t.Parallel()
	root := testenv.SimNode(t, 1)
	// Ports are not compared: the external URL's host is a name.
	base, _ := startAgent(t, root, filepath.Join(t.TempDir(), "r.db"), "--auth.token-file=", "--auth.insecure-none",
		"--web.external-url=http://gpu-orphan-remediator.test")
	addr := strings.TrimPrefix(base, "http://")
	_, port, _ := net.SplitHostPort(addr)
	uuid := gpuUUID(t, root, 0)
	send := func(method, path, host string, body []byte) (int, string) {
		t.Helper()
		req, _ := http.NewRequest(method, base+path, bytes.NewReader(body))
		req.Host = host
		if body != nil {
			req.Header.Set("Content-Type", "application/json")
		}
		resp, b := fetch(t, http.DefaultClient, req)
		return resp.StatusCode, b
	}
	alertBody := func(i int) []byte {
		return payload(alert("resolved", "node-a", uuid, fp(240+i), time.Now().Add(-time.Minute)))
	}
	for _, host := range []string{"rebind.example:" + port, "rebind.example", "127.0.0.1.nip.io:" + port} {
		for _, tc := range []struct {
			method, path string
			body         []byte
		}{
			{http.MethodGet, "/api/v1/actions", nil},
			{http.MethodPost, "/api/v1/breaker/reset", []byte("{}")},
			{http.MethodPost, "/api/v1/alerts", alertBody(0)},
			{http.MethodGet, "/api/v1/status", nil},
			{http.MethodGet, "/actions", nil},
		} {
			if code, body := send(tc.method, tc.path, host, tc.body); code != http.StatusForbidden || !strings.Contains(body, "--web.external-url") {
				t.Errorf("%s %s with Host %s and no credential: %d, want 403 naming --web.external-url: %s", tc.method, tc.path, host, code, body)
			}
		}
	}
	for i, host := range []string{addr, "localhost:" + port, "[::1]:" + port, "gpu-orphan-remediator.test:" + port} {
		if code, body := send(http.MethodGet, "/api/v1/actions", host, nil); code != http.StatusOK || !strings.HasPrefix(body, "[") {
			t.Errorf("GET /api/v1/actions with Host %s: %d, want 200: %s", host, code, body)
		}
		if code, body := send(http.MethodPost, "/api/v1/breaker/reset", host, []byte("{}")); code != http.StatusOK || !strings.Contains(body, "was_open") {
			t.Errorf("POST /api/v1/breaker/reset with Host %s: %d, want 200: %s", host, code, body)
		}
		// Alertmanager's webhook, as it sends it: the Host of its URL.
		if code, body := send(http.MethodPost, "/api/v1/alerts", host, alertBody(1+i)); code != http.StatusOK || results(t, body)["resolved"] != 1 {
			t.Errorf("the webhook with Host %s: %d, want 200 with the alert taken: %s", host, code, body)
		}
		if code, body := send(http.MethodGet, "/actions", host, nil); code != http.StatusOK {
			t.Errorf("GET /actions with Host %s: %d, want 200\n%s", host, code, body)
		}
	}
	// What every remediator serves without a credential, whatever its
	// authentication, does not depend on the Host.
	for _, p := range []string{"/metrics", "/-/healthy", "/-/ready"} {
		if code, body := send(http.MethodGet, p, "rebind.example", nil); code != http.StatusOK {
			t.Errorf("GET %s with Host rebind.example: %d, want 200: %s", p, code, body)
		}
	}
}
