package cli

import (
	"log/slog"
	"time"

	"github.com/gpu-orphan/gpu-orphan/internal/proc"
	"github.com/gpu-orphan/gpu-orphan/internal/snapshot"
)

// LineageSaveEvery is how often a loop saves what it remembers when nothing
// new was seen: the owners' last sightings, which bound how long they are
// kept.
const LineageSaveEvery = time.Minute

// KeepLineage restores what loop remembered before a restart, from load,
// and makes it save with save from now on. where names the state for the
// log ("the state file /var/lib/...", "the store"). A state that cannot be
// read, is corrupt, or was written in another boot is reported and
// ignored: the loop starts with an empty memory, as without a state.
func KeepLineage(logger *slog.Logger, loop *snapshot.Loop, fs proc.FS, where string, load func() ([]byte, bool, error), save func([]byte) error) {
	bootID, err := fs.BootID()
	if err != nil {
		logger.Warn("Cannot tell this boot: what the collector remembers is neither restored nor kept", "err", err)
		return
	}
	data, ok, err := load()
	switch {
	case err != nil:
		logger.Warn("Ignoring the collector's saved state", "where", where, "err", err)
	case !ok:
		logger.Info("No saved state of the collector yet", "where", where)
	default:
		if err := loop.Lineage().RestoreState(data, bootID); err != nil {
			logger.Warn("Ignoring the collector's saved state", "where", where, "err", err)
		} else {
			logger.Info("Restored what the collector remembered", "where", where, "owners", loop.Lineage().Owners(),
				"recorded_descendants", loop.Lineage().RecordedDescendants())
		}
	}
	loop.Persist(bootID, LineageSaveEvery, save, logger)
}
