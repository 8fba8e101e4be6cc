//go:build e2e

package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

// requiredEnv makes a missing Prometheus or Alertmanager a failure instead
// of a skip; `make e2e` and CI set it.
const requiredEnv = "GPU_ORPHAN_E2E_REQUIRED"

// tool finds an external binary under any of its names (Debian calls
// Alertmanager prometheus-alertmanager), skipping or failing the test when
// there is none.
func tool(t *testing.T, names ...string) string {
	t.Helper()
	for _, n := range names {
		if p, err := exec.LookPath(n); err == nil {
			return p
		}
	}
	msg := fmt.Sprintf("%s not found in PATH: the e2e test needs a real Prometheus and Alertmanager; "+
		"install them with scripts/deps.sh (make deps)", strings.Join(names, " or "))
	if os.Getenv(requiredEnv) != "" {
		t.Fatalf("%s (%s is set, so this is a failure)", msg, requiredEnv)
	}
	t.Skipf("%s, or set %s=1 to make this a failure", msg, requiredEnv)
	return ""
}

// daemon is a long-running process the test started, in its own process
// group, logging to a file that is printed when the test fails.
type daemon struct {
	name string
	cmd  *exec.Cmd
	log  string
	done chan struct{} // closed when it has exited
	err  error         // its exit status, once done is closed
}

// startDaemon starts bin. It is stopped at cleanup: SIGTERM to its process
// group, SIGKILL after 10 s. Pdeathsig kills it if the test binary dies
// without running its cleanups (a panic, the -timeout).
func startDaemon(t *testing.T, logDir, name, bin string, args ...string) *daemon {
	t.Helper()
	d := &daemon{name: name, log: filepath.Join(logDir, name+".log"), done: make(chan struct{})}
	logf, err := os.Create(d.log)
	if err != nil {
		t.Fatal(err)
	}
	d.cmd = exec.Command(bin, args...)
	d.cmd.Stdout, d.cmd.Stderr = logf, logf
	d.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := d.cmd.Start(); err != nil {
		logf.Close()
		t.Fatalf("starting %s: %v", name, err)
	}
	go func() {
		d.err = d.cmd.Wait()
		logf.Close()
		close(d.done)
	}()
	t.Cleanup(func() {
		d.stop(t)
		if t.Failed() {
			b, _ := os.ReadFile(d.log)
			t.Logf("----- %s log (%s) -----\n%s", name, strings.Join(d.cmd.Args, " "), b)
		}
	})
	return d
}

func (d *daemon) stop(t *testing.T) {
	pgid := d.cmd.Process.Pid
	syscall.Kill(-pgid, syscall.SIGTERM)
	select {
	case <-d.done:
	case <-time.After(10 * time.Second):
		t.Errorf("%s did not stop within 10s of SIGTERM; killing it", d.name)
		syscall.Kill(-pgid, syscall.SIGKILL)
		<-d.done
	}
	// Anything left in its group (it starts no children, so nothing should
	// be) goes too.
	syscall.Kill(-pgid, syscall.SIGKILL)
}

// exited reports an error when the daemon is no longer running.
func (d *daemon) exited() error {
	select {
	case <-d.done:
		return fmt.Errorf("%s exited early (%v); its log is printed below", d.name, d.err)
	default:
		return nil
	}
}

// configDir is scripts/e2e-config, shared with scripts/run.sh.
func configDir(t *testing.T) string {
	t.Helper()
	root, err := testenv.ModuleRoot()
	if err != nil {
		t.Fatal(err)
	}
	return filepath.Join(root, "scripts", "e2e-config")
}

// fillTemplate writes scripts/e2e-config/name with its @KEY@ placeholders
// replaced to dst, and fails if any is left.
func fillTemplate(t *testing.T, name, dst string, vars map[string]string) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(configDir(t), name))
	if err != nil {
		t.Fatal(err)
	}
	var pairs []string
	for k, v := range vars {
		pairs = append(pairs, "@"+k+"@", v)
	}
	out := strings.NewReplacer(pairs...).Replace(string(b))
	if left := placeholder.FindString(out); left != "" {
		t.Fatalf("%s: placeholder %s not filled", name, left)
	}
	if err := os.WriteFile(dst, []byte(out), 0o644); err != nil {
		t.Fatal(err)
	}
}

var placeholder = regexp.MustCompile(`@[A-Z_]+@`)

// shortenRules writes the test copy of alerts/gpu-orphan.rules.yml with
// the script that `make run` uses.
func shortenRules(t *testing.T, dst string, age int, forDur string) string {
	t.Helper()
	root, _ := testenv.ModuleRoot()
	src := filepath.Join(root, "alerts", "gpu-orphan.rules.yml")
	cmd := exec.Command("awk", "-v", fmt.Sprintf("age=%d", age), "-v", "for_="+forDur,
		"-f", filepath.Join(configDir(t), "shorten-rules.awk"), src)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("shorten-rules.awk: %v\n%s", err, stderr.Bytes())
	}
	if err := os.WriteFile(dst, out, 0o644); err != nil {
		t.Fatal(err)
	}
	return src
}

var httpClient = &http.Client{Timeout: 3 * time.Second}

// getJSON GETs u (with a bearer token if tok is set) and decodes a 200
// answer into v.
func getJSON(u, tok string, v any) error {
	req, err := http.NewRequest(http.MethodGet, u, nil)
	if err != nil {
		return err
	}
	if tok != "" {
		req.Header.Set("Authorization", "Bearer "+tok)
	}
	resp, err := httpClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s: %s", u, resp.Status, bytes.TrimSpace(b))
	}
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("GET %s: %w: %s", u, err, b)
	}
	return nil
}

// statusOf GETs u and returns the status code.
func statusOf(u, tok string) int {
	req, _ := http.NewRequest(http.MethodGet, u, nil)
	if tok != "" {
		req.Header.Set("Authorization", "Bearer "+tok)
	}
	resp, err := httpClient.Do(req)
	if err != nil {
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}

// promSample is one element of an instant vector from Prometheus's query API.
type promSample struct {
	Metric map[string]string `json:"metric"`
	Value  [2]any            `json:"value"`
}

func (s promSample) float() float64 {
	str, _ := s.Value[1].(string)
	var f float64
	fmt.Sscan(str, &f)
	return f
}

// promQuery runs an instant query.
func promQuery(base, q string) ([]promSample, error) {
	var r struct {
		Status string `json:"status"`
		Data   struct {
			ResultType string       `json:"resultType"`
			Result     []promSample `json:"result"`
		} `json:"data"`
	}
	if err := getJSON(base+"/api/v1/query?query="+url.QueryEscape(q), "", &r); err != nil {
		return nil, err
	}
	if r.Status != "success" || r.Data.ResultType != "vector" {
		return nil, fmt.Errorf("query %q: status %s, type %s", q, r.Status, r.Data.ResultType)
	}
	return r.Data.Result, nil
}

// promAlert is an alert of Prometheus's /api/v1/alerts.
type promAlert struct {
	Labels   map[string]string `json:"labels"`
	State    string            `json:"state"`
	ActiveAt time.Time         `json:"activeAt"`
	Value    string            `json:"value"`
}

func promAlerts(base string) ([]promAlert, error) {
	var r struct {
		Data struct {
			Alerts []promAlert `json:"alerts"`
		} `json:"data"`
	}
	err := getJSON(base+"/api/v1/alerts", "", &r)
	return r.Data.Alerts, err
}

// amAlert is an alert of Alertmanager's /api/v2/alerts.
type amAlert struct {
	Labels      map[string]string `json:"labels"`
	Fingerprint string            `json:"fingerprint"`
	StartsAt    time.Time         `json:"startsAt"`
	Status      struct {
		State string `json:"state"`
	} `json:"status"`
	Receivers []struct {
		Name string `json:"name"`
	} `json:"receivers"`
}

func (a amAlert) sentTo(receiver string) bool {
	for _, r := range a.Receivers {
		if r.Name == receiver {
			return true
		}
	}
	return false
}

func amAlerts(base string) ([]amAlert, error) {
	var r []amAlert
	err := getJSON(base+"/api/v2/alerts", "", &r)
	return r, err
}

// matches reports whether labels include every pair of want.
func matches(labels, want map[string]string) bool {
	for k, v := range want {
		if labels[k] != v {
			return false
		}
	}
	return true
}

// stage is one step of the loop and when it was first seen.
type stage struct {
	name    string
	at      time.Duration // since the parent was killed
	delta   time.Duration // since the previous stage
	details string
}

// timeline records the stages in order.
type timeline struct {
	t0     time.Time
	last   time.Duration
	stages []stage
}

func (tl *timeline) mark(t *testing.T, name, details string) {
	t.Helper()
	at := time.Since(tl.t0)
	s := stage{name: name, at: at, delta: at - tl.last, details: details}
	tl.last = at
	tl.stages = append(tl.stages, s)
	t.Logf("stage %-38s +%6.2fs (Δ %5.2fs)  %s", name, at.Seconds(), s.delta.Seconds(), details)
}

func (tl *timeline) table() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%-40s %10s %10s  %s\n", "stage (after the parent's SIGKILL)", "at", "Δ", "details")
	for _, s := range tl.stages {
		fmt.Fprintf(&b, "%-40s %9.2fs %9.2fs  %s\n", s.name, s.at.Seconds(), s.delta.Seconds(), s.details)
	}
	return b.String()
}

func (tl *timeline) markdown() string {
	var b strings.Builder
	b.WriteString("| stage | at (s after SIGKILL) | Δ (s) | details |\n|---|---:|---:|---|\n")
	for _, s := range tl.stages {
		fmt.Fprintf(&b, "| %s | %.2f | %.2f | %s |\n", s.name, s.at.Seconds(), s.delta.Seconds(),
			strings.ReplaceAll(s.details, "|", "\\|"))
	}
	return b.String()
}

// waitFor polls cond every 100 ms until it returns true, an error from
// check (a daemon died), or the timeout. cond's string says what it last
// saw, for the failure message.
func waitFor(t *testing.T, timeout time.Duration, what string, check func() error, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	var last string
	for {
		ok, seen := cond()
		if ok {
			return
		}
		if seen != "" {
			last = seen
		}
		if err := check(); err != nil {
			t.Fatalf("waiting for %s: %v (last seen: %s)", what, err, last)
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s; last seen: %s", timeout, what, last)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// errString is err's message, or "".
func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}
