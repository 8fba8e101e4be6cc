package cli

import (
	"strings"
	"testing"
	"time"

	"github.com/alecthomas/kingpin/v2"
)

func TestParseBytes(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want uint64
		ok   bool
	}{
		{"268435456", 256 << 20, true},
		{"0", 0, true},
		{"256MiB", 256 << 20, true},
		{"256 MiB", 256 << 20, true}, // as the README writes it
		{"1GiB", 1 << 30, true},
		{"1.5GiB", 3 << 29, true},
		{"512KiB", 512 << 10, true},
		{"256MB", 256 << 20, true}, // Prometheus's units: MB counts in 1024s
		{"1B", 1, true},
		{"18446744073709551615", 1<<64 - 1, true},
		{"", 0, false},
		{"abc", 0, false},
		{"-1", 0, false},
		{"-1MiB", 0, false},
		{"1.5", 0, false},
		{"1Gb", 0, false},
		{"1kB", 0, false},
		{"MiB", 0, false},
	} {
		got, err := ParseBytes(tc.in)
		if (err == nil) != tc.ok || got != tc.want {
			t.Errorf("ParseBytes(%q) = %d, %v; want %d, ok %v", tc.in, got, err, tc.want, tc.ok)
		}
	}
}

// TestFlagErrorsNameTheFlag: a wrong value names its flag, shows the
// value, and says what a good one looks like.
func TestFlagErrorsNameTheFlag(t *testing.T) {
	type values struct {
		interval time.Duration
		bytes    uint64
		kind     string
		n        int
		rate     float64
	}
	newApp := func() (*kingpin.Application, *values) {
		app := kingpin.New("test", "")
		app.Terminate(nil)
		v := &values{}
		DurationVar(app.Flag("collector.interval", "").Default("5s"), &v.interval)
		BytesVar(app.Flag("orphan.threshold-bytes", "").Default("256MiB"), &v.bytes)
		EnumVar(app.Flag("backend", "").Default("nvml"), &v.kind, "nvml", "sim")
		IntVar(app.Flag("limit.burst", "").Default("3"), &v.n)
		Float64Var(app.Flag("limit.rate", "").Default("6"), &v.rate)
		return app, v
	}

	app, v := newApp()
	if _, err := app.Parse(nil); err != nil {
		t.Fatal(err)
	}
	if *v != (values{5 * time.Second, 256 << 20, "nvml", 3, 6}) {
		t.Errorf("defaults: %+v", *v)
	}
	app, v = newApp()
	if _, err := app.Parse([]string{"--collector.interval=1m30s", "--orphan.threshold-bytes=1GiB", "--backend=sim", "--limit.burst=7", "--limit.rate=0.5"}); err != nil {
		t.Fatal(err)
	}
	if *v != (values{90 * time.Second, 1 << 30, "sim", 7, 0.5}) {
		t.Errorf("set: %+v", *v)
	}

	for _, tc := range []struct {
		arg  string
		want string
	}{
		{"--collector.interval=abc", `invalid --collector.interval "abc": want a duration such as 5s, 2m or 1h30m`},
		{"--orphan.threshold-bytes=1Gb", `invalid --orphan.threshold-bytes "1Gb": want a size in bytes, such as 268435456, 256MiB or 1GiB`},
		{"--backend=foo", `invalid --backend "foo": want one of nvml, sim`},
		{"--limit.burst=many", `invalid --limit.burst "many": want a whole number`},
		{"--limit.rate=fast", `invalid --limit.rate "fast": want a number`},
	} {
		app, _ := newApp()
		_, err := app.Parse([]string{tc.arg})
		if err == nil || err.Error() != tc.want {
			t.Errorf("%s: error %v, want %q", tc.arg, err, tc.want)
		}
	}
}

// TestEnumVarTyped: an enum of a named string type, as the policy flag is.
func TestEnumVarTyped(t *testing.T) {
	type policy string
	app := kingpin.New("test", "")
	var p policy
	EnumVar(app.Flag("policy", "").Default("dead-owner"), &p, "dead-owner", "orphaned")
	if _, err := app.Parse([]string{"--policy=orphaned"}); err != nil || p != "orphaned" {
		t.Fatalf("policy %q, err %v", p, err)
	}
	if _, err := app.Parse([]string{"--policy=everything"}); err == nil || !strings.Contains(err.Error(), "--policy") {
		t.Errorf("err %v, want one naming --policy", err)
	}
}
