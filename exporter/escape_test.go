package exporter_test

import (
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

// TestCommEscapedInMetrics (issue 24, item 7): a user runs a trainer
// whose executable is named "x ESC[2J NEWLINE FAKE ok" (its comm, which
// /proc shows byte for byte), with a forked worker, and kills the
// trainer. In a real scrape of the exporter the trainer's comm (in
// process_memory_bytes while it lives, in dead_owner_info after) and the
// worker's (in holder_info) are written with \x1b and \n: no ESC byte is
// in the exposition, which a terminal would obey (curl /metrics cleared
// the screen). The text format already wrote the newline as \n.
func TestCommEscapedInMetrics(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	t.Parallel()
	const comm = "x\x1b[2J\nFAKE ok"
	const want = `x\x1b[2J\nFAKE ok`
	root := testenv.SimNode(t, 2)
	bin := filepath.Join(t.TempDir(), comm)
	testenv.CopyExecutable(t, testenv.Bin(t, "gpu-orphan-sim"), bin, 0o755)
	e := startExporter(t, root, "--collector.interval=200ms")
	w := testenv.StartWorkloadCmd(t, exec.Command(bin, "run", "--root", root, "--gpu", "1", "--mib", "1024", "--children", "1"))

	check := func(name string, match map[string]string, pid int) {
		t.Helper()
		var text string
		testenv.Eventually(t, 10*time.Second, name+" of PID "+strconv.Itoa(pid), func() bool {
			txt, fams := testenv.Scrape(t, e.url)
			text = txt
			for _, m := range testenv.Series(fams, name, match) {
				if testenv.Label(m, "pid") == strconv.Itoa(pid) {
					if got := testenv.Label(m, "comm"); got != want {
						t.Fatalf("%s of PID %d: comm %q, want %q", name, pid, got, want)
					}
					return true
				}
			}
			return false
		})
		if strings.Contains(text, "\x1b") {
			t.Errorf("the exposition holds an ESC byte:\n%q", text)
		}
		for _, line := range strings.Split(text, "\n") {
			if strings.HasPrefix(line, "FAKE") {
				t.Errorf("the exposition holds a forged line %q", line)
			}
		}
	}
	check("gpu_orphan_process_memory_bytes", map[string]string{"gpu": "1", "alive": "true"}, w.PID)
	w.KillParent(t)
	check("gpu_orphan_dead_owner_info", map[string]string{"gpu": "1"}, w.PID)
	check("gpu_orphan_holder_info", map[string]string{"gpu": "1", "reason": "inherited_from_dead_owner"}, w.Children[0])
}
