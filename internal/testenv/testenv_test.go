package testenv

import (
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
)

func TestMain(m *testing.M) { os.Exit(Main(m)) }

// TestBinBuildSettings: the binaries that tests start are race-built when
// the tests are, and built with the Makefile's CGO_CFLAGS unless the
// environment sets its own.
func TestBinBuildSettings(t *testing.T) {
	bin := Bin(t, "gpu-orphan-sim")
	out, err := exec.Command("go", "version", "-m", bin).CombinedOutput()
	if err != nil {
		t.Fatalf("go version -m: %v\n%s", err, out)
	}
	settings := map[string]string{}
	for line := range strings.Lines(string(out)) {
		if kv, ok := strings.CutPrefix(strings.TrimSpace(line), "build\t"); ok {
			k, v, _ := strings.Cut(kv, "=")
			if u, err := strconv.Unquote(v); err == nil {
				v = u // values with spaces are quoted
			}
			settings[k] = v
		}
	}
	if race := settings["-race"] == "true"; race != RaceEnabled {
		t.Errorf("binary built with -race=%v, tests with -race=%v", race, RaceEnabled)
	}
	want := os.Getenv("CGO_CFLAGS")
	if want == "" {
		want = cgoCFlags
	}
	if got := settings["CGO_CFLAGS"]; got != want {
		t.Errorf("binary built with CGO_CFLAGS=%q, want %q", got, want)
	}
}
