package app

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/sim"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

// TestActRefusedInAnotherPIDNamespace (issue 15, finding 10): the
// remediator run with --act in a PID namespace of its own (unshare --pid
// --fork) while --path.procfs is the host's /proc refuses to start: exit 1,
// a message that says what is wrong and what to do, no audit database, and
// the fork orphan's workers untouched. Without --act it starts, with a
// warning. The same command in the host's namespace cleans the orphan.
func TestActRefusedInAnotherPIDNamespace(t *testing.T) {
	unshare, err := exec.LookPath("unshare")
	if err != nil {
		t.Skip("unshare (util-linux) is not installed")
	}
	if os.Geteuid() != 0 {
		t.Skip("unshare --pid needs root")
	}
	root := testenv.SimNode(t, 2)
	w := testenv.StartWorkload(t, root, 1, 1024, 2)
	bin := testenv.Bin(t, "gpu-orphan-remediator")
	dir := t.TempDir()
	args := func(storePath, addr string, extra ...string) []string {
		return append([]string{"--backend=sim", "--sim.root=" + root, "--path.procfs=/proc", "--auth.insecure-none",
			"--store.path=" + storePath, "--web.listen-address=" + addr, "--node.name=node-a",
			"--collector.interval=200ms", "--remediate.min-age=0s", "--remediate.grace=1s"}, extra...)
	}

	storePath := filepath.Join(dir, "unshared", "remediator.db")
	// --kill-child: the remediator dies with unshare, should the test kill
	// it for starting.
	cmd := exec.Command(unshare, append([]string{"--pid", "--fork", "--kill-child", bin}, args(storePath, testenv.FreeAddr(t), "--act")...)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	cmd.WaitDelay = 5 * time.Second
	done := make(chan error, 1)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { done <- cmd.Wait() }()
	select {
	case err = <-done:
	case <-time.After(60 * time.Second):
		_ = cmd.Process.Kill() // it may have exited meanwhile
		t.Fatalf("the remediator with --act in its own PID namespace kept running (then: %v)", <-done)
	}
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 1 {
		t.Errorf("with --act in its own PID namespace: %v, want exit status 1\n%s", err, stderr.String())
	}
	for _, want := range []string{"refusing to start with --act", "--path.procfs=/proc", "this process is PID 1 in its own PID namespace", "hostPID: true", "--pid=host"} {
		if !strings.Contains(stderr.String(), want) {
			t.Errorf("the refusal does not say %q:\n%s", want, stderr.String())
		}
	}
	if _, err := os.Stat(filepath.Dir(storePath)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the refused start left %s behind (stat: %v)", filepath.Dir(storePath), err)
	}
	for _, c := range w.Children {
		if !testenv.Alive(c) {
			t.Errorf("worker %d died", c)
		}
	}

	// A dry run signals nothing: it starts, and warns. unshare ignores
	// SIGTERM while it waits for its child: the remediator is stopped
	// itself, and dies with unshare if the test ends first (--kill-child).
	addr := testenv.FreeAddr(t)
	logPath := filepath.Join(dir, "dry.log")
	logf, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	dry := exec.Command(unshare, append([]string{"--pid", "--fork", "--kill-child=SIGTERM", bin}, args(filepath.Join(dir, "dry", "remediator.db"), addr)...)...)
	dry.Stdout, dry.Stderr = logf, logf
	if err := dry.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dry.Process.Kill(); dry.Wait() })
	waitHealthy(t, "http://"+addr)
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", dry.Process.Pid, dry.Process.Pid))
	child, cerr := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || cerr != nil {
		t.Fatalf("unshare's child: %q, %v, %v", b, err, cerr)
	}
	syscall.Kill(child, syscall.SIGTERM)
	dry.Wait()
	log, _ := os.ReadFile(logPath)
	if !bytes.Contains(log, []byte("Not in the PID namespace that --path.procfs shows")) {
		t.Errorf("a dry run in its own PID namespace does not warn:\n%s", log)
	}

	// The same command, in the host's PID namespace, cleans the orphan.
	addr = testenv.FreeAddr(t)
	testenv.Daemon(t, bin, args(filepath.Join(dir, "host", "remediator.db"), addr, "--act")...)
	url := "http://" + addr
	waitHealthy(t, url)
	// The job dies once the agent runs, as on a node: it saw the workers.
	w.KillParent(t)
	n, err := sim.Load(root)
	if err != nil {
		t.Fatal(err)
	}
	postAlert(t, url, n.GPUs[1].UUID)
	testenv.Eventually(t, 30*time.Second, "the workers to be signalled and gone", func() bool {
		return !testenv.Alive(w.Children[0]) && !testenv.Alive(w.Children[1])
	})
}

func waitHealthy(t *testing.T, url string) {
	t.Helper()
	testenv.Eventually(t, 30*time.Second, "the remediator to serve", func() bool {
		resp, err := http.Get(url + "/-/ready")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
}

// postAlert sends Alertmanager's webhook with one firing GPUOrphanMemory
// alert for GPU uuid of node-a.
func postAlert(t *testing.T, url, uuid string) {
	t.Helper()
	body, _ := json.Marshal(map[string]any{
		"version": "4", "groupKey": "{}:{alertname=\"GPUOrphanMemory\"}", "truncatedAlerts": 0, "status": "firing",
		"receiver": "gpu-orphan", "groupLabels": map[string]string{}, "commonLabels": map[string]string{},
		"commonAnnotations": map[string]string{}, "externalURL": "http://alertmanager",
		"alerts": []map[string]any{{
			"status": "firing", "labels": map[string]string{"alertname": "GPUOrphanMemory", "node": "node-a", "uuid": uuid},
			"annotations": map[string]string{}, "startsAt": time.Now().Format(time.RFC3339Nano), "endsAt": "0001-01-01T00:00:00Z",
			"generatorURL": "", "fingerprint": "00000000000000f1",
		}},
	})
	resp, err := http.Post(url+"/api/v1/alerts", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("POST /api/v1/alerts: %s", resp.Status)
	}
}
