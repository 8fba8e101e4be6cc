// Package slurm reads and sets what Slurm knows of this node, through its
// commands (sinfo, scontrol): the drain that gpu-orphan's prolog and epilog
// set when a GPU's memory cannot be brought back, and that the exporter
// reports.
package slurm

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// ReasonPrefix starts the drain reason that gpu-orphan sets: a node drained
// with another reason was drained by someone else.
const ReasonPrefix = "gpu-orphan: "

// Dirs are where Slurm's commands are looked for when PATH does not have
// them: Slurm runs prologs and epilogs with an environment of its own, no
// PATH in it, and a systemd unit's PATH may lack /opt/slurm/bin.
var Dirs = []string{"/usr/bin", "/usr/local/bin", "/opt/slurm/bin"}

// Look finds one of Slurm's commands: name itself when it is a path, else
// in PATH, else in Dirs. flag names the option that sets it, for the error.
func Look(name, flag string) (string, error) {
	if strings.Contains(name, "/") {
		return name, nil
	}
	if p, err := exec.LookPath(name); err == nil {
		return p, nil
	}
	for _, d := range Dirs {
		p := filepath.Join(d, name)
		if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", fmt.Errorf("%s not found in PATH nor in %s: give %s=PATH", name, strings.Join(Dirs, ", "), flag)
}

// NodeState is a node's state as sinfo prints it in long form ("idle",
// "mixed", "draining", "drained", ...) and its reason ("" without one).
type NodeState struct {
	State  string
	Reason string
}

// Drained reports whether the node is drained or draining: Slurm starts no
// new job on it.
func (s NodeState) Drained() bool { return strings.HasPrefix(s.State, "drain") }

// ByGPUOrphan reports whether gpu-orphan's prolog or epilog set the drain.
func (s NodeState) ByGPUOrphan() bool {
	return s.Drained() && strings.HasPrefix(s.Reason, ReasonPrefix)
}

// ReadNode asks sinfo (the path Look found) for node's state and reason.
func ReadNode(ctx context.Context, sinfo, node string) (NodeState, error) {
	if node == "" {
		return NodeState{}, errors.New("no node name")
	}
	var stderr strings.Builder
	cmd := exec.CommandContext(ctx, sinfo, "--noheader", "--Node", "--nodes="+node, "--format=%T|%E")
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return NodeState{}, fmt.Errorf("%s --nodes=%s: %w: %s", sinfo, node, err, strings.TrimSpace(stderr.String()))
	}
	return ParseNode(string(out))
}

// ParseNode reads sinfo's "%T|%E" line. A node in several partitions has a
// line in each, all alike: the first is read. sinfo prints the reason
// "none" when there is none.
func ParseNode(out string) (NodeState, error) {
	line, _, _ := strings.Cut(strings.TrimSpace(out), "\n")
	state, reason, ok := strings.Cut(strings.TrimSpace(line), "|")
	if !ok || state == "" {
		return NodeState{}, fmt.Errorf("sinfo printed %q, not STATE|REASON: is the node known to Slurm?", line)
	}
	// A state may end in a flag: "drained*" (not responding), "idle~".
	state = strings.TrimRight(state, "*~#!%$@^-")
	if reason == "none" {
		reason = ""
	}
	return NodeState{State: state, Reason: reason}, nil
}
