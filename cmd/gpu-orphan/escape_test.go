package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

// evilName is what a process on a shared node can call itself: move the
// cursor up a line, erase it, and print the all-clear over its own row.
const evilName = "\x1b[1A\x1b[2K\r  no suspect holders\x1b[8m"

// TestPSEscapesProcessNames: a fork orphan's worker named with terminal
// escapes, in its command line (argv[0], as setproctitle writes it) and in
// its comm (prctl(PR_SET_NAME), gpu-orphan-sim run --child-comm). The old
// gpu-orphan ps printed them raw, so that the worker's own suspect row
// read "no suspect holders" on a terminal. Now every control character
// prints as an escape: the table holds none, and the row is there; so does
// clean's plan.
func TestPSEscapesProcessNames(t *testing.T) {
	t.Parallel()
	root := testenv.SimNode(t, 1)
	w := testenv.StartWorkloadCmd(t, &exec.Cmd{
		Path: testenv.Bin(t, "gpu-orphan-sim"),
		Args: []string{evilName, "run", "--root", root, "--gpu", "0", "--mib", "512", "--children", "1", "--child-comm", "\x1b[2J\x1b[H\x07"},
	})
	child := w.Children[0]
	if comm, _ := os.ReadFile("/proc/" + strconv.Itoa(child) + "/comm"); string(comm) != "\x1b[2J\x1b[H\x07\n" {
		t.Fatalf("the worker's comm is %q", comm)
	}
	// The node agent sees the job alive; the owner dies; the worker keeps
	// its context, and the agent records it the owner's inheritor.
	storePath := filepath.Join(t.TempDir(), "r.db")
	testenv.NodeAgent(t, root, storePath)
	w.KillParent(t)
	waitInherited(t, storePath, w.Children...)

	code, out, stderr := runBin(t, "--backend=sim", "--sim.root="+root, "ps", "--store.path="+storePath)
	if code != 0 {
		t.Fatalf("gpu-orphan ps: exit %d\n%s\n%s", code, out, stderr)
	}
	for i, r := range out {
		if r < 0x20 && r != '\n' || r == 0x7f {
			t.Fatalf("gpu-orphan ps printed the control character %q at byte %d:\n%q", r, i, out)
		}
	}
	if !strings.Contains(out, "suspect holders:") || !strings.Contains(out, `\x1b[1A\x1b[2K\r  no suspect`) {
		t.Errorf("the worker's row, escaped, is not in the table:\n%s", out)
	}
	row := ""
	for l := range strings.Lines(out) {
		if strings.HasPrefix(strings.TrimSpace(l), strconv.Itoa(child)+" ") {
			row = l
		}
	}
	if !strings.Contains(row, "inherited_from_dead_owner") {
		t.Errorf("no suspect row for the worker %d:\n%s", child, out)
	}

	// clean's plan (a dry run) lists the same worker as a target.
	_, plan, _ := runBin(t, "--backend=sim", "--sim.root="+root, "clean", "--gpu", "0", "--store.path="+storePath)
	if strings.ContainsFunc(plan, func(r rune) bool { return r < 0x20 && r != '\n' || r == 0x7f }) ||
		!strings.Contains(plan, `\x1b[1A\x1b[2K\r  no suspect`) {
		t.Errorf("gpu-orphan clean's plan does not list the worker, escaped:\n%q", plan)
	}

	// JSON keeps the names as they are, escaped by the encoder.
	_, js, _ := runBin(t, "--backend=sim", "--sim.root="+root, "ps", "-o", "json")
	if strings.ContainsRune(js, 0x1b) || !strings.Contains(js, `"comm": "\u001b[2J\u001b[H\u0007"`) {
		t.Errorf("ps -o json does not carry the comm, escaped:\n%s", js)
	}
}
