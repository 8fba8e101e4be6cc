package exporter_test

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

// stop stops the exporter with SIGTERM and waits for it.
func (e *exporterProc) stop(t *testing.T) {
	t.Helper()
	e.cmd.Process.Signal(syscall.SIGTERM)
	e.cmd.Wait()
}

// TestStateSurvivesRestart (issue 16, §2): an exporter with --state.path
// saw a job alive; it is restarted, and the job dies while it is down. The
// new exporter names the dead owner from the state, as the first would
// have. Without the flag it would not know (TestDeadOwnerIdentity).
func TestStateSurvivesRestart(t *testing.T) {
	t.Parallel()
	root := testenv.SimNode(t, 2)
	state := filepath.Join(t.TempDir(), "state", "exporter.json")
	w := testenv.StartWorkload(t, root, 1, 1024, 1)
	first := startExporter(t, root, "--collector.interval=200ms", "--state.path="+state)
	waitOwned(t, first.url, w.PID)
	testenv.Eventually(t, 5*time.Second, "the state file", func() bool {
		b, err := os.ReadFile(state)
		return err == nil && strings.Contains(string(b), "gpu-orphan-sim")
	})
	first.stop(t)
	w.KillParent(t)

	second := startExporter(t, root, "--collector.interval=200ms", "--state.path="+state)
	got := deadOwner(t, second.url, w.PID)
	if got["comm"] != "gpu-orphan-sim" || got["user"] != "root" {
		t.Errorf("after a restart the dead owner is %v, want comm gpu-orphan-sim, user root", got)
	}
	if !strings.Contains(second.log(t), "Restored what the collector remembered") {
		t.Errorf("the log does not say the state was restored:\n%s", second.log(t))
	}
	fi, err := os.Stat(state)
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("the state file: %v, mode %v; want 0600", err, fi.Mode().Perm())
	}
}

// TestStateCorruptOrForeign: a state that cannot be trusted is reported
// and ignored; the exporter serves as without one, and replaces it.
func TestStateCorruptOrForeign(t *testing.T) {
	t.Parallel()
	for name, content := range map[string]string{
		"corrupt":      `{"version":1,"boot_id":`,
		"another boot": `{"version":1,"boot_id":"00000000-0000-0000-0000-000000000000","owners":[]}`,
	} {
		t.Run(name, func(t *testing.T) {
			root := testenv.SimNode(t, 2)
			state := filepath.Join(t.TempDir(), "exporter.json")
			if err := os.WriteFile(state, []byte(content), 0o600); err != nil {
				t.Fatal(err)
			}
			w := testenv.StartWorkload(t, root, 1, 1024, 1)
			e := startExporter(t, root, "--collector.interval=200ms", "--state.path="+state)
			waitOwned(t, e.url, w.PID)
			if log := e.log(t); !strings.Contains(log, "Ignoring the collector's saved state") {
				t.Errorf("the log does not report the state:\n%s", log)
			}
			testenv.Eventually(t, 5*time.Second, "the state to be replaced", func() bool {
				b, _ := os.ReadFile(state)
				return string(b) != content && strings.Contains(string(b), "gpu-orphan-sim")
			})
		})
	}
}
