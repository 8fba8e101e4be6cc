package cli

import (
	"strings"
	"testing"

	"github.com/alecthomas/kingpin/v2"
)

func TestParseError(t *testing.T) {
	newApp := func() *kingpin.Application {
		app := kingpin.New("gpu-orphan", "")
		app.Flag("sim.root", "").String()
		app.Flag("backend", "").String()
		clean := app.Command("clean", "")
		clean.Flag("min-age", "").String()
		app.Command("ps", "")
		return app
	}
	for _, tc := range []struct {
		args []string
		want string
		not  string
	}{
		{[]string{"--sim-root=/x", "ps"}, "did you mean --sim.root?", ""},
		{[]string{"ps", "--backnd=sim"}, "did you mean --backend?", ""},
		{[]string{"clean", "--min_age=1s"}, "did you mean --min-age?", ""},
		{[]string{"ps", "--everything"}, "gpu-orphan --help lists the flags", "did you mean"},
	} {
		app := newApp()
		_, err := app.Parse(tc.args)
		if err == nil {
			t.Fatalf("%v parsed", tc.args)
		}
		got := ParseError(app, err)
		if !strings.Contains(got, tc.want) || (tc.not != "" && strings.Contains(got, tc.not)) {
			t.Errorf("%v: %q, want %q", tc.args, got, tc.want)
		}
	}
}
