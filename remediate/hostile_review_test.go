package remediate_test

// Issue 16, section 5, through the real remediator binary: the example
// tokens at start, a browser's form with a client certificate, and the
// open /actions page under a foreign Host.

import (
	"crypto/sha256"
	"crypto/x509"
	"encoding/base64"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

// TestExampleTokensRefusedAtStart: the remediator started with a token
// that deploy/ ships as an example (it was accepted, and anyone who read
// the repository could reset the breaker or post alerts) exits at once, 1,
// saying how to make a token; so does a dispatcher given the Kubernetes
// placeholder as the agents' token.
func TestExampleTokensRefusedAtStart(t *testing.T) {
	skipShort(t)
	t.Parallel()
	mod, err := testenv.ModuleRoot()
	if err != nil {
		t.Fatal(err)
	}
	compose := filepath.Join(mod, "deploy", "compose", "token.example")
	agentPlaceholder := filepath.Join(t.TempDir(), "agent")
	if err := os.WriteFile(agentPlaceholder, []byte("REPLACE-ME-agent-token-placeholder\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	targets := filepath.Join(t.TempDir(), "targets.json")
	if err := os.WriteFile(targets, []byte(`{"node-a": "http://127.0.0.1:1"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	root := testenv.SimNode(t, 1)
	for _, tc := range []struct {
		name, file, bin string
		args            []string
	}{
		{"compose's example as --auth.token-file", compose, "gpu-orphan-remediator", []string{"--auth.token-file=" + compose, "--backend=sim", "--sim.root=" + root, "--node.name=node-a"}},
		{"the Kubernetes placeholder as --dispatch.token-file", agentPlaceholder, "gpu-orphan-dispatcher", []string{"--auth.token-file=" + tokenFile(t),
			"--dispatch.token-file=" + agentPlaceholder, "--dispatch.targets-file=" + targets}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			store := filepath.Join(t.TempDir(), "r.db")
			args := append(tc.args, "--store.path="+store, "--web.listen-address="+testenv.FreeAddr(t))
			cmd := exec.Command(testenv.Bin(t, tc.bin), args...)
			done := make(chan struct{})
			var out []byte
			go func() { out, err = cmd.CombinedOutput(); close(done) }()
			select {
			case <-done:
			case <-time.After(20 * time.Second):
				cmd.Process.Kill()
				<-done
				t.Fatalf("the remediator started with %s; log:\n%s", tc.file, out)
			}
			if cmd.ProcessState.ExitCode() != 1 {
				t.Errorf("exit status %d, want 1; log:\n%s", cmd.ProcessState.ExitCode(), out)
			}
			for _, says := range []string{tc.file, "placeholder", "head -c 32 /dev/urandom | base64"} {
				if !strings.Contains(string(out), says) {
					t.Errorf("the log does not say %q:\n%s", says, out)
				}
			}
			if _, err := os.Stat(store); err == nil {
				t.Error("a refused start created the audit store")
			}
		})
	}
}

// TestCrossSiteWithClientCertificate: a browser presents its client
// certificate to a form that another site submits. With the certificate,
// a cross-site POST of application/x-www-form-urlencoded reset the
// breaker (200); now a form's content type gets 415 and a foreign Origin
// 403. Alertmanager's JSON with the certificate, and the same origin's,
// still get through.
func TestCrossSiteWithClientCertificate(t *testing.T) {
	skipShort(t)
	t.Parallel()
	dir := t.TempDir()
	ca := newCA(t, "gpu-orphan test CA")
	srvCert, srvKey := ca.issue(t, "remediator", x509.ExtKeyUsageServerAuth, net.ParseIP("127.0.0.1"))
	cliCert, cliKey := ca.issue(t, "operator", x509.ExtKeyUsageClientAuth)
	webConfig := writeFile(t, dir, "web.yml", fmt.Appendf(nil, `tls_server_config:
  cert_file: %s
  key_file: %s
  client_auth_type: VerifyClientCertIfGiven
  client_ca_file: %s
`, writeFile(t, dir, "server.crt", srvCert), writeFile(t, dir, "server.key", srvKey), writeFile(t, dir, "ca.crt", ca.pem)))
	root := testenv.SimNode(t, 1)
	addr := testenv.FreeAddr(t)
	testenv.Daemon(t, testenv.Bin(t, "gpu-orphan-remediator"), "--backend=sim", "--sim.root="+root,
		"--store.path="+filepath.Join(dir, "r.db"), "--web.config.file="+webConfig, "--node.name=node-a",
		"--web.listen-address="+addr, "--log.level=debug")
	base := "https://" + addr
	withCert := tlsClient(t, ca, cliCert, cliKey)
	waitReady(t, withCert, base)

	for _, tc := range []struct {
		name, contentType, origin, fetchSite string
		want                                 int
	}{
		{"cross-site form", "application/x-www-form-urlencoded", "https://evil.example", "cross-site", http.StatusForbidden},
		{"form from a browser that sends no Origin", "application/x-www-form-urlencoded", "", "", http.StatusUnsupportedMediaType},
		{"text/plain form", "text/plain", "", "", http.StatusUnsupportedMediaType},
		{"cross-site JSON", "application/json", "https://evil.example", "cross-site", http.StatusForbidden},
		{"JSON, no browser (curl --cert)", "application/json", "", "", http.StatusOK},
		{"JSON from the same origin", "application/json", base, "same-origin", http.StatusOK},
	} {
		req, _ := http.NewRequest(http.MethodPost, base+"/api/v1/breaker/reset", strings.NewReader("reset=1"))
		req.Header.Set("Content-Type", tc.contentType)
		if tc.origin != "" {
			req.Header.Set("Origin", tc.origin)
		}
		if tc.fetchSite != "" {
			req.Header.Set("Sec-Fetch-Site", tc.fetchSite)
		}
		resp, err := withCert.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != tc.want {
			t.Errorf("%s: POST /api/v1/breaker/reset with the client certificate: %d %s, want %d", tc.name, resp.StatusCode, body, tc.want)
		}
	}
	// The webhook: Alertmanager with the certificate, and a form.
	uuid := gpuUUID(t, root, 0)
	if r := deliver(withCert, base, "", payload(alert("firing", "node-a", uuid, fp(160), time.Now()))); r.err != nil || r.code != http.StatusOK {
		t.Errorf("Alertmanager's JSON with the client certificate: %d %v %s", r.code, r.err, r.body)
	}
	resp, err := withCert.Post(base+"/api/v1/alerts", "application/x-www-form-urlencoded", strings.NewReader("x=1"))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnsupportedMediaType {
		t.Errorf("a form to the webhook: %d, want 415", resp.StatusCode)
	}
}

// TestActionsPageForeignHost: with --web.ui.open, /actions answered any
// Host, so that a page of another site, once its name resolved to the
// remediator (DNS rebinding), could read it. Now a foreign Host gets 403;
// the names of --web.external-url and the listen address, IP addresses
// and localhost are served (and --web.external-url's origin may POST), with headers that forbid framing, sniffing,
// referrers, scripts and loads; the CSP's hash is the page's own style.
func TestActionsPageForeignHost(t *testing.T) {
	skipShort(t)
	t.Parallel()
	root := testenv.SimNode(t, 1)
	url, _ := startAgent(t, root, filepath.Join(t.TempDir(), "r.db"), "--web.ui.open", "--web.external-url=http://gpu-17.example.com:10836")
	_, port, _ := net.SplitHostPort(strings.TrimPrefix(url, "http://"))
	get := func(host string) (*http.Response, string) {
		t.Helper()
		req, _ := http.NewRequest(http.MethodGet, url+"/actions", nil)
		req.Host = host
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp, string(b)
	}
	// --web.external-url is an origin that may POST; another is not.
	for origin, want := range map[string]int{"http://gpu-17.example.com:10836": http.StatusOK, "http://evil.example": http.StatusForbidden} {
		req, _ := http.NewRequest(http.MethodPost, url+"/api/v1/breaker/reset", nil)
		req.Header.Set("Authorization", "Bearer "+token)
		req.Header.Set("Origin", origin)
		req.Header.Set("Sec-Fetch-Site", "cross-site")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != want {
			t.Errorf("POST /api/v1/breaker/reset from origin %s: %d, want %d", origin, resp.StatusCode, want)
		}
	}
	for host, want := range map[string]int{
		"evil.example:" + port:             http.StatusForbidden,
		"gpu-17.example.com.attacker.test": http.StatusForbidden,
		"gpu-17.example.com:" + port:       http.StatusOK,
		"GPU-17.example.com":               http.StatusOK,
		"127.0.0.1:" + port:                http.StatusOK,
		"[::1]:" + port:                    http.StatusOK,
		"localhost:" + port:                http.StatusOK,
		"10.1.2.3:" + port:                 http.StatusOK,
		"":                                 http.StatusOK, // Go sends the URL's host
	} {
		resp, body := get(host)
		if resp.StatusCode != want {
			t.Errorf("GET /actions with Host %q: %d, want %d: %s", host, resp.StatusCode, want, body)
			continue
		}
		if want == http.StatusForbidden && !strings.Contains(body, "--web.external-url") {
			t.Errorf("Host %q: the refusal does not say what to do: %s", host, body)
		}
		for name, v := range map[string]string{"X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"} {
			if got := resp.Header.Get(name); got != v {
				t.Errorf("Host %q: %s: %q, want %q", host, name, got, v)
			}
		}
		csp := resp.Header.Get("Content-Security-Policy")
		for _, d := range []string{"default-src 'none'", "frame-ancestors 'none'", "form-action 'self'", "base-uri 'none'"} {
			if !strings.Contains(csp, d) {
				t.Errorf("Host %q: Content-Security-Policy %q lacks %s", host, csp, d)
			}
		}
		if want == http.StatusOK {
			_, rest, _ := strings.Cut(body, "<style>")
			css, _, ok := strings.Cut(rest, "</style>")
			sum := sha256.Sum256([]byte(css))
			if h := "'sha256-" + base64.StdEncoding.EncodeToString(sum[:]) + "'"; !ok || !strings.Contains(csp, "style-src "+h) {
				t.Errorf("the page's style hashes to %s, which the CSP %q does not allow", h, csp)
			}
		}
	}
}
