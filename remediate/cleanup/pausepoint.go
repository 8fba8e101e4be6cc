//go:build gpuorphan_pausepoints

package cleanup

import (
	"fmt"
	"os"
)

// Pause points, for the crash tests only (remediate/crash_test.go). A
// remediator built with `-tags gpuorphan_pausepoints` stops a cleanup for
// good at the step that $GPU_ORPHAN_PAUSE_AT names, after writing the
// step's name to the file $GPU_ORPHAN_PAUSE_FILE, so that a test can kill
// it with SIGKILL at exactly that step; the rest of the remediator (its
// API, its queue) runs on. Release builds (`make build`, `make release`,
// the image) are made without the tag, so that this file is not in them and
// no environment can enable it; `--version` lists the tags a binary was
// built with.

var pauseAt, pauseFile = os.Getenv("GPU_ORPHAN_PAUSE_AT"), os.Getenv("GPU_ORPHAN_PAUSE_FILE")

func pausePoint(step string) {
	if pauseAt == "" || step != pauseAt {
		return
	}
	if pauseFile != "" {
		// Best effort: the test times out if the file never comes.
		_ = os.WriteFile(pauseFile, []byte(step+"\n"), 0o600)
	}
	select {}
}

func pauseWarning() string {
	if pauseAt == "" {
		return ""
	}
	return fmt.Sprintf("TEST BUILD: cleanups stop for good at the step %q (GPU_ORPHAN_PAUSE_AT, build tag gpuorphan_pausepoints)", pauseAt)
}
