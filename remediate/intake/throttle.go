package intake

import (
	"log/slog"
	"sync"
	"time"
)

// throttledLog writes at most burst warnings per interval; the warnings
// beyond are counted, and when the interval ends one line says how many
// there were. Anyone who can reach the port can make a request that is
// refused, so one line per refusal would let them fill the disk.
type throttledLog struct {
	logger *slog.Logger
	every  time.Duration
	burst  int

	mu      sync.Mutex
	start   time.Time // of the current interval
	logged  int
	dropped int
	last    []any // the last dropped warning's attributes
	msg     string
	timer   *time.Timer
}

func newThrottledLog(logger *slog.Logger, every time.Duration, burst int) *throttledLog {
	return &throttledLog{logger: logger, every: every, burst: burst}
}

// Warn logs msg with args, unless burst warnings were logged in this
// interval already.
func (l *throttledLog) Warn(msg string, args ...any) {
	l.mu.Lock()
	now := time.Now()
	if l.timer == nil && now.Sub(l.start) >= l.every {
		l.start, l.logged = now, 0
	}
	if l.logged < l.burst {
		l.logged++
		l.mu.Unlock()
		l.logger.Warn(msg, args...)
		return
	}
	l.dropped++
	l.msg, l.last = msg, args
	if l.timer == nil {
		l.timer = time.AfterFunc(l.start.Add(l.every).Sub(now), l.summary)
	}
	l.mu.Unlock()
}

// summary ends an interval in which warnings were dropped: one line with
// their count and the last of them, then a new interval.
func (l *throttledLog) summary() {
	l.mu.Lock()
	n, msg, last := l.dropped, l.msg, l.last
	l.dropped, l.last, l.timer = 0, nil, nil
	l.start, l.logged = time.Now(), 0
	l.mu.Unlock()
	l.logger.Warn(msg+" (more of them, not logged one by one)", "suppressed", n, "interval", l.every, slog.Group("last", last...))
}
