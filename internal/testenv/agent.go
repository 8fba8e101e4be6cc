package testenv

import (
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

// NodeAgent starts a node agent (gpu-orphan-remediator, a dry run unless
// extra says --act) on the simulated node root with its store at
// storePath, as it runs on a node all along: it follows the kernel's
// process events and records in its store who inherited whose context,
// which `gpu-orphan clean` and the Slurm hooks read. It returns once the
// agent has taken its first snapshot (ready), and stops it at cleanup.
func NodeAgent(t testing.TB, root, storePath string, extra ...string) string {
	t.Helper()
	tok := filepath.Join(t.TempDir(), "agent-token")
	if err := os.WriteFile(tok, []byte("node-agent-test-token-0123456789abcdef\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	args := append([]string{"--backend=sim", "--sim.root=" + root, "--store.path=" + storePath,
		"--auth.token-file=" + tok, "--node.name=node-a", "--collector.interval=200ms", "--web.systemd-socket"}, extra...)
	cmd := exec.Command(Bin(t, "gpu-orphan-remediator"), args...)
	url := "http://" + PassListener(t, cmd)
	DaemonCmd(t, cmd)
	FollowsEvents(t, url)
	Eventually(t, 15*time.Second, "the node agent to be ready", func() bool {
		resp, err := http.Get(url + "/-/ready")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	return url
}
