package remediate_test

import (
	"net/http"
	"net/url"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

// TestActionsTrailingSlash: /actions/ (with the slash, as people type it)
// redirects to /actions, query and all, on the real remediator, rather
// than 404 (issue 23, paper cut 6); the page then opens with the
// token, and /actions/{id} is still an action's page.
func TestActionsTrailingSlash(t *testing.T) {
	skipShort(t)
	t.Parallel()
	root := testenv.SimNode(t, 1)
	base, _ := startAgent(t, root, filepath.Join(t.TempDir(), "r.db"))
	c := browser(t) // follows no redirect
	for _, tc := range []struct{ path, want string }{
		{"/actions/", "/actions"},
		{"/actions/?by=comm&since=1d", "/actions?by=comm&since=1d"},
	} {
		for _, method := range []string{http.MethodGet, http.MethodHead} {
			req, _ := http.NewRequest(method, base+tc.path, nil)
			resp, body := fetch(t, c, req)
			loc, err := url.Parse(resp.Header.Get("Location"))
			if err != nil {
				t.Fatal(err)
			}
			page, _ := url.Parse(base + tc.path)
			if got := page.ResolveReference(loc).RequestURI(); resp.StatusCode != http.StatusMovedPermanently || got != tc.want {
				t.Errorf("%s %s: %d, Location %q (%s); want 301 to %s\n%s", method, tc.path, resp.StatusCode, loc, got, tc.want, body)
			}
		}
	}

	// Followed, with the token, it is the page.
	req, _ := http.NewRequest(http.MethodGet, base+"/actions/?by=comm", nil)
	req.Header.Set("Authorization", "Bearer "+token)
	resp, body := fetch(t, &http.Client{}, req)
	if resp.StatusCode != http.StatusOK || resp.Request.URL.Path != "/actions" || !strings.Contains(body, `class="current">comm</a>`) {
		t.Errorf("GET /actions/?by=comm, followed: %d at %s\n%s", resp.StatusCode, resp.Request.URL, body)
	}
	// An action's page is not redirected.
	req, _ = http.NewRequest(http.MethodGet, base+"/actions/no-such-action", nil)
	req.Header.Set("Authorization", "Bearer "+token)
	if resp, body := fetch(t, c, req); resp.StatusCode != http.StatusNotFound || !strings.Contains(body, `no action "no-such-action"`) {
		t.Errorf("GET /actions/no-such-action: %d\n%s", resp.StatusCode, body)
	}
}
