package proc

import "testing"

func TestParseStat(t *testing.T) {
	for _, tc := range []struct {
		line      string
		wantState byte
		wantPGRP  int
		wantOK    bool
	}{
		{"4242 (python3) S 1 4200 4200 0 -1 4194560 ...", 'S', 4200, true},
		{"4242 (a b) c) Z 1 77 77 0", 'Z', 77, true},
		{"4242 (x) S 1", 0, 0, false},
		{"4242 x S 1 2 3", 0, 0, false},
		{"4242 (x) SS 1 2 3", 0, 0, false},
	} {
		state, pgrp, ok := parseStat([]byte(tc.line))
		if state != tc.wantState || pgrp != tc.wantPGRP || ok != tc.wantOK {
			t.Errorf("parseStat(%q) = %c, %d, %v", tc.line, state, pgrp, ok)
		}
	}
}
