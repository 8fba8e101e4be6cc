package cli

import "testing"

func TestMaxProcs(t *testing.T) {
	for _, c := range []struct {
		flag, goChoice, want int
	}{
		{DefaultMaxProcs, 224, 8}, // a dual-socket GPU server: bounded
		{DefaultMaxProcs, 16, 8},
		{DefaultMaxProcs, 2, 2}, // never more Ps than Go would use
		{3, 12, 3},
		{12, 12, 12},
		{0, 224, 224}, // 0 is Go's choice
	} {
		if got := maxProcs(c.flag, c.goChoice); got != c.want {
			t.Errorf("maxProcs(%d, %d) = %d, want %d", c.flag, c.goChoice, got, c.want)
		}
	}
}
