package exporter

import (
	"sync/atomic"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/gpu-orphan/gpu-orphan/internal/snapshot"
)

type countingGatherer struct{ n atomic.Int32 }

func (c *countingGatherer) Gather() ([]*dto.MetricFamily, error) {
	c.n.Add(1)
	return nil, nil
}

type switchableSource struct {
	s atomic.Pointer[snapshot.Snapshot]
}

func (s *switchableSource) Latest() *snapshot.Snapshot { return s.s.Load() }
func (s *switchableSource) OrphanBytes() uint64        { return 0 }

func mustGather(t *testing.T, g *cachedGatherer) {
	t.Helper()
	if _, err := g.Gather(); err != nil {
		t.Fatal(err)
	}
}

// TestGathererFollowsSnapshots: scrapes of one snapshot share a gathering;
// a new snapshot, or the TTL, gathers anew, so GPU figures are never older
// than the latest snapshot.
func TestGathererFollowsSnapshots(t *testing.T) {
	reg := &countingGatherer{}
	src := &switchableSource{}
	src.s.Store(&snapshot.Snapshot{Taken: time.Now()})
	g := &cachedGatherer{g: reg, src: src, ttl: 200 * time.Millisecond}
	for range 5 {
		mustGather(t, g)
	}
	if n := reg.n.Load(); n != 1 {
		t.Fatalf("5 scrapes of one snapshot gathered %d times, want 1", n)
	}
	src.s.Store(&snapshot.Snapshot{Taken: time.Now()})
	mustGather(t, g)
	if n := reg.n.Load(); n != 2 {
		t.Fatalf("a new snapshot did not gather anew (%d)", n)
	}
	time.Sleep(250 * time.Millisecond)
	mustGather(t, g)
	if n := reg.n.Load(); n != 3 {
		t.Fatalf("the TTL did not expire the gathering (%d)", n)
	}
}
