package engine

import (
	"context"
	"log/slog"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"

	"github.com/gpu-orphan/gpu-orphan/internal/stack/slowness"
)

// scripted answers each execution of an action with the next of its
// states: queued ones are put back and tried again.
type scripted struct {
	mu     sync.Mutex
	states []remediate.State
	calls  int
}

func (s *scripted) Execute(_ context.Context, a remediate.Action) (remediate.Action, time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	a.State = s.states[min(s.calls, len(s.states)-1)]
	s.calls++
	if a.State == remediate.StateQueued {
		a.Reason = "waiting: too_young"
	}
	return a, 10 * time.Millisecond
}

func (s *scripted) count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.calls
}

func openStore(t *testing.T) *store.Store {
	t.Helper()
	st, err := store.Open(t.Context(), filepath.Join(t.TempDir(), "remediator.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	return st
}

// TestRunWorksTheQueue: a queued action is claimed and executed; one the
// executor puts back is tried again later, and its final state recorded
// and counted.
func TestRunWorksTheQueue(t *testing.T) {
	st := openStore(t)
	id, err := st.Insert(t.Context(), remediate.Action{Node: "n", GPUUUID: "GPU-a", State: remediate.StateQueued, Source: "webhook", StartedAt: time.Now()})
	if err != nil {
		t.Fatal(err)
	}
	exec := &scripted{states: []remediate.State{remediate.StateQueued, remediate.StateSucceeded}}
	m := remediate.NewMetrics(prometheus.NewRegistry())
	e := New(st, exec, 1, m, slog.New(slog.DiscardHandler))
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { e.Run(ctx, time.Second); close(done) }()
	defer func() { cancel(); <-done }()

	deadline := time.Now().Add(slowness.Scale(10*time.Second, slowness.Factor()))
	for {
		a, err := st.Action(t.Context(), id)
		if err != nil {
			t.Fatal(err)
		}
		if a.State == remediate.StateSucceeded {
			if a.FinishedAt == nil {
				t.Error("a finished action has no FinishedAt")
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("action still %s (%s) after %d executions", a.State, a.Reason, exec.count())
		}
		e.Wake()
		time.Sleep(20 * time.Millisecond)
	}
	if n := exec.count(); n != 2 {
		t.Errorf("%d executions, want 2: one put back, one finished", n)
	}
	if got := testutil.ToFloat64(m.Actions.WithLabelValues(string(remediate.StateSucceeded))); got != 1 {
		t.Errorf("actions_total{state=succeeded} = %v, want 1", got)
	}
	if e.StoreErr() != nil {
		t.Errorf("StoreErr = %v on a writable store", e.StoreErr())
	}
}

// TestRecoverMarksInterrupted: an action a previous run left running is
// marked interrupted, and counted; one that no alert created (the CLI's)
// gets no further attempt (store.TestRecoverAfterRestart has those that
// do).
func TestRecoverMarksInterrupted(t *testing.T) {
	st := openStore(t)
	id, err := st.Insert(t.Context(), remediate.Action{Node: "n", GPUUUID: "GPU-a", State: remediate.StateRunning, Source: "webhook", StartedAt: time.Now()})
	if err != nil {
		t.Fatal(err)
	}
	m := remediate.NewMetrics(prometheus.NewRegistry())
	e := New(st, &scripted{states: []remediate.State{remediate.StateSucceeded}}, 1, m, slog.New(slog.DiscardHandler))
	if err := e.Recover(t.Context()); err != nil {
		t.Fatal(err)
	}
	a, err := st.Action(t.Context(), id)
	if err != nil {
		t.Fatal(err)
	}
	if a.State != remediate.StateInterrupted {
		t.Errorf("state %s, want %s", a.State, remediate.StateInterrupted)
	}
	if got := testutil.ToFloat64(m.Actions.WithLabelValues(string(remediate.StateInterrupted))); got != 1 {
		t.Errorf("actions_total{state=interrupted} = %v, want 1", got)
	}
}
