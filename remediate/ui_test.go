package remediate_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/remediate"
)

// TestActionsPageInABrowser: a Slurm job's orphan is cleaned through the
// webhook, then /actions is loaded in a real headless browser (Debian's
// chromium, which `make deps` installs): its DOM shows the action, who left
// the memory, the report row of that job, and the breaker. A screenshot is
// kept under .run/.
func TestActionsPageInABrowser(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	browser, err := exec.LookPath("chromium")
	if err != nil {
		t.Fatal("chromium not found: run `make deps` (Debian's chromium package)")
	}
	root := testenv.SimNode(t, 2)
	w, job := slurmJob(t, root)
	// Started after the job entered its cgroup: its first snapshot, taken
	// before it serves, sees the owner alive there.
	url, _ := startAgent(t, root, filepath.Join(t.TempDir(), "r.db"), "--act", "--web.ui.open")
	w.KillParent(t)
	a := alertAndWait(t, url, root, 1, fp(140))
	if a.State != remediate.StateSucceeded {
		t.Fatalf("action %s: %s", a.State, a.Reason)
	}

	profile := t.TempDir() // chromium's own state, not the user's
	run := func(args ...string) string {
		t.Helper()
		out, _ := chromium(t, browser, profile, args...)
		return out
	}
	// The console says what the Content-Security-Policy blocked: nothing.
	dom, console := chromium(t, browser, profile, "--dump-dom", url+"/actions?by=slurm_job&since=1d")
	if strings.Contains(console, "Content Security Policy") {
		t.Errorf("the page's Content-Security-Policy blocks part of it:\n%s", console)
	}
	for _, want := range []string{
		`id="action-` + a.ID + `"`,           // the action, linked to its detail
		`href="actions/` + a.ID + `"`,        //
		"Slurm job " + job,                   // who left the memory
		"<td>" + job + "</td>",               // the report's row for the job
		`<span class="closed">closed</span>`, // the breaker
		`class="current">slurm_job</a>`,      // --by as links
		`class="state-succeeded">succeeded`,  // the state
	} {
		if !strings.Contains(dom, want) {
			t.Errorf("the page's DOM lacks %q", want)
		}
	}
	if t.Failed() {
		t.Logf("DOM:\n%s", dom)
	}

	mod, err := testenv.ModuleRoot()
	if err != nil {
		t.Fatal(err)
	}
	shots := filepath.Join(mod, ".run", "actions")
	if err := os.MkdirAll(shots, 0o755); err != nil {
		t.Fatal(err)
	}
	shot := filepath.Join(shots, "actions.png")
	run("--window-size=1400,900", "--screenshot="+shot, url+"/actions?by=slurm_job&since=1d")
	if st, err := os.Stat(shot); err != nil || st.Size() == 0 {
		t.Errorf("no screenshot at %s: %v", shot, err)
	}
}

// TestActionsPageNeedsAuth: without --web.ui.open the page is behind the
// API's authentication.
func TestActionsPageNeedsAuth(t *testing.T) {
	t.Parallel()
	root := testenv.SimNode(t, 1)
	url, _ := startAgent(t, root, filepath.Join(t.TempDir(), "r.db"))
	resp, err := http.Get(url + "/actions")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("GET /actions without a token: %d, want 401", resp.StatusCode)
	}
	req, _ := http.NewRequest(http.MethodGet, url+"/actions", nil)
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err = http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/html") {
		t.Errorf("GET /actions with the token: %d %s", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
}

// chromium runs headless chromium with a profile of its own and returns
// what it printed (--dump-dom) and its console, which --enable-logging
// sends to stderr.
func chromium(t *testing.T, browser, profile string, args ...string) (stdout, console string) {
	t.Helper()
	args = append([]string{"--headless", "--no-sandbox", "--disable-gpu", "--user-data-dir=" + profile, "--enable-logging=stderr", "--v=0"}, args...)
	cmd := exec.Command(browser, args...)
	var errb strings.Builder
	cmd.Stderr = &errb
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("chromium %v: %v\n%s", args, err, errb.String())
	}
	return string(out), errb.String()
}

// crossSitePage is another site's page: it submits a form that resets the
// remediator's breaker, as soon as it loads.
const crossSitePage = `<!DOCTYPE html>
<html><body>
<form id="f" method="POST" action="%s/api/v1/breaker/reset" enctype="application/x-www-form-urlencoded"><input name="reset" value="1"></form>
<script>document.getElementById("f").submit()</script>
</body></html>`

// framingPage is another site's page that frames /actions.
const framingPage = `<!DOCTYPE html>
<html><body><iframe src="%s/actions"></iframe></body></html>`

// TestCrossSiteInABrowser: what another site's page can do with a
// remediator that trusts the browser's network position
// (--auth.insecure-none; a client certificate the browser presents is the
// same): in headless chromium, its form that POSTs to
// /api/v1/breaker/reset is refused (the old remediator reset the breaker:
// 200 {"was_open": ...}), its iframe of /actions stays empty, and its name
// resolved to the remediator's address (DNS rebinding, here chromium's
// --host-resolver-rules) does not get the open page.
func TestCrossSiteInABrowser(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	browser, err := exec.LookPath("chromium")
	if err != nil {
		t.Fatal("chromium not found: run `make deps` (Debian's chromium package)")
	}
	root := testenv.SimNode(t, 1)
	url, _ := startAgent(t, root, filepath.Join(t.TempDir(), "r.db"), "--auth.insecure-none", "--web.ui.open")
	evil := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		page := crossSitePage
		if r.URL.Path == "/frame" {
			page = framingPage
		}
		w.Header().Set("Content-Type", "text/html")
		fmt.Fprintf(w, page, url)
	}))
	defer evil.Close()
	// Another site: localhost's origin is not 127.0.0.1's.
	evilURL := strings.Replace(evil.URL, "127.0.0.1", "localhost", 1)
	profile := t.TempDir()

	// The form: submitted, and refused. --dump-dom prints the page the
	// browser navigated to, the remediator's answer.
	dom, _ := chromium(t, browser, profile, "--virtual-time-budget=10000", "--dump-dom", evilURL+"/form")
	if !strings.Contains(dom, "cross-site request refused: POST /api/v1/breaker/reset") || strings.Contains(dom, "was_open") {
		t.Errorf("another site's form to POST /api/v1/breaker/reset was not refused; the browser shows:\n%s", dom)
	}
	_, mfs := testenv.Scrape(t, url+"/metrics")
	if v, _ := testenv.Value(mfs, "gpu_orphan_remediator_requests_total", map[string]string{"code": "403"}); v != 1 {
		t.Errorf("requests_total{code=\"403\"} = %v, want 1 (the form)", v)
	}

	// The frame: the browser refuses to show /actions in it.
	_, console := chromium(t, browser, profile, "--virtual-time-budget=5000", "--dump-dom", evilURL+"/frame")
	if !strings.Contains(console, "frame-ancestors") {
		t.Errorf("chromium did not refuse to frame /actions; its console:\n%s", console)
	}

	// DNS rebinding: rebind.test resolves to the remediator's address.
	_, port, _ := strings.Cut(strings.TrimPrefix(url, "http://"), ":")
	dom, _ = chromium(t, browser, profile, "--host-resolver-rules=MAP rebind.test 127.0.0.1", "--dump-dom", "http://rebind.test:"+port+"/actions")
	if strings.Contains(dom, `id="breaker"`) || !strings.Contains(dom, "is not a name of this remediator") {
		t.Errorf("/actions under a rebound name was served; the browser shows:\n%s", dom)
	}
}
