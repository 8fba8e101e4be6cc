package snapshot

import (
	"errors"
	"strings"
	"testing"
	"time"
)

func filledLineage(t *testing.T) *Lineage {
	t.Helper()
	l := NewLineage()
	at := time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)
	l.owners.entries[ownerKey{"GPU-a", 100, 5000}] = &ownerEntry{
		id:     Identity{PID: 100, StartTime: 5000, PGID: 100, SID: 100, Comm: "python3", User: "alice", SlurmJob: "42", FirstSeen: at, LastSeen: at},
		listed: at,
	}
	l.recordDescent("GPU-a", procKey{100, 5000}, procKey{201, 5100}, true)
	l.recordDescent("GPU-a", procKey{100, 5000}, procKey{202, 5101}, true)
	l.deadSince[gpuPID{"GPU-a", 100}] = at.Add(time.Minute)
	return l
}

func TestLineageStateRoundTrip(t *testing.T) {
	data, err := filledLineage(t).MarshalState("boot-1")
	if err != nil {
		t.Fatal(err)
	}
	l := NewLineage()
	if err := l.RestoreState(data, "boot-1"); err != nil {
		t.Fatal(err)
	}
	e := l.owners.latest("GPU-a", 100)
	if e == nil || e.id.User != "alice" || e.id.SlurmJob != "42" || e.id.PGID != 100 {
		t.Errorf("owner after restore: %+v", e)
	}
	if !l.descends("GPU-a", procKey{100, 5000}, procKey{201, 5100}) || !l.descends("GPU-a", procKey{100, 5000}, procKey{202, 5101}) {
		t.Errorf("descent not restored: %v", l.descent)
	}
	if got := l.deadSince[gpuPID{"GPU-a", 100}]; !got.Equal(time.Date(2026, 12, 2, 10, 1, 0, 0, time.UTC)) {
		t.Errorf("dead since %v after restore", got)
	}
	if l.Generation() == 0 {
		t.Error("a restore is a change to save")
	}
}

// TestLineageStateRefused: a state from another boot names other
// processes; a corrupt or oversized one is not trusted. Each leaves the
// Lineage as it was.
func TestLineageStateRefused(t *testing.T) {
	good, err := filledLineage(t).MarshalState("boot-1")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, data, boot, want string
	}{
		{"another boot", string(good), "boot-2", "another boot"},
		{"no boot ID here", string(good), "", "another boot"},
		{"corrupt", `{"version":1,"boot_id":"boot-1","owners":[{`, "boot-1", "cannot be read"},
		{"not JSON", "\x00\x01", "boot-1", "cannot be read"},
		{"a future version", `{"version":99,"boot_id":"boot-1"}`, "boot-1", "version 99"},
		{"an owner without a PID", `{"version":1,"boot_id":"boot-1","owners":[{"gpu":"GPU-a","identity":{"PID":0}}]}`, "boot-1", "without a GPU or a PID"},
		{"a bad descendant", `{"version":1,"boot_id":"boot-1","owners":[],"descent":[{"gpu":"GPU-a","owner_pid":1,"owner_start":1,"procs":[[0,5]]}]}`, "boot-1", "descendant with PID 0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := NewLineage()
			err := l.RestoreState([]byte(tc.data), tc.boot)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("RestoreState: %v, want an error with %q", err, tc.want)
			}
			if tc.want == "another boot" && !errors.Is(err, ErrForeignState) {
				t.Errorf("%v is not ErrForeignState", err)
			}
			if l.Owners() != 0 || l.RecordedDescendants() != 0 || l.Generation() != 0 {
				t.Errorf("a refused state changed the lineage")
			}
		})
	}
}

func TestLineageStateBounded(t *testing.T) {
	l := NewLineage()
	at := time.Now()
	for i := range maxStateOwners + 10 {
		l.owners.entries[ownerKey{"GPU-a", 1000 + i, uint64(i)}] = &ownerEntry{id: Identity{PID: 1000 + i, StartTime: uint64(i)}, listed: at.Add(time.Duration(i) * time.Second)}
	}
	data, err := l.MarshalState("b")
	if err != nil {
		t.Fatal(err)
	}
	r := NewLineage()
	if err := r.RestoreState(data, "b"); err != nil {
		t.Fatal(err)
	}
	if r.Owners() != maxStateOwners {
		t.Errorf("%d owners saved, want the %d listed last", r.Owners(), maxStateOwners)
	}
	if r.owners.latest("GPU-a", 1000) != nil {
		t.Error("the owner listed longest ago was kept over the bound")
	}
}
