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

// unavailable is the one line logged when the events cannot be had.
const unavailable = "The kernel's process events are unavailable: holders of a dead owner's GPU cannot be proven its inheritors, and are reported but never signalled (run as root with CAP_NET_ADMIN in the host's network namespace)"

// flushEvery is how often exits are checked while events arrive, and the
// longest an exit waits before its process is checked.
const flushEvery = 50 * time.Millisecond

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
	batches := make(chan []procevents.Event, 256)
	lost := make(chan struct{}, 1)
	go receive(l, batches, lost)
	if err := probe(rec, batches); err != nil {
		l.Close()
		st.Why = err.Error()
		logger.Warn(unavailable, "err", err)
		return st
	}
	if err := rec.Seed(); err != nil {
		l.Close()
		st.Why = err.Error()
		logger.Warn("Cannot seed the fork record from /proc: process events not used", "err", err)
		return st
	}
	st.up.Store(true)
	go func() {
		<-ctx.Done()
		l.Close()
	}()
	go apply(ctx, rec, st, batches, lost, logger)
	return st
}

// probeTimeout is how long the probe's fork may take to be reported.
const probeTimeout = 3 * time.Second

// probe forks a child that fails to exec, and waits for its fork event: a
// subscription from a network namespace other than the initial one
// succeeds, and then nothing ever arrives. Events read meanwhile are
// applied.
func probe(rec *Record, batches <-chan []procevents.Event) error {
	// The child's exec fails (no such file); its fork and exit are what is
	// looked for.
	_, _ = syscall.ForkExec("/nonexistent/gpu-orphan-process-events-probe", nil, &syscall.ProcAttr{})
	self := os.Getpid()
	deadline := time.After(probeTimeout)
	for {
		select {
		case evs, ok := <-batches:
			if !ok {
				return fmt.Errorf("%w: the connector's socket failed", procevents.ErrUnavailable)
			}
			seen := false
			for _, ev := range evs {
				rec.Apply(ev)
				seen = seen || (ev.Kind == procevents.Fork && ev.ParentPID == self && !ev.Thread())
			}
			if seen {
				return nil
			}
		case <-deadline:
			return fmt.Errorf("%w: subscribed, but no event arrived for a probe's fork within %v (a network namespace other than the host's: the connector speaks only to the initial one)", procevents.ErrUnavailable, probeTimeout)
		}
	}
}

// receive reads events until the listener is closed.
func receive(l *procevents.Listener, batches chan<- []procevents.Event, lost chan<- struct{}) {
	defer close(batches)
	for {
		evs, err := l.Receive(nil)
		if len(evs) > 0 {
			batches <- evs
		}
		switch {
		case errors.Is(err, procevents.ErrLost):
			select {
			case lost <- struct{}{}:
			default:
			}
		case err != nil:
			return
		}
	}
}

// apply feeds the record and checks the exits that settled. The timer
// runs only while exits wait: an idle node wakes nothing.
func apply(ctx context.Context, rec *Record, st *Status, batches <-chan []procevents.Event, lost <-chan struct{}, logger *slog.Logger) {
	flush := time.NewTimer(flushEvery)
	flush.Stop()
	armed := false
	var lastLog time.Time
	for {
		select {
		case evs, ok := <-batches:
			if !ok {
				if ctx.Err() == nil {
					logger.Error("The process events stopped: the fork record no longer follows the kernel")
					st.up.Store(false)
				}
				return
			}
			for _, ev := range evs {
				rec.Apply(ev)
			}
			if !armed && rec.Pending() {
				flush.Reset(flushEvery)
				armed = true
			}
		case <-lost:
			n := st.lost.Add(1)
			if time.Since(lastLog) >= lostLogEvery {
				logger.Warn("Process events were lost (a fork storm filled the socket's buffer): resynchronising the fork record from /proc; what it had proven is dropped", "times", n)
				lastLog = time.Now()
			}
			if err := rec.Resync(); err != nil {
				logger.Warn("Resynchronising the fork record failed", "err", err)
			}
		case now := <-flush.C:
			armed = false
			rec.FlushExits(now)
			if rec.Pending() {
				flush.Reset(flushEvery)
				armed = true
			}
		}
	}
}
