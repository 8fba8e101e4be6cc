package cmd

import (
	"bytes"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/gpu-orphan/gpu-orphan/internal/testenv"
)

// helpBinaries are every binary of cmd/, shipped or not.
var helpBinaries = []string{"gpu-orphan", "gpu-orphan-exporter", "gpu-orphan-remediator",
	"gpu-orphan-dispatcher", "gpu-orphan-sim", "gpu-orphan-demo"}

// TestHelpOnStdout: what a user asks to read (--help, -h, a command's
// --help, `help COMMAND`, --version) goes to standard output with exit 0,
// as Prometheus and node_exporter print it, so that `gpu-orphan clean
// --help | grep act` finds the flag (issue 23, paper cut 5); nothing goes
// to standard error. Each case runs the real binary.
func TestHelpOnStdout(t *testing.T) {
	t.Parallel()
	entries, err := os.ReadDir(".")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if e.IsDir() && !slices.Contains(helpBinaries, e.Name()) {
			if _, err := os.Stat(e.Name() + "/main.go"); err == nil {
				t.Errorf("cmd/%s is a binary that this test does not check: add it to helpBinaries", e.Name())
			}
		}
	}
	type tc struct {
		bin  string
		args []string
		says []string // on stdout
	}
	var cases []tc
	for _, bin := range helpBinaries {
		cases = append(cases,
			tc{bin, []string{"--help"}, []string{"usage: " + bin, "--[no-]version"}},
			tc{bin, []string{"-h"}, []string{"usage: " + bin}},
			tc{bin, []string{"--version"}, []string{bin + ", version"}})
	}
	cases = append(cases,
		tc{"gpu-orphan", []string{"clean", "--help"}, []string{"usage: gpu-orphan clean", "--act"}},
		tc{"gpu-orphan", []string{"help", "clean"}, []string{"usage: gpu-orphan clean", "--act"}},
		tc{"gpu-orphan", []string{"ps", "-h"}, []string{"usage: gpu-orphan ps", "--exporter.url"}},
		tc{"gpu-orphan-exporter", []string{"--help"}, []string{"--[no-]nvml.release-zero-pages"}},
		tc{"gpu-orphan-sim", []string{"init", "--help"}, []string{"usage: gpu-orphan-sim init", "--gpus"}})
	for _, c := range cases {
		t.Run(strings.Join(append([]string{c.bin}, c.args...), " "), func(t *testing.T) {
			t.Parallel()
			cmd := exec.Command(testenv.Bin(t, c.bin), c.args...)
			var stdout, stderr bytes.Buffer
			cmd.Stdout, cmd.Stderr = &stdout, &stderr
			if code := testenv.ExitCode(t, cmd.Run()); code != 0 {
				t.Errorf("exit %d, want 0\nstderr:\n%s", code, stderr.String())
			}
			for _, s := range c.says {
				if !strings.Contains(stdout.String(), s) {
					t.Errorf("stdout does not say %q\nstdout:\n%s\nstderr:\n%s", s, stdout.String(), stderr.String())
				}
			}
			if stderr.Len() > 0 {
				t.Errorf("wrote to stderr:\n%s", stderr.String())
			}
		})
	}
}
