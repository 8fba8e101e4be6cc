package cleanup

import (
	"context"
	"testing"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/gpu"
	"github.com/gpu-orphan/gpu-orphan/internal/proc"
	"github.com/gpu-orphan/gpu-orphan/internal/snapshot"
	"github.com/gpu-orphan/gpu-orphan/remediate/decide"
	"github.com/gpu-orphan/gpu-orphan/remediate/exclude"
)

// fixedTaker returns a fresh copy of one snapshot.
type fixedTaker func() *snapshot.Snapshot

func (f fixedTaker) Take(context.Context, bool) *snapshot.Snapshot { return f() }

// TestOnceDatesFromTheSnapshot: a cleanup by hand has no history, so what
// a snapshot shows is first seen when it was taken, as a snapshot.Loop
// dates its first snapshot. A zero min-age then acts on a fork orphan; any
// other min-age waits, as it did with a Loop made for the one call.
func TestOnceDatesFromTheSnapshot(t *testing.T) {
	taken := time.Now()
	worker := proc.Process{PID: 201, PPID: 1, PGID: 100, SID: 50, State: "S", StartTime: 100201, Comm: "pt_data_worker", Cmdline: "python3 worker"}
	orphan := func() *snapshot.Snapshot {
		return &snapshot.Snapshot{
			Taken: taken, Driver: "sim", HostPIDsVisible: true,
			Sources: []snapshot.Source{{Name: "sim"}, {Name: snapshot.SourceProc}, {Name: snapshot.SourceFDScan}},
			GPUs: []snapshot.GPU{{
				Device:         gpu.Device{Index: 0, UUID: "GPU-a"},
				Memory:         gpu.Memory{Used: 4714 * gpu.MiB},
				Owners:         []snapshot.Owner{{PID: 100, UsedBytes: 4706 * gpu.MiB}},
				OwnedDeadBytes: 4706 * gpu.MiB, UnownedBytes: 4714 * gpu.MiB,
				Scanned: true, HolderPIDs: []int{201},
				Holders:  []snapshot.Holding{{Process: worker, Mapped: true}},
				Suspects: []snapshot.Holder{{Process: worker, Reason: snapshot.ReasonInheritedFromDeadOwner}},
			}, {
				Device: gpu.Device{Index: 1, UUID: "GPU-b"}, Memory: gpu.Memory{Used: 8 * gpu.MiB}, UnownedBytes: 8 * gpu.MiB, Scanned: true,
			}},
		}
	}
	once := Once{Taker: fixedTaker(orphan), OrphanBytes: 256 * gpu.MiB}
	s := once.Refresh(t.Context(), true)
	if g := s.GPUs[0]; !g.UnownedSince.Equal(taken) || !g.Suspects[0].Since.Equal(taken) {
		t.Errorf("GPU 0: UnownedSince %v, suspect since %v; want both %v", g.UnownedSince, g.Suspects[0].Since, taken)
	}
	if g := s.GPUs[1]; !g.UnownedSince.IsZero() {
		t.Errorf("GPU 1, below the threshold, has an age clock from %v", g.UnownedSince)
	}

	fs, err := proc.NewFS("")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		minAge time.Duration
		act    bool
	}{{0, true}, {time.Minute, false}} {
		cfg := decide.Config{MinAge: tc.minAge, MinBytes: 256 * gpu.MiB, Self: exclude.Self{PID: 9000, PGID: 9000, SID: 8999}}
		n := New(Config{Snapshots: once, Proc: fs, Decide: cfg})
		p := n.Plan(t.Context(), "0")
		if p.Act != tc.act {
			t.Errorf("min-age %v: Act = %v (%s), want %v", tc.minAge, p.Act, p.SkipText(), tc.act)
		}
		if !tc.act && p.SkipReason != decide.SkipTooYoung {
			t.Errorf("min-age %v: skipped for %s, want %s", tc.minAge, p.SkipReason, decide.SkipTooYoung)
		}
	}
}
