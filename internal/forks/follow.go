package forks

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpu-orphan/gpu-orphan/internal/procevents"
)

// Status says whether a record follows the kernel's events, for metrics.
type Status struct {
	// up: the record is fed by the process events.
	up atomic.Bool
	// Why they are not used, when not Up.
	Why string
	// lost counts the overruns (ENOBUFS), each followed by a resync.
	lost atomic.Uint64
	// applied is the kernel's timestamp (CLOCK_MONOTONIC, ns) of the last
	// event applied to the record.
	applied atomic.Uint64
}

// Up reports whether the record follows the process events.
func (s *Status) Up() bool { return s != nil && s.up.Load() }

// Lost counts the times events were lost.
func (s *Status) Lost() uint64 {
	if s == nil {
		return 0
	}
	return s.lost.Load()
}

// Applied returns when the kernel sent the last event that the record
// applied, on the wall clock; zero before the first. Everything the kernel
// sent before it is in the record.
func (s *Status) Applied() time.Time {
	if s == nil {
		return time.Time{}
	}
	ts := s.applied.Load()
	var now unix.Timespec
	if ts == 0 || unix.ClockGettime(unix.CLOCK_MONOTONIC, &now) != nil {
		return time.Time{}
	}
	return time.Now().Add(-time.Duration(uint64(now.Nano()) - ts))
}

// CatchUp waits, at most limit, until the record has applied every event
// sent before the call: it forks a marker child (whose exec fails, as the
// probe's) and waits for an event sent after it. A decision made on a
// snapshot then sees the forks that made its holders, even while the
// record lags behind a busy node. It reports whether the record caught up;
// a record that is not Up never does.
func (s *Status) CatchUp(ctx context.Context, limit time.Duration) bool {
	if !s.Up() {
		return false
	}
	start := time.Now()
	_, _ = syscall.ForkExec("/nonexistent/gpu-orphan-process-events-marker", nil, &syscall.ProcAttr{})
	deadline := time.NewTimer(limit)
	defer deadline.Stop()
	tick := time.NewTicker(2 * time.Millisecond)
	defer tick.Stop()
	for !s.Applied().After(start) {
		select {
		case <-ctx.Done():
			return false
		case <-deadline.C:
			return false
		case <-tick.C:
		}
	}
	return true
}

// unavailable is the one line logged when the events cannot be had.
const unavailable = "The kernel's process events are unavailable: holders of a dead owner's GPU cannot be proven its inheritors, and are reported but never signalled (run as root with CAP_NET_ADMIN in the host's network namespace)"

// flushEvery is how often exits are checked while events arrive, and the
// longest an exit waits before its process is checked.
const flushEvery = 50 * time.Millisecond

// coalesce is how long the follower lets events gather while they keep
// coming (a fork storm): it then wakes at most 1/coalesce times a second,
// each time for a batch, instead of once or more per event. An event after
// a quiet spell is applied at once.
const coalesce = 25 * time.Millisecond

// lostLogEvery bounds the log lines about lost events.
const lostLogEvery = time.Minute

// Follow subscribes to the process events, seeds rec from /proc and feeds
// it until ctx ends. Where the events cannot be had, it says why once and
// returns a Status that is not Up: the record stays empty, and descent is
// then proven by nothing.
func Follow(ctx context.Context, rec *Record, logger *slog.Logger) *Status {
	st := &Status{}
	l, err := procevents.Listen()
	if err != nil {
		st.Why = err.Error()
		logger.Warn(unavailable, "err", err)
		return st
	}
	f := &follower{l: l, rec: rec, st: st, logger: logger, buf: make([]procevents.Event, 0, procevents.ReceiveBatch)}
	lost, err := f.probe()
	if err != nil {
		l.Close()
		st.Why = err.Error()
		logger.Warn(unavailable, "err", err)
		return st
	}
	seed := rec.Seed
	if lost {
		// What the probe's events recorded may miss an exec.
		st.lost.Add(1)
		seed = rec.Resync
	}
	if err := seed(); err != nil {
		l.Close()
		st.Why = err.Error()
		logger.Warn("Cannot seed the fork record from /proc: process events not used", "err", err)
		return st
	}
	st.up.Store(true)
	f.flush = time.AfterFunc(time.Hour, f.flushExits)
	f.flush.Stop()
	go func() {
		<-ctx.Done()
		l.Close()
	}()
	go f.run(ctx)
	return st
}

// follower receives the events and applies them in one goroutine; a timer
// checks the exits that settled.
type follower struct {
	l      *procevents.Listener
	rec    *Record
	st     *Status
	logger *slog.Logger
	buf    []procevents.Event
	flush  *time.Timer
	armed  atomic.Bool
}

// probeTimeout is how long the probe's fork may take to be reported.
const probeTimeout = 3 * time.Second

// probe forks a child that fails to exec, and waits for its fork event: a
// subscription from a network namespace other than the initial one
// succeeds, and then nothing ever arrives. Events read meanwhile are
// applied; lost reports whether some were lost.
func (f *follower) probe() (lost bool, err error) {
	// The child's exec fails (no such file); its fork and exit are what is
	// looked for.
	_, _ = syscall.ForkExec("/nonexistent/gpu-orphan-process-events-probe", nil, &syscall.ProcAttr{})
	self := os.Getpid()
	f.l.SetDeadline(time.Now().Add(probeTimeout))
	defer f.l.SetDeadline(time.Time{})
	for {
		evs, err := f.l.Receive(f.buf[:0])
		f.rec.ApplyBatch(evs, time.Now())
		for _, ev := range evs {
			if ev.Kind == procevents.Fork && ev.ParentPID == self && !ev.Thread() {
				return lost, nil
			}
		}
		switch {
		case errors.Is(err, procevents.ErrLost):
			lost = true
		case errors.Is(err, os.ErrDeadlineExceeded):
			return lost, fmt.Errorf("%w: subscribed, but no event arrived for a probe's fork within %v (a network namespace other than the host's: the connector speaks only to the initial one)", procevents.ErrUnavailable, probeTimeout)
		case err != nil:
			return lost, fmt.Errorf("%w: the connector's socket failed: %w", procevents.ErrUnavailable, err)
		}
	}
}

// run receives and applies events until the listener is closed.
func (f *follower) run(ctx context.Context) {
	var lastLog, lastWake time.Time
	for {
		evs, err := f.l.Receive(f.buf[:0])
		now := time.Now()
		if len(evs) > 0 {
			if f.rec.ApplyBatch(evs, now) {
				f.armFlush()
			}
			f.st.applied.Store(evs[len(evs)-1].Timestamp)
		}
		switch {
		case errors.Is(err, procevents.ErrLost):
			n := f.st.lost.Add(1)
			if now.Sub(lastLog) >= lostLogEvery {
				f.logger.Warn("Process events were lost (a fork storm filled the socket's buffer): resynchronising the fork record from /proc; what it had proven is dropped", "times", n)
				lastLog = now
			}
			if err := f.rec.Resync(); err != nil {
				f.logger.Warn("Resynchronising the fork record failed", "err", err)
			}
			if f.rec.Pending() {
				f.armFlush()
			}
			continue
		case err != nil:
			if ctx.Err() == nil {
				f.logger.Error("The process events stopped: the fork record no longer follows the kernel", "err", err)
				f.st.up.Store(false)
			}
			return
		}
		if len(evs) == 0 || len(evs) >= procevents.ReceiveBatch/2 {
			continue // more are waiting
		}
		// Events keep coming (this wake follows the last closely): let
		// them gather.
		busy := now.Sub(lastWake) < 2*coalesce
		lastWake = now
		if busy {
			time.Sleep(coalesce)
		}
	}
}

// armFlush starts the exit timer unless it runs: it runs only while exits
// wait, so that an idle node wakes nothing.
func (f *follower) armFlush() {
	if f.armed.CompareAndSwap(false, true) {
		f.flush.Reset(flushEvery)
	}
}

// flushExits checks the exits that settled, and runs again while some
// wait.
func (f *follower) flushExits() {
	f.rec.FlushExits(time.Now())
	f.armed.Store(false)
	if f.rec.Pending() {
		f.armFlush()
	}
}
