package remediate_test

import (
	"net/http"
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
		args = append([]string{"--headless", "--no-sandbox", "--disable-gpu", "--user-data-dir=" + profile}, args...)
		out, err := exec.Command(browser, args...).Output()
		if err != nil {
			t.Fatalf("chromium %v: %v", args, err)
		}
		return string(out)
	}
	dom := run("--dump-dom", url+"/actions?by=slurm_job&since=1d")
	for _, want := range []string{
		`id="action-` + a.ID + `"`,           // the action, linked to its JSON
		`href="api/v1/actions/` + a.ID + `"`, //
		"Slurm job " + job,                   // who left the memory
		"<td>" + job + "</td>",               // the report's row for the job
		`<span class="shut">shut</span>`,     // the breaker
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
