package cli

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/alecthomas/kingpin/v2"
)

func TestExitCode(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want int
	}{
		{nil, ExitOK},
		{errors.New("the driver failed"), ExitFailure},
		{Usagef("invalid --x %q", "y"), ExitUsage},
		{fmt.Errorf("starting: %w", Usagef("authentication is required")), ExitUsage},
	} {
		if got := ExitCode(tc.err); got != tc.want {
			t.Errorf("ExitCode(%v) = %d, want %d", tc.err, got, tc.want)
		}
	}
	if got := Usagef("invalid --x: %w", errors.New("bad")).Error(); got != "invalid --x: bad" {
		t.Errorf("Usagef's message %q", got)
	}
}

func TestNoCommand(t *testing.T) {
	newApp := func() *kingpin.Application {
		app := kingpin.New("gpu-orphan", "")
		app.Version("1")
		app.Terminate(nil)
		app.Flag("backend", "").String()
		app.Command("ps", "")
		app.Command("clean", "").Flag("gpu", "").Required().String()
		app.Command("child", "").Hidden()
		return app
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{nil, "no command: want one of ps, clean (gpu-orphan --help says what each does)"},
		{[]string{"--backend=sim"}, "no command"},
		{[]string{"ps"}, ""},
		{[]string{"clean"}, ""}, // Parse says that --gpu is missing
		{[]string{"--help"}, ""},
		{[]string{"--version"}, ""},
		{[]string{"--nope"}, ""}, // Parse says what is wrong
		{[]string{"top"}, ""},
	} {
		got := NoCommand(newApp(), tc.args)
		if (tc.want == "") != (got == "") || !strings.Contains(got, tc.want) {
			t.Errorf("%v: %q, want %q", tc.args, got, tc.want)
		}
	}
	flagsOnly := kingpin.New("gpu-orphan-exporter", "")
	flagsOnly.Flag("web.listen-address", "").String()
	if got := NoCommand(flagsOnly, nil); got != "" {
		t.Errorf("an application without commands: %q", got)
	}
}
