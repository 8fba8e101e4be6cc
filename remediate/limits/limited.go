package limits

import (
	"errors"
	"fmt"
	"time"
)

// Names of the limits, as Limited.Limit reports them. They are meant as the
// values of a metric label, so they are a closed set: do not add to it
// lightly.
const (
	LimitBreaker     = "breaker"
	LimitCooldown    = "cooldown"
	LimitGPUBusy     = "gpu_busy"
	LimitConcurrency = "concurrency"
	LimitNodeRate    = "node_rate"
	LimitFleetRate   = "fleet_rate"
)

// Limited is the error a limit returns when it holds work back. Callers
// count it by Limit (errors.As) and may retry after RetryAfter.
type Limited struct {
	// Limit is one of the Limit* constants.
	Limit string
	// RetryAfter is the earliest time, from now, at which the same request
	// could pass this limit. Zero means there is no estimate: a slot frees
	// when running work ends, and an open breaker waits for a human.
	RetryAfter time.Duration
	// Reason says why, for a human: the breaker's reason, or which GPU or
	// node held the work back.
	Reason string
}

func (e *Limited) Error() string {
	msg := "held back by the " + e.Limit + " limit"
	if e.Reason != "" {
		msg += ": " + e.Reason
	}
	if e.RetryAfter > 0 {
		msg += fmt.Sprintf(" (retry after %s)", e.RetryAfter)
	}
	return msg
}

// Retry says when work that err held back is worth another try, and which
// limit held it; ok is false when err is not a *Limited. Without an
// estimate (a slot frees when work ends; a breaker waits for a human) it
// says 5 s, to look again now and then; never less than a second.
func Retry(err error) (after time.Duration, limit string, ok bool) {
	var l *Limited
	if !errors.As(err, &l) {
		return 0, "", false
	}
	if l.RetryAfter <= 0 {
		return 5 * time.Second, l.Limit, true
	}
	return max(l.RetryAfter, time.Second), l.Limit, true
}
