package exporter_test

import (
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

// TestStateLinkRefused (issue 24, item 4): a user made a directory in a
// /tmp and, in it, the exporter's --state.path as a link to a file that
// only root may read. The exporter started, read the file and logged its
// first byte ("invalid character 'Z'"). Now it does not start: it says,
// in one line, that the directory is the user's and what to run; after
// that (`chown -R root`, which leaves the link) it says that the state
// file is a link, and what to run. Nothing of root's file is in its
// output, and the file is as it was.
func TestStateLinkRefused(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	t.Parallel()
	n := testenv.NewNeighbour(t)
	const secretText = "Zsecret of root: do not log\n"
	secret := filepath.Join(n.Base, "secret")
	if err := os.WriteFile(secret, []byte(secretText), 0o600); err != nil {
		t.Fatal(err)
	}
	dir := n.Dir(t, "u", map[string]string{"exporter.json": secret})
	state := filepath.Join(dir, "exporter.json")
	root := testenv.SimNode(t, 1)

	for _, step := range []struct {
		name, says string
		before     func()
	}{
		{"the user's directory", "the state file's directory " + dir + " belongs to ", nil},
		{"the link, once the directory is root's", "the state file " + state + " is a symbolic link (to " + secret + "), which the state file does not follow: remove it (`rm " + state + "`)",
			func() {
				if out, err := exec.Command("chown", "-R", "root", dir).CombinedOutput(); err != nil {
					t.Fatalf("%v %s", err, out)
				}
			}},
	} {
		if step.before != nil {
			step.before()
		}
		out, code := runToExit(t, root, "--state.path="+state)
		if code != 1 || !strings.Contains(out, step.says) {
			t.Errorf("%s: the exporter exited %d, want 1, saying %q; output:\n%s", step.name, code, step.says, out)
		}
		if strings.Contains(out, "'Z'") || strings.Contains(out, "secret of root") {
			t.Errorf("%s: the exporter's output tells of root's file:\n%s", step.name, out)
		}
		if b, err := os.ReadFile(secret); err != nil || string(b) != secretText {
			t.Errorf("%s: root's file is now %q %v", step.name, b, err)
		}
	}
}

// runToExit runs the exporter on the node, expecting it to exit at once:
// one that serves instead fails the test. It returns what it printed and
// its exit status.
func runToExit(t *testing.T, root string, extra ...string) (string, int) {
	t.Helper()
	addr := testenv.FreeAddr(t)
	logPath := filepath.Join(t.TempDir(), "exporter.log")
	logf, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	cmd := exec.Command(testenv.Bin(t, "gpu-orphan-exporter"), append([]string{"--backend=sim", "--sim.root=" + root, "--web.listen-address=" + addr}, extra...)...)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	exited := func() bool {
		select {
		case <-done:
			return true
		default:
			return false
		}
	}
	serving := func() bool {
		resp, err := http.Get("http://" + addr + "/metrics")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return true
	}
	testenv.Eventually(t, 30*time.Second, "the exporter to exit or serve", func() bool { return exited() || serving() })
	if !exited() {
		cmd.Process.Kill()
		<-done
		b, _ := os.ReadFile(logPath)
		t.Errorf("the exporter started and served; output:\n%s", b)
		return string(b), -1
	}
	b, _ := os.ReadFile(logPath)
	return string(b), cmd.ProcessState.ExitCode()
}
