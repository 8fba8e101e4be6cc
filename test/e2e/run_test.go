//go:build e2e

package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

// demo is `make run` (cmd/gpu-orphan-demo) on free ports (FREE_PORTS), in a temp
// RUN_DIR, with the binaries this test built, so that it neither clashes
// with a `make run` in progress nor tests a stale bin/. It runs in its own
// process group, as a terminal's job. The settings go through the
// environment variables that `make run` documents.
func demo(ctx context.Context, t *testing.T, env ...string) (*exec.Cmd, *syncBuffer, string) {
	t.Helper()
	tools(t)
	root, err := testenv.ModuleRoot()
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range []string{"gpu-orphan-exporter", "gpu-orphan-remediator", "gpu-orphan-sim"} {
		bin(t, b)
	}
	runDir := t.TempDir()
	cmd := exec.CommandContext(ctx, bin(t, "gpu-orphan-demo"))
	cmd.Dir = root
	// FREE_PORTS: the daemons' ports are chosen where they start, by
	// internal/stack, so that nothing can take one in between.
	// RUN_TIMEOUT: its default, 120 s, stretched by the machine's slowness
	// as the test's own waits are.
	cmd.Env = append(os.Environ(), "RUN_DIR="+runDir, "NODE_NAME=run-once", "BIN_DIR="+filepath.Dir(bin(t, "gpu-orphan-exporter")),
		"FREE_PORTS=1", "RUN_TIMEOUT="+testenv.Scale(120*time.Second).Round(time.Second).String())
	cmd.Env = append(cmd.Env, env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	// On timeout: SIGTERM, which it takes as it takes Ctrl+C.
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM) }
	cmd.WaitDelay = 20 * time.Second
	out := &syncBuffer{}
	cmd.Stdout, cmd.Stderr = out, out
	return cmd, out, runDir
}

// syncBuffer is a bytes.Buffer that the test may read while the command
// writes to it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// TestRunOnce: `RUN_ONCE=1 make run` narrates every stage of the loop,
// exits 0 once the memory is back, and leaves no process behind.
func TestRunOnce(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), testenv.Scale(150*time.Second))
	defer cancel()
	cmd, out, runDir := demo(ctx, t, "RUN_ONCE=1")
	start := time.Now()
	err := cmd.Run()
	t.Logf("gpu-orphan-demo (RUN_ONCE=1) took %.1fs:\n%s", time.Since(start).Seconds(), out)
	if err != nil {
		dumpLogs(t, filepath.Join(runDir, "logs"))
		t.Fatalf("gpu-orphan-demo: %v", err)
	}
	text := out.String()

	// The stages, in order.
	inOrder(t, text, "kill -9", "detected", "scraped", "alert pending", "alert firing", "alert routed",
		"notification received", "plan", "signal", "action finished", "memory back", "RUN_ONCE=1: stopping.",
		"stopped prometheus")
	if !regexp.MustCompile(`memory back +freed 4[0-9]{3} MiB`).MatchString(text) {
		t.Errorf("the narration does not say that >= 4000 MiB were freed")
	}
	if strings.Contains(text, "WARNING") {
		t.Errorf("the narration warns")
	}
	checkNothingLeft(t, text, runDir)

	// Who left it: the remediator saw the job's parent alive, so its
	// action names the dead owner with its user, and so does the report
	// read from its store.
	me := currentUser(t)
	if !regexp.MustCompile(`left by PID [0-9]+: gpu-orphan-sim, user ` + regexp.QuoteMeta(me) + `\n`).MatchString(text) {
		t.Errorf("the plan does not say that the job's parent, of user %s, left the memory", me)
	}
	report := exec.Command(bin(t, "gpu-orphan"), "report", "--store.path="+filepath.Join(runDir, "remediator.db"), "--by=user", "-o", "json")
	b, err := report.Output()
	if err != nil {
		t.Fatalf("gpu-orphan report: %v", err)
	}
	var r struct {
		Rows []struct {
			Key    string `json:"key"`
			Events int    `json:"events"`
		} `json:"rows"`
	}
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatalf("gpu-orphan report: %v\n%s", err, b)
	}
	if len(r.Rows) != 1 || r.Rows[0].Key != me || r.Rows[0].Events != 1 {
		t.Errorf("gpu-orphan report --by user: %s; want one event of user %s", b, me)
	}
}

// currentUser is the name of the user the test runs as, who owns the
// simulated jobs it starts.
func currentUser(t *testing.T) string {
	t.Helper()
	u, err := user.Current()
	if err != nil {
		t.Fatal(err)
	}
	return u.Username
}

// TestRunInterrupt: Ctrl+C while the orphan's children still hold its
// memory stops everything: the daemons and the workload, and exits 0.
func TestRunInterrupt(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), testenv.Scale(150*time.Second))
	defer cancel()
	cmd, out, runDir := demo(ctx, t)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	deadline := time.After(testenv.Scale(60 * time.Second))
	for !strings.Contains(out.String(), "detected") {
		select {
		case err := <-done:
			t.Fatalf("gpu-orphan-demo exited before the orphan was detected: %v\n%s", err, out)
		case <-deadline:
			t.Fatalf("no orphan detected within %s:\n%s", testenv.Scale(60*time.Second), out)
		case <-time.After(100 * time.Millisecond):
		}
	}
	// Ctrl+C: the terminal sends SIGINT to the foreground process group.
	syscall.Kill(-cmd.Process.Pid, syscall.SIGINT)
	var err error
	select {
	case err = <-done:
	case <-time.After(testenv.Scale(30 * time.Second)):
		t.Fatalf("gpu-orphan-demo did not exit within %s of SIGINT:\n%s", testenv.Scale(30*time.Second), out)
	}
	t.Logf("gpu-orphan-demo after SIGINT:\n%s", out)
	if code := cmd.ProcessState.ExitCode(); code != 0 {
		t.Errorf("exit status %d (%v), want 0: a clean stop by Ctrl+C is not an error", code, err)
	}
	text := out.String()
	inOrder(t, text, "detected", "stopped workload", "stopped prometheus", "stopped gpu-orphan-exporter", "logs are in")
	checkNothingLeft(t, text, runDir)
}

// inOrder fails unless text holds each of words after the one before.
func inOrder(t *testing.T, text string, words ...string) {
	t.Helper()
	at := 0
	for _, w := range words {
		i := strings.Index(text[at:], w)
		if i < 0 {
			t.Fatalf("no %q after offset %d of the narration", w, at)
		}
		at += i + len(w)
	}
}

// checkNothingLeft: every process the demo started is gone, and whatever
// they started (each daemon and the workload lead a session of their
// own), and the run directory's lock is released.
func checkNothingLeft(t *testing.T, text, runDir string) {
	t.Helper()
	var sids []int
	for _, m := range regexp.MustCompile(`started \S+ \(pid (\d+)\)`).FindAllStringSubmatch(text, -1) {
		pid, _ := strconv.Atoi(m[1])
		sids = append(sids, pid)
	}
	if len(sids) != 4 {
		t.Errorf("started %d daemons, want 4", len(sids))
	}
	if n := len(regexp.MustCompile(`stopped \S+ \(pid \d+\)`).FindAllString(text, -1)); n != 5 {
		t.Errorf("stopped %d processes, want 4 daemons and the workload", n)
	}
	if m := regexp.MustCompile(`parent (\d+) allocated .* forked (\d+) (\d+),`).FindStringSubmatch(text); m != nil {
		pid, _ := strconv.Atoi(m[1])
		sids = append(sids, pid)
		for _, s := range m[2:] {
			if c, _ := strconv.Atoi(s); testenv.Alive(c) {
				t.Errorf("the workload's child %d is still running", c)
			}
		}
	} else {
		t.Errorf("the narration names no workload")
	}
	if left := inSessions(t, sids); len(left) > 0 {
		t.Errorf("processes %v of the stack are still running after gpu-orphan-demo exited", left)
		for _, pid := range left {
			syscall.Kill(pid, syscall.SIGKILL)
		}
	}
	if _, err := os.Stat(filepath.Join(runDir, "run.pid")); !os.IsNotExist(err) {
		t.Errorf("run.pid left behind: %v", err)
	}
}
