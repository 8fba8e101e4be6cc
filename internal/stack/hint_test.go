package stack

import (
	"strings"
	"testing"
	"time"
)

func TestNextOrphan(t *testing.T) {
	now := time.Date(2026, 1, 2, 10, 0, 0, 0, time.UTC)
	at := func(d time.Duration) *time.Time { t := now.Add(d); return &t }
	signals := []Target{{PID: 11, Signals: []string{"SIGTERM"}}}
	cleaned := func(gpu int, ago time.Duration) Action {
		return Action{GPUIndex: gpu, State: StateSucceeded, FinishedAt: at(-ago), Targets: signals}
	}
	for _, tc := range []struct {
		name    string
		actions []Action
		gpu     int
		wait    time.Duration
	}{
		{"nothing done yet", nil, 0, 0},
		// make run's own orphan is on GPU 1 (--sim.gpu): GPU 0 is free.
		{"the loop's cleanup on GPU 1", []Action{cleaned(1, time.Minute)}, 0, 0},
		{"the loop's cleanup on GPU 0", []Action{cleaned(0, time.Minute)}, 1, 0},
		// The hint's second orphan went to GPU 0: both GPUs cool down,
		// GPU 1's cooldown ends first.
		{"both GPUs cleaned", []Action{cleaned(0, time.Minute), cleaned(1, 3*time.Minute)}, 1, 7 * time.Minute},
		{"a cooldown is over", []Action{cleaned(0, time.Minute), cleaned(1, 11*time.Minute)}, 1, 0},
		{"the later cleanup of a GPU counts", []Action{cleaned(1, 2*time.Minute), cleaned(1, 20*time.Minute), cleaned(0, time.Minute)}, 1, 8 * time.Minute},
		{"a dry run sends no signal", []Action{{GPUIndex: 0, State: StateDryRun, FinishedAt: at(-time.Minute)}}, 0, 0},
		{"a running action holds its GPU", []Action{{GPUIndex: 0, State: StateRunning}, cleaned(1, 9*time.Minute)}, 1, time.Minute},
		{"a queued action changes nothing", []Action{{GPUIndex: 0, State: StateQueued}, cleaned(0, time.Minute), cleaned(1, 2*time.Minute)}, 1, 8 * time.Minute},
		{"a GPU the node lacks", []Action{cleaned(5, time.Minute), {GPUIndex: -1, State: StateSucceeded, FinishedAt: at(0), Targets: signals}}, 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			gpu, ready := NextOrphan(2, tc.actions, 10*time.Minute, now)
			if gpu != tc.gpu || ready.Sub(now) != tc.wait {
				t.Errorf("NextOrphan = GPU %d in %s, want GPU %d in %s", gpu, ready.Sub(now), tc.gpu, tc.wait)
			}
		})
	}
}

// TestOrphanHint: the hint names a GPU the remediator cleans at once, and
// when there is none, says why an orphan waits and until when (issue 23:
// the hint's GPU 0 was in its 10-minute cooldown, and nothing happened).
func TestOrphanHint(t *testing.T) {
	now := time.Date(2026, 1, 2, 10, 0, 0, 0, time.UTC)
	fin := func(d time.Duration) *time.Time { t := now.Add(d); return &t }
	signals := []Target{{PID: 11, Signals: []string{"SIGTERM", "SIGCONT"}}}
	loop := Action{GPUIndex: 1, State: StateSucceeded, FinishedAt: fin(-time.Minute), Targets: signals}
	second := Action{GPUIndex: 0, State: StateSucceeded, FinishedAt: fin(-30 * time.Second), Targets: signals}

	lines := OrphanHint("bin/gpu-orphan-sim", ".run/node", 2, []Action{loop}, Cooldown, now)
	want := []string{
		"Another orphan, on GPU 0, which the remediator cleans at once (its 10m cooldown after a cleanup holds GPU 1 until 10:09:00); from another terminal:",
		"  bin/gpu-orphan-sim run --root .run/node --gpu 0 --mib 2048 --children 2 & sleep 1; kill -9 $!",
	}
	if strings.Join(lines, "\n") != strings.Join(want, "\n") {
		t.Errorf("after the loop:\n%s\nwant:\n%s", strings.Join(lines, "\n"), strings.Join(want, "\n"))
	}

	lines = OrphanHint("bin/gpu-orphan-sim", ".run/node", 2, []Action{second, loop}, Cooldown, now)
	want = []string{
		"Every GPU is in the remediator's 10m cooldown after a cleanup (GPU 0 until 10:09:30 and GPU 1 until 10:09:00): " +
			"an orphan now is detected and alerted on at once, and cleaned when its GPU's cooldown ends; soonest on GPU 1, at 10:09:00 (in 9m0s). From another terminal:",
		"  bin/gpu-orphan-sim run --root .run/node --gpu 1 --mib 2048 --children 2 & sleep 1; kill -9 $!",
	}
	if strings.Join(lines, "\n") != strings.Join(want, "\n") {
		t.Errorf("after a second orphan:\n%s\nwant:\n%s", strings.Join(lines, "\n"), strings.Join(want, "\n"))
	}
}
