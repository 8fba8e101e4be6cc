package store

import (
	"context"
	"path/filepath"
	"strings"
	"testing"
)

func TestState(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "r.db")
	s := openTest(t, path)
	if _, ok, err := s.GetState(ctx, "lineage"); ok || err != nil {
		t.Fatalf("a new store has state: %v %v", ok, err)
	}
	for _, v := range []string{"one", "two"} {
		if err := s.PutState(ctx, "lineage", []byte(v)); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.PutState(ctx, "big", make([]byte, MaxStateBytes+1)); err == nil || !strings.Contains(err.Error(), "more than") {
		t.Errorf("an oversized state was kept: %v", err)
	}
	s.Close()
	s = openTest(t, path)
	v, ok, err := s.GetState(ctx, "lineage")
	if err != nil || !ok || string(v) != "two" {
		t.Errorf("after a reopen: %q %v %v, want the latest value", v, ok, err)
	}
}
