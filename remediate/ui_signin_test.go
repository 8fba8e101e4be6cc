package remediate_test

// Issue 18, section 4: a browser opens /actions, signed in with the token
// or served openly, and the page says why each target was chosen.

import (
	"fmt"
	"html"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/remediate"
)

// browser is an HTTP client that keeps cookies and does not follow
// redirects, as a test of what each answer is.
func browser(t *testing.T) *http.Client {
	t.Helper()
	jar, err := cookiejar.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	return &http.Client{Jar: jar, Timeout: 10 * time.Second,
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
}

func fetch(t *testing.T, c *http.Client, req *http.Request) (*http.Response, string) {
	t.Helper()
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b)
}

func get(t *testing.T, c *http.Client, u string) (*http.Response, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, u, nil)
	return fetch(t, c, req)
}

// signIn posts the sign-in form as a browser on the page's own origin does.
func signIn(t *testing.T, c *http.Client, base, tok string) (*http.Response, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, base+"/actions/login", strings.NewReader(url.Values{"token": {tok}, "next": {"/actions"}}.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Origin", base)
	req.Header.Set("Sec-Fetch-Site", "same-origin")
	return fetch(t, c, req)
}

var hrefRE = regexp.MustCompile(`href="([^"]*)"`)

// links are the page's links, resolved against its URL.
func links(t *testing.T, page, body string) []string {
	t.Helper()
	base, err := url.Parse(page)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, m := range hrefRE.FindAllStringSubmatch(body, -1) {
		ref, err := url.Parse(html.UnescapeString(m[1]))
		if err != nil {
			t.Fatalf("link %q: %v", m[1], err)
		}
		out = append(out, base.ResolveReference(ref).String())
	}
	return out
}

// TestActionsSignIn: without --web.ui.open, a browser that opens /actions
// gets a sign-in form with its 401; the right token posted there sets an
// HttpOnly, SameSite=Strict session cookie (not the token) for the pages
// (Path=/actions) that opens the page and an action's detail, never the
// API: its reads, the webhook and the breaker reset stay 401 with it
// (issue 24, item 5; the old cookie had Path=/ and opened the API's
// reads). A wrong token, a cross-site post and a forged cookie get
// nothing.
func TestActionsSignIn(t *testing.T) {
	skipShort(t)
	t.Parallel()
	root := testenv.SimNode(t, 2)
	w := testenv.StartWorkload(t, root, 1, 1024, 1)
	base, _ := startAgent(t, root, filepath.Join(t.TempDir(), "r.db"), "--act")
	w.KillParent(t)
	a := alertAndWait(t, base, root, 1, fp(180))
	c := browser(t)

	resp, body := get(t, c, base+"/actions")
	if resp.StatusCode != http.StatusUnauthorized || !strings.Contains(body, `action="/actions/login"`) || !strings.Contains(body, "--web.ui.open") {
		t.Fatalf("GET /actions without credentials: %d, want 401 with the sign-in form and --web.ui.open:\n%s", resp.StatusCode, body)
	}
	if csp := resp.Header.Get("Content-Security-Policy"); !strings.Contains(csp, "form-action 'self'") || !strings.Contains(csp, "frame-ancestors 'none'") {
		t.Errorf("the sign-in page's Content-Security-Policy: %q", csp)
	}

	// A wrong token: 401, the form again, no cookie.
	resp, body = signIn(t, c, base, "wrong-token-0123456789")
	if resp.StatusCode != http.StatusUnauthorized || len(resp.Cookies()) != 0 || !strings.Contains(body, "Wrong token") {
		t.Errorf("sign-in with a wrong token: %d, cookies %v:\n%s", resp.StatusCode, resp.Cookies(), body)
	}
	// From another site: 403, no cookie.
	req, _ := http.NewRequest(http.MethodPost, base+"/actions/login", strings.NewReader("token="+token))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Origin", "http://evil.example")
	req.Header.Set("Sec-Fetch-Site", "cross-site")
	if resp, _ := fetch(t, c, req); resp.StatusCode != http.StatusForbidden || len(resp.Cookies()) != 0 {
		t.Errorf("a cross-site sign-in: %d, cookies %v; want 403 and none", resp.StatusCode, resp.Cookies())
	}
	// A forged cookie opens nothing.
	forged := browser(t)
	u, _ := url.Parse(base)
	forged.Jar.SetCookies(u, []*http.Cookie{{Name: "gpu_orphan_session", Value: fmt.Sprintf("%d.AAAA", time.Now().Add(time.Hour).Unix())}})
	if resp, _ := get(t, forged, base+"/actions"); resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("GET /actions with a forged cookie: %d, want 401", resp.StatusCode)
	}

	// The right token.
	resp, _ = signIn(t, c, base, token)
	if resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/actions" {
		t.Fatalf("sign-in with the token: %d to %q, want 303 to /actions", resp.StatusCode, resp.Header.Get("Location"))
	}
	var session *http.Cookie
	for _, ck := range resp.Cookies() {
		if ck.Name == "gpu_orphan_session" {
			session = ck
		}
	}
	if session == nil {
		t.Fatalf("no session cookie: %v", resp.Header["Set-Cookie"])
	}
	if !session.HttpOnly || session.SameSite != http.SameSiteStrictMode || session.Path != "/actions" || session.Secure || strings.Contains(session.Value, token) {
		t.Errorf("session cookie %s: want HttpOnly, SameSite=Strict, Path=/actions, not Secure over http, and not the token", session)
	}

	resp, body = get(t, c, base+"/actions")
	if resp.StatusCode != http.StatusOK || !strings.Contains(body, `id="action-`+a.ID+`"`) {
		t.Fatalf("GET /actions signed in: %d:\n%s", resp.StatusCode, body)
	}
	detail := base + "/actions/" + a.ID
	if !slices.Contains(links(t, base+"/actions", body), detail) {
		t.Errorf("the page does not link the action's detail %s", detail)
	}
	if resp, body := get(t, c, detail); resp.StatusCode != http.StatusOK || !strings.Contains(body, "Action "+a.ID) {
		t.Errorf("GET %s signed in: %d:\n%s", detail, resp.StatusCode, body)
	} else if !slices.Contains(links(t, detail, body), base+"/api/v1/actions/"+a.ID) {
		t.Errorf("the detail does not link the action's JSON")
	}
	// The API never takes the cookie, even sent by hand (the jar keeps
	// it to /actions).
	if resp, body := replay(t, http.DefaultClient, http.MethodGet, base+"/api/v1/actions/"+a.ID, session); resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("GET /api/v1/actions/%s with the session cookie: %d, want 401: %s", a.ID, resp.StatusCode, body)
	}
	if resp, _ := get(t, http.DefaultClient, detail); resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("GET %s without the cookie: %d, want 401", detail, resp.StatusCode)
	}

	// The cookie never authorizes a POST, even one a form cannot send.
	for _, p := range []string{"/api/v1/alerts", "/api/v1/breaker/reset"} {
		req, _ := http.NewRequest(http.MethodPost, base+p, strings.NewReader(`{}`))
		req.AddCookie(&http.Cookie{Name: session.Name, Value: session.Value})
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Origin", base)
		if resp, body := fetch(t, c, req); resp.StatusCode != http.StatusUnauthorized {
			t.Errorf("POST %s with the session cookie: %d, want 401: %s", p, resp.StatusCode, body)
		}
	}
}

// TestActionsPageOpen: with --web.ui.open, the page's link to an action
// opens its detail without credentials, under the Host check; the page
// and the detail say why each target was chosen, its process group and
// whether the group was signalled whole, the policy, act or dry run, that
// the breaker is closed, and refresh themselves. The landing page links
// /actions, and none of its links is a 404.
func TestActionsPageOpen(t *testing.T) {
	skipShort(t)
	t.Parallel()
	root := testenv.SimNode(t, 2)
	w := testenv.StartWorkload(t, root, 1, 1024, 2)
	base, _ := startAgent(t, root, filepath.Join(t.TempDir(), "r.db"), "--act", "--web.ui.open", "--remediate.policy=dead-owner")
	w.KillParent(t)
	a := alertAndWait(t, base, root, 1, fp(181))
	if a.State != remediate.StateSucceeded || len(a.Targets) == 0 {
		t.Fatalf("action %s: %s, targets %v", a.State, a.Reason, a.Targets)
	}
	c := browser(t)
	resp, body := get(t, c, base+"/actions")
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /actions: %d\n%s", resp.StatusCode, body)
	}
	tg := a.Targets[0]
	group := fmt.Sprintf("process group %d, this process alone", tg.PGID)
	if tg.WholeGroup {
		group = fmt.Sprintf("process group %d, signalled whole", tg.PGID)
	}
	for _, want := range []string{
		`<meta http-equiv="refresh" content="10">`,
		"Policy: <b>dead-owner</b>",
		`<span class="act">acts</span>`,
		`<span class="closed">closed</span>: cleanups run`,
		fmt.Sprintf("PID %d %s", tg.PID, tg.Comm),
		"it inherited the GPU context of a dead owner", // tg.Reason in words
		group,
		"policy dead-owner, acted",
	} {
		if !strings.Contains(body, want) {
			t.Errorf("/actions lacks %q", want)
		}
	}
	if strings.Contains(body, "shut") || strings.Contains(body, "<script") {
		t.Error("/actions says shut, or has a script")
	}
	if t.Failed() {
		t.Logf("target %+v\n/actions:\n%s", tg, body)
	}

	detail := base + "/actions/" + a.ID
	if !slices.Contains(links(t, base+"/actions", body), detail) {
		t.Fatalf("the page does not link %s", detail)
	}
	resp, body = get(t, c, detail)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s in open mode: %d\n%s", detail, resp.StatusCode, body)
	}
	for _, want := range []string{`<td id="policy">dead-owner</td>`, `<td id="dry-run">no: it acted`, string(tg.Reason), "signalled whole", "Events"} {
		if (want != "signalled whole" || tg.WholeGroup) && !strings.Contains(body, want) {
			t.Errorf("%s lacks %q", detail, want)
		}
	}
	// Every link of the detail page works but the API's, which needs the
	// token.
	for _, l := range links(t, detail, body) {
		if resp, _ := get(t, c, l); resp.StatusCode != http.StatusOK && !strings.Contains(l, "/api/v1/") {
			t.Errorf("the detail's link %s: %d", l, resp.StatusCode)
		}
	}
	// Under a foreign Host (DNS rebinding), the detail is refused too.
	req, _ := http.NewRequest(http.MethodGet, detail, nil)
	req.Host = "rebind.example"
	if resp, body := fetch(t, c, req); resp.StatusCode != http.StatusForbidden {
		t.Errorf("GET %s with Host rebind.example: %d, want 403: %s", detail, resp.StatusCode, body)
	}
	if resp, _ := get(t, c, base+"/actions/no-such-action"); resp.StatusCode != http.StatusNotFound {
		t.Errorf("GET /actions/no-such-action: %d, want 404", resp.StatusCode)
	}

	// The landing page.
	resp, body = get(t, c, base+"/")
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /: %d", resp.StatusCode)
	}
	ls := links(t, base+"/", body)
	if !slices.Contains(ls, base+"/actions") {
		t.Errorf("the landing page does not link /actions: %v", ls)
	}
	for _, l := range ls {
		if !strings.HasPrefix(l, base) {
			continue // an outside site
		}
		if resp, _ := get(t, c, l); resp.StatusCode == http.StatusNotFound || resp.StatusCode >= 500 {
			t.Errorf("the landing page's link %s: %d", l, resp.StatusCode)
		}
	}
}
