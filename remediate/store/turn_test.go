package store

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/proc"
	"github.com/gpu-orphan/gpu-orphan/remediate"
)

// holderOfProcess is the Holder identity of a running child.
func holderOfProcess(t *testing.T, pid int) Holder {
	t.Helper()
	me, err := Self()
	if err != nil {
		t.Fatal(err)
	}
	pfs, err := proc.NewFS("/proc")
	if err != nil {
		t.Fatal(err)
	}
	st, err := pfs.ReadStat(pid)
	if err != nil {
		t.Fatal(err)
	}
	return Holder{PID: pid, StartTime: st.StartTime, BootID: me.BootID, PIDNS: me.PIDNS}
}

// runningAs inserts a running action on gpu whose holder is h.
func runningAs(t *testing.T, s *Store, gpu, source string, h Holder) string {
	t.Helper()
	id, err := s.Insert(t.Context(), remediate.Action{GPUUUID: gpu, State: remediate.StateRunning, Source: source, StartedAt: time.Now()})
	if err != nil {
		t.Fatal(err)
	}
	j, _ := toJSON(h)
	if _, err := s.db.ExecContext(t.Context(), `UPDATE actions SET holder_json = ? WHERE id = ?`, j, id); err != nil {
		t.Fatal(err)
	}
	return id
}

// TestTurnOnePerGPU: while one running action holds a GPU's turn, another
// waits, says whose turn it waited for, and gets it once it is given back;
// another GPU's turn is free.
func TestTurnOnePerGPU(t *testing.T) {
	t.Parallel()
	s := openTest(t, filepath.Join(t.TempDir(), "r.db"))
	ctx := t.Context()
	first := runningAs(t, s, "GPU-a", remediate.SourceEpilog, mustSelf(t))
	if w, err := s.WaitTurn(ctx, "GPU-a", first, remediate.SourceEpilog, time.Millisecond); err != nil || len(w) != 0 {
		t.Fatalf("first turn: waited %v, %v", w, err)
	}
	second := runningAs(t, s, "GPU-a", remediate.SourceWebhook, mustSelf(t))
	short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	w, err := s.WaitTurn(short, "GPU-a", second, remediate.SourceWebhook, 5*time.Millisecond)
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) || len(w) != 1 || w[0].ActionID != first || w[0].Source != remediate.SourceEpilog {
		t.Fatalf("second turn while the first holds it: waited %+v, %v; want the first's turn and the deadline", w, err)
	}
	other := runningAs(t, s, "GPU-b", remediate.SourceWebhook, mustSelf(t))
	if w, err := s.WaitTurn(ctx, "GPU-b", other, remediate.SourceWebhook, time.Millisecond); err != nil || len(w) != 0 {
		t.Fatalf("another GPU's turn: waited %v, %v", w, err)
	}
	done := make(chan []Turn)
	go func() {
		w, err := s.WaitTurn(ctx, "GPU-a", second, remediate.SourceWebhook, 5*time.Millisecond)
		if err != nil {
			t.Error(err)
		}
		done <- w
	}()
	// Released once the second waits again (its second "waiting" event).
	for waiting := 0; waiting < 2; {
		es, err := s.Events(ctx, second)
		if err != nil {
			t.Fatal(err)
		}
		waiting = 0
		for _, e := range es {
			if e.Kind == "waiting" {
				waiting++
			}
		}
		time.Sleep(time.Millisecond)
	}
	if err := s.ReleaseTurn("GPU-a", first); err != nil {
		t.Fatal(err)
	}
	if w := <-done; len(w) != 1 || w[0].ActionID != first {
		t.Fatalf("waited for %+v, want the first action", w)
	}
	es, err := s.Events(ctx, second)
	if err != nil {
		t.Fatal(err)
	}
	var kinds []string
	for _, e := range es {
		kinds = append(kinds, e.Kind)
	}
	if len(kinds) < 2 || kinds[len(kinds)-1] != "waited" {
		t.Errorf("events %v, want the last to be waited", kinds)
	}
}

func mustSelf(t *testing.T) Holder {
	t.Helper()
	me, err := Self()
	if err != nil {
		t.Fatal(err)
	}
	return me
}

// TestResolveStranded: an action whose process is gone (killed) is
// resolved as interrupted by the next reader, its turn given back, and
// an attempt queued for the node agent with the same GPU, source and job;
// an action whose process runs is left alone.
func TestResolveStranded(t *testing.T) {
	t.Parallel()
	s := openTest(t, filepath.Join(t.TempDir(), "r.db"))
	ctx := t.Context()
	dead := exec.Command("sleep", "600")
	live := exec.Command("sleep", "600")
	for _, c := range []*exec.Cmd{dead, live} {
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() { live.Process.Kill(); live.Wait() })
	deadID := runningAs(t, s, "GPU-a", remediate.SourceEpilog, holderOfProcess(t, dead.Process.Pid))
	liveID := runningAs(t, s, "GPU-b", remediate.SourceEpilog, holderOfProcess(t, live.Process.Pid))
	if _, err := s.db.ExecContext(ctx, `INSERT INTO gpu_turns VALUES ('GPU-a', ?, 'epilog', 'null', '')`, deadID); err != nil {
		t.Fatal(err)
	}
	if in, _, err := s.ResolveStranded(ctx, false); err != nil || len(in) != 0 {
		t.Fatalf("with both holders alive: interrupted %v, %v", in, err)
	}
	dead.Process.Kill()
	dead.Wait()
	in, resumed, err := s.ResolveStranded(ctx, false)
	if err != nil || len(in) != 1 || in[0].ID != deadID || in[0].State != remediate.StateInterrupted {
		t.Fatalf("interrupted %+v, %v; want %s", in, err, deadID)
	}
	if want := fmt.Sprintf("the epilog that ran it (PID %d) ended mid-action", dead.Process.Pid); in[0].Reason != want {
		t.Errorf("reason %q, want %q", in[0].Reason, want)
	}
	if len(resumed) != 1 || resumed[0].State != remediate.StateQueued || resumed[0].GPUUUID != "GPU-a" || resumed[0].Source != remediate.SourceEpilog || resumed[0].RetryOf != deadID {
		t.Errorf("resumed %+v, want a queued attempt on GPU-a after %s", resumed, deadID)
	}
	if a, err := s.Action(ctx, liveID); err != nil || a.State != remediate.StateRunning {
		t.Errorf("the live holder's action: %v, %v", a.State, err)
	}
	var n int
	if err := s.db.QueryRowContext(ctx, `SELECT count(*) FROM gpu_turns`).Scan(&n); err != nil || n != 0 {
		t.Errorf("%d turns left, %v; want the stranded one given back", n, err)
	}
}
