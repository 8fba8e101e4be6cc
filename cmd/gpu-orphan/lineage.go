package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"

	"github.com/gpu-orphan/gpu-orphan/internal/proc"
	"github.com/gpu-orphan/gpu-orphan/internal/snapshot"
	"github.com/gpu-orphan/gpu-orphan/remediate/hooks"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

// readAgentLineage restores what the node agent recorded in its
// store at path (read-only) into mem: who the dead owners were and which holders it
// proved their inheritors at fork. A command started after a death cannot
// see the forks that happened before it; only a daemon that followed the
// kernel's process events can. It returns a sentence that says where the
// proof comes from, for the command's output.
func readAgentLineage(ctx context.Context, mem *snapshot.Lineage, fs proc.FS, path string, logger *slog.Logger) string {
	const none = "No node agent's record of descent was read: this command cannot see forks that happened before it ran, so no holder is proven to have inherited a dead owner's context (run gpu-orphan-remediator on the node, or give its --store.path)"
	if path == "" {
		return none
	}
	if _, err := os.Stat(path); err != nil {
		return fmt.Sprintf("%s; %s: %v", none, path, err)
	}
	st, err := store.OpenReadOnly(ctx, path)
	if err != nil {
		logger.Warn("Cannot read the node agent's record of descent", "path", path, "err", err)
		return fmt.Sprintf("%s; %s cannot be read: %v", none, path, err)
	}
	defer st.Close()
	found, err := hooks.RestoreAgentLineage(ctx, st, mem, fs)
	switch {
	case err != nil:
		return fmt.Sprintf("%s; the one in %s was ignored: %v", none, path, err)
	case !found:
		return fmt.Sprintf("%s; %s holds none yet", none, path)
	}
	return fmt.Sprintf("Proof of descent from the node agent's record in %s (%d owners remembered).", path, mem.Owners())
}
