package main

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"

	"github.com/prometheus/common/promslog"
)

// dispatcherName is the binary that --role=dispatcher runs.
const dispatcherName = "gpu-orphan-dispatcher"

// dispatcherArgs says whether args ask for the deprecated --role=dispatcher
// (--role=dispatcher or --role dispatcher, before a "--"), and returns
// them without it: gpu-orphan-dispatcher's arguments. The node agent no
// longer declares the --dispatch.* flags, so this is decided before
// parsing.
func dispatcherArgs(args []string) ([]string, bool) {
	rest := make([]string, 0, len(args))
	found := false
	for i := 0; i < len(args); i++ {
		switch {
		case args[i] == "--":
			return append(rest, args[i:]...), found
		case args[i] == "--role=dispatcher":
			found = true
		case args[i] == "--role" && i+1 < len(args) && args[i+1] == "dispatcher":
			found = true
			i++
		default:
			rest = append(rest, args[i])
		}
	}
	return rest, found
}

// findDispatcher looks for gpu-orphan-dispatcher beside this executable,
// then in PATH.
func findDispatcher() (string, error) {
	if self, err := os.Executable(); err == nil {
		beside := filepath.Join(filepath.Dir(self), dispatcherName)
		if fi, err := os.Stat(beside); err == nil && fi.Mode().IsRegular() && fi.Mode().Perm()&0o111 != 0 {
			return beside, nil
		}
	}
	path, err := exec.LookPath(dispatcherName)
	if err != nil {
		return "", errors.New(dispatcherName + " is neither beside this executable nor in PATH")
	}
	return path, nil
}

// execDispatcher replaces this process with gpu-orphan-dispatcher and
// args (the same process: same PID, same signals), after a deprecation
// line in the log; it returns only when that fails.
func execDispatcher(args []string) int {
	logger := promslog.New(&promslog.Config{})
	path, err := findDispatcher()
	if err != nil {
		fmt.Fprintf(os.Stderr, "gpu-orphan-remediator: --role=dispatcher is deprecated and the dispatcher is now its own binary, but %s; install it, or run it instead of gpu-orphan-remediator --role=dispatcher\n", err)
		return 1
	}
	logger.Warn("--role=dispatcher is deprecated and will be removed in the next release: running "+dispatcherName+" with the same arguments minus --role; run it directly instead", "path", path)
	if err := syscall.Exec(path, append([]string{path}, args...), os.Environ()); err != nil {
		fmt.Fprintf(os.Stderr, "gpu-orphan-remediator: running %s: %s\n", path, err)
	}
	return 1
}
