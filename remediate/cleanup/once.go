package cleanup

import (
	"context"

	"github.com/gpu-orphan/gpu-orphan/internal/snapshot"
)

// Once gives snapshots for a cleanup by hand (gpu-orphan clean), which has
// no history to measure ages from: each snapshot is a first sighting.
// Memory with no live owner above OrphanBytes, and every suspect, count as
// first seen when the snapshot was taken, as a snapshot.Loop dates them on
// its first snapshot. Ages are then zero, so only a zero minimum age acts.
// The remediator keeps a snapshot.Loop, whose clocks run across snapshots.
type Once struct {
	Taker interface {
		Take(ctx context.Context, forceScan bool) *snapshot.Snapshot
	}
	// OrphanBytes starts a GPU's age clock, as snapshot.NewLoop's
	// orphanBytes does: decide.Config.MinBytes.
	OrphanBytes uint64
}

// Refresh takes a snapshot and dates what it finds from it.
func (o Once) Refresh(ctx context.Context, forceScan bool) *snapshot.Snapshot {
	s := o.Taker.Take(ctx, forceScan)
	for i := range s.GPUs {
		g := &s.GPUs[i]
		if g.Accountable() && g.UnownedBytes > o.OrphanBytes && g.UnownedSince.IsZero() {
			g.UnownedSince = s.Taken
		}
		if !g.Scanned {
			continue
		}
		for j := range g.Suspects {
			if g.Suspects[j].Since.IsZero() {
				g.Suspects[j].Since = s.Taken
			}
		}
	}
	return s
}
