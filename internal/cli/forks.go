package cli

import (
	"context"
	"log/slog"

	"github.com/alecthomas/kingpin/v2"

	"github.com/gpu-orphan/gpu-orphan/internal/forks"
	"github.com/gpu-orphan/gpu-orphan/internal/proc"
	"github.com/gpu-orphan/gpu-orphan/internal/snapshot"
)

// ProcessEventsFlag adds --collector.process-events to a daemon.
func ProcessEventsFlag(a *kingpin.Application) *kingpin.FlagClause {
	return a.Flag("collector.process-events", "Follow the kernel's process events (fork, exec, exit; needs root or CAP_NET_ADMIN, in the host's network namespace): they are the proof that a holder of a dead owner's GPU inherited its context, and an owner's exit is reported at once rather than at the next interval. Without them (--no-collector.process-events, or where they are unavailable) such holders are reported and never signalled.").
		Default("true")
}

// FollowForks starts the fork record that proves descent for loop, fed by
// the kernel's process events, unless enabled is false. The returned
// collector exports whether it runs. Call it before the loop's first
// snapshot.
func FollowForks(ctx context.Context, logger *slog.Logger, loop *snapshot.Loop, fs proc.FS, enabled bool) forks.Collector {
	if !enabled {
		logger.Warn("Process events disabled (--no-collector.process-events): holders of a dead owner's GPU are reported and never signalled")
		return forks.Collector{Status: &forks.Status{Why: "disabled by --no-collector.process-events"}}
	}
	rec := forks.New(fs)
	st := forks.Follow(ctx, rec, logger)
	if !st.Up() {
		return forks.Collector{Status: st}
	}
	loop.FollowForks(rec, st)
	logger.Info("Following the kernel's process events: descent is recorded at fork, exits are seen at once", "processes", rec.Counts().Live)
	return forks.Collector{Record: rec, Status: st}
}
