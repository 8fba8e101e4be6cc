package remediate_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/sim"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/remediate"
)

const token = "test-token-0123456789abcdef"

func tokenFile(t *testing.T) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(p, []byte(token+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// startAgent starts a node agent on a simulated node; extra flags are
// appended. storePath may be shared between restarts.
func startAgent(t *testing.T, root, storePath string, extra ...string) (url string, stop func(sig syscall.Signal)) {
	t.Helper()
	addr := testenv.FreeAddr(t)
	args := withDefaults(extra, "--backend=sim", "--sim.root="+root, "--store.path="+storePath,
		"--auth.token-file="+tokenFile(t), "--node.name=node-a", "--web.listen-address="+addr,
		"--collector.interval=200ms", "--remediate.min-age=500ms", "--remediate.grace=1s",
		"--remediate.verify-timeout=10s", "--log.level=debug")
	cmd := testenv.Daemon(t, testenv.Bin(t, "gpu-orphan-remediator"), args...)
	url = "http://" + addr
	waitReady(t, http.DefaultClient, url)
	return url, func(sig syscall.Signal) {
		cmd.Process.Signal(sig)
		cmd.Wait()
	}
}

// withDefaults appends each default flag that extra does not set itself.
func withDefaults(extra []string, defaults ...string) []string {
	args := append([]string{}, extra...)
	for _, d := range defaults {
		name, _, _ := strings.Cut(d, "=")
		if !slices.ContainsFunc(extra, func(e string) bool { return e == name || strings.HasPrefix(e, name+"=") }) {
			args = append(args, d)
		}
	}
	return args
}

// results decodes an intake reply's counts by result.
func results(t *testing.T, body string) map[string]int {
	t.Helper()
	var r struct {
		Results map[string]int `json:"results"`
	}
	if err := json.Unmarshal([]byte(body), &r); err != nil {
		t.Fatalf("intake reply %q: %v", body, err)
	}
	return r.Results
}

func gpuUUID(t *testing.T, root string, index int) string {
	t.Helper()
	n, err := sim.Load(root)
	if err != nil {
		t.Fatal(err)
	}
	return n.GPUs[index].UUID
}

// alert builds one Alertmanager alert as JSON-ready data.
func alert(status, node, uuid, fingerprint string, startsAt time.Time) map[string]any {
	return map[string]any{
		"status":       status,
		"labels":       map[string]string{"alertname": "GPUOrphanMemory", "node": node, "uuid": uuid, "gpu": "1", "severity": "warning"},
		"annotations":  map[string]string{"summary": "orphan"},
		"startsAt":     startsAt.Format(time.RFC3339Nano),
		"endsAt":       "0001-01-01T00:00:00Z",
		"generatorURL": "http://prometheus/graph",
		"fingerprint":  fingerprint,
	}
}

func payload(alerts ...map[string]any) []byte {
	status := "resolved"
	for _, a := range alerts {
		if a["status"] == "firing" {
			status = "firing"
		}
	}
	b, _ := json.Marshal(map[string]any{
		"version": "4", "groupKey": "{}:{alertname=\"GPUOrphanMemory\"}", "truncatedAlerts": 0,
		"status": status, "receiver": "gpu-orphan", "groupLabels": map[string]string{"alertname": "GPUOrphanMemory"},
		"commonLabels": map[string]string{}, "commonAnnotations": map[string]string{}, "externalURL": "http://alertmanager",
		"alerts": alerts,
	})
	return b
}

func post(t *testing.T, url, tok string, body []byte) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url+"/api/v1/alerts", bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	if tok != "" {
		req.Header.Set("Authorization", "Bearer "+tok)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("post: %v", err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func actions(t *testing.T, url string) []remediate.Action {
	t.Helper()
	var out []remediate.Action
	if code := getJSON(t, http.DefaultClient, url+"/api/v1/actions?limit=1000", token, &out); code != http.StatusOK {
		t.Fatalf("GET actions: %d", code)
	}
	return out
}

// finished waits until an action reaches a final state and returns it.
func finished(t *testing.T, url string, timeout time.Duration) remediate.Action {
	t.Helper()
	var got remediate.Action
	testenv.Eventually(t, timeout, "an action to finish", func() bool {
		for _, a := range actions(t, url) {
			if a.State != remediate.StateQueued && a.State != remediate.StateRunning {
				got = a
				return true
			}
		}
		return false
	})
	return got
}

func usedMiB(t *testing.T, root string, gpu int) uint64 {
	t.Helper()
	d, err := sim.NewDriver(root)
	if err != nil {
		t.Fatal(err)
	}
	rs, err := d.Read(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	return rs[gpu].Memory.Used >> 20
}

// skipShort skips a test of this package under -short: each starts the
// project's binaries on a simulated node (about a minute in all).
func skipShort(t *testing.T) {
	t.Helper()
	if testing.Short() {
		t.Skip("integration test: starts the binaries")
	}
}

func TestMain(m *testing.M) {
	testenv.RunMapperIfAsked()
	os.Exit(testenv.Main(m))
}

// protectedHolder runs a process named nv-hostengine (this test binary
// under that name) that holds and maps GPU gpu's device node, in a session
// of its own: a suspect in every way but its protected name.
func protectedHolder(t *testing.T, root string, gpu int) int {
	t.Helper()
	n, err := sim.Load(root)
	if err != nil {
		t.Fatal(err)
	}
	// A hard link: protection goes by the executable file's own name and
	// owner, and a symlink's name is nobody's executable.
	bin := filepath.Join(t.TempDir(), "nv-hostengine")
	if err := os.Link(os.Args[0], bin); err != nil {
		testenv.CopyExecutable(t, os.Args[0], bin, 0o755)
	}
	dev, err := os.Open(n.DevicePath(n.GPUs[gpu].Minor))
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	cmd := exec.Command(bin)
	cmd.Env = testenv.MapperEnviron()
	cmd.ExtraFiles = []*os.File{dev}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	maps := fmt.Sprintf("/proc/%d/maps", cmd.Process.Pid)
	testenv.Eventually(t, 5*time.Second, "nv-hostengine to map the device", func() bool {
		b, _ := os.ReadFile(maps)
		return bytes.Contains(b, []byte(n.DevicePath(n.GPUs[gpu].Minor)))
	})
	return cmd.Process.Pid
}

func fp(i int) string { return fmt.Sprintf("%016x", 0xabc000+i) }

// TestWebhookCleansForkOrphan: the fork-orphan case cleaned through the
// webhook, with the memory verified back, and what must not be touched
// left alone.
func TestWebhookCleansForkOrphan(t *testing.T) {
	skipShort(t)
	t.Parallel()
	root := testenv.SimNode(t, 2)
	uuid := gpuUUID(t, root, 1)
	orphan := testenv.StartWorkload(t, root, 1, 6144, 2, "--ignore-sigterm")
	bystander := testenv.StartWorkload(t, root, 1, 1024, 1) // owns live memory on the same GPU
	protected := protectedHolder(t, root, 1)                // DCGM's host engine holding the device node

	url, _ := startAgent(t, root, filepath.Join(t.TempDir(), "r.db"), "--act")
	orphan.KillParent(t)
	if code, body := post(t, url, "", payload(alert("firing", "node-a", uuid, fp(1), time.Now()))); code != http.StatusUnauthorized {
		t.Fatalf("no token: %d %s", code, body)
	}
	received := time.Now()
	if code, body := post(t, url, token, payload(alert("firing", "node-a", uuid, fp(1), time.Now().Add(-time.Minute)))); code != http.StatusOK {
		t.Fatalf("post: %d %s", code, body)
	}
	a := finished(t, url, 30*time.Second)
	t.Logf("webhook to memory verified back: %s", time.Since(received).Round(time.Millisecond))
	if a.State != remediate.StateSucceeded {
		t.Fatalf("action %s: %s (%+v)", a.State, a.Reason, a)
	}
	if a.FreedBytes != (6144+8)<<20 {
		t.Errorf("freed %d MiB, want 6152", a.FreedBytes>>20)
	}
	if a.Before == nil || a.After == nil || a.Before.UnownedBytes < 6144<<20 || a.After.UnownedBytes > 256<<20 {
		t.Errorf("evidence before=%+v after=%+v", a.Before, a.After)
	}
	if len(a.Targets) != 2 {
		t.Fatalf("targets %+v, want the two children", a.Targets)
	}
	for _, tg := range a.Targets {
		// The children ignore SIGTERM: SIGKILL after the grace period.
		if tg.Outcome != "exited_after_sigkill" || tg.PGID != orphan.PID || tg.StartTime == 0 {
			t.Errorf("target %d: outcome %s pgid %d start %d signals %v", tg.PID, tg.Outcome, tg.PGID, tg.StartTime, tg.Signals)
		}
		if testenv.Alive(tg.PID) {
			t.Errorf("target %d still alive", tg.PID)
		}
	}
	if !testenv.Alive(bystander.PID) || !testenv.Alive(bystander.Children[0]) {
		t.Fatal("the workload that owns live memory was touched")
	}
	if !testenv.Alive(protected) {
		t.Fatal("a protected process (nv-hostengine) was touched")
	}
	if !slices.ContainsFunc(a.Excluded, func(e remediate.Exclusion) bool { return e.PID == protected && e.Why == "protected" }) {
		t.Errorf("the protected holder is not recorded as excluded: %+v", a.Excluded)
	}
	if got := usedMiB(t, root, 1); got != 1024+8 {
		t.Errorf("GPU 1 used %d MiB after cleanup, want the bystander's 1032", got)
	}
}

// TestDuplicatesActOnce: retries and HA replicas send copies; exactly one
// action results, and a resolved alert cancels queued work.
func TestDuplicatesActOnce(t *testing.T) {
	skipShort(t)
	t.Parallel()
	root := testenv.SimNode(t, 2)
	uuid := gpuUUID(t, root, 1)
	w := testenv.StartWorkload(t, root, 1, 2048, 1)
	url, _ := startAgent(t, root, filepath.Join(t.TempDir(), "r.db"))
	w.KillParent(t)

	startsAt := time.Now().Add(-time.Minute)
	body := payload(alert("firing", "node-a", uuid, fp(2), startsAt))
	done := make(chan int, 9)
	for range 9 { // three replicas, three retries each
		go func() {
			code, _ := post(t, url, token, body)
			done <- code
		}()
	}
	for range 9 {
		if code := <-done; code != http.StatusOK {
			t.Fatalf("copy answered %d", code)
		}
	}
	a := finished(t, url, 20*time.Second)
	if a.State != remediate.StateDryRun || len(a.Targets) != 1 || a.Targets[0].PID != w.Children[0] {
		t.Fatalf("dry run plan: %+v", a)
	}
	if n := len(actions(t, url)); n != 1 {
		t.Fatalf("%d actions for one alert, want 1", n)
	}
	if !testenv.Alive(w.Children[0]) {
		t.Fatal("a dry run killed a process")
	}
	// Another node's alert, and an unknown GPU, are recorded as ignored.
	code, resp := post(t, url, token, payload(alert("firing", "node-b", uuid, fp(3), startsAt), alert("firing", "node-a", "GPU-../../etc", fp(4), startsAt)))
	if code != http.StatusOK || results(t, resp)["ignored"] != 2 {
		t.Fatalf("foreign alerts: %d %s", code, resp)
	}
	if n := len(actions(t, url)); n != 1 {
		t.Fatalf("ignored alerts created actions: %d", n)
	}
}

// A remediator killed with -9 mid-cleanup and restarted: TestCrashAtEveryStep
// (crash_test.go), at each step of the cleanup.
