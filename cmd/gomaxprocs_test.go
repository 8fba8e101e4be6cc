package cmd

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

// TestRuntimeGOMAXPROCS: each daemon runs its Go code on at most
// --runtime.gomaxprocs CPUs, read from GOMAXPROCS when that is set, as its
// own go_sched_gomaxprocs_threads says; a negative value is bad input.
// (The default's bound, 8 of a large server's CPUs, is TestMaxProcs: this
// machine may have fewer.)
func TestRuntimeGOMAXPROCS(t *testing.T) {
	t.Parallel()
	root := testenv.SimNode(t, 1)
	dir := t.TempDir()
	token, targets := filepath.Join(dir, "token"), filepath.Join(dir, "targets.json")
	if err := os.WriteFile(token, []byte("gomaxprocs-test-token-0123456789abcdef\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(targets, []byte("{}"), 0o600); err != nil {
		t.Fatal(err)
	}
	daemons := map[string]func(addr string) []string{
		"gpu-orphan-exporter": func(addr string) []string {
			return []string{"--backend=sim", "--sim.root=" + root, "--web.listen-address=" + addr}
		},
		"gpu-orphan-remediator": func(addr string) []string {
			return []string{"--backend=sim", "--sim.root=" + root, "--node.name=n", "--auth.token-file=" + token,
				"--store.path=" + filepath.Join(t.TempDir(), "r.db"), "--web.listen-address=" + addr}
		},
		"gpu-orphan-dispatcher": func(addr string) []string {
			return []string{"--auth.token-file=" + token, "--dispatch.targets-file=" + targets,
				"--store.path=" + filepath.Join(t.TempDir(), "d.db"), "--web.listen-address=" + addr}
		},
	}
	for _, c := range []struct {
		daemon, env, flag string
		want              float64
	}{
		{"gpu-orphan-exporter", "", "--runtime.gomaxprocs=1", 1},
		{"gpu-orphan-exporter", "12", "", 12},                      // GOMAXPROCS is Go's choice and the flag's value
		{"gpu-orphan-exporter", "12", "--runtime.gomaxprocs=3", 3}, // the flag wins
		{"gpu-orphan-exporter", "12", "--runtime.gomaxprocs=0", 12},
		{"gpu-orphan-remediator", "", "--runtime.gomaxprocs=1", 1},
		{"gpu-orphan-remediator", "12", "", 12},
		{"gpu-orphan-dispatcher", "", "--runtime.gomaxprocs=1", 1},
	} {
		t.Run(fmt.Sprintf("%s/GOMAXPROCS=%s/%s", c.daemon, c.env, c.flag), func(t *testing.T) {
			t.Parallel()
			addr := testenv.FreeAddr(t)
			args := daemons[c.daemon](addr)
			if c.flag != "" {
				args = append(args, c.flag)
			}
			cmd := exec.Command(testenv.Bin(t, c.daemon), args...)
			cmd.Env = withoutEnv(os.Environ(), "GOMAXPROCS")
			if c.env != "" {
				cmd.Env = append(cmd.Env, "GOMAXPROCS="+c.env)
			}
			testenv.DaemonCmd(t, cmd)
			url := "http://" + addr + "/metrics"
			testenv.Eventually(t, 30*time.Second, url+" to serve", func() bool { return idleScrapeOnce(url) == nil })
			_, mfs := testenv.Scrape(t, url)
			got, ok := testenv.Value(mfs, "go_sched_gomaxprocs_threads", nil)
			if !ok || got != c.want {
				t.Errorf("go_sched_gomaxprocs_threads = %v (found: %v), want %v", got, ok, c.want)
			}
		})
	}
	t.Run("negative", func(t *testing.T) {
		t.Parallel()
		out, err := exec.Command(testenv.Bin(t, "gpu-orphan-exporter"), "--backend=sim", "--sim.root="+root,
			"--runtime.gomaxprocs=-1").CombinedOutput()
		if code := testenv.ExitCode(t, err); code != 2 || !strings.Contains(string(out), "--runtime.gomaxprocs") {
			t.Errorf("--runtime.gomaxprocs=-1: exit %d, %q; want exit 2 naming the flag", code, out)
		}
	})
}

func withoutEnv(env []string, name string) []string {
	var out []string
	for _, kv := range env {
		if !strings.HasPrefix(kv, name+"=") {
			out = append(out, kv)
		}
	}
	return out
}
