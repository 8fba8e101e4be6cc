package app

import (
	"fmt"
	"log/slog"

	"github.com/gpu-orphan/gpu-orphan/internal/proc"
)

// checkPIDNamespace refuses to act from another PID namespace than the one
// --path.procfs shows. The kill ladder opens pidfds, and the group kill
// signals, by PID in the remediator's own namespace, while the PIDs it
// decides on are the procfs's (and NVML's): every target would be "gone
// before signal", or, where a local PID equals a worker's PID there, the
// wrong process would be signalled. A dry run signals nothing, so it
// starts, with a warning.
func checkPIDNamespace(fs proc.FS, act bool, logger *slog.Logger) error {
	err := fs.CheckOwnPIDNamespace()
	if err == nil {
		return nil
	}
	if act {
		return fmt.Errorf("refusing to start with --act: --path.procfs=%s: %w", fs.Root(), err)
	}
	logger.Warn("Not in the PID namespace that --path.procfs shows: plans may name the wrong processes, and with --act the remediator will not start",
		"path.procfs", fs.Root(), "err", err)
	return nil
}
