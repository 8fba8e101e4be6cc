//go:build e2e

package e2e

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

// TestRunOnce: `RUN_ONCE=1 make run` (scripts/run.sh) narrates every stage
// of the loop, exits 0 once the memory is back, and leaves no process
// behind. It runs on free ports and in a temp RUN_DIR, with the binaries
// this test built, so it neither clashes with a `make run` in progress nor
// tests a stale bin/.
func TestRunOnce(t *testing.T) {
	tool(t, "prometheus")
	tool(t, "alertmanager", "prometheus-alertmanager")
	root, err := testenv.ModuleRoot()
	if err != nil {
		t.Fatal(err)
	}
	port := func() string {
		a := testenv.FreeAddr(t)
		return a[strings.LastIndexByte(a, ':')+1:]
	}
	runDir := t.TempDir()
	ctx, cancel := context.WithTimeout(t.Context(), 90*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(root, "scripts", "run.sh"), "sim")
	cmd.Env = append(os.Environ(), "RUN_ONCE=1", "RUN_DIR="+runDir, "NODE_NAME=run-once",
		"BIN_DIR="+filepath.Dir(bin(t, "gpu-orphan-exporter")),
		"EXPORTER_PORT="+port(), "REMEDIATOR_PORT="+port(), "PROMETHEUS_PORT="+port(), "ALERTMANAGER_PORT="+port())
	// Its own process group, as a terminal's job; on timeout the script
	// gets SIGTERM (SIGINT may be ignored in a background job), which it
	// traps as it does Ctrl+C, and stops what it started.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM) }
	cmd.WaitDelay = 20 * time.Second
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	start := time.Now()
	err = cmd.Run()
	t.Logf("scripts/run.sh (RUN_ONCE=1) took %.1fs:\n%s", time.Since(start).Seconds(), out.String())
	if err != nil {
		if b, _ := os.ReadFile(filepath.Join(runDir, "logs", "remediator.log")); len(b) > 0 {
			t.Logf("remediator log:\n%s", b)
		}
		t.Fatalf("scripts/run.sh: %v", err)
	}
	text := out.String()

	// The stages, in order.
	at := 0
	for _, stage := range []string{"kill -9", "detected", "alert pending", "alert firing",
		"notification received", "plan", "signal", "memory back", "stopped prometheus"} {
		i := strings.Index(text[at:], stage)
		if i < 0 {
			t.Fatalf("no %q after offset %d of the narration", stage, at)
		}
		at += i + len(stage)
	}
	if !regexp.MustCompile(`memory back +freed 4[0-9]{3} MiB`).MatchString(text) {
		t.Errorf("the narration does not say that >= 4000 MiB were freed")
	}

	// Nothing left: neither the daemons it stopped nor the workload.
	var pids []int
	for _, m := range regexp.MustCompile(`stopped \S+ \(pid (\d+)\)`).FindAllStringSubmatch(text, -1) {
		pid, _ := strconv.Atoi(m[1])
		pids = append(pids, pid)
	}
	if len(pids) != 4 {
		t.Errorf("stopped %d daemons, want 4", len(pids))
	}
	if m := regexp.MustCompile(`parent (\d+) allocated .* forked (\d+) (\d+),`).FindStringSubmatch(text); m != nil {
		for _, s := range m[1:] {
			pid, _ := strconv.Atoi(s)
			pids = append(pids, pid)
		}
	} else {
		t.Errorf("the narration names no workload")
	}
	for _, pid := range pids {
		if testenv.Alive(pid) {
			t.Errorf("process %d is still running after run.sh exited", pid)
			syscall.Kill(pid, syscall.SIGKILL)
		}
	}
	if _, err := os.Stat(filepath.Join(runDir, "run.pid")); !os.IsNotExist(err) {
		t.Errorf("run.pid left behind: %v", err)
	}
}
