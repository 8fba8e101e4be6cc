package cli

import (
	"strings"
	"testing"

	"github.com/alecthomas/kingpin/v2"
)

// TestReleaseZeroPagesOptIn: --nvml.release-zero-pages is off unless given
// (issue 24, item 10), and its help says so and why.
func TestReleaseZeroPagesOptIn(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want bool
	}{
		{nil, false},
		{[]string{"--nvml.release-zero-pages"}, true},
		{[]string{"--no-nvml.release-zero-pages"}, false},
	} {
		app := kingpin.New("test", "")
		app.Terminate(nil)
		b := AddBackendFlags(app)
		b.AddDaemonFlags(app)
		if _, err := app.Parse(tc.args); err != nil {
			t.Fatalf("Parse(%q): %v", tc.args, err)
		}
		if b.ReleaseZeroPages != tc.want {
			t.Errorf("Parse(%q): ReleaseZeroPages = %v, want %v", tc.args, b.ReleaseZeroPages, tc.want)
		}
	}

	app := kingpin.New("test", "")
	AddBackendFlags(app).AddDaemonFlags(app)
	f := app.GetFlag("nvml.release-zero-pages")
	if f == nil {
		t.Fatal("no --nvml.release-zero-pages")
	}
	if got := f.Model().Default; len(got) != 1 || got[0] != "false" {
		t.Errorf("default %q, want false", got)
	}
	for _, says := range []string{"Off unless given", "13 MiB", "580", "x86_64", "pinned", "EFAULT", "arm64", "crash at start-up", "driver upgrade"} {
		if !strings.Contains(f.Model().Help, says) {
			t.Errorf("help does not say %q: %s", says, f.Model().Help)
		}
	}
}
