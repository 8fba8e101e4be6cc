//go:build e2e

package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/proc"
	"github.com/gpu-orphan/gpu-orphan/internal/stack"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

// requiredEnv makes a missing Prometheus or Alertmanager a failure instead
// of a skip; `make e2e` and CI set it.
const requiredEnv = "GPU_ORPHAN_E2E_REQUIRED"

// tools finds Prometheus and Alertmanager, skipping or failing the test
// when they are missing.
func tools(t *testing.T) (prometheus, alertmanager string) {
	t.Helper()
	prometheus, alertmanager, err := stack.FindTools()
	if err != nil {
		if os.Getenv(requiredEnv) != "" {
			t.Fatalf("%v (%s is set, so this is a failure)", err, requiredEnv)
		}
		t.Skipf("%v; or set %s=1 to make this a failure", err, requiredEnv)
	}
	return prometheus, alertmanager
}

// startStack starts the stack of `make run` on free ports in a temp
// directory, with the binaries this test built, narrating its events into
// the test's log and passing them to hook. At cleanup it stops the stack,
// prints the daemons' logs if the test failed, and fails if any process of
// the stack is left.
func startStack(t *testing.T, cfg stack.Config, hook func(stack.Event)) *stack.Stack {
	t.Helper()
	cfg.Prometheus, cfg.Alertmanager = tools(t)
	root, err := testenv.ModuleRoot()
	if err != nil {
		t.Fatal(err)
	}
	cfg.Dir = t.TempDir()
	cfg.BinDir = filepath.Dir(bin(t, "gpu-orphan-exporter"))
	bin(t, "gpu-orphan-remediator")
	bin(t, "gpu-orphan-sim")
	cfg.RulesFile = filepath.Join(root, "alerts", "gpu-orphan.rules.yml")
	n := &stack.Narrator{W: testenv.LogWriter(t)}
	cfg.OnEvent = func(ev stack.Event) {
		n.Event(ev)
		if hook != nil {
			hook(ev)
		}
	}
	s, err := stack.Start(t.Context(), cfg)
	if err != nil {
		dumpLogs(t, filepath.Join(cfg.Dir, "logs"))
		t.Fatal(err)
	}
	t.Cleanup(func() {
		sessions := s.Sessions()
		if err := s.Stop(); err != nil {
			t.Error(err)
		}
		if left := inSessions(t, sessions); len(left) > 0 {
			t.Errorf("processes %v of the stack are still running after Stop", left)
			for _, pid := range left {
				syscall.Kill(pid, syscall.SIGKILL)
			}
		}
		if t.Failed() {
			dumpLogs(t, s.Logs)
		}
	})
	return s
}

// inSessions lists the live processes in any of the sessions sids: what
// the stack started, and whatever they started.
func inSessions(t *testing.T, sids []int) []int {
	t.Helper()
	fs, err := proc.NewFS("")
	if err != nil {
		t.Fatal(err)
	}
	pids, err := fs.PIDs()
	if err != nil {
		t.Fatal(err)
	}
	var left []int
	for _, pid := range pids {
		if p, ok := fs.Alive(pid); ok && slices.Contains(sids, p.SID) {
			left = append(left, pid)
		}
	}
	return left
}

func dumpLogs(t *testing.T, dir string) {
	logs, _ := filepath.Glob(filepath.Join(dir, "*.log"))
	for _, l := range logs {
		b, _ := os.ReadFile(l)
		t.Logf("----- %s -----\n%s", filepath.Base(l), b)
	}
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

// mark records a stage seen at `seen`.
func (tl *timeline) mark(name string, seen time.Time, details string) {
	at := seen.Sub(tl.t0)
	tl.stages = append(tl.stages, stage{name: name, at: at, delta: at - tl.last, details: details})
	tl.last = at
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
