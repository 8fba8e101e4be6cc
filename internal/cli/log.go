package cli

import (
	"context"
	"log/slog"
	"strconv"
	"strings"

	"github.com/gpu-orphan/gpu-orphan/internal/snapshot"
)

// LogSnapshot logs what an operator needs to know about one snapshot:
// failed sources, a foreign PID namespace, and GPUs with orphaned memory.
func LogSnapshot(logger *slog.Logger, s *snapshot.Snapshot) {
	for _, line := range describe(s) {
		logger.Log(context.Background(), line.level, line.msg, line.attrs...)
	}
}

// LogChanges logs each snapshot's findings when they differ from the
// previous snapshot's, so that a steady state is not repeated every tick.
func LogChanges(ctx context.Context, logger *slog.Logger, loop *snapshot.Loop) {
	last := ""
	if s := loop.Latest(); s != nil {
		last = key(describe(s))
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-loop.Next():
		}
		s := loop.Latest()
		lines := describe(s)
		if k := key(lines); k != last {
			last = k
			if len(lines) == 0 {
				logger.Info("All GPUs accounted: no memory without a live owner")
			}
			LogSnapshot(logger, s)
		}
	}
}

type logLine struct {
	level slog.Level
	msg   string
	attrs []any
}

func key(lines []logLine) string {
	var b strings.Builder
	for _, l := range lines {
		b.WriteString(l.msg)
		for _, a := range l.attrs {
			if s, ok := a.(string); ok {
				b.WriteString(s)
			}
		}
	}
	return b.String()
}

func describe(s *snapshot.Snapshot) []logLine {
	var out []logLine
	for _, src := range s.Sources {
		if src.Err != nil {
			out = append(out, logLine{slog.LevelError, "Snapshot source failed", []any{"input", src.Name, "err", src.Err.Error()}})
		}
	}
	if len(s.GPUs) > 0 && !s.HostPIDsVisible {
		out = append(out, logLine{slog.LevelWarn, "The driver's PIDs are in a PID namespace this /proc does not show (run with hostPID, or point --path.procfs at the host's /proc); no memory will be called orphaned", nil})
	}
	for _, g := range s.GPUs {
		id := []any{"gpu", strconv.Itoa(g.Device.Index), "uuid", g.Device.UUID}
		switch {
		case g.Err != nil:
			out = append(out, logLine{slog.LevelError, "Cannot read GPU", append(id, "err", g.Err.Error())})
		case g.Unsupported != "" && g.Unsupported != snapshot.UnsupportedForeignPIDNamespace:
			out = append(out, logLine{slog.LevelWarn, "GPU accounting unsupported; its numbers are withheld", append(id, "reason", g.Unsupported)})
		case g.Accountable() && (g.OwnedDeadBytes > 0 || len(g.Suspects) > 0):
			var pids []string
			for _, h := range g.Suspects {
				pids = append(pids, strconv.Itoa(h.PID)+"("+h.Comm+","+h.Reason+")")
			}
			var dead []string
			for _, o := range g.Owners {
				if !o.Alive {
					dead = append(dead, strconv.Itoa(int(o.PID)))
				}
			}
			out = append(out, logLine{slog.LevelWarn, "GPU memory with no live owner", append(id,
				"unowned_mib", strconv.FormatUint(g.UnownedBytes>>20, 10),
				"dead_owner_pids", strings.Join(dead, ","),
				"suspects", strings.Join(pids, " "))})
		}
	}
	return out
}
