package limits

import (
	"errors"
	"fmt"
	"testing"
	"time"
)

func TestRetry(t *testing.T) {
	for _, tc := range []struct {
		name  string
		err   error
		after time.Duration
		limit string
		ok    bool
	}{
		{"not a limit", errors.New("disk full"), 0, "", false},
		{"an estimate", &Limited{Limit: LimitCooldown, RetryAfter: time.Minute}, time.Minute, LimitCooldown, true},
		{"never under a second", &Limited{Limit: LimitNodeRate, RetryAfter: time.Millisecond}, time.Second, LimitNodeRate, true},
		{"no estimate: look again in 5 s", &Limited{Limit: LimitBreaker}, 5 * time.Second, LimitBreaker, true},
		{"wrapped", fmt.Errorf("acquiring: %w", &Limited{Limit: LimitGPUBusy, RetryAfter: 3 * time.Second}), 3 * time.Second, LimitGPUBusy, true},
	} {
		after, limit, ok := Retry(tc.err)
		if after != tc.after || limit != tc.limit || ok != tc.ok {
			t.Errorf("%s: Retry = %v, %q, %v; want %v, %q, %v", tc.name, after, limit, ok, tc.after, tc.limit, tc.ok)
		}
	}
}
