package cleanup

import (
	"context"
	"errors"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/proc"
	"github.com/gpu-orphan/gpu-orphan/internal/sim"
	"github.com/gpu-orphan/gpu-orphan/internal/snapshot"
	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/decide"
	"github.com/gpu-orphan/gpu-orphan/remediate/kill"
)

func TestMain(m *testing.M) { os.Exit(testenv.Main(m)) }

// failingRecorder fails every write of one event kind.
type failingRecorder struct {
	failKind string
	mu       sync.Mutex
	kinds    []string
}

func (r *failingRecorder) Update(context.Context, remediate.Action) error { return nil }

func (r *failingRecorder) AddEvent(_ context.Context, _, kind string, _ any) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.kinds = append(r.kinds, kind)
	if kind == r.failKind {
		return errors.New("disk I/O error")
	}
	return nil
}

// actOnForkOrphan plans and acts on a fork orphan on a simulated node
// whose children ignore SIGTERM, recording through rec.
func actOnForkOrphan(t *testing.T, rec EventRecorder) (remediate.Action, *testenv.Workload) {
	t.Helper()
	root := testenv.SimNode(t, 1)
	w := testenv.StartWorkload(t, root, 0, 1024, 1, "--ignore-sigterm")
	drv, err := sim.NewDriver(root)
	if err != nil {
		t.Fatal(err)
	}
	fs, err := proc.NewFS("")
	if err != nil {
		t.Fatal(err)
	}
	cfg := decide.Config{MinBytes: 256 << 20}
	taker := snapshot.NewTaker(snapshot.Config{Driver: drv, Proc: fs})
	loop := snapshot.NewLoop(taker, time.Hour, cfg.MinBytes)
	// A snapshot sees the worker share the live owner's open file (the
	// proof of inheritance), then the owner dies.
	loop.Refresh(t.Context(), true)
	w.KillParent(t)
	loop.Refresh(t.Context(), true) // starts the age clock
	n := New(Config{
		Snapshots: loop, Proc: fs, Decide: cfg, Act: true, VerifyTimeout: 5 * time.Second, Recorder: rec,
		Ladder: &kill.Ladder{Grace: 500 * time.Millisecond, ExitTimeout: time.Second, Proc: fs},
	})
	plan := n.Plan(t.Context(), "0")
	if !plan.Act {
		t.Fatalf("plan: %s", plan.SkipReason)
	}
	a := remediate.Action{ID: "a1", GPUUUID: plan.GPUUUID, StartedAt: time.Now(), Targets: plan.Targets}
	return n.Act(t.Context(), a, plan), w
}

// TestActStopsWhenASignalCannotBeRecorded: no signal goes unaccounted for.
// The first SIGTERM's record fails, so the ladder stops before SIGKILL and
// the action fails saying why.
func TestActStopsWhenASignalCannotBeRecorded(t *testing.T) {
	rec := &failingRecorder{failKind: "signal"}
	a, w := actOnForkOrphan(t, rec)
	if a.State != remediate.StateFailed || !strings.Contains(a.Reason, "audit record could not be written") {
		t.Fatalf("action %s (%s), want failed because the record could not be written", a.State, a.Reason)
	}
	for _, tg := range a.Targets {
		for _, s := range tg.Signals {
			if s == "SIGKILL" {
				t.Errorf("target %d got SIGKILL after a signal could not be recorded", tg.PID)
			}
		}
	}
	if !testenv.Alive(w.Children[0]) {
		t.Error("the child, which ignores SIGTERM, died: the ladder did not stop")
	}
}

// TestActFailsWhenVerificationCannotBeRecorded: the cleanup worked, but an
// action whose record is incomplete is not called a success.
func TestActFailsWhenVerificationCannotBeRecorded(t *testing.T) {
	rec := &failingRecorder{failKind: "verify"}
	a, w := actOnForkOrphan(t, rec)
	if a.State != remediate.StateFailed || !strings.Contains(a.Reason, "could not be written") {
		t.Fatalf("action %s (%s), want failed because the verification could not be recorded", a.State, a.Reason)
	}
	if testenv.Alive(w.Children[0]) {
		t.Error("the child survived the cleanup")
	}
}
